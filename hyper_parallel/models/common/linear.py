"""``Linear``: a projection whose dimensions come from the parent at build time (optionally LoRA-adapted)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.models.common.lora import LoRA, init_lora_A_
from hyper_parallel.protocols.module import Module
from hyper_parallel.protocols.param_init import NormalInit, ParamInit

__all__ = ["Linear"]


class Linear(Module):
    """``y = x W^T (+ b)`` with ``W [out_features, in_features]`` (HF layout).

    Build with ``Linear.Config(...).build(in_features=..., out_features=...)``: dimensions are derived
    by the parent, never stored twice in the config tree.

    With ``lora`` set, two more direct parameters ``lora_A [r, in]`` and ``lora_B [out, r]`` add
    ``scale * (dropout(x) A^T) B^T`` (``models/common/lora.py``); the HF key of each is the weight's with
    ``.weight`` -> ``.lora_A.weight`` / ``.lora_B.weight`` (PEFT's names).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        bias: bool = False
        """Add a bias vector."""
        param_init: ParamInit.Config | None = field(default_factory=NormalInit.Config)
        """Weight initialiser (biases are zeroed)."""
        lora: LoRA.Config | None = None
        """LoRA adapter on this projection (set by ``apply_lora`` from ``--lora.*``); None: none."""

    def __init__(self, config: Config, *, in_features: int, out_features: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(config)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if config.bias else None
        if config.lora is not None:
            rank = config.lora.rank
            self.lora_A = nn.Parameter(torch.empty(rank, in_features, dtype=dtype))
            self.lora_B = nn.Parameter(torch.empty(out_features, rank, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        lora = self.config.lora
        if lora is None:
            return y
        if lora.dropout > 0:
            x = F.dropout(x, lora.dropout, self.training)
        return y + lora.scale * F.linear(F.linear(x, self.lora_A), self.lora_B)

    @torch.no_grad()
    def init_own_weights(self) -> None:
        # The base first (param_init on the weight, bias zeroed), then the adapter as PEFT: A kaiming-uniform, B 0.
        init = self.config.param_init.build() if self.config.param_init is not None else None
        if init is not None:
            init(self.weight)
        if self.bias is not None:
            self.bias.zero_()
        if self.config.lora is not None:
            init_lora_A_(self.lora_A)
            self.lora_B.zero_()

    def extra_repr(self) -> str:
        out = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        lora = self.config.lora
        if lora is not None:
            out += f", lora_rank={lora.rank}, lora_scale={lora.scale:g}"
            out += f", lora_dropout={lora.dropout}" if lora.dropout else ""
        return out
