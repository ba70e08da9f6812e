"""The Switch aux loss is layout-invariant: ``qwen3_5_moe_debug`` (``router_aux_loss_coef`` 0.001, AdamW) through the
real Trainer under CP 2 / 4 / 8, TP 2 (+ sequence parallel: the MoE routes each tp rank's sequence shard) and
CP 2 x TP 2 equals one process over 3 steps: every loss within 1e-5, the logged aux loss within 1e-8 (it is
~2e-3), and every first-step parameter gradient within 1e-5 relative (``grad_check``).

Each CP / tp rank routes only its pieces of every row, so the per-expert counts and probability sums are pooled
over the cp x tp ranks before the product (``distributed/token_split.py``). Before that, each rank's loss on its
own pieces was averaged: the routers' first-step gradients differed by 4e-4..7e-4 (CP) and 9e-3 (TP 2, whose
copies were also counted once per tp rank) relative, and AdamW's first step made that 1.6e-4 in the CP 4 step-2
loss.

The data uses the default padding, so every layout pads its rows differently (one process: not at all; CP 8: to a
multiple of 16 = 2 cp: 44 padding tokens over the 6 micro-batches). Padding positions are left out of the router
statistics (the batch's ``token_mask``, split like the tokens by CP and SP, reaches every MoE: HF's
``load_balancing_loss_func(..., attention_mask)``). With padding counted, the routers' first-step gradients differed
by 6.1e-4 (CP 2 / 4, TP 2, CP 2 x TP 2) and 3.5e-3 (CP 8) relative, the aux loss by up to 1.7e-6 and the step-3
losses by 1.2e-5 .. 2.6e-5; with it left out: gradients <= 4.5e-6 (DeltaNet's ``A_log``, not the MoE), aux loss
<= 2.3e-10, losses <= 4.8e-7.
"""

from __future__ import annotations

import pytest

from tests.torch.st.cp_aux_jobs import trainer_layouts_job

pytestmark = pytest.mark.slow

STEPS = 3
_P = "--parallelism."
# Two micro-batches of at most 128 tokens per step, default padding: each layout pads to what it needs (see the
# docstring). Next-fit packing leaves room in the rows, so the layouts pad them differently (one process: never;
# CP 8, to 16: 0..15 tokens a row; TP 2, to 2: 0..1).
COMMON = ["--data.max_tokens_per_microbatch", "128", "--data.global_batch_tokens", "256", "--data.packing_bins", "1"]


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


def test_layouts_pad_differently(runs):
    """The case this file guards: one process routes no padding, CP 8 pads every micro-batch's row."""
    assert runs["one"]["padding"] == 0, runs["one"]["padding"]
    assert runs["cp8"]["padding"] > 0, runs["cp8"]["padding"]


@pytest.mark.parametrize("name", NAMES)
def test_aux_loss_layout_matches_single_process(runs, name):
    ref, got = runs["one"], runs[name]
    assert all(a is not None and a > 0 for a in ref["aux"]), ref["aux"]  # the recipe trains with the aux loss
    dloss = [abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)]
    daux = [abs(a - b) for a, b in zip(got["aux"], ref["aux"], strict=True)]
    want, mine = ref["first_grads"], got["first_grads"]
    assert mine.keys() == want.keys(), sorted(mine.keys() ^ want.keys())
    rel = {n: (mine[n] - g).abs().max().item() / max(g.abs().max().item(), 1e-3) for n, g in want.items()}
    worst = max(rel, key=rel.get)
    build, steps = got["seconds"]
    print(f"\n{name} ({got['parallel_dims']}, {got['padding']} padding tokens): |dloss| "
          f"{[f'{d:.1e}' for d in dloss]}, |daux| {[f'{d:.1e}' for d in daux]}; worst first-step gradient "
          f"{worst} {rel[worst]:.2e}; build/steps {build:.1f}/{steps:.1f} s")  # fmt: skip
    assert rel[worst] <= 1e-5, f"first-step gradient of {worst} differs by {rel[worst]:.2e} (relative)"
    assert max(dloss) <= 1e-5, dloss
    assert max(daux) <= 1e-8, daux
