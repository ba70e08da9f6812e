"""Parallel layouts with VIDEO batches reproduce the single process (fp32, gloo), for Qwen3-VL-MoE and the
Qwen3.5-MoE VL model: FSDP 2, CP 2 (``[3, B, T]`` positions split; every CP rank runs the whole tower and
keeps the image and video features of its own chunk) and EP 2. Rows mix text, images and videos (frame
groups with timestamps between them); some ranks' micro-batches hold no video, or nothing visual, and still
take part in every collective. Every first-step gradient within 1e-5 (relative), step-1 |dloss| <= 1e-5,
all steps <= 1e-4 (``grad_check.assert_matches_reference``).
"""

from __future__ import annotations

import pytest

from tests.torch.st.glm_jobs import Layout
from tests.torch.st.grad_check import assert_matches_reference
from tests.torch.st.qwen3_vl_jobs import global_rows, layouts_job, reference_job

pytestmark = pytest.mark.slow

STEPS = 4
CASES = {
    "qwen3_vl_moe": [(Layout(world=2), False), (Layout(world=2, cp=2), False), (Layout(world=2, ep=2), False)],
    "qwen3_5_moe": [(Layout(world=2), False), (Layout(world=2, cp=2), False)],
}
PARAMS = [(family, layout) for family, cases in CASES.items() for layout, _ in cases]


def test_some_ranks_see_no_video():
    """The premise of the collective check: at dp 2, some step gives a rank rows without any video."""
    per_rank = [[sum(len(r["video_grids"]) for r in global_rows(s, True)[k * 2 : k * 2 + 2]) for k in range(2)]
                for s in range(STEPS)]  # fmt: skip
    assert any(0 in counts for counts in per_rank) and any(sum(c) for c in per_rank), per_rank


@pytest.fixture(scope="module")
def references(pool):
    return {f: pool.run(reference_job, 1, STEPS, False, f, True)[0] for f in CASES}


@pytest.fixture(scope="module")
def results(pool):
    return {f: pool.run(layouts_job, 2, cases, STEPS, f, True, timeout=600.0)[0] for f, cases in CASES.items()}


@pytest.mark.parametrize("family, layout", PARAMS, ids=[f"{f}-{layout}" for f, layout in PARAMS])
def test_video_layout_matches_single_process(references, results, family, layout):
    out = results[family][str(layout)]
    assert_matches_reference(out, references[family], f"{family} video {layout} ({out['parallel_dims']})",
                             learns_by=0.05)  # fmt: skip
    assert out["tower_sharded"]
