"""Gather a DTensor to the ranks that need it, and to no other (the HF export's per-tensor gather).

``DTensor.full_tensor()`` all-gathers: every rank of the mesh receives the whole tensor, although only
the rank that writes the tensor's file needs it. ``gather_to(t, dests)`` sends each distinct shard once
(a ``Replicate`` copy is sent by one of its holders only) straight to each destination, point to point
(``isend``/``irecv``: gloo and nccl both have them), so an export moves every byte once instead of
``world`` times and only the destinations hold a full tensor.

Which rank holds which part follows from the placements alone, the same on every rank: per tensor
dimension, the global indices a mesh coordinate's local shard covers, written as runs of consecutive
indices (``Shard``: one run; FSDP2 over TP, ``_StridedShard`` then ``Shard`` on one dimension: one run where
the TP split puts it; a ``_StridedShard`` alone: several).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import lru_cache

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _get_shard_size_and_offsets  # DTensor's own offset rule
from torch.distributed.tensor.placement_types import Placement, _StridedShard

__all__ = ["gather_many", "gather_to", "shard_runs"]

Run = tuple[int, int, int]
"""``(local start, global start, length)``: local rows ``start:start+length`` are global rows from there."""
Region = tuple[tuple[Run, ...], ...]
"""The runs of one local shard, per tensor dimension."""


def _runs(index: torch.Tensor) -> tuple[Run, ...]:
    """Consecutive stretches of a local -> global index map."""
    idx = index.tolist()
    out: list[Run] = []
    i = 0
    while i < len(idx):
        j = i + 1
        while j < len(idx) and idx[j] == idx[j - 1] + 1:
            j += 1
        out.append((i, idx[i], j - i))
        i = j
    return tuple(out)


def _region(
    shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], placements: Sequence[Placement]
) -> Region:
    """The runs of the shard at mesh coordinate ``coord``: DTensor's own offset rule, applied left to right
    over the mesh dimensions, keeping every index (not only the first, as its checkpoint helper does)."""
    size, index = list(shape), {}
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, (Shard, _StridedShard)):
            continue
        d = p.dim
        size[d], index[d] = _get_shard_size_and_offsets(
            size[d], mesh_shape[mesh_dim], coord[mesh_dim], p, index.get(d), shape[d], False
        )
        if size[d] == 0:
            index[d] = torch.empty(0, dtype=torch.long)
    return tuple(_runs(index[d][: size[d]]) if d in index else ((0, 0, n),) for d, n in enumerate(shape))


@lru_cache(maxsize=4096)
def _senders(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], ranks: tuple[int, ...], placements: tuple[Placement, ...]
) -> tuple[tuple[tuple[int, Region], ...], frozenset[int]]:
    """``(global rank, region)`` per distinct non-empty shard, sent by the first rank (in mesh order) holding
    it; and the ranks whose local tensor is the whole tensor (they need nothing sent)."""
    seen: dict[Region, int] = {}
    whole: set[int] = set()
    full = tuple(((0, 0, n),) for n in shape)
    for flat, coord in enumerate(itertools.product(*(range(n) for n in mesh_shape))):
        region = _region(shape, mesh_shape, coord, placements)
        if region == full:
            whole.add(ranks[flat])
        if all(region_dim for region_dim in region) and region not in seen:
            seen[region] = ranks[flat]
    return tuple((r, region) for region, r in seen.items()), frozenset(whole)


def shard_runs(t: DTensor) -> tuple[tuple[tuple[int, Region], ...], frozenset[int]] | None:
    """Who sends which part of ``t`` and who holds it whole (see ``_senders``); ``None`` for placements other
    than ``Shard``, ``_StridedShard`` and ``Replicate`` (``Partial``: the caller all-gathers)."""
    if any(not isinstance(p, (Shard, _StridedShard, Replicate)) for p in t.placements):
        return None
    mesh = t.device_mesh
    ranks = tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())
    return _senders(tuple(t.shape), tuple(mesh.shape), ranks, tuple(t.placements))


def _members(mesh: DeviceMesh) -> frozenset[int]:
    """The global ranks of this rank's copy of ``mesh``."""
    return frozenset(int(r) for r in mesh.mesh.reshape(-1).tolist())


