"""Run-level option groups: training loop, activation checkpointing, compile, comm, debug."""

from dataclasses import dataclass, field
from typing import Literal

from hyper_parallel.config.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """How long and how the model trains."""

    steps: int = 100
    """Number of optimizer steps to run."""
    max_norm: float = 1.0
    """Clip the global gradient norm (over all meshes) to this value; <= 0 disables clipping."""
    mixed_precision_param: Literal["float32", "bfloat16"] = "float32"
    """Dtype FSDP casts parameters to for forward/backward compute. (float16 is not offered: its narrow
    range needs loss scaling, which this trainer does not do; bfloat16 has fp32's range.)"""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype FSDP reduce-scatters (and all-reduces, HSDP) gradients in: float32 by default, also when parameters
    compute in bfloat16 (bf16 sums over many ranks lose low bits); bfloat16 halves the reduce bytes and buffers."""
    defer_grad_reduce: bool = False
    """Reduce FSDP gradients once per step, after the last micro-batch, instead of after every one: fewer
    collectives, but every rank holds full unsharded fp32 gradients between micro-batches (small models)."""
    moe_bias_update_rate: float = 0.0
    """Aux-loss-free load balancing: after each step move every router's e_score_correction_bias by this
    rate towards equal expert load (DeepSeek-V3); 0 disables it."""
    on_nonfinite: Literal["error", "skip"] = "error"
    """A NaN/inf loss or grad norm: `error` stops naming the step, `skip` drops that step's update."""

    def __post_init__(self) -> None:
        if self.mixed_precision_param not in ("float32", "bfloat16"):
            hint = (
                " float16 gradients underflow without loss scaling (a GradScaler), which this trainer does not do;"
                if self.mixed_precision_param in ("float16", "fp16", "half")
                else ""
            )
            raise ConfigError(
                f"training.mixed_precision_param={self.mixed_precision_param!r} is not supported:{hint} "
                "use 'bfloat16' (fp32's exponent range, no scaling needed) or 'float32'"
            )


@dataclass(kw_only=True, slots=True)
class ActivationCheckpointConfig:
    """Activation checkpointing, applied per decoder layer."""

    mode: Literal["none", "full", "selective"] = "none"
    """`full` recomputes every decoder layer; `selective` recomputes every N-th layer."""
    selective_every_n_layers: int = 2
    """With mode=selective: checkpoint one decoder layer out of this many."""
    preserve_rng_state: bool = False
    """Replay RNG on recompute (for dropout)."""


@dataclass(kw_only=True, slots=True)
class CompileConfig:
    """torch.compile, applied per decoder layer."""

    enable: bool = False
    """Compile each decoder layer with torch.compile."""
    backend: str = "inductor"
    """torch.compile backend name."""
    fullgraph: bool = False
    """Ask torch.compile for a single graph per layer (errors on graph breaks)."""


@dataclass(kw_only=True, slots=True)
class CommConfig:
    """Process-group set-up."""

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend; `auto` picks nccl when CUDA is available, else gloo."""
    init_timeout_seconds: int = 300
    """Timeout of the first collectives (process-group creation and warm-up)."""
    train_timeout_seconds: int = 600
    """Timeout of every collective after the first step."""
    hf_load_timeout_seconds: int = 3600
    """Timeout of the collectives around `--checkpoint.initial_load_path` (each rank reads its own slices; a slow file system keeps the fastest rank waiting)."""


@dataclass(kw_only=True, slots=True)
class DebugConfig:
    """Reproducibility and debugging switches."""

    seed: int = 0
    """Seed of every RNG (model init, data order, dropout)."""
    deterministic: bool = False
    """Use deterministic algorithms (bitwise-repeatable runs on CPU)."""
    detect_anomaly: bool = False
    """Run autograd anomaly detection (slow)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Free-form debug switches for experiments (not read by the library)."""
