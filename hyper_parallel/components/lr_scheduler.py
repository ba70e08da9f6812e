"""LR schedule: linear warmup, then cosine / linear / constant decay to ``min_lr_ratio``.

The factor multiplying every group's peak LR at optimizer step ``s`` (0-based: ``s`` steps done) is::

    s <  warmup_steps:  (s + 1) / warmup_steps                      # never a zero-LR first step
    s >= warmup_steps:  p = min(1, (s - warmup_steps + 1) / decay_steps)
                        linear:   1 - (1 - min_lr_ratio) * p
                        cosine:   min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2
                        constant: 1

``decay_steps=None`` decays over the rest of training (``total_steps - warmup_steps``), so the last
step runs at exactly ``min_lr_ratio * peak``. Call ``step()`` once after every optimizer step.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from hyper_parallel.config.configurable import Configurable
from hyper_parallel.rank_log import warn_on_rank0

logger = logging.getLogger(__name__)

__all__ = ["LRSchedulersContainer", "lr_factor"]


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    decay_steps: int,
    decay_type: Literal["cosine", "linear", "constant"],
    min_lr_ratio: float,
) -> float:
    """The LR multiplier at 0-based optimizer step ``step`` (see the module docstring)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_type == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps + 1) / max(1, decay_steps))
    if decay_type == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    if decay_type == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_scheduler.decay_type={decay_type!r}: use 'cosine', 'linear' or 'constant'")


class LRSchedulersContainer(Configurable):
    """One ``LambdaLR`` per optimizer of an ``OptimizersContainer`` (or a plain optimizer).

    Build with ``LRSchedulersContainer.Config(...).build(optimizers=container, total_steps=N)``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        warmup_steps: int = 0
        """Steps of linear warmup from peak/warmup_steps to the peak LR."""
        decay_type: Literal["cosine", "linear", "constant"] = "cosine"
        """Shape of the decay after warmup."""
        min_lr_ratio: float = 0.1
        """Final LR as a fraction of the peak LR."""
        decay_steps: int | None = None
        """Steps of decay after warmup; None = until training.steps (then the LR stays at the minimum)."""

    def __init__(self, config: Config, *, optimizers: Any, total_steps: int) -> None:
        super().__init__(config)
        self.config: LRSchedulersContainer.Config = config
        if config.warmup_steps < 0:
            raise ValueError(f"lr_scheduler.warmup_steps={config.warmup_steps} must be >= 0")
        if not 0.0 <= config.min_lr_ratio <= 1.0:
            raise ValueError(f"lr_scheduler.min_lr_ratio={config.min_lr_ratio} must be in [0, 1]")
        warmup_steps = config.warmup_steps
        if warmup_steps > total_steps:
            # A short smoke run of a long recipe (torchtitan does the same): warm up over the whole run.
            warn_on_rank0(
                logger,
                "lr_scheduler.warmup_steps=%d > training.steps=%d: warming up over all %d steps",
                warmup_steps, total_steps, total_steps,
            )  # fmt: skip
            warmup_steps = total_steps
        if config.decay_steps is not None and config.decay_steps < 1 and config.decay_type != "constant":
            raise ValueError(f"lr_scheduler.decay_steps={config.decay_steps} must be >= 1 (or None: until the end)")
        decay_steps = config.decay_steps if config.decay_steps is not None else total_steps - warmup_steps
        self.warmup_steps = warmup_steps
        self.factor = functools.partial(
            lr_factor,
            warmup_steps=warmup_steps,
            decay_steps=decay_steps,
            decay_type=config.decay_type,
            min_lr_ratio=config.min_lr_ratio,
        )
        opts = list(getattr(optimizers, "optimizers", [optimizers]))
        self.schedulers: list[LRScheduler] = [LambdaLR(opt, self.factor) for opt in opts]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list[float]:
        """Current LR of every group of the first optimizer."""
        return self.schedulers[0].get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        # All schedulers move in lock step; the schedule itself is rebuilt from the config.
        sd = self.schedulers[0].state_dict()
        return {"last_epoch": sd["last_epoch"], "_step_count": sd["_step_count"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for s in self.schedulers:
            s.last_epoch = int(state_dict["last_epoch"])
            s._step_count = int(state_dict["_step_count"])
            # Recompute the LR of every group for the restored step (the optimizer state may carry
            # the LRs too, but this keeps the schedule the single source of truth).
            values = [base * self.factor(s.last_epoch) for base in s.base_lrs]
            for group, lr in zip(s.optimizer.param_groups, values):
                group["lr"] = lr
            s._last_lr = values
