"""Jobs of the pipeline-parallel tests (gloo workers, see ``harness.py``): a debug recipe through the real
``Trainer`` (``ConfigManager`` argv, so every ``--parallelism.pipeline_*`` flag is the CLI's), several layouts in
turn in one launch. Every rank reports, per run, the losses and gradient norms of every step and the whole
first- and last-step gradient of every parameter its stages hold (the test merges the ranks' dictionaries: each stage's
parameters live on its own ranks), plus the stages it ran.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.torch.st.grad_check import whole_grads
from tests.torch.helpers import canonical_fqn

_DATA = ["--data.max_tokens_per_microbatch", "128", "--data.global_batch_tokens", "512"]
FAMILIES: dict[str, list[str]] = {
    "glm": ["--module", "glm_image_moe", "--config", "glm_image_moe_debug", *_DATA],
    "qwen3_5_moe": ["--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--model.use_mtp", "true", *_DATA],
    # its toy conversations hold up to ~140 tokens with the images expanded; 5 text layers (4 stages fit)
    "qwen3_vl_moe": ["--module", "qwen3_vl_moe", "--config", "qwen3_vl_moe_pp_debug",
                     "--data.max_tokens_per_microbatch", "256", "--data.global_batch_tokens", "1024"],
}
"""The families under test: GlmImageMoe on its image+text corpus, Qwen3.5-MoE with its MTP block, Qwen3-VL-MoE on
its image corpus."""

COMMON = [
    "--debug.deterministic", "--metrics.log_freq", "1", "--metrics.no_plot_loss", "--checkpoint.no_export_hf",
    "--lr_scheduler.warmup_steps", "1", "--lr_scheduler.decay_steps", "8",
]  # fmt: skip


def argv(family: str, dump: str, steps: int, *extra: str, checkpoint: int | None = None) -> list[str]:
    """The trainer's command line of ``family`` for ``steps`` steps in ``dump`` (DCP every ``checkpoint`` steps)."""
    ckpt = ["--checkpoint.no_enable"] if checkpoint is None else [
        "--checkpoint.enable", "--checkpoint.interval", str(checkpoint), "--checkpoint.keep_latest_k", "0"]  # fmt: skip
    return [*FAMILIES[family], *COMMON, "--training.steps", str(steps), "--dump_folder", dump, *ckpt, *extra]


def run_trainer(args: list[str]) -> dict[str, Any]:
    """One trainer run of ``args`` (resuming when its dump folder holds a checkpoint)."""
    from hyper_parallel.config.manager import ConfigManager

    trainer = ConfigManager().parse_args(args).build()
    record: dict[str, Any] = {"start": trainer.step, "losses": [], "grad_norms": [], "first_grads": {}}
    record["stages"] = list(trainer.pipeline.stage_ids) if trainer.pipeline is not None else None
    train_step = trainer.train_step

    def step() -> dict[str, Any]:  # the trainer's own step, observed
        stats = train_step()
        record["losses"].append(float(stats["loss"]))  # under train() the stats stay on the device until a log step
        record["grad_norms"].append(float(stats["grad_norm"]))
        if trainer.step in (record["start"] + 1, trainer.config.training.steps):
            key = "first_grads" if trainer.step == record["start"] + 1 else "last_grads"
            for part in trainer.model_parts:
                record.setdefault(key, {}).update({canonical_fqn(n): g for n, g in whole_grads(part).items()})
        return stats

    validate = trainer.validator.validate

    def validated(at: int) -> Any:  # the validator's own evaluation, observed
        result = validate(at)
        record["val"].append(result.record["val/loss"])
        return result

    record["val"] = []
    trainer.validator.validate = validated
    trainer.train_step = step
    try:
        trainer.train()
        record["parallel_dims"] = str(trainer.parallel_dims)
    finally:
        trainer.close()
    return record


def runs_job(runs: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Every run of ``runs`` (label -> argv) in turn on this launch's ranks; every rank reports."""
    torch.use_deterministic_algorithms(True)
    return {label: run_trainer(args) for label, args in runs.items()}


def merged(per_rank: list[dict[str, dict[str, Any]]], label: str) -> dict[str, Any]:
    """Run ``label`` as one record: rank 0's losses and norms, every rank's first-step gradients."""
    out = dict(per_rank[0][label])
    for key in ("first_grads", "last_grads"):
        out[key] = {k: v for rank in per_rank for k, v in rank[label].get(key, {}).items()}
    return out
