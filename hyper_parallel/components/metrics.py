"""Training metrics: console progress lines, ``metrics.jsonl``, optional TensorBoard, a loss-curve PNG.

Call ``log(step, loss=..., grad_norm=..., lr=..., num_tokens=...)`` after every optimizer step. The
processor records the loss of every step (for the curve) and, every ``log_freq`` steps (and at step
1 and the last step), emits one record with window averages:

- ``tps``: tokens per second per rank over the window (``num_tokens`` is this rank's tokens);
- ``flops_per_token``: training FLOPs per token of the window's steps, from their real documents
  (``BaseModel.training_flops`` of each micro-batch: attention causal within each packed document, routed
  experts at top-k, the vision tower / image path; convention in ``models/common/flops.py``);
- ``tflops``: achieved TFLOP/s per rank (``tps * flops_per_token / 1e12``);
- ``mfu``: ``tflops`` over the device's peak in percent, only when the peak is known: ``--metrics.peak_tflops``,
  else the bf16/fp16 table of known CUDA devices (``PEAK_FLOPS_TABLE``). A CPU, an unknown GPU or fp32 compute
  has no known peak: no MFU is printed (never a guessed one);
- ``memory_gib``: peak CUDA memory allocated, or peak process RSS on CPU, the most of any rank (pipeline stages
  and expert shards differ; the fullest rank is the one that runs out);
- ``expert_load/<layer>``: max/mean tokens per expert of each MoE layer (1.0 is perfect balance);
- ``extra`` values as given (e.g. the data's ``bad_samples_skipped``; a mixture's
  ``data/<name>/{tokens,share,epoch,bad_samples_skipped}`` and the trainer's ``loss/<name>``, which
  the console line shows compactly as ``src <name> <share>% <loss>, ...``).

``log_validation(step, record)`` emits a validation record (``val/loss``, ``val/ppl``, ``val/<source>/loss``,
``val/loss_mtp`` ...; :mod:`.validate`) as its own line of ``metrics.jsonl`` (``{"step": N, "val/loss": ...}``),
its own console line and TensorBoard scalars; the loss curve shows it beside the training loss.

With ``--metrics.wandb`` every record also goes to a Weights & Biases run (project, run name, entity), whose
config is the resolved run config. wandb reads its own environment as usual: ``WANDB_MODE=offline`` runs
without a network (the run folder can be synced later), ``WANDB_DIR`` chooses where the run folder goes
(default: the dump folder), ``WANDB_API_KEY`` logs in. A missing package or a run that cannot start is an
error on every rank at start-up, not mid-run.

Only rank 0 writes files, console lines and W&B records.
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

__all__ = ["MetricsProcessor", "PEAK_FLOPS_TABLE", "known_peak_flops", "measure_peak_flops", "peak_memory_gib"]

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


def known_peak_flops(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The data-sheet peak FLOP/s of a known CUDA device (``PEAK_FLOPS_TABLE``) for bf16/fp16 compute; None for
    anything else (a CPU, an unknown GPU, fp32): MFU against a guess would mislead."""
    device = torch.device(device)
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        for key, flops in PEAK_FLOPS_TABLE.items():
            if key in name:
                return flops
    return None


