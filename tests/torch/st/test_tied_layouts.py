"""Tied embeddings (``tie_word_embeddings=True``, Qwen3.5-0.8B/2B/4B) under FSDP2, TP2 and FSDP2 x TP2 train
to the single-process run (fp32, gloo): every first-step gradient within 1e-5 relative (the shared table's
gradient sums its embedding and head uses), step-1 |dloss| <= 1e-5, all steps <= 1e-4. The shared weight
is ONE parameter after parallelisation (one FSDP unit for embedding and head, one TP DTensor), after a
DCP checkpoint is loaded into a fresh model, and after an HF export is read back (which holds no
``lm_head.weight``, as transformers writes a tied model). Layouts of one world size share one launch.
"""

from __future__ import annotations

import pytest

from tests.torch.st.glm_jobs import Layout
from tests.torch.st.grad_check import assert_matches_reference
from tests.torch.st.tied_jobs import tied_layouts_job, tied_reference_job

pytestmark = pytest.mark.slow

STEPS = 6

LAUNCHES = {
    "dense": {
        2: [Layout(world=2), Layout(world=2, tp=2), Layout(world=2, tp=2, sp=False, loss_parallel=False)],
        4: [Layout(world=4, dp_shard=2, tp=2)],
    },
    "moe": {2: [Layout(world=2, tp=2)], 4: [Layout(world=4, dp_shard=2, tp=2)]},
}
CASES = [(family, layout) for family, launches in LAUNCHES.items() for ls in launches.values() for layout in ls]


@pytest.fixture(scope="module")
def runs(pool, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tied")
    out = {}
    for family, launches in LAUNCHES.items():
        reference = pool.run(tied_reference_job, 1, STEPS, family)[0]
        for world, layouts in launches.items():
            for label, result in pool.run(tied_layouts_job, world, layouts, STEPS, family, str(folder), timeout=600.0)[
                0
            ].items():
                out[(family, label)] = (result, reference)
    return out


@pytest.mark.parametrize(("family", "layout"), CASES, ids=lambda v: str(v))
def test_tied_layout_matches_single_process_and_stays_one_parameter(runs, family, layout):
    out, reference = runs[(family, str(layout))]
    assert "lm_head.weight" not in out["first_grads"]  # one parameter: named once
    assert_matches_reference(out, reference, f"tied {family} {layout} ({out['parallel_dims']})", learns_by=0.5)
    assert out["tied_after_parallelize"] and out["one_optimizer_param"]
    assert out["tied_after_resume"] and out["resume_keys_equal"] and out["resume_max_diff"] == 0.0
    assert not out["export_has_head"]
    assert out["tied_after_export"] and out["export_max_diff"] == 0.0
