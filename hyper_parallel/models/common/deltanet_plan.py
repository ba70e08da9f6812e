"""Gated DeltaNet's per-micro-batch plans: where packed documents sit in the conv window and in the chunk layout.

Legend: N tokens of the flat ``B*T`` stream, D documents, K conv taps, L chunk length, S chunk steps.

Every plan is made from the document bounds as Python ints (``AttentionMeta.cu_seqlens_host``: the collate made
them on the host) plus the SAME bounds as a device tensor (the batch's ``cu_seqlens``, copied to the device once
per micro-batch by the trainer). Sizes come from the host ints; the index tensors are computed by device ops from
the device bounds, with those sizes given (``output_size=``, no boolean-mask compaction). So no plan ever reads
device data back (no device-to-host sync) and none turns host data into a device tensor inside a layer.

Plans are cached by their content (bounds, chunk length or taps, device), so the first Gated DeltaNet layer of a
micro-batch builds them and every later layer (and every backward) reuses them: the same tensors, whatever
object carried the bounds. Fake or meta tensors (a dry run) are never cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["ChunkPlan", "ConvPlan", "cached", "chunk_plan", "conv_plan", "device_bounds", "host_index"]

_CACHE: OrderedDict[tuple, Any] = OrderedDict()
# A few kinds of plan per micro-batch, for the last few micro-batches (a pipeline schedule interleaves several; a miss
# only rebuilds: a backward keeps what it needs on its autograd context). At 128k tokens a chunk plan is ~2 MiB.
_CACHE_SIZE = 16


def cached(key: tuple, like: torch.Tensor, build: Callable[[], Any]) -> Any:
    """``build()`` once per ``key`` (LRU); never cached when ``like`` holds no data (fake/meta: a dry run)."""
    if is_fake(like) or like.device.type == "meta":
        return build()
    key = (*key, like.device)
    hit = _CACHE.get(key)
    if hit is not None:
        try:
            _CACHE.move_to_end(key)
        except KeyError:  # another thread (simulated CP ranks) evicted it meanwhile
            pass
        return hit
    value = _CACHE[key] = build()
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return value


def device_bounds(cu: Sequence[int], cu_dev: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The bounds ``cu`` as an int64 tensor on ``like``'s device: from ``cu_dev`` (the same bounds, already
    there), from ``arange`` for equal rows, else one host-to-device copy (derived bounds, context parallel)."""

    def build() -> torch.Tensor:
        if cu_dev is not None:
            return cu_dev.to(device=like.device, dtype=torch.long)
        step = cu[1] - cu[0] if len(cu) > 1 else 1
        if all(b - a == step for a, b in zip(cu[:-1], cu[1:])):
            return torch.arange(cu[0], cu[-1] + 1, step, device=like.device)
        return host_index(cu, like)

    return cached(("bounds", tuple(cu)), like, build)


