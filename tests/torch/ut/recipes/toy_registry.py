"""A tiny recipe module used by the ConfigManager tests (a dotted --module path)."""

from dataclasses import dataclass, field

from hyper_parallel.config import Configurable, ParallelismConfig, TrainingConfig
from hyper_parallel.models.common.feed_forward import FeedForward


class ToyRun(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        model: FeedForward.Config = field(default_factory=lambda: FeedForward.Config(hidden_dim=8))
        """The toy model."""
        training: TrainingConfig = field(default_factory=TrainingConfig)
        """Training loop options."""
        parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
        """Parallel layout."""
        name: str = "toy"
        """Run name."""


def toy_small() -> ToyRun.Config:
    """A small toy run."""
    return ToyRun.Config()


def toy_large() -> ToyRun.Config:
    """Derived from toy_small with a wider model."""
    cfg = toy_small()
    cfg.model.hidden_dim = 64
    return cfg
