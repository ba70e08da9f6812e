"""Profiling with torchtitan's flags: a Chrome trace per rank every ``profile_freq`` steps, and CUDA memory
snapshots.

Wrap the training loop and call ``step()`` once per finished optimizer step::

    with config.profiling.build(dump_folder=dump, global_step=step, device=device) as profiler:
        while step < steps:
            step += 1
            train_step()
            profiler.step()

Every ``profile_freq`` steps the profiler waits, warms up for ``profiler_warmup`` steps and records
``profiler_active`` steps (torchtitan's ``torch.profiler.schedule``), so the trace of step ``N`` (a
multiple of ``profile_freq``) lands in ``<dump>/<save_traces_folder>/iteration_<N>/rank<r>_trace.json``
(open it in Perfetto or ``chrome://tracing``). The schedule counts global steps, so a resumed run traces
the same steps as an uninterrupted one. With ``enable_memory_snapshot`` (CUDA only) the allocator's
history is recorded and dumped every ``profile_freq`` steps to
``<dump>/<save_memory_snapshot_folder>/iteration_<N>/rank<r>_memory_snapshot.pickle`` (view it at
https://pytorch.org/memory_viz), and once more as ``iteration_<N>_exit`` when a step runs out of memory.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch
import torch.distributed as dist

from hyper_parallel.config.configurable import Configurable

__all__ = ["Profiler", "ProfilingConfig"]

logger = logging.getLogger(__name__)

MEMORY_SNAPSHOT_MAX_ENTRIES = 100_000
"""Allocator events kept in the memory history (torchtitan's value)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Profiler(Configurable):
    """Build with ``Profiler.Config(...).build(dump_folder=..., global_step=0, device=device)``; use it as a
    context manager around the loop and call ``step()`` after every step. Does nothing when disabled."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        enable_profiling: bool = False
        """Record a torch.profiler trace (CPU, plus CUDA kernels on GPU) every ``profile_freq`` steps."""
        save_traces_folder: str = "profile_traces"
        """Trace folder, relative to the dump folder (``iteration_<step>/rank<r>_trace.json`` inside)."""
        profile_freq: int = 10
        """Trace (and snapshot memory) every this many steps; at least ``profiler_warmup + profiler_active``
        when profiling."""
        profiler_active: int = 1
        """Steps recorded in each trace (the last of them is the multiple of ``profile_freq``)."""
        profiler_warmup: int = 3
        """Steps the profiler runs unrecorded before each trace (its start-up overhead stays out of the trace)."""
        enable_memory_snapshot: bool = False
        """Record the CUDA allocator history and dump a snapshot every ``profile_freq`` steps (CUDA only;
        ignored with a log line on other devices)."""
        save_memory_snapshot_folder: str = "memory_snapshot"
        """Memory snapshot folder, relative to the dump folder."""

        def __post_init__(self) -> None:
            if self.profile_freq < 1:
                raise ValueError(f"profiling.profile_freq={self.profile_freq} must be >= 1")
            if self.profiler_active < 1 or self.profiler_warmup < 0:
                raise ValueError(
                    f"profiling.profiler_active={self.profiler_active} must be >= 1 and "
                    f"profiling.profiler_warmup={self.profiler_warmup} >= 0"
                )
            if self.enable_profiling and self.profiler_warmup + self.profiler_active > self.profile_freq:
                raise ValueError(
                    f"profiling.profile_freq={self.profile_freq} is shorter than profiler_warmup + profiler_active "
                    f"= {self.profiler_warmup + self.profiler_active}: raise --profiling.profile_freq or lower "
                    "--profiling.profiler_warmup"
                )

    def __init__(
        self,
        config: Config,
        *,
        dump_folder: str | os.PathLike,
        global_step: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(config)
        self.config: Profiler.Config = config
        self.step_num = global_step
        """The last finished step (global: a resumed run starts at its checkpoint's step)."""
        self.rank = _rank()
        self.device = torch.device(device) if device is not None else None
        self.trace_dir = Path(dump_folder) / config.save_traces_folder
        self.snapshot_dir = Path(dump_folder) / config.save_memory_snapshot_folder
        on_cuda = self.device.type == "cuda" if self.device is not None else torch.cuda.is_available()
        self.memory_snapshot = config.enable_memory_snapshot and on_cuda
        if config.enable_memory_snapshot and not on_cuda:
            logger.info(f"profiling.enable_memory_snapshot is ignored: it needs CUDA, the device is {self.device}")
        self._on_cuda = on_cuda
        self._torch_profiler: torch.profiler.profile | None = None

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Profiler:
        cfg = self.config
        if cfg.enable_profiling:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self._on_cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            wait = cfg.profile_freq - cfg.profiler_warmup - cfg.profiler_active
            schedule = torch.profiler.schedule(wait=wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active)
            offset = self.step_num
            # torch.profiler counts its own steps from 0; offset them so the schedule follows global steps
            # (the action at profiler step n is for global step offset + n + 1).
            self._torch_profiler = torch.profiler.profile(
                activities=activities,
                schedule=lambda n: schedule(n + offset),
                on_trace_ready=self._save_trace,
                record_shapes=True,
            )
            self._torch_profiler.__enter__()
            logger.info(f"Profiling active: a trace every {cfg.profile_freq} steps under {self.trace_dir}")
        if self.memory_snapshot:
            self.snapshot_dir.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_SNAPSHOT_MAX_ENTRIES)
            logger.info(f"Memory snapshots every {cfg.profile_freq} steps under {self.snapshot_dir}")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._torch_profiler is not None:
                self._torch_profiler.__exit__(exc_type, exc, tb)
                self._torch_profiler = None
        finally:
            if self.memory_snapshot:
                if isinstance(exc, torch.OutOfMemoryError):
                    self._dump_memory_snapshot(f"iteration_{self.step_num + 1}_exit")  # the step that failed
                torch.cuda.memory._record_memory_history(enabled=None)
        # exceptions propagate

    def step(self) -> None:
        """Call once after every finished step: advances the trace schedule, dumps memory on schedule."""
        self.step_num += 1
        if self._torch_profiler is not None:
            self._torch_profiler.step()
        if self.memory_snapshot and self.step_num % self.config.profile_freq == 0:
            self._dump_memory_snapshot(f"iteration_{self.step_num}")

    # ------------------------------------------------------------------ writers
    def trace_path(self, step: int) -> Path:
        """Where the trace that ends at ``step`` is written for this rank."""
        return self.trace_dir / f"iteration_{step}" / f"rank{self.rank}_trace.json"

    def _save_trace(self, prof: torch.profiler.profile) -> None:
        path = self.trace_path(self.step_num)
        path.parent.mkdir(parents=True, exist_ok=True)
        begin = time.monotonic()
        prof.export_chrome_trace(str(path))
        logger.info(f"Profiler trace of step {self.step_num} written to {path} in {time.monotonic() - begin:.2f} s")

    def _dump_memory_snapshot(self, dir_name: str) -> None:
        path = self.snapshot_dir / dir_name / f"rank{self.rank}_memory_snapshot.pickle"
        path.parent.mkdir(parents=True, exist_ok=True)
        begin = time.monotonic()
        torch.cuda.memory._dump_snapshot(str(path))
        logger.info(f"Memory snapshot written to {path} in {time.monotonic() - begin:.2f} s")


ProfilingConfig = Profiler.Config
"""The ``profiling`` option group (``Trainer.Config.profiling``)."""
