"""Jobs of ``test_hf_sharded_io.py``'s gather test (gloo workers, see ``harness.py``): ``gather_to`` on DTensors
of every placement the models use, compared with the tensor they were distributed from."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.hf import shard_gather
from hyper_parallel.hf.shard_gather import gather_many, gather_to


def _cases(world: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...], list[Any]]]:
    """(name, mesh shape, tensor shape, placements); odd sizes make uneven (and empty) shards."""
    cases = [
        ("shard0", (world,), (7, 5), [Shard(0)]),
        ("shard1", (world,), (3, 9), [Shard(1)]),
        ("replicate", (world,), (4, 6), [Replicate()]),
        ("fewer_rows_than_ranks", (world,), (1, 3), [Shard(0)]),
        # a local shard made of several stretches of the global rows (rows 0-1 and 4-5 on rank 0 of 2)
        ("strided_runs", (world,), (4 * world, 3), [_StridedShard(0, split_factor=2)]),
    ]
    if world % 2 == 0:
        cases += [
            # experts over one mesh dim, rows over the other
            ("ep_x_fsdp", (2, world // 2), (6, 10, 3), [Shard(0), Shard(1)]),
            ("fsdp_x_replicate", (2, world // 2), (5, 4), [Replicate(), Shard(0)]),
            # FSDP2 over TP on the same dim: each rank's rows sit where the TP split put them (rank (0, 1) holds
            # rows 6-8), not where two plain Shard(0) would (rows 3-5)
            ("strided", (2, world // 2), (12, 3), [_StridedShard(0, split_factor=world // 2), Shard(0)]),
        ]
    return cases


def gather_job() -> dict[str, Any]:
    """Per case and destination set: whether a destination got the exact tensor, receiving at most the parts
    it lacked once each, and whether every other rank got ``None`` and received nothing (no all-gather)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    received = {"bytes": 0}
    batch = shard_gather.dist.batch_isend_irecv

    def counting(ops: list[Any]) -> Any:
        received["bytes"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.irecv)
        return batch(ops)

    def no_all_gather(self: DTensor) -> torch.Tensor:
        raise AssertionError("gather_to all-gathered a tensor whose placements it can map")

    out: dict[str, Any] = {}
    full_tensor = DTensor.full_tensor
    shard_gather.dist.batch_isend_irecv, DTensor.full_tensor = counting, no_all_gather  # type: ignore[method-assign]
    try:
        for name, mesh_shape, shape, placements in _cases(world):
            mesh = init_device_mesh("cpu", mesh_shape)
            g = torch.Generator().manual_seed(len(name))
            full = torch.randn(shape, generator=g)
            t = distribute_tensor(full, mesh, placements)
            for dests in ([0], [world - 1], list(range(world))[::2]):
                received["bytes"] = 0
                got = gather_to(t, dests)
                if rank in dests:
                    ok = torch.equal(got, full) and received["bytes"] <= full.numel() * full.element_size()
                else:
                    ok = got is None and received["bytes"] == 0
                out[f"{name}->{dests}"] = ok
        # a DTensor on a sub-mesh is one copy per sub-mesh (the FSDP mesh of a TP run, or a size-1 mesh):
        # every destination is served by its own copy, whichever sub-mesh the destinations sit in
        if world % 2 == 0:
            root = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("a", "b"))
            for dim, placements in (("a", [Shard(0)]), ("b", [Shard(1)]), ("b", [Replicate()])):
                full = torch.randn(6, 4, generator=torch.Generator().manual_seed(7))
                t = distribute_tensor(full, root[dim], placements)
                for dests in ([0], [world - 1], list(range(world))):
                    got = gather_to(t, dests)
                    out[f"submesh_{dim}_{placements[0]}->{dests}"] = (
                        torch.equal(got, full) if rank in dests else got is None
                    )
        # one exchange, every rank the destination of a different tensor (the export's rounds)
        cases = _cases(world)[:world]
        fulls, items = [], []
        for d, (name, mesh_shape, shape, placements) in enumerate(cases):
            full = torch.randn(shape, generator=torch.Generator().manual_seed(d))
            fulls.append(full)
            items.append((distribute_tensor(full, init_device_mesh("cpu", mesh_shape), placements), [d]))
        got = gather_many(items)
        out["many"] = all(
            torch.equal(g, f) if d == rank else g is None for d, (g, f) in enumerate(zip(got, fulls, strict=True))
        )
    finally:
        shard_gather.dist.batch_isend_irecv, DTensor.full_tensor = batch, full_tensor  # type: ignore[method-assign]
    return out
