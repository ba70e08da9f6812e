"""``GatedDeltaNet``: the linear-attention token mixer of Qwen3.5 (HF ``Qwen3_5GatedDeltaNet``, no cache).

Legend: B batch, T tokens, D model dim, Hk key heads, Hv value heads, Dk/Dv head dims (head counts are
LOCAL under tensor parallel: they are read off the projections' outputs).

    qkv = in_proj_qkv(x)           rows grouped by key head (see below)
    z   = in_proj_z(x)             [B, T, Hv, Dv]
    beta = sigmoid(in_proj_b(x))   model dtype;   g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)  fp32
    o   = delta_rule(qkv, g, beta)   (causal depthwise conv + SiLU, then the gated delta rule)
    out = out_proj(norm(o, z))     (GatedRMSNorm per value head)

Packed documents are exact: the conv window and the recurrent state restart at every ``cu_seqlens``
boundary (see ``gated_delta_rule``).

Row order of the fused ``in_proj_qkv.weight`` and of ``conv1d.weight`` (a trap: same keys as HF, other
order). HF stores ``[Q | K | V]``, each head-major. We store the rows grouped by key head ``j``::

    [q_j (Dk) | k_j (Dk) | v_{j*r} .. v_{j*r + r - 1} (r*Dv)]  for j = 0 .. Hk-1,   r = Hv / Hk

(value head ``h`` reads key head ``h // r``), so one ``Shard(0)`` over any tensor-parallel degree that
divides Hk hands every rank whole groups: exactly its Q, K and V heads (Megatron's fused-QKV order). The
order is fixed by the model config, not by the layout, so checkpoints are layout-independent; the state
dict adapters convert with ``GatedDeltaNet.qkv_rows_from_hf`` / ``qkv_rows_to_hf``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.models.common.attention import AttentionMeta
from hyper_parallel.models.common.flops import chunked_delta_rule_flops
from hyper_parallel.models.common.gated_delta_rule import GatedDeltaRule
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.mixer import TokenMixer
from hyper_parallel.models.common.qwen3_5_norm import GatedRMSNorm
from hyper_parallel.protocols.module import Module
from hyper_parallel.protocols.param_init import NormalInit, ParamInit
from hyper_parallel.protocols.sharding import local_shard

__all__ = ["CausalConv1d", "GatedDeltaNet"]


class CausalConv1d(Module):
    """Depthwise causal conv weights ``[channels, 1, kernel_size]`` (HF ``nn.Conv1d(groups=C, bias=False)``).

    Holds the weight only; ``GatedDeltaNet``'s ``delta_rule`` applies it per document.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        kernel_size: int = 4
        """Taps per channel (HF ``linear_conv_kernel_dim``); the last tap multiplies the current token."""
        param_init: ParamInit.Config | None = field(default_factory=NormalInit.Config)
        """Weight initialiser (HF: normal(0, initializer_range))."""

    def __init__(self, config: Config, *, channels: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(config)
        if config.kernel_size < 1:
            raise ValueError(f"CausalConv1d.Config.kernel_size={config.kernel_size} must be >= 1")
        self.channels = channels
        self.weight = nn.Parameter(torch.empty(channels, 1, config.kernel_size, dtype=dtype))

    def extra_repr(self) -> str:
        return f"channels={self.channels}, kernel_size={self.config.kernel_size}"


class GatedDeltaNet(TokenMixer):
    """Gated DeltaNet mixer with HF Qwen3.5 parameter names and numerics (reference doc section 1.5)."""

    @dataclass(kw_only=True, slots=True)
    class Config(TokenMixer.Config):
        num_k_heads: int
        """Query/key heads Hk (HF ``linear_num_key_heads``)."""
        num_v_heads: int
        """Value heads Hv, a multiple of Hk (HF ``linear_num_value_heads``)."""
        head_k_dim: int
        """Query/key head dim Dk (HF ``linear_key_head_dim``)."""
        head_v_dim: int
        """Value head dim Dv (HF ``linear_value_head_dim``)."""
        in_proj_qkv: Linear.Config = field(default_factory=Linear.Config)
        """Fused q/k/v projection ``[2*Hk*Dk + Hv*Dv, D]``, rows grouped by key head (module docstring; no bias)."""
        in_proj_z: Linear.Config = field(default_factory=Linear.Config)
        """Output-gate projection ``[Hv*Dv, D]``."""
        in_proj_b: Linear.Config = field(default_factory=Linear.Config)
        """Write-strength projection ``[Hv, D]`` (beta = sigmoid)."""
        in_proj_a: Linear.Config = field(default_factory=Linear.Config)
        """Decay projection ``[Hv, D]``."""
        conv1d: CausalConv1d.Config = field(default_factory=CausalConv1d.Config)
        """Depthwise causal conv over the q/k/v channels (rows in ``in_proj_qkv``'s grouped order)."""
        norm: GatedRMSNorm.Config = field(default_factory=GatedRMSNorm.Config)
        """Gated output norm over Dv (HF ``rms_norm_eps``)."""
        out_proj: Linear.Config = field(default_factory=Linear.Config)
        """Output projection ``[D, Hv*Dv]``."""
        delta_rule: GatedDeltaRule.Config = field(default_factory=GatedDeltaRule.Config)
        """The sequence core (conv + recurrence); context parallel wraps it."""

    def __init__(self, config: Config, *, dim: int) -> None:
        super().__init__(config)
        c = config
        if c.num_v_heads % c.num_k_heads:
            raise ValueError(
                f"GatedDeltaNet.Config: num_v_heads={c.num_v_heads} must be a multiple of num_k_heads={c.num_k_heads}"
            )
        self.key_dim, self.value_dim = c.num_k_heads * c.head_k_dim, c.num_v_heads * c.head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = c.in_proj_qkv.build(in_features=dim, out_features=conv_dim)
        self.in_proj_z = c.in_proj_z.build(in_features=dim, out_features=self.value_dim)
        self.in_proj_b = c.in_proj_b.build(in_features=dim, out_features=c.num_v_heads)
        self.in_proj_a = c.in_proj_a.build(in_features=dim, out_features=c.num_v_heads)
        self.conv1d = c.conv1d.build(channels=conv_dim)
        self.dt_bias = nn.Parameter(torch.empty(c.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(c.num_v_heads))
        self.norm = c.norm.build(dim=c.head_v_dim)
        self.out_proj = c.out_proj.build(in_features=self.value_dim, out_features=dim)
        self.delta_rule = c.delta_rule.build(head_k_dim=c.head_k_dim, head_v_dim=c.head_v_dim)

    @torch.no_grad()
    def init_own_weights(self) -> None:
        # HF: dt_bias = 1, A = U(0.01, 16) (kept away from 0 so log A is finite).
        self.dt_bias.fill_(1.0)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log_())

    def flops(self, doc_lens: Sequence[int]) -> float:
        """The chunked recurrence's training FLOPs, every document in whole ``chunk_size`` chunks
        (``flops.chunked_delta_rule_flops``)."""
        c = self.config
        return chunked_delta_rule_flops(doc_lens, heads=c.num_v_heads, k_dim=c.head_k_dim, v_dim=c.head_v_dim,
                                        chunk=self.delta_rule.config.chunk_size)  # fmt: skip

    def forward(
        self, x_BTD: torch.Tensor, *, position_ids: torch.Tensor | None = None, meta: AttentionMeta | None = None
    ) -> torch.Tensor:
        del position_ids  # no positions: order comes from the recurrence
        c = self.config
        B, T, _ = x_BTD.shape
        dk, dv, r = c.head_k_dim, c.head_v_dim, c.num_v_heads // c.num_k_heads
        b = self.in_proj_b(x_BTD)
        n_v = b.shape[-1]  # local value heads (tensor parallel shards heads)
        n_k = n_v // r
        # Grouped rows (module docstring): [q_j | k_j | v_j*r .. v_j*r+r-1] per local key head j; the core
        # convolves them in this order (depthwise: any channel order) and splits q/k/v itself.
        qkv = self.in_proj_qkv(x_BTD).view(B, T, n_k, 2 * dk + r * dv)
        z = self.in_proj_z(x_BTD).view(B, T, n_v, dv)
        beta = b.sigmoid()
        dt_bias, A_log = local_shard(self.dt_bias), local_shard(self.A_log)  # this rank's value heads
        g = -A_log.float().exp() * F.softplus(self.in_proj_a(x_BTD).float() + dt_bias)
        conv_weight = local_shard(self.conv1d.weight).squeeze(1)
        o = self.delta_rule(qkv, g, beta, conv_weight=conv_weight, meta=meta)
        o = self.norm(o, z)
        return self.out_proj(o.reshape(B, T, -1))

    @staticmethod
    def qkv_rows_from_hf(config: Config, rows: torch.Tensor) -> torch.Tensor:
        """HF's ``[Q | K | V]`` rows (dim 0 of ``in_proj_qkv.weight`` or ``conv1d.weight``) -> our grouped order."""
        c = config
        key_dim, value_dim = c.num_k_heads * c.head_k_dim, c.num_v_heads * c.head_v_dim
        if rows.shape[0] != 2 * key_dim + value_dim:
            raise ValueError(
                f"a Gated DeltaNet q/k/v tensor has 2 * {key_dim} + {value_dim} rows, got shape {tuple(rows.shape)}: "
                "the checkpoint's linear_* head fields differ from the model's"
            )
        tail = rows.shape[1:]
        q, k, v = (t.reshape(c.num_k_heads, -1, *tail) for t in rows.split([key_dim, key_dim, value_dim]))
        return torch.cat([q, k, v], dim=1).reshape(rows.shape)

    @staticmethod
    def qkv_rows_to_hf(config: Config, rows: torch.Tensor) -> torch.Tensor:
        """Our grouped rows -> HF's ``[Q | K | V]`` order (the inverse of ``qkv_rows_from_hf``)."""
        c = config
        r = c.num_v_heads // c.num_k_heads
        grouped = rows.reshape(c.num_k_heads, 2 * c.head_k_dim + r * c.head_v_dim, *rows.shape[1:])
        q, k, v = grouped.split([c.head_k_dim, c.head_k_dim, r * c.head_v_dim], dim=1)
        return torch.cat([t.reshape(-1, *rows.shape[1:]) for t in (q, k, v)])

    def extra_repr(self) -> str:
        c = self.config
        return f"num_k_heads={c.num_k_heads}, num_v_heads={c.num_v_heads}, head_k_dim={c.head_k_dim}, head_v_dim={c.head_v_dim}"

