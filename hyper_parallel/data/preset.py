"""The ``preset_pt`` source: replay a ``torch.save``d list of ready micro-batches.

For exact comparisons between runs and frameworks: the file holds a list of dicts in the batch
contract (generic keys, ``[B, T]`` rows allowed, plus any model inputs). Batch ``i`` of the list is
global micro-batch ``i`` (the list repeats when it runs out), so a step on rank ``r`` gets the same
batches for every DP degree (:mod:`.base`). Batches are checked on load; a broken one is an error
naming its index. Model inputs are checked by the source that defines them
(:func:`register_batch_check`, e.g. DirectToken's image inputs); without one, input ids and labels
must lie below the model's ``vocab_size``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from hyper_parallel.data.bad_samples import IGNORE_INDEX
from hyper_parallel.data.base import BaseDataLoader

__all__ = ["BATCH_KEYS", "PresetDataLoader", "check_batch", "register_batch_check"]

BATCH_KEYS = ("input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen")
"""The generic keys of every micro-batch (the batch contract); model inputs come on top."""

BatchCheck = Callable[[dict[str, Any], Mapping[str, Any], str], None]
_BATCH_CHECKS: dict[str, BatchCheck] = {}


def register_batch_check(key: str, check: BatchCheck) -> None:
    """``check(batch, model_facts, where)`` validates (and may normalise) batches that hold ``key``;
    it also owns the range of ``input_ids`` and ``labels`` of such batches."""
    _BATCH_CHECKS[key] = check


def check_batch(batch: Mapping[str, Any], *, model_facts: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Validate one micro-batch against the contract; returns it with canonical dtypes."""

    def fail(msg: str) -> None:
        raise ValueError(f"{where}: {msg}")

    if not isinstance(batch, Mapping):
        fail(f"must be a dict in the batch contract, got {type(batch).__name__}")
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        fail(f"is missing {missing} (the batch contract has {list(BATCH_KEYS)})")
    out = dict(batch)
    for k in ("input_ids", "labels", "position_ids", "cu_seqlens"):
        v = out[k]
        if not isinstance(v, torch.Tensor) or v.dtype.is_floating_point or v.dtype.is_complex:
            fail(f"{k} must be an integer tensor")
        out[k] = v.to(torch.int32 if k == "cu_seqlens" else torch.int64)
    ids, labels, pos = out["input_ids"], out["labels"], out["position_ids"]
    if ids.dim() != 2:
        fail(f"input_ids must be [B, T], got shape {tuple(ids.shape)}")
    if labels.shape != ids.shape:
        fail(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(ids.shape)}")
    if pos.shape != ids.shape and pos.shape != (3, *ids.shape):
        fail(f"position_ids shape {tuple(pos.shape)} must be input_ids' {tuple(ids.shape)} or [3, B, T]")
    cu = out["cu_seqlens"]
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != ids.numel() or bool((cu.diff() < 0).any()):
        fail(f"cu_seqlens must rise from 0 to input_ids.numel()={ids.numel()}, got {cu.tolist()}")
    out["max_seqlen"] = int(out["max_seqlen"])
    if bool((ids < 0).any()) or bool(((labels != IGNORE_INDEX) & (labels < 0)).any()):
        fail("input_ids must be >= 0 and labels >= 0 or -100")
    checks = [check for key, check in _BATCH_CHECKS.items() if key in out]
    for check in checks:
        check(out, model_facts, where)
    vocab = model_facts.get("vocab_size")
    if not checks and vocab is not None and (bool((ids >= vocab).any()) or bool((labels >= vocab).any())):
        fail(f"input_ids and labels must lie below the model's vocab_size={vocab}")
    return out


class PresetDataLoader(BaseDataLoader):
    """Serves saved micro-batches: global micro-batch ``g`` is batch ``g mod len(list)``."""

    source: ClassVar[str] = "preset_pt"

    def __init__(self, config: BaseDataLoader.Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        path = config.path
        if not path:
            raise ValueError("data.source=preset_pt needs data.path: the .pt file of saved batches")
        try:
            batches = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise FileNotFoundError(f"data.path={path!r} (source preset_pt) does not exist") from None
        if not isinstance(batches, (list, tuple)) or not batches:
            raise ValueError(f"data.path={path!r} must hold a non-empty list of batch dicts, got {type(batches).__name__}")
        self.batches = [
            check_batch(b, model_facts=self.model_facts, where=f"{path} batch {i}") for i, b in enumerate(batches)
        ]
        self._file = f"{os.path.basename(path)}:{os.path.getsize(path)}"

    @property
    def pass_micro_batches(self) -> int | None:
        return len(self.batches) if self.single_pass else None

    def _micro_batches(self, gs: range) -> list[dict[str, Any]]:
        return [dict(self.batches[g % len(self.batches)]) for g in gs]

    def _order(self) -> dict[str, Any]:
        return {"source": self.source, "file": self._file}
