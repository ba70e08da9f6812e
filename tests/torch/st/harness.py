"""Multi-process harness for system tests: a pool of persistent gloo workers on CPU.

Starting a Python process that imports torch.distributed costs seconds, and a test session runs
dozens of layouts; so the pool spawns ``max_world`` workers once and reuses them. Each job runs on
ranks ``0..world_size-1``: those workers create a fresh default process group (a new TCPStore port
per job), run ``fn(*args)`` and tear down every group the job made with the library's own teardown
(``destroy_distributed``: the groups of every mesh the job built, DTensor's mesh caches, then the
default group), then collect the job's garbage: FSDP state and DTensors form reference cycles, and a
cycle that still holds a gloo group keeps its threads running until a full collection. So a worker
is back at its baseline thread count after every job (``test_process_group_teardown.py``).
Results (picklable) come back per rank.

A failing rank usually leaves the others blocked in a collective; the pool then reports the first
error at once and restarts all workers, so one broken layout cannot hang the whole session.
"""

from __future__ import annotations

import gc
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["JobError", "WorkerPool"]


class JobError(RuntimeError):
    """A rank raised; ``.rank_errors`` maps rank -> formatted traceback."""

    def __init__(self, rank_errors: dict[int, str]) -> None:
        self.rank_errors = rank_errors
        # Prefer a rank that failed on its own over ranks that only saw a peer disappear.
        own = [r for r, tb in sorted(rank_errors.items()) if not any(s in tb for s in _PEER_ERRORS)]
        first = own[0] if own else min(rank_errors)
        super().__init__(f"rank {first} failed (of {sorted(rank_errors)}):\n{rank_errors[first]}")


_PEER_ERRORS = ("Connection reset by peer", "Connection closed by peer", "remote worker")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, jobs: mp.Queue, results: mp.Queue) -> None:
    import torch

    import hyper_parallel.distributed  # noqa: F401 - imported once here, not inside the first job

    torch.set_num_threads(1)
    # The imports made ~3e5 long-lived objects: freezing them makes the per-job gc.collect() below scan only
    # what jobs created (a full pass over everything takes ~0.3-1 s here).
    gc.freeze()
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, world_size, port, args, kwargs = job
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
        os.environ.update(env)
        try:
            out = _run_job(fn, args, kwargs)
            results.put((rank, True, out))
        except BaseException:  # noqa: BLE001 - the traceback is the result
            results.put((rank, False, traceback.format_exc()))


def _run_job(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    from hyper_parallel.distributed.env import destroy_distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        return fn(*args, **kwargs)
    finally:
        try:
            destroy_distributed()
        finally:
            gc.collect()  # the job's model/FSDP cycles still hold gloo groups (threads) until collected


class WorkerPool:
    """``max_world`` persistent CPU workers; ``run(fn, world_size, ...)`` returns one result per rank."""

    def __init__(self, max_world: int = 8) -> None:
        self.max_world = max_world
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._jobs: list[Any] = []
        self._results: Any = None

    def _start(self) -> None:
        self._results = self._ctx.Queue()
        self._jobs = [self._ctx.Queue() for _ in range(self.max_world)]
        self._procs = [
            self._ctx.Process(target=_worker, args=(r, self._jobs[r], self._results), daemon=True)
            for r in range(self.max_world)
        ]
        for p in self._procs:
            p.start()

    def _ensure_started(self) -> None:
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()

    def pids(self) -> list[int]:
        """Process ids of the workers by rank (starting them if needed)."""
        self._ensure_started()
        return [p.pid for p in self._procs]

    def run(
        self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ranks ``0..world_size-1``; return the results by rank."""
        if not 1 <= world_size <= self.max_world:
            raise ValueError(f"world_size {world_size} must be in [1, {self.max_world}]")
        self._ensure_started()
        port = _free_port()
        for r in range(world_size):
            self._jobs[r].put((fn, world_size, port, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            while len(results) + len(errors) < world_size:
                rank, ok, value = self._results.get(timeout=timeout)
                if ok:
                    results[rank] = value
                else:
                    errors[rank] = value
                    break  # the other ranks may be stuck in a collective: fail fast
        except queue.Empty:
            errors[-1] = f"timed out after {timeout}s with ranks {sorted(results)} done"
        if errors:
            # The first report may be a peer's "connection reset"; give the failing rank a moment to report.
            deadline = time.monotonic() + 5.0
            while len(results) + len(errors) < world_size and time.monotonic() < deadline:
                try:
                    rank, ok, value = self._results.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if not ok:
                    errors[rank] = value
        if errors:
            self.close()  # restart the workers for the next job
            raise JobError(errors)
        return [results[r] for r in range(world_size)]

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        self._procs = []
        self._jobs = []
        self._results = None
