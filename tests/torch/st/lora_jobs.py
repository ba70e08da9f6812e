"""Jobs of the LoRA layout and checkpoint tests (gloo workers, see ``harness.py``): the ``qwen3_5_moe_debug``
recipe through the real ``Trainer`` (``ConfigManager`` argv, so every ``--lora.*`` flag is the CLI's), with
adapters on every linear projection (gated attention, Gated DeltaNet, shared expert) and on the routed experts,
the LM head trained in full (``modules_to_save``), started from a tiny HF folder written by our own export
(and ``GLM``: the MLA case).

A job runs several trainer runs in turn (one launch, several layouts) and reports, per run, the losses and
gradient norms of every step, every trainable parameter's whole gradient after steps 1 and 2 (B starts at
zero, so the A gradients are zero at step 1 and first differ at step 2) and what the layout made of the model:
each adapter's placement per mesh axis, the frozen base's dtype and gradients, the optimizer's parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.torch.st.grad_check import whole_grads
from tests.torch.helpers import canonical_fqn

STEPS = 3
CAPTURE = (1, 2)
"""Steps after which every trainable parameter's whole gradient is reported."""

BASE = [
    "--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--debug.deterministic",
    "--metrics.log_freq", "1", "--metrics.no_plot_loss", "--checkpoint.no_export_hf",
    "--data.max_tokens_per_microbatch", "128", "--data.global_batch_tokens", "512",
    # the Switch aux loss pools router statistics over one rank's rows: a data-parallel layout changes it
    "--model.router_aux_loss_coef", "0",
    # a schedule that does not depend on the run's length (runs of 3 and 4 steps are compared)
    "--lr_scheduler.warmup_steps", "1", "--lr_scheduler.decay_steps", "8",
    "--lora.rank", "4", "--lora.alpha", "8", "--lora.targets", "all-linear", "experts", "shared_expert_gate",
    "--lora.modules_to_save", "lm_head",
]  # fmt: skip

GLM = [
    "--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--debug.deterministic", "--metrics.log_freq", "1",
    "--metrics.no_plot_loss", "--checkpoint.no_export_hf", "--checkpoint.no_enable",
    "--data.max_tokens_per_microbatch", "128", "--data.global_batch_tokens", "512", "--model.router_aux_loss_coef", "0",
    "--lr_scheduler.warmup_steps", "1", "--lora.rank", "4", "--lora.alpha", "8",
    "--lora.targets", "all-linear", "experts", "--training.steps", str(max(CAPTURE)),
]  # fmt: skip
"""GlmImageMoe (``glm_image_moe_debug``, random base, its toy image+text corpus): MLA's latent projections
``q_a_proj`` / ``kv_a_proj_with_mqa`` are plain linears inside the attention's TP region, so their adapters are
plain parameters whose gradients are partial over tp (completed by their tp-including FSDP unit)."""


def glm_argv(dump: str | Path, *extra: str) -> list[str]:
    return [*GLM, "--dump_folder", str(dump), *extra]


LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
    "ep2": ["--parallelism.expert_parallel_degree", "2"],
    "cp2_ac": ["--parallelism.context_parallel_degree", "2", "--activation_checkpoint.mode", "full"],
    "fsdp2_ep2": ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.expert_parallel_degree", "2"],
}
"""Parallel layouts by name (``fsdp2_ep2`` runs on 4 ranks: experts on ep 2 x efsdp 2, the rest FSDP 4)."""


def argv(
    dump: str | Path, *extra: str, folder: str | Path | None = None, steps: int = STEPS, checkpoint: int | None = None
) -> list[str]:
    """The trainer's command line: ``BASE`` + the run's dump folder and steps, an HF folder when given, DCP
    checkpoints every ``checkpoint`` steps when given (none otherwise)."""
    load = ["--checkpoint.initial_load_path", str(folder)] if folder is not None else []
    if checkpoint is None:
        ckpt = ["--checkpoint.no_enable"]
    else:
        ckpt = ["--checkpoint.enable", "--checkpoint.interval", str(checkpoint), "--checkpoint.keep_latest_k", "0"]
    return [*BASE, "--training.steps", str(steps), "--dump_folder", str(dump), *load, *ckpt, *extra]


