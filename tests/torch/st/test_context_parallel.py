"""Context parallel beyond the head counts equals one process (fp32, gloo): a tiny Qwen3.5-MoE with 1 K/V
head and 2 DeltaNet key heads (so CP 4 and 8 need the K/V all-gather and the DeltaNet state passing), on
packed rows whose documents straddle every piece boundary or start exactly on one (the conv window and the
state restart there, on another rank than the previous piece's). Logits and every first-step gradient within
1e-5 (gradients relative to their largest entry): CP 4, CP 4 x FSDP 2, CP 8, and CP 2 x TP 2 (2 K/V heads,
one per tp rank). Dropping the cross-piece DeltaNet state (the mutation run) moves the logits far past that.
With a slow DeltaNet decay (``cp_jobs.SLOW_DECAY``: the recipe's init decays the state to ~0 within a piece)
CP 4 still matches, and dropping only the state a piece passes through a document that crosses it whole
(``M S_in``) moves the logits far past 1e-5.
"""

from __future__ import annotations

import pytest

from tests.torch.st.cp_jobs import layouts_job, reference_job
from tests.torch.st.glm_jobs import Layout
from tests.torch.st.grad_check import assert_grads_match

pytestmark = pytest.mark.slow

CP4 = Layout(world=4, cp=4)
LAUNCHES = [  # (world, K/V heads, layouts)
    (4, 1, [CP4]),
    (4, 2, [Layout(world=4, dp_shard=1, cp=2, tp=2)]),  # CP 2 x TP 2 (+ SP, loss parallel)
    (8, 1, [Layout(world=8, dp_shard=2, cp=4), Layout(world=8, cp=8)]),  # CP 4 x FSDP 2, CP 8
]


@pytest.fixture(scope="module")
def references(pool):
    return {key: pool.run(reference_job, 1, kv, key == "slow")[0] for key, kv in ((1, 1), (2, 2), ("slow", 1))}


@pytest.fixture(scope="module")
def results(pool):
    out = {}
    for world, kv, layouts in LAUNCHES:
        extra = (CP4,) if layouts == [CP4] else ()  # the mutated and slow-decay runs share CP 4's launch
        for key, value in pool.run(layouts_job, world, layouts, kv, extra, extra, timeout=600.0)[0].items():
            out[key] = (kv, value)
    return out


@pytest.mark.parametrize("layout", [x for _, _, layouts in LAUNCHES for x in layouts], ids=str)
def test_cp_beyond_heads_matches_single_process(references, results, layout):
    kv, got = results[str(layout)]
    ref = references[kv]
    assert got["balanced"], "a text model with all-gather / state passing takes the balanced order"
    assert "state_passing" in got["forms"] and "allgather" in got["forms"], got["forms"]
    diff = (got["logits"] - ref["logits"]).abs().max().item()
    summary = assert_grads_match(got["grads"], ref["grads"], tol=1e-5)
    print(f"\n{layout}: logits max |diff| {diff:.2e}; {summary}")
    assert diff <= 1e-5, diff


def test_without_state_passing_the_layout_differs(references, results):
    _, got = results[f"mutated {CP4}"]
    diff = (got["logits"] - references[1]["logits"]).abs().max().item()
    print(f"\nCP 4 without the cross-piece DeltaNet state: logits max |diff| {diff:.2e}")
    assert diff > 1e-4, diff  # the layout test above allows 1e-5


def test_slow_decay_matches_single_process(references, results):
    _, got = results[f"slow {CP4}"]
    ref = references["slow"]
    diff = (got["logits"] - ref["logits"]).abs().max().item()
    summary = assert_grads_match(got["grads"], ref["grads"], tol=1e-5)
    print(f"\nCP 4, slow DeltaNet decay: logits max |diff| {diff:.2e}; {summary}")
    assert diff <= 1e-5, diff


def test_slow_decay_state_crosses_whole_pieces(references, results):
    _, got = results[f"slow mutated {CP4}"]
    diff = (got["logits"] - references["slow"]["logits"]).abs().max().item()
    print(f"\nCP 4, slow decay, without M S_in through whole pieces: logits max |diff| {diff:.2e}")
    assert diff > 1e-3, diff  # the layout test above allows 1e-5
