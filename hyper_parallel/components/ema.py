"""Exponential moving average of the trainable weights.

Every ``update_every``-th call of ``update(model)`` does ``shadow = decay * shadow + (1 - decay) * p``
for each trainable parameter. Shadows are ``detach().clone()`` of the parameters, so a DTensor
parameter (FSDP/TP/EP-sharded) gets a shadow with the same mesh and placements: the update is
elementwise on local shards and needs no communication, and DCP saves the shadows sharded.
``swap(model)`` temporarily puts the EMA weights into the model (for evaluation or an HF export).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyper_parallel.config.configurable import Configurable

__all__ = ["EMA"]


def _trainable(model: nn.Module | Sequence[nn.Module]) -> dict[str, nn.Parameter]:
    """Trainable parameters by name; of several model parts (pipeline stages: their names never collide) all."""
    parts = [model] if isinstance(model, nn.Module) else list(model)
    return {n: p for part in parts for n, p in part.named_parameters() if p.requires_grad}


class EMA(Configurable):
    """EMA of ``model``'s trainable parameters. Build with ``EMA.Config(decay=0.999).build(model=model)``.

    Build it after the weights are final for step 0 (initialised, or loaded from ``initial_load_path``):
    the shadows start as copies of the current weights. A checkpoint restores them.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        decay: float = 0.0
        """EMA decay per update, e.g. 0.999; 0 disables EMA (no shadow copies are kept)."""
        update_every: int = 1
        """Update the EMA every this many optimizer steps."""

    def __init__(self, config: Config, *, model: nn.Module | Sequence[nn.Module]) -> None:
        super().__init__(config)
        self.config: EMA.Config = config
        if not 0.0 <= config.decay < 1.0:
            raise ValueError(f"ema.decay={config.decay} must be in [0, 1) (0 disables EMA)")
        if config.update_every < 1:
            raise ValueError(f"ema.update_every={config.update_every} must be >= 1")
        self.num_calls = 0
        self.num_updates = 0
        self.shadow: dict[str, torch.Tensor] = {}
        if self.enabled:
            with torch.no_grad():
                self.shadow = {n: p.detach().clone() for n, p in _trainable(model).items()}

    @property
    def enabled(self) -> bool:
        return self.config.decay > 0.0

    def _params(self, model: nn.Module | Sequence[nn.Module]) -> dict[str, nn.Parameter]:
        params = _trainable(model)
        if params.keys() != self.shadow.keys():
            missing, extra = sorted(self.shadow.keys() - params.keys()), sorted(params.keys() - self.shadow.keys())
            raise ValueError(f"EMA was built for other parameters: missing in model {missing}, new in model {extra}")
        return params

    @torch.no_grad()
    def update(self, model: nn.Module | Sequence[nn.Module]) -> bool:
        """Call after each optimizer step; returns whether the shadows were updated."""
        if not self.enabled:
            return False
        self.num_calls += 1
        if self.num_calls % self.config.update_every:
            return False
        for name, p in self._params(model).items():
            self.shadow[name].lerp_(p.detach(), 1.0 - self.config.decay)
        self.num_updates += 1
        return True

    @torch.no_grad()
    def copy_to(self, model: nn.Module | Sequence[nn.Module]) -> None:
        """Overwrite ``model``'s trainable parameters with the EMA weights."""
        for name, p in self._params(model).items():
            p.copy_(self.shadow[name])

    @contextlib.contextmanager
    def swap(self, model: nn.Module | Sequence[nn.Module]) -> Iterator[nn.Module]:
        """Inside the block the model holds the EMA weights; the training weights come back after."""
        if not self.enabled:
            yield model
            return
        params = self._params(model)
        with torch.no_grad():
            backup = {n: p.detach().clone() for n, p in params.items()}
            self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(backup[name])

    # -- Stateful (DCP): shadows are loaded in place, so sharded shadows stay sharded -------------
    def state_dict(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        return {"num_calls": self.num_calls, "num_updates": self.num_updates, "shadow": dict(self.shadow)}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if not state_dict:
            raise ValueError("ema.decay > 0 but the checkpoint has no EMA state; set ema.decay=0 or start fresh")
        shadow = state_dict["shadow"]
        if shadow.keys() != self.shadow.keys():
            raise ValueError(
                f"EMA state keys differ: missing {sorted(self.shadow.keys() - shadow.keys())}, "
                f"unexpected {sorted(shadow.keys() - self.shadow.keys())}"
            )
        for name, t in shadow.items():
            if t is not self.shadow[name]:
                self.shadow[name].copy_(t)
        self.num_calls = int(state_dict["num_calls"])
        self.num_updates = int(state_dict["num_updates"])
