"""The Module protocol: Module, containers, BaseModel, ModelSpec registry, sharding and HF adapters."""

from hyper_parallel.config.configurable import Configurable, Function
from hyper_parallel.protocols.model import BaseModel, ModelOutput, split_output
from hyper_parallel.protocols.model_spec import (
    ModelSpec,
    discover_model_spec,
    get_spec,
    list_specs,
    register_spec,
)
from hyper_parallel.protocols.module import Module, ModuleDict, ModuleList, Sequential
from hyper_parallel.protocols.param_init import ConstantInit, NormalInit, ParamInit, TruncNormalInit
from hyper_parallel.protocols.sharding import LocalMapConfig, MeshAxisName, NamedPlacement, ShardingConfig
from hyper_parallel.protocols.state_dict_adapter import (
    BaseStateDictAdapter,
    parse_size,
    read_safetensors,
    write_safetensors,
)

__all__ = [
    "BaseModel",
    "BaseStateDictAdapter",
    "Configurable",
    "ConstantInit",
    "Function",
    "LocalMapConfig",
    "MeshAxisName",
    "ModelOutput",
    "ModelSpec",
    "Module",
    "ModuleDict",
    "ModuleList",
    "NamedPlacement",
    "NormalInit",
    "ParamInit",
    "Sequential",
    "ShardingConfig",
    "TruncNormalInit",
    "discover_model_spec",
    "get_spec",
    "list_specs",
    "parse_size",
    "read_safetensors",
    "register_spec",
    "split_output",
    "write_safetensors",
]
