"""The verdict on a layout that does not fit, naming the knobs that shrink its largest parts."""

from __future__ import annotations

import math

from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.dry_run.report import GIB, DryRunReport
from hyper_parallel.trainer import Trainer

__all__ = ["fit_advice", "fitting_cp_degree", "fitting_pp_degree"]

_P = "--parallelism."


def fitting_cp_degree(pd: ParallelDims, activations: float, room: float) -> int | None:
    """The smallest context-parallel degree above ``pd.cp`` (a divisor of the ranks left after tp and
    dp_replicate) whose activations, assumed to scale as 1/cp (every rank keeps T/cp tokens of every
    sequence), fit in ``room`` bytes; None when none does."""
    if room <= 0:
        return None
    span = pd.world_size // (pd.tp * pd.dp_replicate)
    for cp in range(pd.cp + 1, span + 1):
        if span % cp == 0 and activations * pd.cp / cp <= room:
            return cp
    return None


def fitting_pp_degree(pd: ParallelDims, static: float, room: float, num_layers: int) -> tuple[int, int, int] | None:
    """``(pp, dp_replicate, world)`` of the smallest pipeline degree above ``pd.pp`` whose fullest stage's static
    memory fits in ``room`` bytes, assuming it scales as ``pd.pp / pp`` (each stage holds ``1/pp`` of the layers,
    spread evenly; the ranks of a stage shard it as now); None when none does (or ``room <= 0``).

    HSDP replicas become stages first (the same ranks: ``dp_replicate`` shrinks by ``pp / pd.pp``); then more ranks
    (every pipeline rank group as now), at most one stage per layer."""
    if room <= 0 or static <= 0:
        return None
    replicas = pd.pp * pd.dp_replicate
    for pp in range(pd.pp + 1, min(replicas, num_layers) + 1):
        if replicas % pp == 0 and pp % pd.pp == 0 and static * pd.pp / pp <= room:
            return pp, replicas // pp, pd.world_size
    group = pd.world_size // pd.pp
    for pp in range(2 * pd.pp, num_layers + 1, pd.pp):
        if static * pd.pp / pp <= room:
            return pp, pd.dp_replicate, pp * group
    return None


def _activation_knobs(config: Trainer.Config, pd: ParallelDims, activations: float, room: float) -> list[str]:
    mode = config.activation_checkpoint.mode
    knobs = []
    if mode != "full":
        knobs.append(f"--activation_checkpoint.mode full (now {mode}) keeps only each layer's input for backward")
    cp = fitting_cp_degree(pd, activations, room)
    split = (
        f"{_P}context_parallel_degree {cp} (now {pd.cp}) splits every sequence so the activations should fit"
        if cp is not None
        else f"split every sequence with {_P}context_parallel_degree (now {pd.cp}; no degree up to the "
        f"{pd.world_size // (pd.tp * pd.dp_replicate)} ranks left after tp and dp_replicate fits alone)"
    )
    knobs.append(
        f"lower --data.max_tokens_per_microbatch (now {config.data.max_tokens_per_microbatch}): activations scale "
        f"with it; or {split}; or {_P}tensor_parallel_degree (now {pd.tp})"
    )
    return knobs


def _static_knobs(report: DryRunReport, config: Trainer.Config, pd: ParallelDims, room: float) -> list[str]:
    worst = max(report.ranks, key=lambda m: m.static)
    knobs = []
    if pd.dp_replicate > 1:
        knobs.append(
            f"lower {_P}data_parallel_replicate_degree (now {pd.dp_replicate}): HSDP keeps a full set of shards per "
            "replica; FSDP over more ranks shrinks each rank's share"
        )
    if room > 0:
        need = math.ceil(pd.dp_shard * worst.static / room)  # params, grads and optimizer state scale as 1/dp_shard
        knobs.append(
            f"{_P}data_parallel_shard_degree {need} or more (now {pd.dp_shard}; {need * pd.world_size // pd.dp_shard} "
            "ranks in all): parameters, gradients and optimizer state shrink as 1/data_parallel_shard_degree"
        )
    else:
        knobs.append("no shard degree helps while the activations alone exceed the device: shrink them first")
    pipe = fitting_pp_degree(pd, worst.static, room, report.num_layers)
    if pipe is not None:
        pp, replicate, world = pipe
        how = (
            f"on the same {world} ranks with {_P}data_parallel_replicate_degree {replicate} (now {pd.dp_replicate})"
            if world == pd.world_size
            else f"on {world} ranks ({world // pp} per stage, as now)"
        )
        knobs.append(
            f"{_P}pipeline_parallel_degree {pp} (now {pd.pp}) {how}: each stage holds 1/{pp} of the layers, so the "
            f"per-stage memory would fit (about {worst.static * pd.pp / pp / GIB:.2f} GiB static, layers spread evenly)"
        )
    if config.optimizer.name == "adamw" and worst.optimizer >= max(worst.params, worst.grads):
        knobs.append("--optimizer.name muon keeps one momentum buffer per matrix instead of AdamW's two moments")
    lora = getattr(config, "lora", None)
    if lora is not None and not lora.enabled and worst.grads > 0:
        knobs.append(
            "a LoRA fine-tune (--lora.rank 16, e.g. --lora.targets all-linear experts): the base is frozen in the "
            "training dtype, with no gradient or optimizer state, so it needs a fraction of this static memory (the "
            "*_lora recipes are sized for 2 x 80 GiB)"
        )
    return knobs


def fit_advice(report: DryRunReport, config: Trainer.Config, pd: ParallelDims) -> list[str]:
    """Headroom when the fullest rank fits; otherwise what it needs, and the knobs for its larger part first."""
    budget = report.device_memory_gib * GIB

    def need(m):  # the estimated peak (pipeline stages differ in activations), else the static memory
        peak = report.estimated_peak(m)
        return (peak if peak is not None else m.static, m.static)

    worst = max(report.ranks, key=need)
    peak = report.estimated_peak(worst)
    total = peak if peak is not None else worst.static
    if total <= budget:
        return [f"headroom {(budget - total) / GIB:.2f} GiB on the fullest rank ({worst.rank})"]
    rest = (peak - worst.static) if peak is not None else 0.0
    lines = [
        f"does not fit: rank {worst.rank} needs {total / GIB:.2f} GiB > {report.device_memory_gib:g} GiB "
        f"(static {worst.static / GIB:.2f}: params {worst.params / GIB:.2f} + grads {worst.grads / GIB:.2f} + "
        f"optimizer {worst.optimizer / GIB:.2f}; the rest of the peak (activations, gathered weights, "
        f"temporaries) {rest / GIB:.2f})"
    ]
    parts = [("activations", rest, _activation_knobs(config, pd, rest, budget - worst.static))]
    parts.append(("static state", worst.static, _static_knobs(report, config, pd, budget - rest)))
    parts.sort(key=lambda p: -p[1])
    for i, (name, size, knobs) in enumerate(parts):
        if i > 0 and size < budget / 4:
            break  # a small part: shrinking it cannot close the gap
        lines.append(f"{name} ({size / GIB:.2f} GiB): " + "; or ".join(knobs))
    return lines
