"""Packing: documents into micro-batches of at most ``max_tokens`` tokens, and the batch contract.

:class:`Packer` is a first-fit packer over ``open_bins`` partly filled micro-batches: a document
goes into the first open bin with room; if none has room, the fullest open bin is emitted (when all
``open_bins`` are in use) and a new bin is opened. A bin that is exactly full is emitted at once.
``open_bins=1`` is next-fit (arrival order). The open bins are part of the checkpoint.

:func:`collate_packed` turns one bin into the batch contract (DESIGN.md sections 4-5):

- ``input_ids`` int64 ``[1, T]``: the documents back to back, then padding (``pad_token_id``) up to
  a multiple of ``pad_to_multiple_of``; image positions hold ``placeholder_token_id``;
- ``labels`` int64 ``[1, T]``: already shifted, -100 at each document's last position and padding;
- ``position_ids`` int64 ``[1, T]``: restart at 0 for every document (and for the padding run);
- ``cu_seqlens`` int32 ``[D+1]``: segment boundaries over the flat stream, the padding run being
  the last segment, so ``cu_seqlens[-1] == T``; ``max_seqlen`` int: the longest segment;
- ``visual_indices`` int64 ``[N]``: flat positions of the image tokens (indices into
  ``input_ids.view(-1)``); ``vq_codes`` int64 ``[N]``: their codes, in the same order;
- ``placeholder_token_id`` int.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hyper_parallel.data.sample import IGNORE_INDEX, Sample

__all__ = ["Packer", "batch_to_device", "collate_packed"]


class Packer:
    """First-fit packing of a sample stream into bins of at most ``max_tokens`` tokens."""

    def __init__(self, source: Callable[[], Sample], max_tokens: int, open_bins: int) -> None:
        self.source, self.max_tokens, self.open_bins = source, max_tokens, max(1, open_bins)
        self.bins: list[list[Sample]] = []
        self.used: list[int] = []  # tokens in each open bin
        self.ready: deque[list[Sample]] = deque()

    def next(self) -> list[Sample]:
        """The next full-enough micro-batch (a list of samples, in packing order)."""
        while not self.ready:
            sample = self.source()
            n = len(sample)
            if n > self.max_tokens:  # validation rejects these earlier; guard against misuse
                raise ValueError(f"sample {sample.key!r} has {n} tokens > max_tokens={self.max_tokens}")
            i = next((i for i, u in enumerate(self.used) if u + n <= self.max_tokens), None)
            if i is None:
                while len(self.bins) >= self.open_bins:
                    # emit the fullest bin: it is the least likely to take another document
                    self._emit(self.used.index(max(self.used)))
                self.bins.append([])
                self.used.append(0)
                i = len(self.bins) - 1
            self.bins[i].append(sample)
            self.used[i] += n
            if self.used[i] == self.max_tokens:
                self._emit(i)
        return self.ready.popleft()

    def _emit(self, i: int) -> None:
        self.ready.append(self.bins.pop(i))
        self.used.pop(i)

    def state_dict(self) -> dict[str, Any]:
        return {
            "bins": [[s.to_dict() for s in b] for b in self.bins],
            "ready": [[s.to_dict() for s in b] for b in self.ready],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bins = [[Sample.from_dict(s) for s in b] for b in state["bins"]]
        self.used = [sum(len(s) for s in b) for b in self.bins]
        self.ready = deque([Sample.from_dict(s) for s in b] for b in state["ready"])


def collate_packed(
    samples: Sequence[Sample],
    *,
    placeholder_token_id: int,
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
) -> dict[str, Any]:
    """Pack ``samples`` into one ``[1, T]`` micro-batch in the batch contract (module docstring)."""
    if not samples:
        raise ValueError("collate_packed needs at least one sample")
    lengths = [len(s) for s in samples]
    used = sum(lengths)
    total = -(-used // pad_to_multiple_of) * pad_to_multiple_of
    pad = total - used
    offsets = np.cumsum([0, *lengths])

    input_ids = np.concatenate([s.input_ids for s in samples] + [np.full(pad, pad_token_id, np.int32)])
    labels = np.concatenate([s.labels for s in samples] + [np.full(pad, IGNORE_INDEX, np.int32)])
    seg_lengths = lengths + ([pad] if pad else [])
    position_ids = np.concatenate([np.arange(n, dtype=np.int64) for n in seg_lengths])
    cu_seqlens = np.cumsum([0, *seg_lengths])
    visual_indices = np.concatenate([s.image_positions + off for s, off in zip(samples, offsets[:-1])])
    vq_codes = np.concatenate([s.vq_codes for s in samples])
    return {
        "input_ids": torch.from_numpy(input_ids.astype(np.int64)).view(1, total),
        "labels": torch.from_numpy(labels.astype(np.int64)).view(1, total),
        "position_ids": torch.from_numpy(position_ids).view(1, total),
        "cu_seqlens": torch.from_numpy(cu_seqlens.astype(np.int32)),
        "max_seqlen": int(max(seg_lengths)),
        "visual_indices": torch.from_numpy(visual_indices.astype(np.int64)),
        "vq_codes": torch.from_numpy(vq_codes.astype(np.int64)),
        "placeholder_token_id": int(placeholder_token_id),
    }


def batch_to_device(batch: dict[str, Any], device: torch.device | str, non_blocking: bool = True) -> dict[str, Any]:
    """Move a micro-batch's tensors to ``device`` (ints such as ``max_seqlen`` stay Python ints)."""
    return {k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
