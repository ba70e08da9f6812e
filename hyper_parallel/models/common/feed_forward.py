"""``FeedForward``: the SwiGLU MLP ``down(silu(gate(x)) * up(x))`` (dense layers, shared experts)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hyper_parallel.models.common.linear import Linear
from hyper_parallel.protocols.module import Module

__all__ = ["FeedForward"]


class FeedForward(Module):
    """SwiGLU MLP; ``dim`` comes from the parent, ``hidden_dim`` is this module's own choice."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        hidden_dim: int
        """Intermediate size (HF ``intermediate_size``; for shared experts ``moe_intermediate_size * n_shared``)."""
        gate_proj: Linear.Config = field(default_factory=Linear.Config)
        """Gate projection ``[hidden_dim, dim]``."""
        up_proj: Linear.Config = field(default_factory=Linear.Config)
        """Up projection ``[hidden_dim, dim]``."""
        down_proj: Linear.Config = field(default_factory=Linear.Config)
        """Down projection ``[dim, hidden_dim]``."""

    def __init__(self, config: Config, *, dim: int) -> None:
        super().__init__(config)
        self.gate_proj = config.gate_proj.build(in_features=dim, out_features=config.hidden_dim)
        self.up_proj = config.up_proj.build(in_features=dim, out_features=config.hidden_dim)
        self.down_proj = config.down_proj.build(in_features=config.hidden_dim, out_features=dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
