"""``GQAttention``: grouped-query attention (Llama/Qwen2/Qwen3 style), HF ``Qwen3Attention`` math.

Legend: B batch, T tokens, D model dim, H query heads, Hk key/value heads (LOCAL counts under tensor
parallel: every view uses ``-1`` for heads), d head dim.

    q = q_norm(q_proj(x) per head), k = k_norm(k_proj(x) per head), v = v_proj(x) per head
    q, k = rope(q, k)  on the first ``rotary_dim`` channels of each head
    out = o_proj(softmax(q k^T * scale, causal) v)     (k/v heads shared by H/Hk query heads)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hyper_parallel.models.common.attention import AttentionMeta, VarlenAttention
from hyper_parallel.models.common.flops import attention_flops
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.models.common.mixer import TokenMixer
from hyper_parallel.models.common.rope import RoPE

__all__ = ["GQAttention"]


class GQAttention(TokenMixer):
    """Multi-head attention with ``n_kv_heads`` shared key/value heads and optional per-head q/k RMSNorm."""

    @dataclass(kw_only=True, slots=True)
    class Config(TokenMixer.Config):
        n_heads: int
        """Number of query heads."""
        n_kv_heads: int
        """Number of key/value heads (divides ``n_heads``)."""
        head_dim: int
        """Channels per head (RoPE covers its first ``head_dim * partial_rotary_factor``)."""
        q_proj: Linear.Config = field(default_factory=Linear.Config)
        """Query projection ``[H*d, D]`` (Qwen2/3: bias iff ``attention_bias``)."""
        k_proj: Linear.Config = field(default_factory=Linear.Config)
        """Key projection ``[Hk*d, D]``."""
        v_proj: Linear.Config = field(default_factory=Linear.Config)
        """Value projection ``[Hk*d, D]``."""
        o_proj: Linear.Config = field(default_factory=Linear.Config)
        """Output projection ``[D, H*d]``."""
        q_norm: RMSNorm.Config | None = None
        """Per-head RMSNorm of the queries before RoPE (Qwen3); None for none."""
        k_norm: RMSNorm.Config | None = None
        """Per-head RMSNorm of the keys before RoPE (Qwen3); None for none."""
        rope: RoPE.Config = field(default_factory=lambda: RoPE.Config(layout="half"))
        """Rotary embedding over each head's ``head_dim`` channels (its ``partial_rotary_factor`` of them)."""
        inner_attention: VarlenAttention.Config = field(default_factory=VarlenAttention.Config)
        """The softmax core (replaced or wrapped by context parallel)."""
        softmax_scale: float | None = None
        """Softmax scale; None = ``head_dim ** -0.5``. The RoPE's yarn factor multiplies it at forward."""

    def __init__(self, config: Config, *, dim: int) -> None:
        super().__init__(config)
        c = config
        if c.n_heads % c.n_kv_heads:
            raise ValueError(f"GQAttention.Config: n_heads={c.n_heads} must be a multiple of n_kv_heads={c.n_kv_heads}")
        self.q_proj = c.q_proj.build(in_features=dim, out_features=c.n_heads * c.head_dim)
        self.k_proj = c.k_proj.build(in_features=dim, out_features=c.n_kv_heads * c.head_dim)
        self.v_proj = c.v_proj.build(in_features=dim, out_features=c.n_kv_heads * c.head_dim)
        self.o_proj = c.o_proj.build(in_features=c.n_heads * c.head_dim, out_features=dim)
        if c.q_norm is not None:
            self.q_norm = c.q_norm.build(dim=c.head_dim)
        if c.k_norm is not None:
            self.k_norm = c.k_norm.build(dim=c.head_dim)
        self.rope = c.rope.build(head_dim=c.head_dim)
        self.inner_attention = c.inner_attention.build()
        self.softmax_scale = c.softmax_scale if c.softmax_scale is not None else c.head_dim**-0.5

    def flops(self, doc_lens: Sequence[int]) -> float:
        """Training FLOPs of ``QK^T`` and ``PV``, causal within each packed document (``models/common/flops.py``)."""
        c = self.config
        return attention_flops(doc_lens, heads=c.n_heads, qk_dim=c.head_dim, v_dim=c.head_dim)

    def forward(
        self, x_BTD: torch.Tensor, *, position_ids: torch.Tensor, meta: AttentionMeta | None = None
    ) -> torch.Tensor:
        c = self.config
        B, T, _ = x_BTD.shape
        rope_cos_sin = self.rope(position_ids, x_BTD.dtype)
        q = self.q_proj(x_BTD).view(B, T, -1, c.head_dim)
        k = self.k_proj(x_BTD).view(B, T, -1, c.head_dim)
        v = self.v_proj(x_BTD).view(B, T, -1, c.head_dim)
        if c.q_norm is not None:
            q = self.q_norm(q)
        if c.k_norm is not None:
            k = self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = rope_cos_sin.apply(q, k)
        scale = self.softmax_scale * rope_cos_sin.attention_scale
        out_BTHd = self.inner_attention(q, k, v, scale=scale, meta=meta)
        return self.o_proj(out_BTHd.reshape(B, T, -1))
