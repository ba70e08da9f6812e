"""Every supported parallel layout of a tiny Qwen3.5-MoE (hybrid DeltaNet / gated attention, packed
documents) reproduces the single-process run (fp32, gloo): every first-step parameter gradient within
1e-5 (relative to its largest entry), step-1 |dloss| <= 1e-5, all 10 steps <= 1e-4, clipped gradient norm
within 1e-4 relative. Layouts of one world size share one launch (``qwen3_5_jobs``).
Ulysses CP splits the DeltaNet heads around ``delta_rule``; TP shards them (grouped ``in_proj_qkv`` rows,
per-head ``dt_bias``/``A_log``) and the gated attention's heads. The dense family (``qwen3_5``, a SwiGLU
MLP) runs the layouts that treat its MLP differently (TP, FSDP x TP, CP) and TP x CP, which splits the
DeltaNet heads twice (TP's grouped shards, then Ulysses' key-head-group chunks).
"""

from __future__ import annotations

import pytest

from tests.torch.st.glm_jobs import Layout
from tests.torch.st.grad_check import assert_matches_reference
from tests.torch.st.qwen3_5_jobs import layouts_job, reference_job

pytestmark = pytest.mark.slow

STEPS = 10

LAUNCHES = {
    4: [
        Layout(world=4),  # FSDP 4
        Layout(world=4, dp_replicate=2),  # HSDP 2 x 2
        Layout(world=4, ep=4),  # EP 4 over FSDP 4 (two experts per rank)
        Layout(world=4, ep=2),  # EP 2 with FSDP 4 (experts FSDP-sharded over efsdp = 2)
        Layout(world=4, dp_shard=2, cp=2, ep=2),  # FSDP 2 x CP 2 with EP 2 (ep borrows from dp_shard x cp)
        Layout(world=4, dp_shard=2, tp=2),  # FSDP 2 x TP 2 (+ sequence parallel)
    ],
    2: [
        Layout(world=2, ep=2),  # EP 2 (experts whole on each rank)
        Layout(world=2, ac="full"),  # FSDP 2, every layer recomputed
        Layout(world=2, ac="selective"),  # FSDP 2, layers 0 and 2 recomputed
        Layout(world=2, cp=2),  # Ulysses CP 2 (DeltaNet heads split around delta_rule)
        Layout(world=2, tp=2),  # TP 2 + sequence parallel, loss parallel
        Layout(world=2, tp=2, sp=False, loss_parallel=False),  # TP 2 alone
    ],
}
LAYOUTS = [layout for layouts in LAUNCHES.values() for layout in layouts]
# The dense family (same mixers, a SwiGLU MLP): the layouts that split its MLP and mixers differently.
DENSE_LAUNCHES = {
    4: [Layout(world=4, dp_shard=2, tp=2), Layout(world=4, dp_shard=1, tp=2, cp=2)],  # FSDP 2 x TP 2 / TP 2 x CP 2
    2: [Layout(world=2, tp=2, sp=False, loss_parallel=False), Layout(world=2, cp=2)],  # TP 2 / Ulysses CP 2
}
DENSE_LAYOUTS = [layout for layouts in DENSE_LAUNCHES.values() for layout in layouts]


@pytest.fixture(scope="module")
def reference(pool):
    return pool.run(reference_job, 1, STEPS)[0]


@pytest.fixture(scope="module")
def dense_reference(pool):
    return pool.run(reference_job, 1, STEPS, "dense")[0]


@pytest.fixture(scope="module")
def dense_results(pool):
    out = {}
    for world, layouts in DENSE_LAUNCHES.items():
        out.update(pool.run(layouts_job, world, layouts, STEPS, "dense", timeout=600.0)[0])
    return out


@pytest.mark.parametrize("layout", DENSE_LAYOUTS, ids=str)
def test_dense_layout_matches_single_process(dense_reference, dense_results, layout):
    out = dense_results[str(layout)]
    assert_matches_reference(out, dense_reference, f"dense {layout} ({out['parallel_dims']})", learns_by=0.5)


@pytest.fixture(scope="module")
def results(pool):
    out = {}
    for world, layouts in LAUNCHES.items():
        out.update(pool.run(layouts_job, world, layouts, STEPS, timeout=600.0)[0])
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_layout_matches_single_process(reference, results, layout):
    out = results[str(layout)]
    assert_matches_reference(out, reference, f"{layout} ({out['parallel_dims']})", learns_by=0.5)
    # activation checkpointing really recomputes: a checkpointed layer's mixer runs twice per step.
    expected = {"none": [1, 1, 1, 1], "full": [2, 2, 2, 2], "selective": [2, 1, 2, 1]}[layout.ac]
    assert out["mixer_calls"] == [STEPS * n for n in expected]
