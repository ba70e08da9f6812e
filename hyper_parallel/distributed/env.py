"""Process-group set-up, device choice and determinism, decided at run time.

The same code runs on GPUs (cuda + NCCL) and on CPUs (gloo): nothing here names a device unless it
was detected. A run launched without ``torchrun`` (no ``WORLD_SIZE`` in the environment) becomes a
one-rank world, so the rest of the code never special-cases "not distributed".
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
from collections.abc import Iterator
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel.config.training import CommConfig
from hyper_parallel.distributed.teardown import release_tracked_meshes

__all__ = [
    "MAX_INTRA_OP_THREADS",
    "available_cpus",
    "default_intra_op_threads",
    "destroy_distributed",
    "device_type",
    "get_device",
    "init_distributed",
    "intra_op_threads",
    "resolve_backend",
    "set_determinism",
    "set_pg_timeouts",
    "world_info",
]

MAX_INTRA_OP_THREADS = 8
"""At most this many intra-op threads per rank unless ``OMP_NUM_THREADS`` says otherwise: a rank's host-side
work (a GPU run) gains little from more, and a CPU run on a big machine can ask for more explicitly."""


def device_type() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` on GPU machines, ``cpu`` otherwise."""
    if device_type() == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_backend(backend: str = "auto") -> str:
    """``auto`` -> ``nccl`` with CUDA, else ``gloo``; an explicit NCCL request without CUDA is an error."""
    if backend == "auto":
        return "nccl" if device_type() == "cuda" else "gloo"
    if backend == "nccl" and device_type() != "cuda":
        raise ValueError("--comm.backend nccl needs CUDA, and none is available: use --comm.backend gloo or auto")
    return backend


def world_info() -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` from the process group, or from the environment before init."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return rank, int(os.environ.get("LOCAL_RANK", rank)), world


def init_distributed(comm: CommConfig | None = None) -> torch.device:
    """Initialise the default process group (idempotent) and return this rank's device.

    Reads the torchrun environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...). Without it, a
    one-rank group on an in-memory store is created so meshes and collectives still work.
    """
    comm = comm or CommConfig()
    device = get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device
    backend = resolve_backend(comm.backend)
    timeout = timedelta(seconds=comm.init_timeout_seconds)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device


def destroy_distributed() -> None:
    """Destroy every process group of this process: each live mesh's groups, then the default group.

    The teardown of a process that ran jobs without closing their ``ParallelDims`` (a failed run, a
    test job): ``dist.destroy_process_group()`` alone leaves the meshes' groups alive (see
    ``teardown.py``). A run that owns its meshes closes them itself (``Trainer.close()``).
    """
    release_tracked_meshes()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def set_pg_timeouts(timeout_seconds: int, world_mesh: DeviceMesh | None = None) -> None:
    """Set the timeout of the default group and of every group of ``world_mesh``'s root.

    Called after the first step: the first collectives (group creation, compile) may take far longer
    than steady-state ones, so ``CommConfig`` has a long init timeout and a shorter train timeout.
    """
    from torch.distributed.distributed_c10d import _set_pg_timeout

    timeout = timedelta(seconds=timeout_seconds)
    # A barrier first, so no rank changes its timeout while another still runs a slow first collective.
    dist.barrier(device_ids=[torch.cuda.current_device()] if device_type() == "cuda" else None)
    _set_pg_timeout(timeout, None)
    if world_mesh is not None:
        for group in getattr(world_mesh._get_root_mesh(), "_pg_registry", {}).values():
            _set_pg_timeout(timeout, group)


def set_determinism(seed: int, *, deterministic: bool = False, rank_offset: int = 0) -> None:
    """Seed python, numpy and torch (all devices) with ``seed + rank_offset``.

    ``deterministic`` turns on torch's deterministic algorithms (bitwise-repeatable on CPU; on CUDA also
    fixes cuBLAS workspaces and disables cuDNN autotuning). Model init must use the same seed on
    every rank (``rank_offset=0``); dropout streams may differ per rank via ``rank_offset``.
    """
    value = seed + rank_offset
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask, and the cgroup v2 CPU quota when one is set
    (a container limited to 2 CPUs on a 64-core host counts 2)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def default_intra_op_threads(*, cpus: int, local_world_size: int) -> int:
    """Intra-op threads per rank when the user set none: the CPUs left after one (for the data loader, the
    launcher and whatever else runs on the machine) shared by the node's ranks, 1 to ``MAX_INTRA_OP_THREADS``.

    Why not torch's default (every core, in every rank): OpenMP threads spin at each parallel region's
    barrier, so a team wider than the idle cores collapses. A plain ``python -m hyper_parallel.train`` on a
    busy 2-core box ran 19x slower with torch's 2 threads than with 1 (torchrun sets ``OMP_NUM_THREADS=1``
    for several ranks; plain python sets nothing).
    """
    return max(1, min(MAX_INTRA_OP_THREADS, (cpus - 1) // max(1, local_world_size)))


@contextlib.contextmanager
def intra_op_threads(log: logging.Logger | None = None) -> Iterator[int]:
    """Run the block with a sane intra-op thread count (``torch.set_num_threads``) and log it once.

    ``OMP_NUM_THREADS`` set: torch already follows it and it is kept. Unset: ``default_intra_op_threads``
    of ``available_cpus()`` and torchrun's ``LOCAL_WORLD_SIZE``. The caller's count is restored after (an
    in-process run leaves its caller's threads as they were). Device-agnostic: every rank has host work.
    """
    before = torch.get_num_threads()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    user = os.environ.get("OMP_NUM_THREADS")
    if user:
        threads, why = before, f"OMP_NUM_THREADS={user}"
    else:
        cpus = available_cpus()
        threads = default_intra_op_threads(cpus=cpus, local_world_size=local_world)
        why = (
            f"{cpus} CPUs for {local_world} local rank(s), one left free, at most {MAX_INTRA_OP_THREADS}; "
            "set OMP_NUM_THREADS to choose"
        )
    if log is not None:
        log.info("intra-op threads: %d per rank (%s)", threads, why)
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)
