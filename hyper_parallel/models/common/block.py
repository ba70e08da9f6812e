"""``TransformerBlock``: one pre-norm decoder layer (HF ``Glm4MoeLiteDecoderLayer``, ``Qwen3_5DecoderLayer``).

    h   = x + self_attn(input_layernorm(x))
    out = h + mlp(post_attention_layernorm(h))

``self_attn`` is any ``TokenMixer`` (MLA, GQA, gated attention, Gated DeltaNet); ``mlp`` any module built
with ``build(dim=)`` (dense ``FeedForward`` or sparse ``MoE``); the norms any module built with
``build(dim=)`` (``RMSNorm`` or a zero-centred variant). The unit of FSDP wrapping and activation
checkpointing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from hyper_parallel.models.common.attention import AttentionMeta
from hyper_parallel.models.common.mixer import TokenMixer
from hyper_parallel.models.common.moe import LoadBalanceStats, MoE
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.protocols.module import Module

__all__ = ["TransformerBlock", "combine_aux_losses"]


def combine_aux_losses(auxes: Iterable[torch.Tensor | LoadBalanceStats | None]) -> torch.Tensor | None:
    """One model-level auxiliary loss from every layer's ``pop_aux_loss()``: tensors add up; MoE router
    statistics pool over ALL layers before the Switch product (HF ``load_balancing_loss_func`` over the
    concatenated router logits), then join the sum. None when no layer produced one."""
    total: torch.Tensor | None = None
    pooled: LoadBalanceStats | None = None
    for aux in auxes:
        if aux is None:
            continue
        if isinstance(aux, LoadBalanceStats):
            pooled = aux if pooled is None else pooled + aux
        else:
            total = aux if total is None else total + aux
    if pooled is not None:
        total = pooled.loss() if total is None else total + pooled.loss()
    return total


class TransformerBlock(Module):
    """Token mixer + MLP (dense ``FeedForward`` or sparse ``MoE``), each behind a pre-norm residual."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        # Open types: any mixer / MLP / norm config. The CLI sees the recipe's concrete classes (tyro
        # takes the runtime type of the default), so every field of the chosen mixer is overridable.
        self_attn: TokenMixer.Config
        """Token mixer (MLA for Glm4MoeLite, GQA for Qwen-style models, gated attention or DeltaNet for Qwen3.5)."""
        mlp: Module.Config
        """Dense SwiGLU ``FeedForward.Config`` or sparse ``MoE.Config`` (HF ``mlp_layer_types[i]``)."""
        input_layernorm: Module.Config = field(default_factory=RMSNorm.Config)
        """Norm before the mixer (HF ``rms_norm_eps``)."""
        post_attention_layernorm: Module.Config = field(default_factory=RMSNorm.Config)
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

    def pop_aux_loss(self) -> torch.Tensor | LoadBalanceStats | None:
        """The auxiliary loss the MLP stored in its last forward, cleared; or None. A 0-dim tensor (a
        per-layer loss, summed over layers) or MoE router statistics that ``combine_aux_losses`` pools
        over layers; pass every layer's value to it."""
        aux = getattr(self.mlp, "aux_loss", None)
        if aux is not None:
            self.mlp.aux_loss = None
        return aux

    def forward(
        self, x_BTD: torch.Tensor, *, position_ids: torch.Tensor, meta: AttentionMeta | None = None
    ) -> torch.Tensor:
        h = x_BTD + self.self_attn(self.input_layernorm(x_BTD), position_ids=position_ids, meta=meta)
        if self.is_moe and meta is not None and meta.token_mask is not None:
            # padding out of the router statistics (under TP the MoE cuts the mask to its sequence shard)
            return h + self.mlp(self.post_attention_layernorm(h), token_mask=meta.token_mask)
        return h + self.mlp(self.post_attention_layernorm(h))
