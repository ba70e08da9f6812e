"""``RMSNorm`` with HF's exact numerics: fp32 statistics, cast back before the weight multiply."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from hyper_parallel.protocols.module import Module
from hyper_parallel.protocols.param_init import ConstantInit, ParamInit

__all__ = ["RMSNorm"]


class RMSNorm(Module):
    """``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        eps: float = 1e-5
        """Added to the mean square (Glm4MoeLite: 1e-5; its q_a/kv_a layernorms: 1e-6)."""
        param_init: ParamInit.Config | None = field(default_factory=lambda: ConstantInit.Config(value=1.0))
        """Weight initialiser (ones)."""

    def __init__(self, config: Config, *, dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(config)
        self.dim = dim
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.config.eps)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.config.eps}"
