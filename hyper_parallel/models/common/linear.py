"""``Linear``: a projection whose dimensions come from the parent at build time."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.protocols.module import Module
from hyper_parallel.protocols.param_init import NormalInit, ParamInit

__all__ = ["Linear"]


class Linear(Module):
    """``y = x W^T (+ b)`` with ``W [out_features, in_features]`` (HF layout).

    Build with ``Linear.Config(...).build(in_features=..., out_features=...)``: dimensions are derived
    by the parent, never stored twice in the config tree.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        bias: bool = False
        """Add a bias vector."""
        param_init: ParamInit.Config | None = field(default_factory=NormalInit.Config)
        """Weight initialiser (biases are zeroed)."""

    def __init__(self, config: Config, *, in_features: int, out_features: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(config)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if config.bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
