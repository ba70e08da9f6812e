"""Qwen3.5 norms: the zero-centred ``Qwen3_5RMSNorm`` and the gated output norm of Gated DeltaNet.

Both keep HF's exact op order (reference doc section 1.4), which matters in bf16:

- ``Qwen3_5RMSNorm``: ``(x̂ * (1 + w))`` entirely in fp32, cast at the end; ``w`` starts at 0 and is
  stored as is in checkpoints (never add 1 when converting).
- ``GatedRMSNorm``: ``(w * x̂.to(dtype)) * silu(z.float())`` cast at the end; a plain weight (starts
  at 1) multiplied AFTER the cast, the norm before the gate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.protocols.module import Module
from hyper_parallel.protocols.param_init import ConstantInit, ParamInit

__all__ = ["GatedRMSNorm", "Qwen3_5RMSNorm"]


def _normalize_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class Qwen3_5RMSNorm(Module):
    """Zero-centred RMSNorm ``(x̂ * (1 + w)).to(x.dtype)`` with fp32 statistics (HF ``Qwen3_5RMSNorm``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        eps: float = 1e-6
        """Added to the mean square (HF ``rms_norm_eps``)."""
        param_init: ParamInit.Config | None = field(default_factory=lambda: ConstantInit.Config(value=0.0))
        """Weight initialiser (zeros: the norm starts as the identity scale ``1 + 0``)."""

    def __init__(self, config: Config, *, dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(config)
        self.dim = dim
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_normalize_fp32(x, self.config.eps) * (1.0 + self.weight.float())).type_as(x)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.config.eps}"


class GatedRMSNorm(Module):
    """``((w * x̂.to(dtype)) * silu(z.float())).to(dtype)`` over the last dim (HF ``Qwen3_5RMSNormGated``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        eps: float = 1e-6
        """Added to the mean square (HF ``rms_norm_eps``)."""
        param_init: ParamInit.Config | None = field(default_factory=lambda: ConstantInit.Config(value=1.0))
        """Weight initialiser (ones)."""

    def __init__(self, config: Config, *, dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(config)
        self.dim = dim
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = self.weight * _normalize_fp32(x, self.config.eps).to(dtype)
        return (h * F.silu(gate.float())).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.config.eps}"
