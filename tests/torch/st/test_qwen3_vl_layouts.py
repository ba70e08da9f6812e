"""Parallel layouts of a tiny Qwen3-VL-MoE (tower with deepstack + MoE text decoder, packed VL rows with
``[3, B, T]`` M-RoPE positions) reproduce the single-process run (fp32, gloo): every first-step parameter
gradient within 1e-5 (relative to its largest entry), step-1 |dloss| <= 1e-5, all steps <= 1e-4, clipped
grad norm within 1e-4 relative. The Qwen3.5-MoE VL composition runs TP 2 and CP 2 the same way. The vision
tower is FSDP-only (no TP placements); ``freeze_vision`` keeps it bit-identical and outside FSDP on every
rank. Under Ulysses CP every rank runs the whole tower and keeps the visual features of its own sequence
chunk.
"""

from __future__ import annotations

import pytest

from tests.torch.st.glm_jobs import Layout
from tests.torch.st.grad_check import assert_matches_reference
from tests.torch.st.qwen3_vl_jobs import layouts_job, reference_job

pytestmark = pytest.mark.slow

STEPS = 10

LAUNCHES = {
    4: [
        (Layout(world=4), False),  # FSDP 4 (vision blocks and mergers are units of their own)
        (Layout(world=4, dp_replicate=2), False),  # HSDP 2 x 2
        (Layout(world=4, dp_shard=2, cp=2), False),  # FSDP 2 x CP 2: [3, B, T] positions split, tower whole
    ],
    2: [
        (Layout(world=2, ep=2), False),  # EP 2 on the text MoE
        (Layout(world=2, tp=2, sp=False), False),  # TP 2 on the text decoder; the tower stays whole
        (Layout(world=2), True),  # FSDP 2 with freeze_vision
    ],
}
CASES = [case for cases in LAUNCHES.values() for case in cases]


def _name(case) -> str:
    layout, freeze = case
    return f"{layout}{'-freeze_vision' if freeze else ''}"


# The Qwen3.5-MoE VL composition (DeltaNet + gated attention text decoder with a gated shared expert, no
# deepstack, so sequence parallel is allowed): tensor parallel on the text decoder and Ulysses CP.
QWEN3_5_CASES = [(Layout(world=2, tp=2), False), (Layout(world=2, cp=2), False)]


@pytest.fixture(scope="module")
def qwen3_5_reference(pool):
    return pool.run(reference_job, 1, STEPS, False, "qwen3_5_moe")[0]


@pytest.fixture(scope="module")
def qwen3_5_results(pool):
    return pool.run(layouts_job, 2, QWEN3_5_CASES, STEPS, "qwen3_5_moe", timeout=600.0)[0]


@pytest.mark.parametrize("case", QWEN3_5_CASES, ids=_name)
def test_qwen3_5_moe_vl_layout_matches_single_process(qwen3_5_reference, qwen3_5_results, case):
    out = qwen3_5_results[_name(case)]
    assert_matches_reference(out, qwen3_5_reference, f"qwen3_5_moe VL {_name(case)}", learns_by=0.3)
    assert out["tower_sharded"]


@pytest.fixture(scope="module")
def references(pool):
    return {freeze: pool.run(reference_job, 1, STEPS, freeze)[0] for freeze in (False, True)}


@pytest.fixture(scope="module")
def results(pool):
    out = {}
    for world, cases in LAUNCHES.items():
        out.update(pool.run(layouts_job, world, cases, STEPS, timeout=600.0)[0])
    return out


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_layout_matches_single_process(references, results, case):
    layout, freeze = case
    out = results[_name(case)]
    assert_matches_reference(out, references[freeze], f"{_name(case)} ({out['parallel_dims']})", learns_by=0.3)
    if freeze:
        assert out["tower_identical"] and out["tower_fsdp_ignored"]
    else:
        assert out["tower_sharded"]
