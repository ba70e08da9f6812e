"""The Switch aux loss is layout-invariant: ``qwen3_5_moe_debug`` (``router_aux_loss_coef`` 0.001, AdamW) through the
real Trainer under CP 2 / 4 / 8, TP 2 (+ sequence parallel: the MoE routes each tp rank's sequence shard) and
CP 2 x TP 2 equals one process over 3 steps: every loss within 1e-5, the logged aux loss within 1e-8 (it is
~2e-3), and every first-step parameter gradient within 1e-5 relative (``grad_check``).

Each CP / tp rank routes only its pieces of every row, so the per-expert counts and probability sums are pooled
over the cp x tp ranks before the product (``distributed/token_split.py``). Before that, each rank's loss on its
own pieces was averaged: the routers' first-step gradients differed by 4e-4..7e-4 (CP) and 9e-3 (TP 2, whose
copies were also counted once per tp rank) relative, and AdamW's first step made that 1.6e-4 in the CP 4 step-2
loss. Every layout pads its rows to the same multiple (16 = 2 cp x tp of CP 8): padding rows route like tokens
(as in HF without an attention mask), so a layout that pads more would change the statistics by its padding.
"""

from __future__ import annotations

import pytest

from tests.torch.st.cp_aux_jobs import trainer_layouts_job
from tests.torch.st.grad_check import assert_grads_match

pytestmark = pytest.mark.slow

STEPS = 3
_P = "--parallelism."
# Two micro-batches of 128 tokens per step; every layout pads rows to the same multiple (see the docstring).
COMMON = ["--data.max_tokens_per_microbatch", "128", "--data.global_batch_tokens", "256",
          "--data.pad_to_multiple_of", "16"]  # fmt: skip


def _layout(cp: int = 1, tp: int = 1) -> list[str]:
    return [*COMMON, f"{_P}data_parallel_shard_degree", "1", f"{_P}context_parallel_degree", str(cp),
            f"{_P}tensor_parallel_degree", str(tp)]  # fmt: skip


LAUNCHES = {  # world size -> {name: flags}, one launch each
    2: {"cp2": _layout(cp=2), "tp2": _layout(tp=2)},
    4: {"cp4": _layout(cp=4), "cp2_tp2": _layout(cp=2, tp=2)},
    8: {"cp8": _layout(cp=8)},
}
NAMES = [name for layouts in LAUNCHES.values() for name in layouts]


@pytest.fixture(scope="module")
def runs(pool, tmp_path_factory):
    root = tmp_path_factory.mktemp("aux")
    out = pool.run(trainer_layouts_job, 1, {"one": COMMON}, STEPS, str(root / "w1"), timeout=600.0)[0]
    for world, layouts in LAUNCHES.items():
        out.update(pool.run(trainer_layouts_job, world, layouts, STEPS, str(root / f"w{world}"), timeout=600.0)[0])
    return out


@pytest.mark.parametrize("name", NAMES)
def test_aux_loss_layout_matches_single_process(runs, name):
    ref, got = runs["one"], runs[name]
    assert all(a is not None and a > 0 for a in ref["aux"]), ref["aux"]  # the recipe trains with the aux loss
    dloss = [abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)]
    daux = [abs(a - b) for a, b in zip(got["aux"], ref["aux"], strict=True)]
    summary = assert_grads_match(got["first_grads"], ref["first_grads"], tol=1e-5)
    build, steps = got["seconds"]
    print(f"\n{name} ({got['parallel_dims']}): |dloss| {[f'{d:.1e}' for d in dloss]}, |daux| "
          f"{[f'{d:.1e}' for d in daux]}; {summary}; build/steps {build:.1f}/{steps:.1f} s")  # fmt: skip
    assert max(dloss) <= 1e-5, dloss
    assert max(daux) <= 1e-8, daux
