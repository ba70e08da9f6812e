"""Multi-token prediction under every kind of parallelism: FSDP 2, TP 2 (+ sequence and loss parallel), EP 2
and Ulysses CP 2 each reproduce the single-process run of the tiny Qwen3.5-MoE with its MTP block on (fp32,
gloo, one launch): every first-step parameter gradient (MTP block included) within 1e-5 relative, step-1
|dloss| <= 1e-5 (loss = CE + 0.1 * MTP CE), and the same MTP loss and top-1 accuracy every step. The tiny
GlmImageMoe with images and its nextn layer does the same under CP 2 (the images one token after a chunk
cross to the previous rank's MTP input, ``split_inputs_for_cp``) and TP 2."""

from __future__ import annotations

import pytest

from tests.torch.st.glm_jobs import Layout
from tests.torch.st.grad_check import assert_matches_reference
from tests.torch.st.mtp_jobs import layouts_job, reference_job

pytestmark = pytest.mark.slow

STEPS = 3
LAYOUTS = [Layout(world=2), Layout(world=2, tp=2), Layout(world=2, ep=2), Layout(world=2, cp=2)]
GLM_LAYOUTS = [Layout(world=2, cp=2), Layout(world=2, tp=2)]


@pytest.fixture(scope="module")
def reference(pool):
    return pool.run(reference_job, 1, STEPS)[0]


@pytest.fixture(scope="module")
def results(pool):
    return pool.run(layouts_job, 2, LAYOUTS, STEPS, timeout=600.0)[0]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_mtp_layout_matches_single_process(reference, results, layout):
    out = results[str(layout)]
    assert any(name.startswith("mtp.") for name in out["first_grads"])
    assert_matches_reference(out, reference, f"mtp {layout} ({out['parallel_dims']})", learns_by=0.0)
    assert max(abs(a - b) for a, b in zip(out["mtp_losses"], reference["mtp_losses"])) <= 1e-4
    assert out["top1"] == pytest.approx(reference["top1"], abs=1e-9)


@pytest.fixture(scope="module")
def glm_reference(pool):
    return pool.run(reference_job, 1, STEPS, "glm")[0]


@pytest.fixture(scope="module")
def glm_results(pool):
    return pool.run(layouts_job, 2, GLM_LAYOUTS, STEPS, "glm", timeout=600.0)[0]


@pytest.mark.parametrize("layout", GLM_LAYOUTS, ids=str)
def test_glm_nextn_layout_matches_single_process(glm_reference, glm_results, layout):
    out = glm_results[str(layout)]
    assert any(name.startswith("mtp.") for name in out["first_grads"])
    assert_matches_reference(out, glm_reference, f"glm mtp {layout} ({out['parallel_dims']})", learns_by=0.0)
    assert max(abs(a - b) for a, b in zip(out["mtp_losses"], glm_reference["mtp_losses"])) <= 1e-4
    assert out["top1"] == pytest.approx(glm_reference["top1"], abs=1e-9)
