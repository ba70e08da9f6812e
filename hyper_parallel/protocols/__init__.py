"""The Module protocol: Module, containers, BaseModel, ModelSpec registry (with its ``HFSpec``), sharding types and
the HF adapter contract (the HF checkpoint engine itself is ``hyper_parallel.hf``)."""

from hyper_parallel.config.configurable import Configurable, Function
from hyper_parallel.protocols.model import BaseModel, ModelOutput, split_output
from hyper_parallel.protocols.hf_spec import HF_MODEL_TYPES, HFMtp, HFSpec
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
from hyper_parallel.protocols.state_dict_adapter import BaseStateDictAdapter

__all__ = [
    "HF_MODEL_TYPES",
    "HFMtp",
    "HFSpec",
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
    "register_spec",
    "split_output",
]
