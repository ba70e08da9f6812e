"""Jobs of the hybrid context-parallel tests (gloo workers, see ``harness.py``).

The tiny Qwen3.5-MoE of ``cp_jobs`` with 2 query / 2 K/V heads and 2 DeltaNet key heads: at CP 4 and 8 no core's
heads divide by the CP degree, so with ``context_parallel_ulysses_degree 2`` every core runs Ulysses over pairs of
neighbouring CP ranks and then the K/V all-gather / state passing across the pairs (``hybrid_allgather``,
``hybrid_state_passing``). Same packed rows (documents straddle every piece boundary), one forward/backward per
layout; the single-process run (``cp_jobs.reference_job(2)``) is the reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.config import ParallelismConfig
from hyper_parallel.distributed.context_parallel import apply_context_parallel
from hyper_parallel.distributed.parallel_dims import ParallelDims
from tests.torch.st.cp_jobs import DOCS, SEQ, _model, _step, batch, layouts_job
from tests.torch.st.glm_jobs import Layout
from tests.torch.st.grad_check import whole_grads

KV_HEADS = 2


@dataclasses.dataclass
class HybridLayout(Layout):
    """A layout with hybrid context parallel: Ulysses over ``ulysses`` neighbouring CP ranks."""

    ulysses: int = 1

    def __str__(self) -> str:
        return f"{Layout.__str__(self)}-u{self.ulysses}"

    def parallelism(self) -> ParallelismConfig:
        p = Layout.parallelism(self)
        p.context_parallel_ulysses_degree = self.ulysses
        return p


def hybrid_layouts_job(layouts: list[HybridLayout]) -> dict[str, Any]:
    """``cp_jobs.layouts_job`` (parallelize with FSDP, balanced order, logits at global positions, whole
    gradients) on the hybrid layouts, each result with the inner / outer group sizes it ran with."""
    out = layouts_job(layouts, KV_HEADS)
    for layout in layouts:
        pd = ParallelDims.from_config(layout.parallelism(), dist.get_world_size())
        out[str(layout)]["levels"] = (pd.cp_inner, pd.cp_outer)
    return out


def contiguous_job(cp: int, ulysses: int) -> dict[str, Any]:
    """CP in the contiguous batch order (``apply_context_parallel(balanced=False)``), hybrid when ``ulysses > 1``,
    no FSDP: each rank's replicated gradients are summed over the CP group by hand."""
    torch.use_deterministic_algorithms(True)
    model = _model(KV_HEADS)
    pd = ParallelDims.from_config(
        ParallelismConfig(context_parallel_degree=cp, context_parallel_ulysses_degree=ulysses), dist.get_world_size()
    )
    pd.build_mesh("cpu")
    try:
        plan = apply_context_parallel(model, pd.mesh("cp"), hybrid=pd.cp_hybrid_meshes(), balanced=False)
        shard = model.cp_shard
        full = batch()
        num_tokens = int((full["labels"] != -100).sum())
        mine = dict(full)
        t = SEQ // shard.size
        idx = torch.cat([torch.arange(lo, hi) for lo, hi in shard.ranges(t)])
        for key in ("input_ids", "labels", "position_ids"):
            mine[key] = full[key][:, idx]
        logits = _step(model, mine, num_tokens, False).detach()
        placed = torch.zeros(len(DOCS), SEQ, logits.shape[-1])
        placed[:, idx] = logits
        dist.all_reduce(placed)
        grads = whole_grads(model)
        for g in grads.values():
            dist.all_reduce(g)
        return {"logits": placed, "grads": grads, "balanced": shard.balanced, "forms": sorted(set(plan.values()))}
    finally:
        pd.close()


def swapped_meshes_job(cp: int, ulysses: int) -> dict[str, Any]:
    """The inner and outer groups exchanged (Ulysses over ranks ``ulysses`` apart): must be refused. Also the
    groups' ranks, and whether ``ParallelDims.close()`` destroyed both."""
    model = _model(KV_HEADS)
    pd = ParallelDims.from_config(
        ParallelismConfig(context_parallel_degree=cp, context_parallel_ulysses_degree=ulysses), dist.get_world_size()
    )
    pd.build_mesh("cpu")
    inner, outer = pd.cp_hybrid_meshes()
    groups = [inner.get_group(), outer.get_group()]
    out = {"ranks": [dist.get_process_group_ranks(g) for g in groups], "error": ""}
    try:
        apply_context_parallel(model, pd.mesh("cp"), hybrid=(outer, inner))
    except ValueError as e:
        out["error"] = str(e)
    finally:
        pd.close()
    out["freed"] = not any(g in dist.distributed_c10d._world.pg_map for g in groups)
    return out
