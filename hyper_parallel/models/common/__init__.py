"""The building-block floor (floor 2, docs/design.md section 2): the blocks every model family composes.

It imports only ``config`` and ``protocols``, never ``distributed``, ``data``, ``hf`` or ``components``
(``tests/torch/ut/test_import_graph.py``): what a parallelism needs of a block is declared here (its
``ShardingConfig``, the decoder's ``stage_costs``) and applied on a higher floor. LoRA lives here too: the adapters
(``lora.py``) and every LoRA decision of a run (``lora_policy.py``).

Each block is a ``Module`` built from its nested ``Config`` (``Linear.Config(bias=False).build(in_features=,
out_features=)``); a model package composes them in its flavor builder. Token mixers (MLA, GQA, gated
attention, Gated DeltaNet) share the ``TokenMixer`` base. The generic sharding helpers
(``set_decoder_sharding_config``, ``colwise_config`` ...) build the placements a model's
``sharding.py`` declares.
"""

from hyper_parallel.models.common.attention import AttentionMeta, VarlenAttention
from hyper_parallel.models.common.block import TransformerBlock
from hyper_parallel.models.common.decoder import Decoder
from hyper_parallel.models.common.embedding import Embedding
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.gated_attention import GatedAttention
from hyper_parallel.models.common.gated_delta_rule import GatedDeltaRule
from hyper_parallel.models.common.gated_deltanet import CausalConv1d, GatedDeltaNet
from hyper_parallel.models.common.gqa import GQAttention
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.mixer import TokenMixer
from hyper_parallel.models.common.mla import MLAttention
from hyper_parallel.models.common.moe import GroupedExperts, MoE, Router, load_balancing_loss
from hyper_parallel.models.common.qwen3_5_norm import GatedRMSNorm, Qwen3_5RMSNorm
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
    "CausalConv1d",
    "Decoder",
    "Embedding",
    "FeedForward",
    "GQAttention",
    "GatedAttention",
    "GatedDeltaNet",
    "GatedDeltaRule",
    "GatedRMSNorm",
    "GroupedExperts",
    "LocalTokenDispatcher",
    "Linear",
    "MLAttention",
    "MoE",
    "Qwen3_5RMSNorm",
    "RMSNorm",
    "RoPE",
    "RoPECosSin",
    "Router",
    "TokenMixer",
    "TransformerBlock",
    "VarlenAttention",
    "colwise_config",
    "embedding_config",
    "load_balancing_loss",
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
