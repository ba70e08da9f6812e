"""hyper-parallel: PyTorch-native training of large MoE and multimodal models.

The public API (the RFC's M8.3 list, as far as it exists here) is importable from the top level::

    from hyper_parallel import ConfigManager, Module, ModelSpec, Linear, MoE, TrainingConfig

Names resolve lazily on first use, so ``import hyper_parallel`` stays cheap and
``python -m hyper_parallel.config.manager`` does not find its own module pre-imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PROTOCOLS = "hyper_parallel.protocols"
_CONFIG = "hyper_parallel.config"
_COMMON = "hyper_parallel.models.common"

_EXPORTS: dict[str, str] = {
    # the Module protocol
    "Configurable": _CONFIG,
    "Module": _PROTOCOLS,
    "ModuleList": _PROTOCOLS,
    "ModuleDict": _PROTOCOLS,
    "Sequential": _PROTOCOLS,
    "BaseModel": _PROTOCOLS,
    "ModelSpec": _PROTOCOLS,
    "register_spec": _PROTOCOLS,
    "get_spec": _PROTOCOLS,
    "discover_model_spec": _PROTOCOLS,
    "ShardingConfig": _PROTOCOLS,
    "NamedPlacement": _PROTOCOLS,
    "LocalMapConfig": _PROTOCOLS,
    "MeshAxisName": _PROTOCOLS,
    "BaseStateDictAdapter": _PROTOCOLS,
    "set_glm_image_moe_sharding_config": "hyper_parallel.models.glm_image_moe_v2.sharding",
    # the config system
    "ConfigManager": "hyper_parallel.config.manager",
    "ConfigError": "hyper_parallel.config.manager",
    "Function": _CONFIG,
    "TORCH_DTYPE_MAP": _CONFIG,
    "TrainingConfig": _CONFIG,
    "ParallelismConfig": _CONFIG,
    "ActivationCheckpointConfig": _CONFIG,
    "CompileConfig": _CONFIG,
    "CommConfig": _CONFIG,
    "DebugConfig": _CONFIG,
    # training components
    "OptimizersContainer": "hyper_parallel.components",
    "LRSchedulersContainer": "hyper_parallel.components",
    "BaseLoss": "hyper_parallel.components",
    "CrossEntropyLoss": "hyper_parallel.components",
    "EMA": "hyper_parallel.components",
    "CheckpointManager": "hyper_parallel.components",
    "MetricsProcessor": "hyper_parallel.components",
    "TokenDataLoader": "hyper_parallel.data",
    "Trainer": "hyper_parallel.trainer",
    # common model blocks
    "Linear": _COMMON,
    "Embedding": _COMMON,
    "RMSNorm": _COMMON,
    "RoPE": _COMMON,
    "RoPECosSin": _COMMON,
    "AttentionMeta": _COMMON,
    "VarlenAttention": _COMMON,
    "MLAttention": _COMMON,
    "GQAttention": _COMMON,
    "FeedForward": _COMMON,
    "Router": _COMMON,
    "GroupedExperts": _COMMON,
    "MoE": _COMMON,
    "TransformerBlock": _COMMON,
    "Decoder": _COMMON,
    "LocalTokenDispatcher": _COMMON,
}
"""Public name -> the module it lives in."""

_SUBPACKAGES = ("components", "config", "data", "distributed", "models", "protocols")

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'hyper_parallel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBPACKAGES})


if TYPE_CHECKING:  # static analysers and IDEs see the eager imports
    from hyper_parallel.components import (
        EMA,
        BaseLoss,
        CheckpointManager,
        CrossEntropyLoss,
        LRSchedulersContainer,
        MetricsProcessor,
        OptimizersContainer,
    )
    from hyper_parallel.config import (
        TORCH_DTYPE_MAP,
        ActivationCheckpointConfig,
        CommConfig,
        CompileConfig,
        Configurable,
        DebugConfig,
        Function,
        ParallelismConfig,
        TrainingConfig,
    )
    from hyper_parallel.config.manager import ConfigError, ConfigManager
    from hyper_parallel.data import TokenDataLoader
    from hyper_parallel.models.common import (
        AttentionMeta,
        Decoder,
        Embedding,
        FeedForward,
        GQAttention,
        GroupedExperts,
        Linear,
        LocalTokenDispatcher,
        MLAttention,
        MoE,
        RMSNorm,
        RoPE,
        RoPECosSin,
        Router,
        TransformerBlock,
        VarlenAttention,
    )
    from hyper_parallel.models.glm_image_moe_v2.sharding import set_glm_image_moe_sharding_config
    from hyper_parallel.protocols import (
        BaseModel,
        BaseStateDictAdapter,
        LocalMapConfig,
        MeshAxisName,
        ModelSpec,
        Module,
        ModuleDict,
        ModuleList,
        NamedPlacement,
        Sequential,
        ShardingConfig,
        discover_model_spec,
        get_spec,
        register_spec,
    )
    from hyper_parallel.trainer import Trainer
