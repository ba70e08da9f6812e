"""``MLAttention``: multi-head latent attention (DeepSeek-V2/V3, Glm4MoeLite), HF ``Glm4MoeLiteAttention`` math.

Legend: B batch, T tokens, D model dim, H heads (the LOCAL count under tensor parallel: every view uses
``-1`` for heads, so column-sharded ``q_b_proj``/``kv_b_proj`` work unchanged), dn/dr/dv = nope/rope/value
head dims, dq = dn + dr.

    q   = q_b_proj(q_a_layernorm(q_a_proj(x)))         (or q_proj(x) when q_lora_rank is None)
    c, k_rot = split(kv_a_proj_with_mqa(x), [kv_lora_rank, dr]);  c = kv_a_layernorm(c)
    k_nope, v = split(kv_b_proj(c) per head, [dn, dv])
    Q = [q_nope | rope(q_rot)],  K = [k_nope | rope(k_rot) shared by all heads],  V = v
    out = o_proj(softmax(Q K^T * scale, causal) V)
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

__all__ = ["MLAttention"]


class MLAttention(TokenMixer):
    """MLA with a low-rank (``q_lora_rank``) or a full (``q_proj``) query path; children named as in HF."""

    @dataclass(kw_only=True, slots=True)
    class Config(TokenMixer.Config):
        n_heads: int
        """Number of attention heads (HF ``num_attention_heads``)."""
        q_lora_rank: int | None
        """Rank of the query compression; None = one full ``q_proj`` (and no q_a_*/q_b_proj)."""
        kv_lora_rank: int
        """Rank of the compressed key/value latent."""
        qk_nope_head_dim: int
        """Per-head query/key channels without RoPE."""
        qk_rope_head_dim: int
        """Per-head query/key channels with RoPE (one key rope head shared by all heads)."""
        v_head_dim: int
        """Per-head value channels."""
        q_proj: Linear.Config | None = None
        """Full query projection ``[H*dq, D]`` (never a bias in HF). Used iff ``q_lora_rank`` is None; the
        default is filled in then, and it is cleared otherwise."""
        q_a_proj: Linear.Config | None = None
        """Query down-projection ``[q_lora_rank, D]`` (HF: bias iff ``attention_bias``). Used iff ``q_lora_rank``
        is set (default filled in); cleared otherwise."""
        q_a_layernorm: RMSNorm.Config | None = None
        """Norm of the query latent (default eps 1e-6, HF's constructor default); cleared without ``q_lora_rank``."""
        q_b_proj: Linear.Config | None = None
        """Query up-projection ``[H*dq, q_lora_rank]`` (default filled in); cleared without ``q_lora_rank``."""
        kv_a_proj_with_mqa: Linear.Config = field(default_factory=Linear.Config)
        """Joint latent + shared rope-key projection ``[kv_lora_rank + dr, D]`` (HF: bias iff ``attention_bias``)."""
        kv_a_layernorm: RMSNorm.Config = field(default_factory=lambda: RMSNorm.Config(eps=1e-6))
        """Norm of the key/value latent (not of k_rot); eps 1e-6 as in HF."""
        kv_b_proj: Linear.Config = field(default_factory=Linear.Config)
        """Key/value up-projection ``[H*(dn+dv), kv_lora_rank]``, rows head-major ``[k_nope | v]``."""
        o_proj: Linear.Config = field(default_factory=Linear.Config)
        """Output projection ``[D, H*dv]`` (HF: bias iff ``attention_bias``)."""
        rope: RoPE.Config = field(default_factory=RoPE.Config)
        """Rotary embedding of the ``qk_rope_head_dim`` channels (HF ``rope_theta``, ``rope_interleave``)."""
        inner_attention: VarlenAttention.Config = field(default_factory=VarlenAttention.Config)
        """The softmax core (replaced or wrapped by context parallel)."""
        softmax_scale: float | None = None
        """Softmax scale; None = ``(dn + dr) ** -0.5``. The RoPE's yarn factor multiplies it at forward."""

        def __post_init__(self) -> None:
            # q_lora_rank is the one switch between the two query paths. Only the selected branch holds
            # configs (HF defaults filled in when None) and the other is cleared, so traverse() FQNs equal
            # the built module's FQNs and `--q_lora_rank None` alone switches a recipe from the CLI.
            if self.q_lora_rank is None:
                self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
                if self.q_proj is None:
                    self.q_proj = Linear.Config()
            else:
                self.q_proj = None
                if self.q_a_proj is None:
                    self.q_a_proj = Linear.Config()
                if self.q_a_layernorm is None:
                    self.q_a_layernorm = RMSNorm.Config(eps=1e-6)
                if self.q_b_proj is None:
                    self.q_b_proj = Linear.Config()

    def __init__(self, config: Config, *, dim: int) -> None:
        super().__init__(config)
        c = config
        self.qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
        q_out = c.n_heads * self.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = c.q_proj.build(in_features=dim, out_features=q_out)
        else:
            self.q_a_proj = c.q_a_proj.build(in_features=dim, out_features=c.q_lora_rank)
            self.q_a_layernorm = c.q_a_layernorm.build(dim=c.q_lora_rank)
            self.q_b_proj = c.q_b_proj.build(in_features=c.q_lora_rank, out_features=q_out)
        self.kv_a_proj_with_mqa = c.kv_a_proj_with_mqa.build(
            in_features=dim, out_features=c.kv_lora_rank + c.qk_rope_head_dim
        )
        self.kv_a_layernorm = c.kv_a_layernorm.build(dim=c.kv_lora_rank)
        self.kv_b_proj = c.kv_b_proj.build(
            in_features=c.kv_lora_rank, out_features=c.n_heads * (c.qk_nope_head_dim + c.v_head_dim)
        )
        self.o_proj = c.o_proj.build(in_features=c.n_heads * c.v_head_dim, out_features=dim)
        self.rope = c.rope.build(head_dim=c.qk_rope_head_dim)
        self.inner_attention = c.inner_attention.build()
        self.softmax_scale = c.softmax_scale if c.softmax_scale is not None else self.qk_head_dim**-0.5

    def flops(self, doc_lens: Sequence[int]) -> float:
        """Training FLOPs of ``QK^T`` (nope + rope head dim) and ``PV`` (v head dim), causal within each packed
        document (``models/common/flops.py``)."""
        c = self.config
        return attention_flops(doc_lens, heads=c.n_heads, qk_dim=self.qk_head_dim, v_dim=c.v_head_dim)

    def forward(
        self, x_BTD: torch.Tensor, *, position_ids: torch.Tensor, meta: AttentionMeta | None = None
    ) -> torch.Tensor:
        c = self.config
        B, T, _ = x_BTD.shape
        rope_cos_sin = self.rope(position_ids, x_BTD.dtype)
        dn, dr = c.qk_nope_head_dim, c.qk_rope_head_dim

        if c.q_lora_rank is None:
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        q_BHTd = q.view(B, T, -1, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = torch.split(q_BHTd, [dn, dr], dim=-1)

        kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(x_BTD), [c.kv_lora_rank, dr], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope)
        k_rot = k_rot.view(B, 1, T, dr)  # one rope-key head shared by every query head
        q_rot, k_rot = rope_cos_sin.apply(q_rot, k_rot)

        kv = self.kv_b_proj(kv_nope).view(B, T, -1, dn + c.v_head_dim).transpose(1, 2)
        k_nope, v = torch.split(kv, [dn, c.v_head_dim], dim=-1)
        n_local_heads = k_nope.shape[1]
        query = torch.cat((q_nope, q_rot), dim=-1)
        key = torch.cat((k_nope, k_rot.expand(-1, n_local_heads, -1, -1)), dim=-1)

        scale = self.softmax_scale * rope_cos_sin.attention_scale
        out_BTHd = self.inner_attention(query, key, v, scale=scale, meta=meta)
        return self.o_proj(out_BTHd.reshape(B, T, -1))