def measure_peak_flops(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> float:
    """Peak matmul FLOP/s of ``device`` for ``dtype``: the table for known GPUs in bf16/fp16,
    else a short measured square-matmul loop (about 0.1 s on CPU). For benchmarks; the metrics never use a
    measured peak."""
    device = torch.device(device)
    known = known_peak_flops(device, dtype)
    if known is not None:
        return known
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


def _most_of_any_rank(value: float, device: torch.device) -> float:
    """The largest ``value`` of all ranks (every rank calls: ``log`` emits on the same steps everywhere)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _start_wandb(config: MetricsProcessor.Config, dump_folder: Path, run_config: Any) -> Any:
    """Rank 0 starts the W&B run; every rank learns whether it started, so a failure stops all of them now.

    Returns the run on rank 0, None elsewhere.
    """
    run, error = None, None
    if _rank() == 0:
        try:
            run = _init_wandb_run(config, dump_folder, run_config)
        except (ImportError, RuntimeError) as e:
            error = e
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [None if error is None else str(error)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and error is None:
            error = RuntimeError(f"rank 0 could not start the W&B run: {box[0]}")
    if error is not None:
        raise error
    return run


def _init_wandb_run(config: MetricsProcessor.Config, dump_folder: Path, run_config: Any) -> Any:
    try:
        import wandb
    except ImportError as e:
        raise ImportError(
            "metrics.wandb=True needs the `wandb` package: pip install 'hyper-parallel[wandb]', or drop --metrics.wandb"
        ) from e
    resolved = None
    if run_config is not None:
        to_dict = getattr(run_config, "to_dict", None)
        resolved = json.loads(json.dumps(to_dict() if callable(to_dict) else run_config, default=str))
    kwargs: dict[str, Any] = {
        "project": config.wandb_project,
        "name": config.wandb_run_name or dump_folder.resolve().name,
        "config": resolved,
    }
    if config.wandb_entity:
        kwargs["entity"] = config.wandb_entity
    if not os.environ.get("WANDB_DIR"):  # wandb's own variable wins; else the run folder sits in the dump folder
        dump_folder.mkdir(parents=True, exist_ok=True)
        kwargs["dir"] = str(dump_folder)
    try:
        return wandb.init(**kwargs)
    except Exception as e:  # noqa: BLE001 - wandb raises many types (usage, auth, communication, timeouts)
        raise RuntimeError(
            f"W&B could not start the run ({type(e).__name__}: {e}): log in (`wandb login` or WANDB_API_KEY), run "
            "offline with WANDB_MODE=offline (sync later with `wandb sync`), or drop --metrics.wandb"
        ) from e


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
        wandb: bool = False
        """Also log every record and the resolved run config to Weights & Biases (rank 0; the optional `wandb` package). WANDB_MODE=offline needs no network; WANDB_DIR sets the run folder's parent (default: the dump folder)."""
        wandb_project: str = "hyper_parallel"
        """W&B project of the run."""
        wandb_run_name: str = ""
        """W&B run name; empty = the dump folder's name."""
        wandb_entity: str = ""
        """W&B entity (user or team); empty = the account's default."""
        peak_tflops: float = 0.0
        """Peak dense TFLOP/s of one device in the run's compute dtype, for MFU (e.g. 989 for an H100/H200 in bf16).
        0 = the table of known CUDA devices (bf16/fp16), else no MFU (CPUs, unknown GPUs, fp32)."""

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
        run_config: Any = None,
    ) -> None:
        """``run_config``: the resolved run config (the W&B run's config)."""
        super().__init__(config)
        self.config: MetricsProcessor.Config = config
        if config.log_freq < 1:
            raise ValueError(f"metrics.log_freq={config.log_freq} must be >= 1")
        self.dump_folder = Path(dump_folder)
        self.total_steps = total_steps
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.flops_per_token = flops_per_token
        """FLOPs per token of a step that ``log`` is not given its own for (None: none)."""
        if config.peak_tflops < 0:
            raise ValueError(f"metrics.peak_tflops={config.peak_tflops} must be >= 0 (0 = the known-device table)")
        if peak_flops is None:
            known = known_peak_flops(self.device, compute_dtype)
            peak_flops = config.peak_tflops * 1e12 if config.peak_tflops > 0 else known
        self.peak_flops = peak_flops
        """Peak FLOP/s per device for MFU; None = unknown (no MFU)."""
        self.is_writer = _rank() == 0
        self.loss_history: list[tuple[int, float]] = []
        self.val_history: list[tuple[int, float]] = []
        self._jsonl = None
        self._tb = None
        self._wandb = _start_wandb(config, self.dump_folder, run_config) if config.wandb else None
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
        self._flops_window: float | None = 0.0
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
        flops_per_token: float | None = None,
    ) -> dict[str, Any] | None:
        """Record one optimizer step; returns the emitted record on log steps, else None. ``flops_per_token``: the
        step's training FLOPs per token from its documents (default: the one given at build)."""
        loss_value = float(loss)
        self.loss_history.append((step, loss_value))
        self._tokens_window += int(num_tokens)
        fpt = self.flops_per_token if flops_per_token is None else flops_per_token
        if fpt is not None and self._flops_window is not None:
            self._flops_window += float(fpt) * int(num_tokens)
        else:  # a step without a count: the window has no FLOPs figure
            self._flops_window = None
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
        if self._flops_window and self._tokens_window:
            record["flops_per_token"] = self._flops_window / self._tokens_window
            record["tflops"] = self._flops_window / window / 1e12
            if self.peak_flops and self.peak_flops > 0:
                record["mfu"] = 100.0 * record["tflops"] * 1e12 / self.peak_flops
        record["memory_gib"] = _most_of_any_rank(peak_memory_gib(self.device), self.device)
        record["step_time_s"] = window / self._steps_window
        record["elapsed_s"] = now - self._t_start
        if expert_load:
            for name, load in expert_load.items():
                load = load.detach().float()
                record[f"expert_load/{name}"] = float(load.max() / load.mean().clamp(min=1e-9))
        for key, value in (extra or {}).items():
            record[key] = float(value)
        self._t_window, self._tokens_window, self._flops_window, self._steps_window = now, 0, 0.0, 0
        if self.is_writer:
            self._emit(record)
        return record

    def log_validation(self, step: int, record: Mapping[str, float]) -> dict[str, Any]:
        """Emit one validation record (``val/...`` keys, :mod:`.validate`) after optimizer step ``step``;
        ``val/time_s`` (the evaluation's seconds) is left out of the training throughput window."""
        out: dict[str, Any] = {"step": step, **{k: float(v) for k, v in record.items()}}
        # the evaluation's time is not training time: keep it out of the next record's tps, mfu and step time
        self._t_window += out.get("val/time_s", 0.0)
        if "val/loss" in out:
            self.val_history.append((step, out["val/loss"]))
        if not self.is_writer:
            return out
        parts = [f"val  {step:>6d}", f"loss {out.get('val/loss', float('nan')):.4f}", f"ppl {out.get('val/ppl', float('nan')):.2f}"]
        if "val/best_loss" in out:
            parts.append(f"best {out['val/best_loss']:.4f}")
        if "val/loss_mtp" in out:
            parts.append(f"mtp {out['val/loss_mtp']:.4f} top1 {100 * out.get('val/mtp/top1', 0.0):.1f}%")
        sources = [
            f"{k[len('val/') : -len('/loss')]} {v:.3f}"
            for k, v in out.items()
            if k.startswith("val/") and k.endswith("/loss") and k.count("/") == 2
        ]
        if sources:
            parts.append("src " + ", ".join(sources))
        logger.info(" | ".join(parts))
        self._write(out)
        return out

    def _write(self, record: dict[str, Any]) -> None:
        """One record to metrics.jsonl, TensorBoard and W&B (rank 0)."""
        step = record["step"]
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        scalars = {k: v for k, v in record.items() if k != "step"}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

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
        if "tflops" in record:
            parts.append(f"tflops {record['tflops']:.3g}")
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
        self._write(record)

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
        earlier, earlier_val = self._earlier_records(self.loss_history[0][0])
        steps, losses = zip(*(earlier + self.loss_history))
        ax.plot(steps, losses, linewidth=1.0, label="train")
        if self.val_history or earlier_val:
            val_steps, val_losses = zip(*(earlier_val + self.val_history))
            ax.plot(val_steps, val_losses, marker="o", markersize=3, linewidth=1.2, label="validation")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(out)
        return out

    def _earlier_records(self, first_step: int) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        """``(train, validation)`` losses of the steps before ``first_step`` from metrics.jsonl: a resumed run's
        curve starts where the run started (the last record of a step wins: a step logged again by a rerun)."""
        path = self.dump_folder / self.config.jsonl_name
        train: dict[int, float] = {}
        val: dict[int, float] = {}
        if not path.is_file():
            return [], []
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                    step = int(record["step"])
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line of a killed run, or a record without a step
                if step >= first_step:
                    continue
                if isinstance(record.get("loss"), (int, float)):
                    train[step] = float(record["loss"])
                if isinstance(record.get("val/loss"), (int, float)):
                    val[step] = float(record["val/loss"])
        return sorted(train.items()), sorted(val.items())

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
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
