"""Common model blocks shared by every model package.

Each block is a ``Module`` built from its nested ``Config`` (``Linear.Config(bias=False).build(in_features=,
out_features=)``); a model package composes them in its flavor builder. Placements are declared per
model (``models/<name>/sharding.py``), not here.
"""

from hyper_parallel.models.common.attention import AttentionMeta, VarlenAttention
from hyper_parallel.models.common.block import TransformerBlock
from hyper_parallel.models.common.decoder import Decoder
from hyper_parallel.models.common.embedding import Embedding
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.gqa import GQAttention
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.mla import MLAttention
from hyper_parallel.models.common.moe import GroupedExperts, MoE, Router
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.models.common.rope import RoPE, RoPECosSin
from hyper_parallel.models.common.sharding import (
    colwise_config,
    embedding_config,
    lm_head_config,
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
from hyper_parallel.models.common.token_dispatcher import LocalTokenDispatcher

__all__ = [
    "AttentionMeta",
    "Decoder",
    "Embedding",
    "FeedForward",
    "GQAttention",
    "GroupedExperts",
    "LocalTokenDispatcher",
    "Linear",
    "MLAttention",
    "MoE",
    "RMSNorm",
    "RoPE",
    "RoPECosSin",
    "Router",
    "TransformerBlock",
    "VarlenAttention",
    "colwise_config",
    "embedding_config",
    "lm_head_config",
    "norm_config",
    "region_config",
    "rowwise_config",
    "set_decoder_sharding_config",
    "set_dense_ffn_sharding",
    "set_gqa_attention_sharding",
    "set_mla_attention_sharding",
    "set_moe_sharding",
    "set_qkv_linear_sharding",
    "without_sharding",
]
