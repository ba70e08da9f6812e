"""``GatedAttention``: Qwen3.5's output-gated GQA (HF ``Qwen3_5Attention``).

Legend: B batch, T tokens, D model dim, H query heads, Hk key/value heads (LOCAL counts under tensor
parallel: every view uses ``-1`` for heads), d head dim.

    q_h, gate_h = split(q_proj(x) per head, [d, d])      rows per head are [q_h | gate_h]
    q = q_norm(q), k = k_norm(k_proj(x) per head)         zero-centred RMSNorm over d, before RoPE
    q, k = rope(q, k)                                     rotate_half on the first rotary_dim channels
    out = o_proj(softmax(q k^T * d^-0.5, causal) v * sigmoid(gate))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hyper_parallel.models.common.attention import AttentionMeta, VarlenAttention
from hyper_parallel.models.common.flops import attention_flops
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.mixer import TokenMixer
from hyper_parallel.models.common.qwen3_5_norm import Qwen3_5RMSNorm
from hyper_parallel.models.common.rope import RoPE

__all__ = ["GatedAttention"]


class GatedAttention(TokenMixer):
    """GQA with per-head q/k norms, partial RoPE and a sigmoid output gate from ``q_proj``."""

    @dataclass(kw_only=True, slots=True)
    class Config(TokenMixer.Config):
        n_heads: int
        """Query heads H (HF ``num_attention_heads``)."""
        n_kv_heads: int
        """Key/value heads Hk, dividing H (HF ``num_key_value_heads``)."""
        head_dim: int
        """Channels per head d (HF ``head_dim``)."""
        q_proj: Linear.Config = field(default_factory=Linear.Config)
        """Query + gate projection ``[H*2d, D]``, rows per head ``[q_h | gate_h]`` (HF: bias iff ``attention_bias``)."""
        k_proj: Linear.Config = field(default_factory=Linear.Config)
        """Key projection ``[Hk*d, D]``."""
        v_proj: Linear.Config = field(default_factory=Linear.Config)
        """Value projection ``[Hk*d, D]``."""
        o_proj: Linear.Config = field(default_factory=Linear.Config)
        """Output projection ``[D, H*d]``."""
        q_norm: Qwen3_5RMSNorm.Config = field(default_factory=Qwen3_5RMSNorm.Config)
        """Per-head zero-centred norm of the queries, before RoPE."""
        k_norm: Qwen3_5RMSNorm.Config = field(default_factory=Qwen3_5RMSNorm.Config)
        """Per-head zero-centred norm of the keys, before RoPE."""
        rope: RoPE.Config = field(
            default_factory=lambda: RoPE.Config(layout="half", partial_rotary_factor=0.25, mrope_section=(11, 11, 10))
        )
        """Rotary embedding over the first ``head_dim * partial_rotary_factor`` channels (M-RoPE capable)."""
        inner_attention: VarlenAttention.Config = field(default_factory=VarlenAttention.Config)
        """The softmax core (wrapped by context parallel)."""

    def __init__(self, config: Config, *, dim: int) -> None:
        super().__init__(config)
        c = config
        if c.n_heads % c.n_kv_heads:
            raise ValueError(f"GatedAttention.Config: n_heads={c.n_heads} must be a multiple of n_kv_heads={c.n_kv_heads}")
        self.q_proj = c.q_proj.build(in_features=dim, out_features=2 * c.n_heads * c.head_dim)
        self.k_proj = c.k_proj.build(in_features=dim, out_features=c.n_kv_heads * c.head_dim)
        self.v_proj = c.v_proj.build(in_features=dim, out_features=c.n_kv_heads * c.head_dim)
        self.o_proj = c.o_proj.build(in_features=c.n_heads * c.head_dim, out_features=dim)
        self.q_norm = c.q_norm.build(dim=c.head_dim)
        self.k_norm = c.k_norm.build(dim=c.head_dim)
        self.rope = c.rope.build(head_dim=c.head_dim)
        self.inner_attention = c.inner_attention.build()
        self.softmax_scale = c.head_dim**-0.5

    def flops(self, doc_lens: Sequence[int]) -> float:
        """Training FLOPs of ``QK^T`` and ``PV``, causal within each packed document (``models/common/flops.py``)."""
        c = self.config
        return attention_flops(doc_lens, heads=c.n_heads, qk_dim=c.head_dim, v_dim=c.head_dim)

    def forward(
        self, x_BTD: torch.Tensor, *, position_ids: torch.Tensor, meta: AttentionMeta | None = None
    ) -> torch.Tensor:
        d = self.config.head_dim
        B, T, _ = x_BTD.shape
        rope_cos_sin = self.rope(position_ids, x_BTD.dtype)
        q, gate = self.q_proj(x_BTD).view(B, T, -1, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x_BTD).view(B, T, -1, d)).transpose(1, 2)
        v = self.v_proj(x_BTD).view(B, T, -1, d).transpose(1, 2)
        q, k = rope_cos_sin.apply(q, k)
        out_BTHd = self.inner_attention(q, k, v, scale=self.softmax_scale * rope_cos_sin.attention_scale, meta=meta)
        return self.o_proj(out_BTHd.reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1)))
