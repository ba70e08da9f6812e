"""Process-group set-up, device choice and determinism, decided at run time.

The same code runs on GPUs (cuda + NCCL) and on CPUs (gloo): nothing here names a device unless it
was detected. A run launched without ``torchrun`` (no ``WORLD_SIZE`` in the environment) becomes a
one-rank world, so the rest of the code never special-cases "not distributed".
"""

from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel.config.training import CommConfig
from hyper_parallel.distributed.teardown import release_tracked_meshes

__all__ = [
    "destroy_distributed",
    "device_type",
    "get_device",
    "init_distributed",
    "resolve_backend",
    "set_determinism",
    "set_pg_timeouts",
    "world_info",
]


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
