"""Config system: Configurable/Function, option groups and the tyro-based ConfigManager."""

from hyper_parallel.config.configurable import Configurable, Function, config_to_dict
from hyper_parallel.config.errors import ConfigError
from hyper_parallel.config.dtypes import TORCH_DTYPE_MAP, to_torch_dtype
from hyper_parallel.config.parallelism import ParallelismConfig
from hyper_parallel.config.training import (
    ActivationCheckpointConfig,
    CommConfig,
    CompileConfig,
    DebugConfig,
    TrainingConfig,
)

__all__ = [
    "ActivationCheckpointConfig",
    "CommConfig",
    "CompileConfig",
    "ConfigError",
    "ConfigManager",
    "Configurable",
    "DebugConfig",
    "Function",
    "ParallelismConfig",
    "TORCH_DTYPE_MAP",
    "TrainingConfig",
    "config_to_dict",
    "to_torch_dtype",
]


def __getattr__(name: str):
    # Lazy: `python -m hyper_parallel.config.manager` must not find the module pre-imported.
    if name == "ConfigManager":
        from hyper_parallel.config import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'hyper_parallel.config' has no attribute {name!r}")