def host_index(values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """Host ints as an int64 tensor on ``like``'s device: one non-blocking copy, cached by content (callers use it
    for bounds derived on the host, which no device tensor holds yet)."""

    def build() -> torch.Tensor:
        host = torch.tensor(list(values), dtype=torch.long)
        if like.device.type == "cuda":
            host = host.pin_memory()
        return host.to(like.device, non_blocking=True)

    return cached(("index", tuple(values)), like, build)


def _doc_start(cu_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """First row of the document holding each row ``t`` (``cu_t`` int64 bounds)."""
    return cu_t[torch.searchsorted(cu_t, t, right=True) - 1]


def _doc_end(cu_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """One past the last row of the document holding each row ``t``."""
    return cu_t[torch.searchsorted(cu_t, t, right=True)]


@dataclass(frozen=True, slots=True)
class ConvPlan:
    """The rows of the causal conv whose ``K``-tap window crosses a document boundary.

    ``forward``/``backward``: ``(rows [R], src [R, K], valid [R, K])`` for the forward (taps read back: the first
    ``K-1`` rows of every document after the first) and the input gradient (taps read ahead: the last ``K-1`` rows
    of every document before the last); ``src`` clamped into the stream, ``valid`` = the tap lies in the row's own
    document. A document shorter than ``K-1`` rows lends its spare candidate rows to the next document's first
    rows: those are recomputed twice, to the same bits. ``crossing[s - 1]``: for the weight gradient at shift
    ``s``, the rows ``u`` of the product ``g[u + s] * x[u]`` that pair two documents, or the spare index ``N - s``
    (one past the product) where a candidate pairs none.
    """

    forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    backward: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    crossing: tuple[torch.Tensor, ...]


def conv_plan(cu: Sequence[int], cu_dev: torch.Tensor | None, K: int, like: torch.Tensor) -> ConvPlan:
    """The ``ConvPlan`` of the bounds ``cu`` (host ints; ``cu_dev`` the same on the device, or None)."""

    def build() -> ConvPlan:
        cu_t = device_bounds(cu, cu_dev, like)
        N, dev = cu[-1], like.device
        i = torch.arange(K - 1, device=dev)
        shift = K - 1 - torch.arange(K, device=dev)
        # forward: candidates start + i of every document after the first
        rows = (cu_t[1:-1, None] + i).flatten().clamp_max(N - 1)
        src = rows[:, None] - shift
        fwd = (rows, src.clamp(0, N - 1), src >= _doc_start(cu_t, rows)[:, None])
        # input gradient: candidates end - 1 - i of every document before the last
        rows = (cu_t[1:-1, None] - 1 - i).flatten().clamp_min(0)
        src = rows[:, None] + shift
        bwd = (rows, src.clamp(0, N - 1), src < _doc_end(cu_t, rows)[:, None])
        crossing = []
        for s in range(1, K):
            t = (cu_t[1:-1, None] + torch.arange(s, device=dev)).flatten()
            pairs_two = (t < N) & (t - s >= 0) & (t - _doc_start(cu_t, t.clamp_max(N - 1)) < s)
            crossing.append(torch.where(pairs_two, t - s, N - s))
        return ConvPlan(forward=fwd, backward=bwd, crossing=tuple(crossing))

    return cached(("conv", tuple(cu), K), like, build)


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Where every token sits in the step-major chunk layout (see ``gated_delta_rule._chunk_rule``)."""

    gather_NL: torch.Tensor
    """Token index of each chunk slot (``B*T`` = padding: a zero row), chunks in step-major order."""
    slot_of_token: torch.Tensor
    """Flat slot (``chunk * L + i``) of every token of the ``B*T`` stream."""
    docs_per_step: list[int]
    """Documents that still have a chunk at each scan step (a prefix of the length-sorted documents)."""
    order: list[int]
    """The documents (indices into the bounds) sorted by chunk count, longest first (stable)."""
    step_offsets: list[int]
    """First chunk row of every step (host ints)."""


def chunk_plan(cu: Sequence[int], cu_dev: torch.Tensor | None, L: int, like: torch.Tensor) -> ChunkPlan:
    """The ``ChunkPlan`` of the bounds ``cu`` (host ints; ``cu_dev`` the same on the device, or None) for chunks of
    ``L``: documents sorted by chunk count (stable), chunk ``j`` of the first ``docs_per_step[j]`` of them at step
    ``j``."""

    def build() -> ChunkPlan:
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        n_chunks = [-(-n // L) for n in lengths]
        order = sorted(range(len(lengths)), key=lambda d: -n_chunks[d])  # stable: equal lengths keep their order
        steps = n_chunks[order[0]]
        docs_per_step = [sum(1 for d in order if n_chunks[d] > j) for j in range(steps)]
        step_offsets = [0]
        for n in docs_per_step[:-1]:
            step_offsets.append(step_offsets[-1] + n)
        N_chunks, n_tok, dev = sum(docs_per_step), cu[-1], like.device
        # the same order on the device: a stable sort of the chunk counts computed there from the device bounds
        cu_t = device_bounds(cu, cu_dev, like)
        counts_D = (cu_t[1:] - cu_t[:-1] + (L - 1)).div(L, rounding_mode="floor")
        order_t = torch.sort(-counts_D, stable=True).indices
        starts, ends = cu_t[:-1][order_t], cu_t[1:][order_t]
        per_step = (counts_D[order_t][None, :] > torch.arange(steps, device=dev)[:, None]).sum(1)  # docs_per_step
        first = per_step.cumsum(0) - per_step
        step_idx = torch.repeat_interleave(torch.arange(steps, device=dev), per_step, output_size=N_chunks)
        doc_idx = torch.arange(N_chunks, device=dev) - torch.repeat_interleave(first, per_step, output_size=N_chunks)
        tok = starts[doc_idx, None] + step_idx[:, None] * L + torch.arange(L, device=dev)
        gather = torch.where(tok < ends[doc_idx, None], tok, n_tok)
        # every token's slot; the padding slots all land on the spare entry n_tok, dropped
        slots = torch.empty(n_tok + 1, dtype=torch.long, device=dev)
        slots.index_put_((gather.flatten(),), torch.arange(gather.numel(), device=dev))
        return ChunkPlan(gather_NL=gather, slot_of_token=slots[:n_tok], docs_per_step=docs_per_step, order=order,
                         step_offsets=step_offsets)  # fmt: skip

    return cached(("chunks", tuple(cu), L), like, build)
