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
    "ModelOutput": _PROTOCOLS,
    "ModelSpec": _PROTOCOLS,
    "register_spec": _PROTOCOLS,
    "get_spec": _PROTOCOLS,
    "discover_model_spec": _PROTOCOLS,
    "from_pretrained": "hyper_parallel.hf.pretrained",
    "HF_MODEL_TYPES": "hyper_parallel.protocols.hf_spec",
    "HFSpec": "hyper_parallel.protocols.hf_spec",
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
    "Profiler": "hyper_parallel.components",
    # data
    "BaseTokenizer": "hyper_parallel.data.tokenizer",
    "HuggingFaceTokenizer": "hyper_parallel.data.tokenizer",
    "BaseDataLoader": "hyper_parallel.data",
    "DataConfig": "hyper_parallel.data",
    "TokenDataLoader": "hyper_parallel.data",
    "HuggingFaceTextDataLoader": "hyper_parallel.data",
    "DummyDataLoader": "hyper_parallel.data",
    "PresetDataLoader": "hyper_parallel.data",
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
    "CausalConv1d": _COMMON,
    "GatedAttention": _COMMON,
    "GatedDeltaNet": _COMMON,
    "GatedDeltaRule": _COMMON,
    "GatedRMSNorm": _COMMON,
    "Qwen3_5RMSNorm": _COMMON,
    "TokenMixer": _COMMON,
    "load_balancing_loss": _COMMON,
    "colwise_config": _COMMON,
    "embedding_config": _COMMON,
    "lm_head_config": _COMMON,
    "norm_config": _COMMON,
    "region_config": _COMMON,
    "rowwise_config": _COMMON,
    "set_decoder_sharding_config": _COMMON,
    "set_dense_ffn_sharding": _COMMON,
    "set_gqa_attention_sharding": _COMMON,
    "set_mla_attention_sharding": _COMMON,
    "set_moe_sharding": _COMMON,
    "set_qkv_linear_sharding": _COMMON,
    "without_sharding": _COMMON,
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
        BaseLoss,
        CheckpointManager,
        CrossEntropyLoss,
        EMA,
        LRSchedulersContainer,
        MetricsProcessor,
        OptimizersContainer,
        Profiler,
    )
    from hyper_parallel.config import (
        ActivationCheckpointConfig,
        CommConfig,
        CompileConfig,
        Configurable,
        DebugConfig,
        Function,
        ParallelismConfig,
        TORCH_DTYPE_MAP,
        TrainingConfig,
    )
    from hyper_parallel.config.manager import (
        ConfigError,
        ConfigManager,
    )
    from hyper_parallel.data import (
        BaseDataLoader,
        DataConfig,
        DummyDataLoader,
        HuggingFaceTextDataLoader,
        PresetDataLoader,
        TokenDataLoader,
    )
    from hyper_parallel.data.tokenizer import (
        BaseTokenizer,
        HuggingFaceTokenizer,
    )
    from hyper_parallel.models.common import (
        AttentionMeta,
        CausalConv1d,
        Decoder,
        Embedding,
        FeedForward,
        GQAttention,
        GatedAttention,
        GatedDeltaNet,
        GatedDeltaRule,
        GatedRMSNorm,
        GroupedExperts,
        Linear,
        LocalTokenDispatcher,
        MLAttention,
        MoE,
        Qwen3_5RMSNorm,
        RMSNorm,
        RoPE,
        RoPECosSin,
        Router,
        TokenMixer,
        TransformerBlock,
        VarlenAttention,
        colwise_config,
        embedding_config,
        lm_head_config,
        load_balancing_loss,
        norm_config,
        region_config,
        rowwise_config,
        set_decoder_sharding_config,
        set_dense_ffn_sharding,
        set_gqa_attention_sharding,
        set_mla_attention_sharding,
        set_moe_sharding,
        set_qkv_linear_sharding,
        without_sharding,
    )
    from hyper_parallel.models.glm_image_moe_v2.sharding import (
        set_glm_image_moe_sharding_config,
    )
    from hyper_parallel.hf.pretrained import from_pretrained
    from hyper_parallel.protocols.hf_spec import HF_MODEL_TYPES, HFSpec
    from hyper_parallel.protocols import (
        BaseModel,
        BaseStateDictAdapter,
        LocalMapConfig,
        MeshAxisName,
        ModelOutput,
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
    from hyper_parallel.trainer import (
        Trainer,
    )