def _local_shape(region: Region) -> tuple[int, ...]:
    return tuple(sum(n for _, _, n in runs) for runs in region)


def _place(out: torch.Tensor, local: torch.Tensor, region: Region) -> None:
    """Copy a local shard into the full tensor, run by run (one box per combination of runs)."""
    for combo in itertools.product(*region):
        src = tuple(slice(lo, lo + n) for lo, _, n in combo)
        dst = tuple(slice(go, go + n) for _, go, n in combo)
        out[dst].copy_(local[src])


@torch.no_grad()
def gather_many(items: Sequence[tuple[DTensor, Sequence[int]]]) -> list[torch.Tensor | None]:
    """``gather_to`` for several tensors in one exchange: per item the full tensor on its destination
    ranks, ``None`` elsewhere. All point-to-point operations are posted together (``batch_isend_irecv``) and
    then waited for, so with one destination rank per item every destination assembles its tensor at the
    same time. Each pair of ranks must exchange at most one message per item.

    Every rank of the default group calls it with the same items in the same order. Placements it cannot
    map fall back to ``full_tensor()`` (every rank receives).
    """
    if not items:
        return []
    rank = dist.get_rank()
    outs: list[torch.Tensor | None] = [None] * len(items)
    ops: list[dist.P2POp] = []
    received: list[tuple[int, torch.Tensor, Region]] = []
    for i, (t, dests) in enumerate(items):
        plan = shard_runs(t)
        if plan is None:
            full = t.full_tensor()  # a collective: every rank, in item order
            outs[i] = full if rank in dests else None
            continue
        senders, whole = plan
        local = t.to_local()
        if rank in dests and rank in whole:
            outs[i] = local  # a replica of the whole tensor (one rank, or replicated): no copy
        elif rank in dests:
            outs[i] = torch.empty(t.shape, dtype=t.dtype, device=local.device)
        # The others receive every part they lack, from this mesh's ranks. A DTensor on a sub-mesh (the FSDP
        # mesh of a TP run, say) is one of several copies, one per sub-mesh: a destination outside this rank's
        # sub-mesh is served by its own copy's ranks, which plan the same way from their own mesh.
        members = _members(t.device_mesh)
        need = [d for d in dests if d in members and d not in whole]
        payload = local.contiguous()  # one buffer for every isend of this item, alive until the waits below
        for src, region in senders:
            if src == rank and tuple(local.shape) != _local_shape(region):
                raise RuntimeError(
                    f"rank {rank}: local shard {list(local.shape)} of a {list(t.shape)} DTensor {t.placements} is "
                    f"not the {list(_local_shape(region))} its placements give: padded storage is not supported here"
                )
            for d in need:
                if src == rank == d:
                    _place(outs[i], local, region)
                elif src == rank:
                    ops.append(dist.P2POp(dist.isend, payload, d))
                elif d == rank:
                    buf = torch.empty(_local_shape(region), dtype=t.dtype, device=local.device)
                    ops.append(dist.P2POp(dist.irecv, buf, src))
                    received.append((i, buf, region))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for i, buf, region in received:
        _place(outs[i], buf, region)
    return outs


def gather_to(t: DTensor, dests: Sequence[int]) -> torch.Tensor | None:
    """The full tensor of ``t`` on the ranks ``dests`` (global ranks), ``None`` on the others.

    Every rank of the default group calls it with the same ``dests`` (a collective in that sense); a rank
    that holds a part nobody else sends sends it to each destination, a destination receives each part and
    places it. Falls back to ``full_tensor()`` (every rank receives) for placements it cannot map.
    """
    return gather_many([(t, dests)])[0]
