"""Parameter initialisers as configurable functions (``Module.Config.param_init``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hyper_parallel.config.configurable import Function

__all__ = ["ConstantInit", "NormalInit", "ParamInit", "TruncNormalInit"]


class ParamInit(Function):
    """Initialises one tensor in place: ``init(tensor)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Function.Config):
        pass

    @torch.no_grad()
    def __call__(self, tensor: torch.Tensor) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class NormalInit(ParamInit):
    """``normal_(mean, std)`` (HF's ``_init_weights`` for Linear/Embedding/experts)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParamInit.Config):
        mean: float = 0.0
        """Mean of the normal distribution."""
        std: float = 0.02
        """Standard deviation of the normal distribution."""

    @torch.no_grad()
    def __call__(self, tensor: torch.Tensor) -> None:
        nn.init.normal_(tensor, mean=self.config.mean, std=self.config.std)


class TruncNormalInit(ParamInit):
    """Normal truncated at ``cutoff`` standard deviations."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParamInit.Config):
        std: float = 0.02
        """Standard deviation before truncation."""
        cutoff: float = 3.0
        """Truncate at this many standard deviations."""

    @torch.no_grad()
    def __call__(self, tensor: torch.Tensor) -> None:
        s, c = self.config.std, self.config.cutoff
        nn.init.trunc_normal_(tensor, mean=0.0, std=s, a=-c * s, b=c * s)


class ConstantInit(ParamInit):
    """Fill with a constant (norm weights: 1, biases: 0)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParamInit.Config):
        value: float = 0.0
        """The constant."""

    @torch.no_grad()
    def __call__(self, tensor: torch.Tensor) -> None:
        nn.init.constant_(tensor, self.config.value)
