"""Packing: documents into micro-batches of at most ``max_tokens`` tokens, and the generic batch contract.

:class:`FirstFitPacker` decides which documents share a micro-batch from their lengths alone (the
global plan runs it on the index, before any record is read): a document goes into the first open
bin with room; if none has room, the fullest open bin is emitted (when all ``open_bins`` are in
use) and a new bin is opened. A bin that is exactly full is emitted at once. ``open_bins=1`` is
next-fit (arrival order). The open bins are part of the plan's checkpoint.

:func:`collate_packed` turns the documents of one bin into the generic batch contract
(docs/design.md section 8):

- ``input_ids`` int64 ``[1, T]``: the documents back to back, then padding (``pad_token_id``) up to
  a multiple of ``pad_to_multiple_of``;
- ``labels`` int64 ``[1, T]``: already shifted, -100 at each document's last position and padding;
- ``position_ids`` int64 ``[1, T]``: restart at 0 for every document (and for the padding run);
- ``cu_seqlens`` int32 ``[D+1]``: segment boundaries over the flat stream, the padding run being
  the last segment, so ``cu_seqlens[-1] == T``; ``cu_seqlens_host``: the same boundaries as a Python
  ``list[int]`` (attention reads them without a device sync); ``max_seqlen`` int: the longest segment;
- ``token_mask`` bool ``[1, T]``: True at the documents' tokens, False on the padding run (HF's
  ``attention_mask``): statistics over a forward's tokens (the MoE router's load-balancing loss) leave the
  padding out, so a layout that pads more (context parallel pads to ``2 x cp``) computes the same values;

plus the source's model inputs, from its ``extras(documents, offsets)`` hook (DirectToken:
its image inputs). Generic code knows no model input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

from hyper_parallel.data.bad_samples import IGNORE_INDEX

__all__ = [
    "Document",
    "FirstFitPacker",
    "TokenDocument",
    "add_mtp_targets",
    "batch_to_device",
    "collate_packed",
    "pins_host_memory",
    "shift_labels",
]

R = TypeVar("R")


class Document(Protocol):
    """What packing needs of a decoded document: int arrays ``input_ids`` and shifted ``labels`` ``[L]``."""

    key: str
    input_ids: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int: ...


@dataclass(slots=True, eq=False)
class TokenDocument:
    """A plain token document (text): ``input_ids``/``labels`` int32 ``[L]``, labels already shifted."""

    key: str
    shard: str
    input_ids: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def shift_labels(targets: np.ndarray) -> np.ndarray:
    """``labels[t] = targets[t + 1]``; the last position predicts nothing (never across documents)."""
    labels = np.empty_like(targets)
    labels[:-1] = targets[1:]
    labels[-1:] = IGNORE_INDEX
    return labels


class FirstFitPacker(Generic[R]):
    """First-fit packing of ``(length, ref)`` items into bins of at most ``max_tokens`` tokens."""

    def __init__(self, max_tokens: int, open_bins: int, bins: Sequence[Sequence[tuple[int, R]]] = ()) -> None:
        self.max_tokens, self.open_bins = max_tokens, max(1, open_bins)
        self.bins: list[list[tuple[int, R]]] = [list(b) for b in bins]
        self.used: list[int] = [sum(n for n, _ in b) for b in self.bins]

    def add(self, length: int, ref: R) -> list[list[tuple[int, R]]]:
        """Place one item; returns the bins this emits (zero, one or two), in order."""
        return self.add_many([(length, ref)])

    def add_many(self, items: Iterable[tuple[int, R]]) -> list[list[tuple[int, R]]]:
        """Place items in order; returns the bins they emit, in order (the planner's inner loop)."""
        max_tokens, open_bins, bins, used = self.max_tokens, self.open_bins, self.bins, self.used
        out: list[list[tuple[int, R]]] = []
        for item in items:
            length = item[0]
            if not 0 < length <= max_tokens:
                raise ValueError(f"item {item[1]!r} has {length} tokens, outside [1, max_tokens={max_tokens}]")
            room = max_tokens - length
            i = -1
            for j, u in enumerate(used):
                if u <= room:
                    i = j
                    break
            if i < 0:
                while len(bins) >= open_bins:
                    # emit the fullest bin: it is the least likely to take another document
                    k = used.index(max(used))
                    used.pop(k)
                    out.append(bins.pop(k))
                bins.append([])
                used.append(0)
                i = len(bins) - 1
            bins[i].append(item)
            used[i] += length
            if used[i] == max_tokens:
                used.pop(i)
                out.append(bins.pop(i))
        return out


def collate_packed(
    documents: Sequence[Document],
    *,
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
    extras: Callable[[Sequence[Document], np.ndarray], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Pack ``documents`` into one ``[1, T]`` micro-batch in the batch contract (module docstring).

    ``extras(documents, offsets)`` adds the source's model inputs; ``offsets[i]`` is where document
    ``i`` starts in the flat stream.
    """
    if not documents:
        raise ValueError("collate_packed needs at least one document")
    lengths = [len(d) for d in documents]
    used = sum(lengths)
    total = -(-used // pad_to_multiple_of) * pad_to_multiple_of
    pad = total - used
    offsets = np.cumsum([0, *lengths])
    input_ids = np.concatenate([d.input_ids for d in documents] + [np.full(pad, pad_token_id, np.int64)])
    labels = np.concatenate([d.labels for d in documents] + [np.full(pad, IGNORE_INDEX, np.int64)])
    seg_lengths = lengths + ([pad] if pad else [])
    position_ids = np.concatenate([np.arange(n, dtype=np.int64) for n in seg_lengths])
    cu_seqlens = np.cumsum([0, *seg_lengths])
    token_mask = np.arange(total) < used
    batch = {
        "input_ids": torch.from_numpy(input_ids.astype(np.int64, copy=False)).view(1, total),
        "labels": torch.from_numpy(labels.astype(np.int64, copy=False)).view(1, total),
        "position_ids": torch.from_numpy(position_ids).view(1, total),
        "cu_seqlens": torch.from_numpy(cu_seqlens.astype(np.int32)),
        # the same boundaries as Python ints: attention reads them without a device->host sync
        "cu_seqlens_host": cu_seqlens.tolist(),
        "max_seqlen": int(max(seg_lengths)),
        "token_mask": torch.from_numpy(token_mask).view(1, total),
    }
    if extras is not None:
        batch.update(extras(documents, offsets[:-1]))
    return batch


def add_mtp_targets(batch: dict[str, Any], *, ignore_index: int = IGNORE_INDEX) -> dict[str, Any]:
    """The batch plus the multi-token-prediction inputs, computed per document on the host.

    ``mtp_input_ids[t] = input_ids[t + 1]`` and ``mtp_labels[t] = labels[t + 1]`` (the token two ahead of
    ``t``), both ``[B, T]`` int64, when ``t + 1`` is in ``t``'s document; at the last position of every
    document (and of every row) ``mtp_input_ids`` is -1 (the model embeds zeros there) and ``mtp_labels``
    is ``ignore_index``, so no target crosses a document boundary. Documents are the segments of
    ``cu_seqlens_host`` / ``cu_seqlens`` over the flattened ``B*T`` stream (the padding run included),
    else the rows. Done before context parallel splits the batch, which then slices these like ``labels``.
    """
    input_ids, labels = batch["input_ids"], batch["labels"]
    B, T = input_ids.shape
    bounds = batch.get("cu_seqlens_host")
    if bounds is None and batch.get("cu_seqlens") is not None:
        bounds = batch["cu_seqlens"].tolist()
    last = np.zeros(B * T, dtype=bool)  # positions without a next token in their document
    last[T - 1 :: T] = True
    if bounds is not None:
        ends = np.asarray(bounds[1:], dtype=np.int64)
        if len(ends) and int(ends[-1]) != B * T:
            raise ValueError(f"cu_seqlens end at {int(ends[-1])} but the batch holds B*T = {B * T} tokens")
        last[ends[ends > 0] - 1] = True
    last_t = torch.from_numpy(last).view(B, T)
    next_ids = torch.roll(input_ids.reshape(-1), -1).view(B, T).to(torch.int64)
    next_labels = torch.roll(labels.reshape(-1), -1).view(B, T).to(torch.int64)
    out = dict(batch)
    out["mtp_input_ids"] = torch.where(last_t, torch.full_like(next_ids, -1), next_ids)
    out["mtp_labels"] = torch.where(last_t, torch.full_like(next_labels, ignore_index), next_labels)
    return out


def pins_host_memory(device: torch.device | str) -> bool:
    """Whether host batches bound for ``device`` go through pinned (page-locked) memory: on CUDA only.

    A ``non_blocking`` copy from pageable memory is staged synchronously by the driver; from pinned memory it
    is a real asynchronous DMA that overlaps the previous micro-batch's compute. A CPU run copies nothing.
    """
    return torch.device(device).type == "cuda"


def batch_to_device(
    batch: dict[str, Any], device: torch.device | str, non_blocking: bool = True, *, pin: bool | None = None
) -> dict[str, Any]:
    """Move a micro-batch's tensors to ``device`` (ints such as ``max_seqlen`` stay Python ints).

    ``pin`` (default ``pins_host_memory(device)``): host tensors are pinned first, so the ``non_blocking`` copy
    is asynchronous. The pinned buffer comes from torch's caching host allocator, which keeps it until the copy
    has finished, so the host batch may be dropped right away.
    """
    if pin is None:
        pin = pins_host_memory(device)
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            if pin and v.device.type == "cpu":
                v = v.pin_memory()
            v = v.to(device, non_blocking=non_blocking)
        out[k] = v
    return out
