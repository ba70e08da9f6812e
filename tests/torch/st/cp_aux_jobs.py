"""Jobs of the aux-loss layout tests (gloo workers, see ``harness.py``): ``qwen3_5_moe_debug`` (Switch aux loss
on, ``router_aux_loss_coef`` 0.001) through the real ``Trainer`` for a few steps, deterministic, one warmup step.

Each job runs one or more layouts in turn on the same ranks (one launch per world size) and returns, from rank 0,
every step's loss and aux loss, every parameter's first-step gradient, whole (``grad_check.whole_grads``), and how
many padding tokens the layout's micro-batches held (the batch's ``token_mask``).
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from tests.torch.st.grad_check import whole_grads

__all__ = ["trainer_layouts_job"]


def _run(flags: list[str], steps: int, dump: str, cache: str) -> dict[str, Any]:
    from hyper_parallel.config import ConfigManager

    t0 = time.perf_counter()
    cfg = ConfigManager().parse_args([
        "--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--dump_folder", dump,
        "--checkpoint.no_enable", "--checkpoint.no_export_hf", "--training.steps", str(steps),
        "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--metrics.no_plot_loss",
        "--debug.deterministic", "--data.cache_dir", cache, *flags,
    ])  # fmt: skip
    trainer = cfg.build()
    t1 = time.perf_counter()
    out: dict[str, Any] = {"losses": [], "aux": [], "parallel_dims": str(trainer.parallel_dims), "padding": 0}
    next_step = trainer.data.next_step

    def counting_next_step() -> list[dict[str, Any]]:  # the padding tokens this layout's rows carry
        batches = next_step()
        out["padding"] += sum(int((~mb["token_mask"]).sum()) if "token_mask" in mb else -1 for mb in batches)
        return batches

    trainer.data.next_step = counting_next_step
    try:
        while trainer.step < steps:  # Trainer.train's loop, with the first step's gradients kept
            trainer.step += 1
            stats = trainer.train_step()
            out["losses"].append(stats["loss"])
            out["aux"].append(stats["extra"].get("aux_loss"))
            if trainer.step == 1:  # a collective: every rank gathers
                out["first_grads"] = whole_grads(trainer.model)
    finally:
        trainer.close()
    out["seconds"] = (t1 - t0, time.perf_counter() - t1)  # (build, steps)
    return out


def trainer_layouts_job(layouts: dict[str, list[str]], steps: int, dump: str) -> dict[str, dict[str, Any]]:
    """``{name: result}`` of each layout (its parallelism flags) in turn; results on rank 0 only."""
    cache = f"{dump}/cache{dist.get_rank()}"  # the toy corpus, tokenized once per rank and launch
    results = {name: _run(flags, steps, f"{dump}/{name}", cache) for name, flags in layouts.items()}
    return results if dist.get_rank() == 0 else {}
