"""``TransformerBlock``: one pre-norm decoder layer (HF ``Glm4MoeLiteDecoderLayer``).

    h   = x + self_attn(input_layernorm(x))
    out = h + mlp(post_attention_layernorm(h))

The unit of FSDP wrapping and activation checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import torch
import tyro

from hyper_parallel.models.common.attention import AttentionMeta
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.gqa import GQAttention
from hyper_parallel.models.common.mla import MLAttention
from hyper_parallel.models.common.moe import MoE
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.models.common.rope import RoPECosSin
from hyper_parallel.protocols.module import Module

__all__ = ["TransformerBlock"]


class TransformerBlock(Module):
    """Attention + MLP (dense ``FeedForward`` or sparse ``MoE``), each behind a pre-norm residual."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        # Both members are classes named `Config`: explicit subcommand names keep them apart for tyro.
        self_attn: (
            Annotated[MLAttention.Config, tyro.conf.subcommand("mla")]
            | Annotated[GQAttention.Config, tyro.conf.subcommand("gqa")]
        )
        """Attention (MLA for Glm4MoeLite, GQA for Qwen-style models)."""
        mlp: (
            Annotated[FeedForward.Config, tyro.conf.subcommand("dense")]
            | Annotated[MoE.Config, tyro.conf.subcommand("moe")]
        )
        """Dense SwiGLU MLP or sparse MoE (HF ``mlp_layer_types[i]`` = ``dense`` / ``sparse``)."""
        input_layernorm: RMSNorm.Config = field(default_factory=RMSNorm.Config)
        """Norm before attention (HF ``rms_norm_eps``)."""
        post_attention_layernorm: RMSNorm.Config = field(default_factory=RMSNorm.Config)
        """Norm before the MLP (HF ``rms_norm_eps``)."""

    def __init__(self, config: Config, *, dim: int) -> None:
        super().__init__(config)
        self.input_layernorm = config.input_layernorm.build(dim=dim)
        self.self_attn = config.self_attn.build(dim=dim)
        self.post_attention_layernorm = config.post_attention_layernorm.build(dim=dim)
        self.mlp = config.mlp.build(dim=dim)

    @property
    def is_moe(self) -> bool:
        """Whether the MLP is sparse."""
        return isinstance(self.mlp, MoE)

    def forward(
        self, x_BTD: torch.Tensor, *, rope_cos_sin: RoPECosSin, meta: AttentionMeta | None = None
    ) -> torch.Tensor:
        h = x_BTD + self.self_attn(self.input_layernorm(x_BTD), rope_cos_sin=rope_cos_sin, meta=meta)
        return h + self.mlp(self.post_attention_layernorm(h))
