"""Training metrics: console progress lines, ``metrics.jsonl``, optional TensorBoard, a loss-curve PNG.

Call ``log(step, loss=..., grad_norm=..., lr=..., num_tokens=...)`` after every optimizer step. The
processor records the loss of every step (for the curve) and, every ``log_freq`` steps (and at step
1 and the last step), emits one record with window averages:

- ``tps``: tokens per second per rank over the window (``num_tokens`` is this rank's tokens);
- ``mfu``: ``tps * flops_per_token / peak_flops`` in percent (``flops_per_token`` from
  ``BaseModel.get_nparams_and_flops``; the peak from a table of known GPUs or a measured matmul);
- ``memory_gib``: peak CUDA memory allocated, or peak process RSS on CPU;
- ``expert_load/<layer>``: max/mean tokens per expert of each MoE layer (1.0 is perfect balance);
- ``extra`` values as given (e.g. the data's ``bad_samples_skipped``; a mixture's
  ``data/<name>/{tokens,share,epoch,bad_samples_skipped}`` and the trainer's ``loss/<name>``, which
  the console line shows compactly as ``src <name> <share>% <loss>, ...``).

Only rank 0 writes files and console lines.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.config.configurable import Configurable

__all__ = ["MetricsProcessor", "PEAK_FLOPS_TABLE", "measure_peak_flops", "peak_memory_gib"]

logger = logging.getLogger(__name__)

PEAK_FLOPS_TABLE: dict[str, float] = {
    # Dense bf16/fp16 tensor-core peak FLOP/s per device (vendor data sheets). Order matters:
    # the first name contained in torch.cuda.get_device_name() wins.
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "V100": 125e12,
    "MI300X": 1307e12,
}


def measure_peak_flops(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> float:
    """Peak matmul FLOP/s of ``device`` for ``dtype``: the table for known GPUs in bf16/fp16,
    else a short measured square-matmul loop (about 0.1 s on CPU)."""
    device = torch.device(device)
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        for key, flops in PEAK_FLOPS_TABLE.items():
            if key in name:
                return flops
    n, reps = (4096, 20) if device.type == "cuda" else (512, 8)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2.0 * n**3 * reps / max(time.perf_counter() - t0, 1e-9)


def peak_memory_gib(device: torch.device | str | None = None) -> float:
    """Peak CUDA memory allocated on ``device``, or the process's peak RSS off-GPU, in GiB."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def _source_parts(record: Mapping[str, Any]) -> str:
    """``src big 61% 2.314, mid 29% 2.871``: each mixture source's share of the step's tokens and its
    loss (keys ``data/<name>/share`` and ``loss/<name>``); empty for a single-source run."""
    names = [k[len("data/") : -len("/share")] for k in record if k.startswith("data/") and k.endswith("/share")]
    items = []
    for name in names:
        loss = record.get(f"loss/{name}")
        items.append(f"{name} {100 * record[f'data/{name}/share']:.0f}%" + (f" {loss:.3f}" if loss is not None else ""))
    return ("src " + ", ".join(items)) if items else ""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class MetricsProcessor(Configurable):
    """Build with ``MetricsProcessor.Config(...).build(dump_folder=..., total_steps=N,
    flops_per_token=F, device=device)``; call ``log`` every step and ``close`` at the end."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        log_freq: int = 10
        """Emit a metrics record every this many steps (plus step 1 and the last step)."""
        enable_tensorboard: bool = False
        """Also write TensorBoard scalars (needs the optional `tensorboard` package)."""
        tensorboard_folder: str = "tb"
        """TensorBoard folder, relative to the dump folder."""
        jsonl_name: str = "metrics.jsonl"
        """File in the dump folder that gets one JSON record per emitted log line."""
        plot_loss: bool = True
        """Write the loss curve of every step to loss_curve.png in the dump folder at close."""

    def __init__(
        self,
        config: Config,
        *,
        dump_folder: str | os.PathLike,
        total_steps: int | None = None,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__(config)
        self.config: MetricsProcessor.Config = config
        if config.log_freq < 1:
            raise ValueError(f"metrics.log_freq={config.log_freq} must be >= 1")
        self.dump_folder = Path(dump_folder)
        self.total_steps = total_steps
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.flops_per_token = flops_per_token
        if flops_per_token is not None and peak_flops is None:
            peak_flops = measure_peak_flops(self.device, compute_dtype)
        self.peak_flops = peak_flops
        self.is_writer = _rank() == 0
        self.loss_history: list[tuple[int, float]] = []
        self._jsonl = None
        self._tb = None
        if self.is_writer:
            self.dump_folder.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.dump_folder / config.jsonl_name, "a", encoding="utf-8")  # noqa: SIM115
            if config.enable_tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError as e:
                    raise ImportError(
                        "metrics.enable_tensorboard=True needs the `tensorboard` package: "
                        "pip install 'hyper-parallel[tensorboard]', or set --metrics.enable_tensorboard false"
                    ) from e
                self._tb = SummaryWriter(log_dir=str(self.dump_folder / config.tensorboard_folder))
        self.reset_timer()

    def reset_timer(self) -> None:
        """Start the time window now (call right before the first step to exclude set-up time)."""
        self._t_start = self._t_window = time.perf_counter()
        self._tokens_window = 0
        self._steps_window = 0

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.config.log_freq == 0 or step == self.total_steps

    def log(
        self,
        step: int,
        *,
        loss: float | torch.Tensor,
        grad_norm: float | torch.Tensor | None = None,
        lr: float | None = None,
        num_tokens: int = 0,
        expert_load: Mapping[str, torch.Tensor] | None = None,
        extra: Mapping[str, float] | None = None,
    ) -> dict[str, Any] | None:
        """Record one optimizer step; returns the emitted record on log steps, else None."""
        loss_value = float(loss)
        self.loss_history.append((step, loss_value))
        self._tokens_window += int(num_tokens)
        self._steps_window += 1
        if not self.should_log(step):
            return None
        now = time.perf_counter()
        window = max(now - self._t_window, 1e-9)
        record: dict[str, Any] = {"step": step, "loss": loss_value}
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        if lr is not None:
            record["lr"] = float(lr)
        record["tps"] = self._tokens_window / window
        if self.flops_per_token and self.peak_flops:
            record["mfu"] = 100.0 * record["tps"] * self.flops_per_token / self.peak_flops
        record["memory_gib"] = peak_memory_gib(self.device)
        record["step_time_s"] = window / self._steps_window
        record["elapsed_s"] = now - self._t_start
        if expert_load:
            for name, load in expert_load.items():
                load = load.detach().float()
                record[f"expert_load/{name}"] = float(load.max() / load.mean().clamp(min=1e-9))
        for key, value in (extra or {}).items():
            record[key] = float(value)
        self._t_window, self._tokens_window, self._steps_window = now, 0, 0
        if self.is_writer:
            self._emit(record)
        return record

    def _emit(self, record: dict[str, Any]) -> None:
        step = record["step"]
        parts = [f"step {step:>6d}"]
        if self.total_steps:
            frac = min(step / self.total_steps, 1.0)
            bar = "#" * int(20 * frac)
            eta = timedelta(seconds=int(record["step_time_s"] * max(self.total_steps - step, 0)))
            parts[0] = f"step {step:>6d}/{self.total_steps} [{bar:<20}] {100 * frac:5.1f}%"
        parts.append(f"loss {record['loss']:.4f}")
        if "grad_norm" in record:
            parts.append(f"gnorm {record['grad_norm']:.3f}")
        if "lr" in record:
            parts.append(f"lr {record['lr']:.2e}")
        parts.append(f"tps {record['tps']:,.0f}")
        if "mfu" in record:
            parts.append(f"mfu {record['mfu']:.2f}%")
        parts.append(f"mem {record['memory_gib']:.2f}GiB")
        loads = [v for k, v in record.items() if k.startswith("expert_load/")]
        if loads:
            parts.append(f"expert max/mean {max(loads):.2f}")
        sources = _source_parts(record)
        if sources:
            parts.append(sources)
        if self.total_steps:
            parts.append(f"eta {eta}")
        logger.info(" | ".join(parts))
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step":
                    self._tb.add_scalar(key, value, step)

    def plot(self, path: str | os.PathLike | None = None) -> Path | None:
        """Write the per-step loss curve PNG (rank 0); returns its path."""
        if not (self.is_writer and self.loss_history):
            return None
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        out = Path(path) if path is not None else self.dump_folder / "loss_curve.png"
        fig = Figure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)  # Agg canvas without pyplot: no global backend state, no display needed
        ax = fig.add_subplot()
        steps, losses = zip(*self.loss_history)
        ax.plot(steps, losses, linewidth=1.0)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(out)
        return out

    def close(self) -> None:
        """Write the loss curve (if configured) and close the files."""
        if self.config.plot_loss:
            self.plot()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
