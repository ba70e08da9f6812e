"""Parallel layouts of the dense VL models (Qwen3.5 dense VL, tied; Qwen3-VL dense, deepstack) reproduce the
single-process run (fp32, gloo) on packed rows with images and videos: every first-step parameter gradient
within 1e-5 (relative to its largest entry), step-1 |dloss| <= 1e-5, all steps <= 1e-4, clipped grad norm
within 1e-4 relative. FSDP 2, TP 2 and CP 2 per model, all in ONE 2-rank launch. The vision tower is
FSDP-only: sharded on the data-parallel mesh, never placed on a tp axis.
"""

from __future__ import annotations

import pytest

from tests.torch.st.glm_jobs import Layout
from tests.torch.st.grad_check import assert_matches_reference
from tests.torch.st.vl_dense_jobs import layouts_job, reference_job

pytestmark = pytest.mark.slow

STEPS = 3


def _families() -> list[str]:
    """``qwen3_vl`` joins once its text family (helper V's ``qwen3_vl_config``) exists."""
    from hyper_parallel.models.qwen3_vl_moe_v2 import model

    return ["qwen3_5", *(["qwen3_vl"] if hasattr(model, "qwen3_vl_config") else [])]


# Qwen3-VL's deepstack adds at the visual positions of the whole sequence: TP without sequence parallel there
_LAYOUTS = {
    "qwen3_5": [Layout(world=2), Layout(world=2, tp=2), Layout(world=2, cp=2)],
    "qwen3_vl": [Layout(world=2), Layout(world=2, tp=2, sp=False), Layout(world=2, cp=2)],
}
CASES = [(family, layout) for family in ("qwen3_5", "qwen3_vl") for layout in _LAYOUTS[family]]


def _name(case) -> str:
    return f"{case[0]}-{case[1]}"


@pytest.fixture(scope="module")
def references(pool):
    return pool.run(reference_job, 1, _families(), STEPS)[0]


@pytest.fixture(scope="module")
def results(pool):
    cases = [case for case in CASES if case[0] in _families()]
    return pool.run(layouts_job, 2, cases, STEPS, timeout=600.0)[0]


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_dense_vl_layout_matches_single_process(references, results, case):
    family, _ = case
    if family not in references:
        pytest.skip(f"the {family} text family is not in the VL package yet")
    out = results[_name(case)]
    assert_matches_reference(out, references[family], f"{_name(case)} ({out['parallel_dims']})", learns_by=0.05)
    assert out["tower_sharded"] and out["tower_tp_free"]
    assert out["tied"] == (family == "qwen3_5")  # one tied parameter under every layout
