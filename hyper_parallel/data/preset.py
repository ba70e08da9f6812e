"""The ``preset_pt`` source: replay a ``torch.save``d list of ready micro-batches.

For exact comparisons between runs and frameworks: the file holds a list of dicts in the batch
contract (see :mod:`hyper_parallel.data.packing`; ``[B, T]`` rows are allowed, ``visual_indices``
index ``input_ids.view(-1)``). Step ``s`` uses the next ``dp_world_size * micro_batches_per_step``
batches of the list; rank ``r`` takes the ``r``-th run of ``micro_batches_per_step`` of them. The
list repeats when it runs out. Batches are checked on load; a broken one is an error naming its
index.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hyper_parallel.data.sample import IGNORE_INDEX

__all__ = ["BATCH_KEYS", "PresetBatches", "check_batch"]

BATCH_KEYS = (
    "input_ids",
    "labels",
    "position_ids",
    "cu_seqlens",
    "max_seqlen",
    "visual_indices",
    "vq_codes",
    "placeholder_token_id",
)
"""The keys of every micro-batch (the batch contract)."""


def check_batch(
    batch: Mapping[str, Any], *, lang_vocab_size: int, codebook_size: int, placeholder_token_id: int, where: str
) -> dict[str, Any]:
    """Validate one micro-batch against the contract; returns it with canonical dtypes."""

    def fail(msg: str) -> None:
        raise ValueError(f"{where}: {msg}")

    if not isinstance(batch, Mapping):
        fail(f"must be a dict in the batch contract, got {type(batch).__name__}")
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        fail(f"is missing {missing} (the batch contract has {list(BATCH_KEYS)})")
    out = {k: batch[k] for k in BATCH_KEYS}
    for k in ("input_ids", "labels", "position_ids", "visual_indices", "vq_codes", "cu_seqlens"):
        v = out[k]
        if not isinstance(v, torch.Tensor) or v.dtype.is_floating_point or v.dtype.is_complex:
            fail(f"{k} must be an integer tensor")
        out[k] = v.to(torch.int32 if k == "cu_seqlens" else torch.int64)
    ids = out["input_ids"]
    if ids.dim() != 2:
        fail(f"input_ids must be [B, T], got shape {tuple(ids.shape)}")
    for k in ("labels", "position_ids"):
        if out[k].shape != ids.shape:
            fail(f"{k} shape {tuple(out[k].shape)} != input_ids shape {tuple(ids.shape)}")
    cu = out["cu_seqlens"]
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != ids.numel() or bool((cu.diff() < 0).any()):
        fail(f"cu_seqlens must rise from 0 to input_ids.numel()={ids.numel()}, got {cu.tolist()}")
    if int(out["placeholder_token_id"]) != placeholder_token_id:
        fail(f"placeholder_token_id {out['placeholder_token_id']} != the model's {placeholder_token_id}")
    vi, codes = out["visual_indices"], out["vq_codes"]
    if vi.shape != codes.shape or vi.dim() != 1:
        fail(f"visual_indices {tuple(vi.shape)} and vq_codes {tuple(codes.shape)} must be matching 1-D tensors")
    flat = ids.view(-1)
    if vi.numel() and (int(vi.min()) < 0 or int(vi.max()) >= flat.numel() or bool((flat[vi] != placeholder_token_id).any())):
        fail("visual_indices must point at placeholder tokens of input_ids")
    if int((flat == placeholder_token_id).sum()) != vi.numel():
        fail("every placeholder token of input_ids needs a visual_indices entry")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= codebook_size):
        fail(f"vq_codes must lie in [0, codebook_size={codebook_size})")
    labels = out["labels"]
    if bool(((labels != IGNORE_INDEX) & ((labels < 0) | (labels >= lang_vocab_size + codebook_size))).any()):
        fail(f"labels must be -100 or in [0, lang_vocab_size + codebook_size={lang_vocab_size + codebook_size})")
    out["max_seqlen"] = int(out["max_seqlen"])
    out["placeholder_token_id"] = int(out["placeholder_token_id"])
    return out


class PresetBatches:
    """Serves the saved micro-batches step by step for one DP rank; ``cursor`` is its state."""

    def __init__(
        self,
        path: str,
        *,
        dp_rank: int,
        dp_world_size: int,
        micro_batches_per_step: int,
        lang_vocab_size: int,
        codebook_size: int,
        placeholder_token_id: int,
    ) -> None:
        try:
            batches = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise FileNotFoundError(f"data.path={path!r} (source preset_pt) does not exist") from None
        if not isinstance(batches, (list, tuple)) or not batches:
            raise ValueError(f"data.path={path!r} must hold a non-empty list of batch dicts, got {type(batches).__name__}")
        self.batches = [
            check_batch(
                b, lang_vocab_size=lang_vocab_size, codebook_size=codebook_size,
                placeholder_token_id=placeholder_token_id, where=f"{path} batch {i}",
            )
            for i, b in enumerate(batches)
        ]
        self.dp_rank, self.dp_world_size, self.per_step = dp_rank, dp_world_size, micro_batches_per_step
        self.cursor = 0  # index of the first batch of the next step (over the whole, repeating list)

    def next_step(self) -> list[dict[str, Any]]:
        start = self.cursor + self.dp_rank * self.per_step
        self.cursor += self.dp_world_size * self.per_step
        return [dict(self.batches[(start + m) % len(self.batches)]) for m in range(self.per_step)]

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cursor = int(state["cursor"])
