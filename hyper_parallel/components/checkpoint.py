"""Checkpointing with ``torch.distributed.checkpoint`` (DCP): atomic, resumable, optionally async.

Layout under ``<dump_folder>/<folder>``::

    step-200/            a complete checkpoint
      .metadata, __*.distcp    DCP: model, optimizer, lr_scheduler, extra states (ema ...), train_state
                               (a LoRA run from an HF folder: no frozen parameter; the base is the folder's)
      global.pt                global_states (the data stream position: the same on every rank), rank 0
      rank0.pt, rank1.pt ...   per-rank state: RNG (python/numpy/torch/cuda) and rank_states
      run_config.json          the run config (rank 0)
    step-300.tmp/        a write in progress (or killed): never loaded, removed by the next save
    latest               text marker with the newest complete step (informative; loading scans)
    best                 text marker with the step of the best validation loss (``keep_best``: never purged)

(The HF export of a run is written by the trainer to ``<dump_folder>/hf``, not here.)

Atomicity: every rank writes into ``step-N.tmp``; after all ranks finished (DCP's own final gather,
then a barrier) rank 0 renames it to ``step-N``, rewrites ``latest`` and drops old checkpoints beyond
``keep_latest_k``. A kill at any point leaves either the previous complete checkpoint or the new
one, never a half-written ``step-N``.

Global state (the data stream position, which does not depend on the layout) is written once by
rank 0 and read by every rank, so it resumes on any number of ranks. Per-rank state (RNG streams)
differs between ranks, while DCP deduplicates equal keys as if they were replicated, so it goes to
one side file per rank; resuming with another world size reshards model/optimizer state and starts
the RNG streams of ranks without a side file fresh (a warning says so).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from hyper_parallel.config.configurable import Configurable, config_to_dict
from hyper_parallel.distributed.teardown import destroy_group
from hyper_parallel.rank_log import warn_on_rank0

__all__ = [
    "CheckpointManager",
    "ModelWrapper",
    "UnsafeCheckpointError",
    "assert_finite",
    "get_rng_state",
    "load_side_file",
    "save_side_file",
    "set_rng_state",
]

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _single_process() -> bool:
    """One rank in all: DCP then needs no collectives (``no_dist``).

    Besides saving the collectives, this avoids a slowdown seen on CPU/gloo: after a DCP save whose
    plan has many entries goes through gloo object collectives, later training steps in the process
    ran about 2x slower (root cause not found; see the issue notes).
    """
    return not _dist_on() or dist.get_world_size() == 1


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every ``no_dist`` call that it assumes a single process, which is what we chose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


def _as_parts(model_parts: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)


def assert_finite(model_parts: nn.Module | Sequence[nn.Module]) -> None:
    """Raise ``FloatingPointError`` naming the tensors if any parameter/float buffer holds NaN/inf.

    One ``isfinite`` per local shard, one host sync and one all-reduce of a flag, so every rank
    raises together.
    """
    parts = _as_parts(model_parts)
    named = [(n, t) for m in parts for n, t in (*m.named_parameters(), *m.named_buffers()) if t.is_floating_point()]
    locals_ = [(n, t.to_local() if isinstance(t, DTensor) else t) for n, t in named]
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, t in locals_:
        if t.numel() > 0:
            per_device.setdefault(t.device, []).append(torch.isfinite(t).all())
    ok = all(bool(torch.stack(flags).all()) for flags in per_device.values())
    if _dist_on():
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        flag = torch.tensor(int(ok), dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok_everywhere = bool(flag.item())
    else:
        ok_everywhere = ok
    if ok_everywhere:
        return
    bad = [n for n, t in locals_ if t.numel() > 0 and not bool(torch.isfinite(t).all())]
    where = f"rank {_rank()}: {bad}" if bad else "another rank"
    raise FloatingPointError(f"non-finite values in the model weights ({where}); refusing to checkpoint them")


def get_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (if initialised) current-CUDA-device RNG states."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


class UnsafeCheckpointError(ValueError):
    """A checkpoint side file (``global.pt``, ``rank<N>.pt``) holds a pickled object of a type checkpoints never
    hold: it is refused unread (unpickling it could run code)."""


_NDARRAY = "__ndarray__"
"""Marker key of a NumPy array stored as a tensor in a side file (``_to_safe``)."""


def _to_safe(obj: Any) -> Any:
    """``obj`` in the types ``torch.load(weights_only=True)`` reads: NumPy arrays become ``{_NDARRAY: tensor,
    "dtype": str}``, NumPy scalars Python numbers; containers are walked (tuples stay tuples)."""
    if isinstance(obj, np.ndarray):
        return {_NDARRAY: torch.from_numpy(np.ascontiguousarray(obj).copy()), "dtype": obj.dtype.str}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _to_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_safe(v) for v in obj)
    return obj


def _from_safe(obj: Any) -> Any:
    """The inverse of :func:`_to_safe`."""
    if isinstance(obj, dict):
        if _NDARRAY in obj:
            return obj[_NDARRAY].numpy().astype(np.dtype(obj["dtype"]), copy=True)
        return {k: _from_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_from_safe(v) for v in obj)
    return obj


def save_side_file(obj: Any, path: Path) -> None:
    """Write a checkpoint side file in the weights-only form (:func:`load_side_file` reads it)."""
    torch.save(_to_safe(obj), path)


def load_side_file(path: Path) -> Any:
    """Read a checkpoint side file with ``weights_only=True`` (tensors, numbers, strings, plain containers): a
    file holding any other pickled type is refused by name (:class:`UnsafeCheckpointError`), never unpickled."""
    import pickle

    try:
        return _from_safe(torch.load(path, map_location="cpu", weights_only=True))
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e)) or re.search(r"global '?([\w.]+)", str(e))
        what = f"a pickled object of type {found.group(1)}" if found else f"something else ({str(e).splitlines()[-1]})"
        raise UnsafeCheckpointError(
            f"{path} holds {what}, which a checkpoint never holds (only tensors, numbers, strings and plain "
            "containers): refusing to unpickle it, since that could run code. Use a checkpoint folder you made or "
            "trust, or delete this step folder to resume from an older one"
        ) from None


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class ModelWrapper:
    """DCP ``Stateful`` over model parts: FQN-keyed, sharded DTensors stay sharded.

    ``save_frozen=False`` leaves frozen parameters (``requires_grad=False``) out of the state, saved and loaded
    alike: a LoRA run started from an HF folder keeps its base there, and only the adapters, the modules
    trained in full and every buffer are checkpointed."""

    def __init__(self, model_parts: nn.Module | Sequence[nn.Module], *, save_frozen: bool = True) -> None:
        self.model_parts = _as_parts(model_parts)
        self.options = StateDictOptions(ignore_frozen_params=not save_frozen)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for m in self.model_parts for k, v in get_model_state_dict(m, options=self.options).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # strict=False: the merged dict holds every part's keys; DCP already failed on a missing key.
        for m in self.model_parts:
            set_model_state_dict(m, state_dict, options=StateDictOptions(strict=False))


class _TrainState:
    def __init__(self, step: int) -> None:
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


class CheckpointManager(Configurable):
    """Saves and resumes the whole training state with DCP.

    Build with ``CheckpointManager.Config(...).build(dump_folder=..., model_parts=[model],
    optimizers=..., lr_schedulers=..., states={"ema": ema}, global_states={"dataloader": dl},
    run_config=config)``. ``states`` are replicated/sharded Statefuls saved through DCP;
    ``global_states`` hold the same plain state on every rank (saved once by rank 0, read by all);
    ``rank_states`` are per-rank Statefuls saved in the rank's side file. ``save_frozen=False`` keeps frozen
    parameters out of the checkpoint (``ModelWrapper``): the caller restores them (a LoRA base from its HF folder)
    before ``load_latest``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        enable: bool = False
        """Save checkpoints and resume from the newest one in `folder` at start."""
        folder: str = "checkpoint"
        """Checkpoint folder, relative to the dump folder."""
        interval: int = 500
        """Save every this many steps (and at the last step)."""
        keep_latest_k: int = 3
        """Keep only the newest K complete checkpoints; 0 keeps all."""
        keep_best: bool = False
        """Also save the step of every new best validation loss and keep the best one beside the newest K (marker file `best`); needs --validation.freq."""
        async_mode: Literal["disabled", "async"] = "disabled"
        """`async` writes in a background thread (dcp.async_save) and finalises before the next save."""
        initial_load_path: str | None = None
        """HF checkpoint folder to initialise the model from when no checkpoint exists to resume."""
        restart_data_stream: bool = False
        """On resume, load model, optimizer, schedule and EMA but start the data stream from its beginning
        (use after changing the data: path, seed, source or packing budget)."""
        export_hf: bool = False
        """Write an HF export of the final weights (EMA weights when EMA is on) to `<dump_folder>/hf`."""
        export_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
        """Dtype of floating tensors in the HF export."""

    def __init__(
        self,
        config: Config,
        *,
        dump_folder: str | os.PathLike,
        model_parts: nn.Module | Sequence[nn.Module],
        optimizers: Any = None,
        lr_schedulers: Any = None,
        states: Mapping[str, Any] | None = None,
        global_states: Mapping[str, Any] | None = None,
        rank_states: Mapping[str, Any] | None = None,
        run_config: Any = None,
        save_frozen: bool = True,
    ) -> None:
        super().__init__(config)
        self.config: CheckpointManager.Config = config
        if config.interval < 1:
            raise ValueError(f"checkpoint.interval={config.interval} must be >= 1")
        self.folder = Path(dump_folder) / config.folder
        self.model = ModelWrapper(model_parts, save_frozen=save_frozen)
        self.optimizers, self.lr_schedulers = optimizers, lr_schedulers
        reserved = {"model", "optimizer", "lr_scheduler", "train_state"} & set(states or {})
        if reserved:
            raise ValueError(f"CheckpointManager states may not use the reserved keys {sorted(reserved)}")
        self.states = dict(states or {})
        self.global_states = dict(global_states or {})
        self.rank_states = dict(rank_states or {})
        self.run_config = run_config
        self.last_saved_step: int | None = None
        self._pending: tuple[Any, int] | None = None
        self._best_pending: int | None = None  # a step being saved as the new best (marked at finalize)
        # The async writer thread runs DCP's collectives; give it its own CPU (gloo) group so they
        # never interleave with the training collectives on the default group.
        self._pg = dist.new_group(backend="gloo") if config.enable and config.async_mode == "async" and _dist_on() else None
        self._stager: DefaultStager | None = None  # built on the first async save, reused by every later one

    # -- paths -------------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def complete_steps(self) -> list[int]:
        """Steps of complete checkpoints (``step-N`` with DCP metadata), oldest first; ``*.tmp`` ignored."""
        if not self.folder.is_dir():
            return []
        steps = []
        for child in self.folder.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and child.is_dir() and (child / ".metadata").is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    # -- save ----------------------------------------------------------------------------------
    def should_save(self, step: int, *, last_step: bool = False) -> bool:
        if not self.config.enable or step == self.last_saved_step:
            return False
        return last_step or step % self.config.interval == 0

    def _dcp_state(self, step: int) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model, "train_state": _TrainState(step)}
        if self.optimizers is not None:
            state["optimizer"] = self.optimizers
        if self.lr_schedulers is not None:
            state["lr_scheduler"] = self.lr_schedulers
        state.update(self.states)
        return state

    def best_step(self) -> int | None:
        """The step the ``best`` marker names (``keep_best``), or None."""
        marker = self.folder / "best"
        try:
            m = _STEP_DIR.match(marker.read_text().strip())
        except OSError:
            return None
        return int(m.group(1)) if m else None

    def save(self, step: int, *, last_step: bool = False, force: bool = False, best: bool = False) -> bool:
        """Save step ``step`` if it is due (``interval``, ``last_step``) or ``force``; returns whether it did.

        ``best``: this step has the best validation loss so far: mark it (``best``) so purging keeps it.
        """
        if best:
            self._best_pending = step
            if step == self.last_saved_step:  # already on disk (an interval save of this step): just mark it
                self.wait()
                self._mark_best(step)
                return False
        if not (force and self.config.enable) and not self.should_save(step, last_step=last_step):
            return False
        self.wait()
        assert_finite(self.model.model_parts)
        tmp = self.folder / f"step-{step}.tmp"
        if _rank() == 0 and tmp.exists():
            shutil.rmtree(tmp)
        _barrier()
        tmp.mkdir(parents=True, exist_ok=True)
        rank_state = {"rng": get_rng_state(), **{k: v.state_dict() for k, v in self.rank_states.items()}}
        save_side_file(rank_state, tmp / f"rank{_rank()}.pt")
        if _rank() == 0 and self.global_states:
            save_side_file({k: v.state_dict() for k, v in self.global_states.items()}, tmp / "global.pt")
        if _rank() == 0 and self.run_config is not None:
            (tmp / "run_config.json").write_text(json.dumps(_config_json(self.run_config), indent=2, default=str))
        state = self._dcp_state(step)
        self.last_saved_step = step
        if self.config.async_mode == "async":
            result = dcp.async_save(
                state,
                checkpoint_id=str(tmp),
                process_group=self._pg,
                async_stager=self._async_stager(),
                no_dist=_single_process(),
            )
            self._pending = (getattr(result, "upload_completion", result), step)
            logger.info("checkpoint: async save of step %d started in %s", step, tmp)
        else:
            with _quiet_single_process():
                dcp.save(state, checkpoint_id=str(tmp), no_dist=_single_process())
            self._finalize(step)
        return True

    def _async_stager(self) -> DefaultStager:
        """The one stager of every async save. It copies the state into CPU buffers it keeps between saves
        (pinned when CUDA is available: fast device->host copies), so a save reuses them instead of
        allocating fresh pageable memory each time (DCP's default). Staging is synchronous: ``save``
        returns once the copy is taken, so the next optimizer step cannot race it; only the write is
        in the background. ``save`` waits for the previous write before staging into the same buffers.
        The buffers (this rank's share of the checkpoint) stay allocated until ``close``."""
        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
                )
            )
        return self._stager

    def wait(self) -> None:
        """Block until a pending async save is written and finalised (no-op otherwise)."""
        if self._pending is None:
            return
        future, step = self._pending
        self._pending = None
        future.result()
        self._finalize(step)

    def _finalize(self, step: int) -> None:
        _barrier()  # every rank's shards and side file are on disk
        if _rank() == 0:
            tmp, final = self.folder / f"step-{step}.tmp", self.step_dir(step)
            if final.exists():  # an older save of the same step (a re-run): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            marker = self.folder / "latest.tmp"
            marker.write_text(f"step-{step}\n")
            os.replace(marker, self.folder / "latest")
            if self._best_pending == step:
                self._mark_best(step)
            self._purge()
            logger.info("checkpoint: saved step %d to %s", step, final)
        _barrier()

    def _mark_best(self, step: int) -> None:
        """Rank 0: point the ``best`` marker at ``step`` (atomically) and drop the previous best if it is old."""
        self._best_pending = None
        if _rank() != 0:
            return
        marker = self.folder / "best.tmp"
        marker.write_text(f"step-{step}\n")
        os.replace(marker, self.folder / "best")
        logger.info("checkpoint: step %d has the best validation loss so far", step)
        self._purge()

    def _purge(self) -> None:
        for stale in self.folder.glob("step-*.tmp"):  # killed writes; the current one was renamed
            shutil.rmtree(stale, ignore_errors=True)
        k = self.config.keep_latest_k
        if k > 0:
            best = self.best_step() if self.config.keep_best else None
            for old in self.complete_steps()[:-k]:
                if old != best:
                    shutil.rmtree(self.step_dir(old), ignore_errors=True)

    # -- load ----------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        """Newest complete checkpoint step (rank 0 decides, every rank gets the same answer)."""
        steps = self.complete_steps()
        latest = [steps[-1] if steps else None]
        if _dist_on():
            dist.broadcast_object_list(latest, src=0)
        return latest[0]

    def load_latest(self) -> int | None:
        """Resume from the newest complete checkpoint; returns its step, or None when there is none."""
        if not self.config.enable:
            return None
        step = self.latest_step()
        if step is None:
            return None
        return self.load(step)

    def load(self, step: int) -> int:
        """Load checkpoint ``step-<step>`` into every registered object; returns the saved step.

        With ``restart_data_stream`` the global states (the data position) are not loaded.
        """
        path = self.step_dir(step)
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no .metadata); complete: {self.complete_steps()}")
        state = self._dcp_state(step)
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(path), no_dist=_single_process())
        if self.global_states and not self.config.restart_data_stream:
            glob = path / "global.pt"
            if not glob.is_file():
                raise FileNotFoundError(
                    f"{glob} is missing: the checkpoint holds no data stream position; resume with "
                    "--checkpoint.restart_data_stream to start the data from its beginning"
                )
            saved = load_side_file(glob)
            for key, obj in self.global_states.items():
                if key not in saved:
                    if getattr(obj, "optional_state", False):  # e.g. validation turned on for a resumed run
                        warn_on_rank0(logger, "checkpoint: %s has no %r state: it starts fresh", glob, key)
                        continue
                    raise KeyError(f"{glob} has no state {key!r} (it has {sorted(saved)})")
                obj.load_state_dict(saved[key])
        side = path / f"rank{_rank()}.pt"
        if side.is_file():
            # RNG states as tuples of ints and tensors: a weights-only load (another type is refused by name)
            rank_state = load_side_file(side)
            set_rng_state(rank_state["rng"])
            for key, obj in self.rank_states.items():
                if key not in rank_state:
                    raise KeyError(f"{side} has no per-rank state {key!r} (it has {sorted(rank_state)})")
                obj.load_state_dict(rank_state[key])
        else:
            logger.warning(
                "checkpoint: %s is missing (resumed with another world size?): RNG and %s state start fresh",
                side,
                sorted(self.rank_states) or "no per-rank",
            )
        self.last_saved_step = state["train_state"].step
        logger.info("checkpoint: resumed from %s", path)
        return state["train_state"].step

    def close(self) -> None:
        """Finish a pending async save, free the staging buffers and destroy the async writer's group."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._pg is not None:
            destroy_group(self._pg)
            self._pg = None  # on gloo, dropping the last reference is what stops the group's threads


def _config_json(config: Any) -> Any:
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return config_to_dict(config)
