"""Training components: optimizers (AdamW, Muon), LR schedules, loss, EMA, checkpointing, metrics, validation."""

from hyper_parallel.components.checkpoint import CheckpointManager, ModelWrapper, assert_finite
from hyper_parallel.components.ema import EMA
from hyper_parallel.components.loss import BaseLoss, CrossEntropyLoss
from hyper_parallel.components.lr_scheduler import LRSchedulersContainer, lr_factor
from hyper_parallel.components.metrics import MetricsProcessor, known_peak_flops, measure_peak_flops
from hyper_parallel.components.muon import MuonWithAuxAdamW, zeropower_via_newtonschulz5
from hyper_parallel.components.optimizer import OptimizersContainer, get_hyper_optimizer, split_muon_params
from hyper_parallel.components.profiler import Profiler, ProfilingConfig
from hyper_parallel.components.validate import ValidationResult, Validator

__all__ = [
    "BaseLoss",
    "CheckpointManager",
    "CrossEntropyLoss",
    "EMA",
    "LRSchedulersContainer",
    "MetricsProcessor",
    "ModelWrapper",
    "MuonWithAuxAdamW",
    "OptimizersContainer",
    "Profiler",
    "ProfilingConfig",
    "ValidationResult",
    "Validator",
    "assert_finite",
    "get_hyper_optimizer",
    "known_peak_flops",
    "lr_factor",
    "measure_peak_flops",
    "split_muon_params",
    "zeropower_via_newtonschulz5",
]