def write_hf_folder(path: str) -> str:
    """A tiny HF folder of the recipe's model (seeded random weights, fp32), written by our own export."""
    from hyper_parallel.models import qwen3_5_moe_v2
    from hyper_parallel.models.qwen3_5_moe_v2.config_registry import qwen3_5_moe_debug

    torch.manual_seed(4321)
    model = qwen3_5_moe_debug().model.build()
    model.init_weights()
    qwen3_5_moe_v2.save_pretrained(model, path, dtype=torch.float32)
    return path


def _axis_placements(p: torch.Tensor) -> dict[str, str]:
    """Placement of a parameter on each named mesh axis (empty for a plain tensor)."""
    if not isinstance(p, DTensor):
        return {}
    names = p.device_mesh.mesh_dim_names or tuple(str(i) for i in range(p.device_mesh.ndim))
    return {name: str(pl) for name, pl in zip(names, p.placements)}


def _structure(trainer: Any) -> dict[str, Any]:
    """What the layout made of the model: adapters' placements, the frozen base, the optimizer's parameters."""
    from hyper_parallel.models.common.lora import is_lora_param

    params = {canonical_fqn(n): p for n, p in trainer.model.named_parameters()}
    trainable = sorted(n for n, p in params.items() if p.requires_grad)
    frozen = {n: p for n, p in params.items() if not p.requires_grad}
    in_optimizer = {id(p) for opt in trainer.optimizers.optimizers for g in opt.param_groups for p in g["params"]}
    optimizer_state = sum(len(opt.state) for opt in trainer.optimizers.optimizers)
    return {
        "placements": {n: _axis_placements(p) for n, p in params.items() if is_lora_param(n) or "lm_head" in n},
        "trainable": trainable,
        "frozen_count": len(frozen),
        "frozen_dtypes": {n: str(p.dtype) for n, p in frozen.items()},
        "trainable_dtypes": sorted({str(params[n].dtype) for n in trainable}),
        "frozen_with_grad": sorted(n for n, p in frozen.items() if p.grad is not None),
        "optimizer_is_trainable": in_optimizer == {id(params[n]) for n in trainable},
        "optimizer_state": optimizer_state,
        "parallel_dims": str(trainer.parallel_dims),
    }


def run_trainer(args: list[str]) -> dict[str, Any]:
    """One trainer run of ``args`` (resuming when its dump folder holds a checkpoint); see the module docstring."""
    from hyper_parallel.config.manager import ConfigManager

    trainer = ConfigManager().parse_args(args).build()
    record: dict[str, Any] = {"start": trainer.step, "losses": [], "grad_norms": [], "grads": {}}
    train_step = trainer.train_step

    def step() -> dict[str, Any]:  # the trainer's own step, observed
        stats = train_step()
        record["losses"].append(stats["loss"])
        record["grad_norms"].append(stats["grad_norm"])
        if trainer.step in CAPTURE:
            record["grads"][trainer.step] = {canonical_fqn(n): g for n, g in whole_grads(trainer.model).items()}
        return stats

    trainer.train_step = step
    try:
        trainer.train()
        record.update(_structure(trainer))
    finally:
        trainer.close()
    return record


def runs_job(runs: dict[str, list[str]]) -> dict[str, dict[str, Any]] | None:
    """Every run of ``runs`` (label -> argv) in turn on this launch's ranks; rank 0 reports them."""
    torch.use_deterministic_algorithms(True)
    out = {label: run_trainer(args) for label, args in runs.items()}
    return out if dist.get_rank() == 0 else None


def error_job(args: list[str]) -> str:
    """The ``ValueError`` a trainer of ``args`` refuses to start with ("" if it starts); caught here, so the pool
    keeps its workers."""
    from hyper_parallel.config.manager import ConfigManager

    try:
        trainer = ConfigManager().parse_args(args).build()
    except ValueError as e:
        return str(e)
    trainer.close()
    return ""


def checkpoint_keys(step_dir: str) -> list[str]:
    """Every key a DCP checkpoint holds (``model.*``, ``optimizer.*`` ...)."""
    import torch.distributed.checkpoint as dcp

    return sorted(dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata)
