"""Hybrid context parallel equals one process (fp32, gloo): Ulysses over pairs of neighbouring CP ranks (inside a
node), then the K/V all-gather / Gated DeltaNet state passing across the pairs, on the tiny Qwen3.5-MoE of
``cp_jobs`` with 2 K/V heads and 2 DeltaNet key heads (no core divides by CP 4 or 8) and packed rows whose
documents straddle every piece boundary. Logits and every first-step gradient within 1e-5: CP 4 = 2 x 2
(balanced order, FSDP over CP), CP 4 x FSDP 2 and CP 8 = 2 x 4, and the contiguous order (hybrid and plain state
passing). The inner groups are neighbours, exchanged groups are refused, and ParallelDims.close() frees both.
"""

from __future__ import annotations

import pytest

from tests.torch.st.cp_hybrid_jobs import HybridLayout, contiguous_job, hybrid_layouts_job, swapped_meshes_job
from tests.torch.st.cp_jobs import reference_job
from tests.torch.st.grad_check import assert_grads_match

pytestmark = pytest.mark.slow

HYBRID = ("hybrid_allgather", "hybrid_state_passing")
LAUNCHES = [  # (world, layouts)
    (4, [HybridLayout(world=4, cp=4, ulysses=2)]),
    (8, [HybridLayout(world=8, dp_shard=2, cp=4, ulysses=2), HybridLayout(world=8, cp=8, ulysses=2)]),
]


@pytest.fixture(scope="module")
def reference(pool):
    return pool.run(reference_job, 1, 2)[0]


@pytest.fixture(scope="module")
def results(pool):
    out = {}
    for world, layouts in LAUNCHES:
        out |= pool.run(hybrid_layouts_job, world, layouts, timeout=600.0)[0]
    return out


def _compare(got: dict, ref: dict, label: str) -> None:
    diff = (got["logits"] - ref["logits"]).abs().max().item()
    summary = assert_grads_match(got["grads"], ref["grads"], tol=1e-5)
    print(f"\n{label}: logits max |diff| {diff:.2e}; {summary}")
    assert diff <= 1e-5, diff


@pytest.mark.parametrize("layout", [x for _, layouts in LAUNCHES for x in layouts], ids=str)
def test_hybrid_cp_matches_single_process(reference, results, layout):
    got = results[str(layout)]
    assert got["forms"] == list(HYBRID), got["forms"]
    assert got["balanced"] and got["levels"] == (2, layout.cp // 2), (got["balanced"], got["levels"])
    _compare(got, reference, str(layout))


@pytest.mark.parametrize("ulysses", [2, 1])
def test_contiguous_order(pool, reference, ulysses):
    """Hybrid, and plain state passing (ulysses 1), in the contiguous order: the first outer rank never reads the
    gathered DeltaNet summaries and conv tails, yet must join their backward collectives (it hung before)."""
    got = pool.run(contiguous_job, 4, 4, ulysses)[0]
    forms = list(HYBRID) if ulysses > 1 else ["allgather", "state_passing"]
    assert got["forms"] == forms and not got["balanced"], got
    _compare(got, reference, f"cp4 = {ulysses} x {4 // ulysses}, contiguous order")


def test_groups_are_neighbours_refused_swapped_and_freed(pool):
    results = pool.run(swapped_meshes_job, 4, 4, 2)
    for rank, got in enumerate(results):
        inner = [rank // 2 * 2, rank // 2 * 2 + 1]  # neighbours: one node
        assert got["ranks"] == [inner, [rank % 2, rank % 2 + 2]], got["ranks"]
        assert "consecutive CP ranks" in got["error"], got["error"]
        assert got["freed"], "ParallelDims.close() left a hybrid CP group alive"
