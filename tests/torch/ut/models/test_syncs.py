"""No device-to-host sync in any layer (issue 43): every family's debug recipe, bf16, one process, counted with
``tests/torch/sync_counter.py`` over one real ``Trainer.train_step`` (two micro-batches) on the fallback path (no
flash-attn / fla / causal-conv1d: what a bare CUDA image runs, and what CPU runs).

Budget per forward (the model's own syncs: forward and backward, every site outside the trainer's step code):
at most one sync (the per-micro-batch copy of host metadata), and none per layer: no site may fire more than once
per forward. The expert-parallel split sync (one per MoE layer per forward) is checked by the EP2 system test
(``tests/torch/st/test_syncs_layouts.py``). The trainer's own step code: no scalar read before the optimizer step
(the non-finite guard runs on the device) and none at a step that does not log.

``test_counter_sees_a_tolist_in_a_layer`` is the canary: a ``.tolist()`` put into an attention layer (or a DeltaNet
layer) makes the budget check red.

Run as a script for the table of the issue note: ``python -m tests.torch.ut.models.test_syncs``.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from tests.torch.sync_counter import SyncCounter

# recipe -> (module, owner of the layers still syncing; None = must hold now)
RECIPES: dict[str, tuple[str, str | None]] = {
    "glm_image_moe_debug": ("glm_image_moe", None),
    "qwen3_5_debug": ("qwen3_5", None),
    "qwen3_5_moe_debug": ("qwen3_5_moe", None),
    "qwen3_vl_moe_debug": ("qwen3_vl_moe", None),
    "qwen3_5_moe_vl_debug": ("qwen3_vl_moe", None),
}
# Sites of the trainer's step code (loss, grad norm, optimizer, metrics), counted apart from the model's.
TRAINER_SITES = ("hyper_parallel/trainer.py", "hyper_parallel/components/", "hyper_parallel/distributed/utils.py")


def _is_trainer(site: str) -> bool:
    return site.startswith(TRAINER_SITES) or site.startswith("<")


def measure(module: str, recipe: str, *flags: str, steps: int = 2, read_stats: bool = False) -> dict[str, Any]:
    """Count one train step (the last of ``steps``; earlier steps warm lazy state) of ``recipe`` in bf16, a step that
    does not log (``read_stats=False``: what ``Trainer.train`` runs between log steps) unless ``read_stats``.

    Returns ``{"forwards", "model", "trainer", "model_sites", "trainer_sites", "report"}``; the batches are read
    before the counter starts (data loading is host work) and marked host, as the trainer keeps them until its
    device copy.
    """
    from hyper_parallel.config import ConfigManager

    dump = tempfile.mkdtemp(prefix="syncs_")
    cfg = ConfigManager().parse_args([
        "--module", module, "--config", recipe, "--dump_folder", dump, "--training.steps", str(steps),
        "--training.mixed_precision_param", "bfloat16", "--metrics.log_freq", "100",
        "--metrics.no_plot_loss", "--checkpoint.no_enable", "--checkpoint.no_export_hf",
        "--lr_scheduler.warmup_steps", "1", "--data.cache_dir", f"{dump}/cache", *flags,
    ])  # fmt: skip
    trainer = cfg.build()
    try:
        counter = None
        for _ in range(steps):
            batches = trainer.data.next_step()
            trainer.data.next_step = lambda b=batches: b
            with SyncCounter(host=batches) as counter:
                trainer.step += 1
                stats = trainer.train_step(read_stats=read_stats, logged=read_stats)
        if not read_stats:
            (stats,) = trainer._read_stats([(trainer.step, stats)])
    finally:
        trainer.close()
    from hyper_parallel.distributed.expert_parallel import AllToAllTokenDispatcher

    ep_layers = sum(isinstance(getattr(m, "dispatcher", None), AllToAllTokenDispatcher) for m in trainer.model.modules())
    model_sites = {s: n for s, n in counter.by_site.items() if not _is_trainer(s)}
    trainer_sites = {s: n for s, n in counter.by_site.items() if _is_trainer(s)}
    return {
        "forwards": len(batches),
        "ep_layers": ep_layers,
        "loss": stats["loss"],
        "grad_norm": stats["grad_norm"],
        "model": sum(model_sites.values()),
        "trainer": sum(trainer_sites.values()),
        "model_sites": model_sites,
        "trainer_sites": trainer_sites,
        "report": counter.report(),
    }


EP_SPLIT_SITE = "hyper_parallel/distributed/expert_parallel.py"


def check_budget(got: dict[str, Any]) -> None:
    """At most one sync per forward and none per layer; with expert parallel, besides, exactly one split-size
    sync per MoE layer per forward (activation-checkpoint recomputes reuse it)."""
    n = got["forwards"]
    sites = dict(got["model_sites"])
    ep = sum(c for s, c in sites.items() if s.startswith(EP_SPLIT_SITE))
    assert ep == got["ep_layers"] * n, (
        f"{ep} expert-parallel split syncs, expected one per MoE layer per forward ({got['ep_layers']} x {n}):\n"
        f"{got['report']}"
    )
    sites = {s: c for s, c in sites.items() if not s.startswith(EP_SPLIT_SITE)}
    per_layer = {s: c for s, c in sites.items() if c > n}
    assert not per_layer, f"sites that sync more than once per forward (per layer) over {n} forwards:\n{got['report']}"
    total = sum(sites.values())
    assert total <= n, f"more than one sync per forward ({total} over {n} forwards):\n{got['report']}"


def _params() -> list[Any]:
    out = []
    for recipe, (module, owner) in RECIPES.items():
        marks = [pytest.mark.xfail(strict=True, reason=f"owner {owner}: layers still sync")] if owner else []
        out.append(pytest.param(module, recipe, marks=marks, id=recipe))
    return out


@pytest.mark.parametrize(("module", "recipe"), _params())
def test_no_sync_per_layer(module: str, recipe: str):
    got = measure(module, recipe)
    print(f"\n{recipe}: {got['model']} model syncs over {got['forwards']} forwards, trainer {got['trainer']}\n"
          f"{got['report']}")  # fmt: skip
    check_budget(got)


def test_trainer_step_reads_no_scalar_off_log_steps():
    """A step that does not log reads nothing back (loss, grad norm, aux, expert loads stay on the device), with
    the device non-finite guard (fused AdamW skips a non-finite step on the device) and the skip policy."""
    got = measure("glm_image_moe", "glm_image_moe_debug", "--optimizer.implementation", "fused",
                  "--training.on_nonfinite", "skip")  # fmt: skip
    assert got["trainer"] == 0, got["report"]


def _poisoned_trainer(tmp_path, *flags: str):
    from hyper_parallel.config import ConfigManager

    cfg = ConfigManager().parse_args([
        "--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--dump_folder", str(tmp_path),
        "--data.global_batch_tokens", "512", "--lr_scheduler.warmup_steps", "1", "--metrics.no_plot_loss",
        "--optimizer.implementation", "fused", "--checkpoint.no_export_hf", *flags,
    ])  # fmt: skip
    return cfg.build()


def test_fused_adamw_skips_a_nonfinite_step_on_the_device(tmp_path):
    """Policy ``skip`` with fused AdamW: the optimizer drops the update itself (``found_inf``), nothing is read
    back, and the stats say the step was skipped once they are read."""
    trainer = _poisoned_trainer(tmp_path, "--training.on_nonfinite", "skip", "--checkpoint.no_enable")
    try:
        trainer.step = 1
        trainer.train_step(read_stats=False)  # step 1 is fine: the optimizer state exists
        with torch.no_grad():
            trainer.model.norm.weight[0] = float("nan")
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        opt_before = [{k: v.clone() for k, v in st.items()} for o in trainer.optimizers for st in o.state.values()]
        trainer.step = 2
        batches = trainer.data.next_step()  # host data, read before counting
        trainer.data.next_step = lambda: batches
        with SyncCounter(host=batches) as syncs:
            stats = trainer.train_step(read_stats=False, logged=False)
        assert not [s for s in syncs.by_site if _is_trainer(s)], syncs.report()
        after = trainer.model.state_dict()
        for key, value in before.items():
            assert torch.equal(value.nan_to_num(7.0), after[key].nan_to_num(7.0)), key
        opt_after = [st for o in trainer.optimizers for st in o.state.values()]
        for old, new in zip(opt_before, opt_after, strict=True):  # moments and step counts untouched too
            assert all(torch.equal(old[k], new[k]) for k in old), "the optimizer state moved on a skipped step"
        (read,) = trainer._read_stats([(2, stats)])
        assert read["extra"]["skipped"] == 1.0 and read["loss"] != read["loss"]  # NaN
    finally:
        trainer.close()


def test_fused_adamw_nonfinite_error_stops_at_the_next_read_naming_the_step(tmp_path):
    """Policy ``error`` with the device guard: ``train`` reads the stats at log steps; the first read after a
    non-finite step raises naming that step, whose update was not applied, and no checkpoint is written."""
    from hyper_parallel.trainer import NonFiniteError

    trainer = _poisoned_trainer(tmp_path, "--training.steps", "4", "--metrics.log_freq", "4",
                                "--checkpoint.interval", "4")  # fmt: skip
    step = trainer.train_step

    def poisoning_step(**kwargs):
        if trainer.step == 2:
            with torch.no_grad():
                trainer.model.norm.weight[0] = float("nan")
        return step(**kwargs)

    trainer.train_step = poisoning_step
    try:
        with pytest.raises(NonFiniteError, match="step 2: loss=nan"):
            trainer.train()
        assert trainer.step == 4  # found at the read of step 4 (its log step), not before
    finally:
        trainer.close()
    assert not any((tmp_path / "checkpoint").glob("step-*"))


def test_counter_counts_device_reads_in_backward_and_not_host_reads():
    """The counter itself: a read in an activation-checkpoint recompute and in a custom backward counts (torch
    function modes are off there), data-dependent shapes count, host data (made without ``device=``, or marked)
    reads freely, and ``repeat_interleave`` with ``output_size`` is no sync."""
    from torch.utils.checkpoint import checkpoint

    class Doubled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            g.sum().tolist()
            return g * 2

    def body(x):
        x.sum().tolist()
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    batch = {"ids": torch.arange(4)}
    with SyncCounter(host=batch) as syncs:
        checkpoint(body, x, use_reentrant=False).sum().backward()  # forward + recompute
        Doubled.apply(x).sum().backward()
        (x > 0).nonzero()
        x.detach()[x.detach() > 0]
        ids = batch["ids"]
        torch.repeat_interleave(ids, ids, output_size=6)
        host = torch.tensor([0, 3, 4])
        host.tolist(), ids.tolist(), int(host[-1]), (host[1:] - host[:-1]).max().item()
    assert syncs.by_kind == {"tolist": 3, "nonzero": 1, "bool-mask index": 1}, syncs.report()


def test_counter_sees_a_tolist_in_a_layer(monkeypatch):
    """The canary: one ``.tolist()`` in an attention layer's forward breaks the budget."""
    from hyper_parallel.models.common import mla

    forward = mla.MLAttention.forward

    def syncing_forward(self, x, *args, **kwargs):
        x.sum().tolist()  # what a careless layer does
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(mla.MLAttention, "forward", syncing_forward)
    got = measure("glm_image_moe", "glm_image_moe_debug", steps=1)
    # the innermost hyper_parallel frame is the block calling the (patched) attention: once per layer and forward
    at_block = sum(n for site, n in got["model_sites"].items() if site.startswith("hyper_parallel/models/common/block"))
    assert at_block >= 2 * got["forwards"], got["report"]
    with pytest.raises(AssertionError, match="per layer"):
        check_budget(got)


def main() -> None:
    """Print the table of the issue note (model syncs per forward, trainer syncs per step)."""
    import sys

    rows = sys.argv[1:] or list(RECIPES)
    print("| recipe | forwards | model syncs | per forward | trainer syncs per step |")
    print("|---|---|---|---|---|")
    for recipe in rows:
        got = measure(RECIPES[recipe][0], recipe)
        n = got["forwards"]
        print(f"| {recipe} | {n} | {got['model']} | {got['model'] / n:.1f} | {got['trainer']} |", flush=True)
        print(got["report"], file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
