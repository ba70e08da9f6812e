"""Pipeline-parallel layouts in the dry run: the stages, their per-rank memory, the bubble and the p2p traffic.

With ``--parallelism.pipeline_parallel_degree P`` the model is cut as the trainer cuts it (``plan_stages`` over the
model's ``stage_costs``, or ``--parallelism.pipeline_split``); every pipeline rank group (``W / P`` ranks, ``pp`` is
the outermost mesh axis) builds its own stage models (``Decoder.restrict_to_stage``) and parallelizes them with the
run's parallelize path, so parameters, gradients and optimizer state are those of the stage's own parameters
sharded over the stage's data-parallel ranks, exactly (``layout.py``).

The step of each pipeline rank is simulated on its stage models (``simulate_pipeline_rank``: one fake forward and
backward per micro-batch and stage, the optimizer step, under the same trackers as ``step.py``), one micro-batch at
a time. A schedule keeps several micro-batches between their forward and backward (``in_flight``); the peak adds
what one micro-batch leaves allocated after a stage's forward (measured) for every further micro-batch in flight,
and the receive buffers torch's ``PipelineStage`` allocates for every micro-batch of the step (activations in,
gradients back: ``M`` boundary-sized buffers each; the received inputs are those buffers, not extra memory).

Rules (``P`` pipeline ranks, ``M`` micro-batches per step, ``v`` stages per rank, pp rank ``r``):

- micro-batches in flight on rank ``r`` (``in_flight``): GPipe ``M``; 1F1B ``min(M, P - r)`` (warm-up forwards plus
  the one in its steady 1F1B pair); Interleaved1F1B ``min(v M, 2 (P - r - 1) + (v - 1) P + 1)`` model chunks, each
  ``1/v`` of the rank's layers (Megatron-LM's interleaved warm-up, ``schedules.py``); ZBVZeroBubble ``min(M, P)``
  micro-batches of the rank's two chunks (ZB-V keeps 1F1B's peak activation memory: Qi et al., "Zero Bubble
  Pipeline Parallelism", ICLR 2024, section 4); DualPipeV ``min(2 M, 2 P + 1) / 2`` (the DualPipe README's table:
  ``PP + 1`` stage-sized micro-batch activations per device for ``PP = 2 P`` stages on ``P`` devices).
- bubble fraction of the step (``bubble_fraction``): GPipe and 1F1B ``(P - 1) / (M + P - 1)`` (Narayanan et al.,
  "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021, section 2.2.1);
  Interleaved1F1B ``(P - 1) / (v M + P - 1)`` (same paper, section 2.2.2: the bubble shrinks by ``v``); ZBVZeroBubble
  0 (Qi et al.: no bubble once ``M >= P`` when forward, input-gradient and weight-gradient passes take equal time;
  the trainer requires ``M >= P``); DualPipeV 0 (its bubble ``(PP/2 - 1)(F&B + B - 3W)`` of the DualPipe README
  vanishes with equal F, B, W times even when the F&B pairs do not overlap, as here; the trainer requires
  ``M >= 2 P``).
- p2p bytes (``boundary_bytes``): per micro-batch and stage boundary each rank of the sending stage sends its hidden
  states ``[1, T / (cp x tp if sequence parallel), D]`` in the compute dtype, the MTP block's
  input embeddings ``[1, T / cp, D]`` when MTP is on (not split by tp), and ``(2 E + 2) x 4`` bytes of router statistics when the MoE aux loss is on; the
  backward sends the same bytes back.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule

from hyper_parallel.config.dtypes import to_torch_dtype
from hyper_parallel.components.model_builder import ModelBuilder
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.pipeline_parallel import check_microbatches
from hyper_parallel.distributed.pipeline_plan import plan_stages, schedule_rules, stage_ranks, stages_of_rank
from hyper_parallel.dry_run.layout import RankMemory
from hyper_parallel.dry_run.simulation import CommLog, SimulationMode
from hyper_parallel.dry_run.step import materialize_with_optimizer, micro_batch, step_objective, step_runner
from hyper_parallel.dry_run.timeline import FSDPSegmentTracker, SegmentTracker
from hyper_parallel.dry_run.world import MESH_DEVICE
from hyper_parallel.protocols.model import ModelOutput
from hyper_parallel.protocols.model_spec import ModelSpec
from hyper_parallel.protocols.pipeline_stage import StageSpan
from hyper_parallel.trainer import Trainer

__all__ = [
    "PipelinePlan", "PipelineRank", "boundary_bytes", "bubble_fraction", "build_stage_parts",
    "format_pipeline", "in_flight",
    "pipeline_plan", "pp_group", "simulate_pipeline_rank",
]  # fmt: skip


def bubble_fraction(schedule: str, pp: int, micro_batches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a step's time on every pipeline rank (rules in the module docstring)."""
    if pp <= 1:
        return 0.0
    if schedule_rules(schedule).splits_weight_grad:  # ZBVZeroBubble, DualPipeV
        return 0.0
    v = stages_per_rank if schedule == "Interleaved1F1B" else 1
    return (pp - 1) / (v * micro_batches + pp - 1)


def in_flight(schedule: str, pp: int, micro_batches: int, pp_rank: int, stages_per_rank: int = 1) -> float:
    """Micro-batches of pp rank ``pp_rank``'s layers whose activations are held at once (module docstring): the
    Interleaved1F1B count of chunks divided by ``v``, so the result always multiplies a whole micro-batch of the
    rank's layers."""
    m, p, r = micro_batches, pp, pp_rank
    if schedule == "GPipe":
        return float(m)
    if schedule == "Interleaved1F1B":
        v = stages_per_rank
        return min(v * m, 2 * (p - r - 1) + (v - 1) * p + 1) / v
    if schedule == "ZBVZeroBubble":
        return float(min(m, p))
    if schedule == "DualPipeV":
        return min(2 * m, 2 * p + 1) / 2
    if schedule_rules(schedule).stages_per_rank != (1, 1):
        raise ValueError(f"the dry run has no in-flight rule for pipeline schedule {schedule}")
    return float(min(m, p - r))


def boundary_bytes(config: Trainer.Config, pd: ParallelDims, model: nn.Module | None = None) -> int:
    """Bytes one rank sends across one stage boundary for one micro-batch in one direction (module docstring)."""
    tokens = config.data.max_tokens_per_microbatch // pd.cp
    dim = int(config.model.dim)
    itemsize = to_torch_dtype(config.training.mixed_precision_param, field="training.mixed_precision_param").itemsize
    total = tokens // (pd.tp if pd.sp_enabled else 1) * dim * itemsize
    if getattr(config.model, "mtp", None) is not None:  # the MTP block's input embeddings: not split by tp
        total += tokens * dim * itemsize
    experts = _aux_experts(config)
    if experts:
        total += (2 * experts + 2) * 4
    return total


def _aux_experts(config: Trainer.Config) -> int:
    """Routed experts of the first MoE with a load-balancing loss (0: no aux statistics travel)."""
    for layer in getattr(config.model, "layers", None) or ():
        mlp = getattr(layer, "mlp", None)
        if getattr(mlp, "router_aux_loss_coef", 0) and getattr(mlp, "num_experts", 0):
            return int(mlp.num_experts)
    return 0


def pp_group(rank: int, pd: ParallelDims) -> int:
    """The pp coordinate of global ``rank`` (``pp`` is the outermost mesh axis)."""
    return rank // (pd.world_size // pd.pp)


@dataclass(slots=True)
class PipelineRank:
    """One pipeline rank group: its stages, its fullest rank's memory and its simulated step."""

    pp_rank: int
    stages: list[int]
    ranks: range
    """Global ranks of the group."""
    in_flight: float
    worst: RankMemory | None = None
    """The group's rank with the most static memory."""
    step_peak: float | None = None
    """Simulated peak of the worst rank, one micro-batch at a time (bytes)."""
    held_per_micro_batch: float | None = None
    """Bytes one micro-batch leaves allocated after the forward of the group's stages (measured)."""
    comm: dict[tuple[str, str, int], list[float]] = field(default_factory=dict)
    recv_buffers: float = 0.0
    """Bytes of the receive buffers torch's ``PipelineStage`` allocates for the step: one per micro-batch for the
    activations of every stage but the first and one per micro-batch for the gradients of every stage but the last
    (``_setup_forward_recv_info`` / ``_setup_backward_recv_info``), each of the boundary's size."""
    received: float = 0.0
    """Bytes of one micro-batch's inputs received by the group's stages (the simulated step's fresh input tensors,
    which in the runtime are the receive buffers already counted)."""

    @property
    def peak(self) -> float | None:
        """The simulated peak, its received inputs replaced by the step's receive buffers, plus the activations of
        the further micro-batches in flight (without their inputs: those are the buffers)."""
        if self.step_peak is None:
            return None
        held = max(0.0, (self.held_per_micro_batch or 0.0) - self.received)
        return self.step_peak - self.received + self.recv_buffers + max(0.0, self.in_flight - 1.0) * held


@dataclass(slots=True)
class PipelinePlan:
    """The pipeline layout: stages, schedule and p2p volume; ``ranks`` one entry per pp rank."""

    schedule: str
    pp: int
    stages_per_rank: int
    micro_batches: int
    spans: list[StageSpan]
    stage_rank: list[int]
    """The pp rank of every stage."""
    bubble: float
    boundary_bytes: int
    """Per rank, micro-batch, boundary and direction."""
    ranks_per_stage: int
    ranks: list[PipelineRank] = field(default_factory=list)
    method: str = "static only"

    @property
    def boundaries(self) -> int:
        """Stage boundaries between different pp ranks (ZB-V's turn at the last rank stays on it)."""
        return sum(self.stage_rank[s] != self.stage_rank[s + 1] for s in range(len(self.spans) - 1))

    def boundary_step_bytes(self) -> float:
        """Bytes crossing one stage boundary per step, both directions, all ranks of the stage."""
        return 2.0 * self.micro_batches * self.boundary_bytes * self.ranks_per_stage

    def rank_sent_bytes(self, pp_rank: int) -> float:
        """Bytes one rank of pp rank ``pp_rank`` sends per step: forward out of each of its stages to the next, backward
        to the previous, where that stage is on another pp rank."""
        n, where = len(self.spans), self.stage_rank
        sends = sum((s + 1 < n and where[s + 1] != pp_rank) + (s > 0 and where[s - 1] != pp_rank)
                    for s in self.ranks[pp_rank].stages)  # fmt: skip
        return float(sends * self.micro_batches * self.boundary_bytes)

    def group_of(self, rank: int) -> PipelineRank:
        return next(g for g in self.ranks if rank in g.ranks)


def pipeline_plan(config: Trainer.Config, pd: ParallelDims, micro_batches: int) -> PipelinePlan:
    """The stages (as the trainer plans them, on a meta model) and the schedule's numbers; raises the trainer's
    ``ConfigError`` when the step has too few micro-batches for the schedule."""
    check_microbatches(pd, config.parallelism.pipeline_schedule, micro_batches,
                       tokens_per_microbatch=config.data.max_tokens_per_microbatch)  # the trainer's own check
    with torch.device("meta"):
        whole = config.model.build()
    spans = plan_stages(
        whole.stage_costs(config.data.max_tokens_per_microbatch), pd.num_stages, config.parallelism.pipeline_split
    )
    schedule = config.parallelism.pipeline_schedule
    plan = PipelinePlan(
        schedule=schedule, pp=pd.pp, stages_per_rank=pd.pp_stages_per_rank, micro_batches=micro_batches, spans=spans,
        stage_rank=stage_ranks(pd.num_stages, pd.pp, schedule),
        bubble=bubble_fraction(schedule, pd.pp, micro_batches, pd.pp_stages_per_rank),
        boundary_bytes=boundary_bytes(config, pd), ranks_per_stage=pd.world_size // pd.pp,
    )  # fmt: skip
    size = pd.world_size // pd.pp
    last = pd.num_stages - 1
    for r in range(pd.pp):
        stages = stages_of_rank(r, pd.num_stages, pd.pp, schedule)
        receiving = sum(s != 0 for s in stages)
        buffers = micro_batches * plan.boundary_bytes * (receiving + sum(s != last for s in stages))
        plan.ranks.append(PipelineRank(
            pp_rank=r, stages=stages, ranks=range(r * size, (r + 1) * size),
            in_flight=in_flight(schedule, pd.pp, micro_batches, r, pd.pp_stages_per_rank),
            recv_buffers=float(buffers), received=float(receiving * plan.boundary_bytes),
        ))  # fmt: skip
    return plan


def build_stage_parts(
    spec: ModelSpec, config: Trainer.Config, pd: ParallelDims, plan: PipelinePlan, pp_rank: int
) -> list[nn.Module]:
    """Pipeline rank ``pp_rank``'s stage models on the meta device, cut, frozen (LoRA) and parallelized by the
    trainer's ``ModelBuilder`` (the fake world must be set up as a rank of that group: the builder cuts the stages
    of the rank's pp coordinate)."""
    built = ModelBuilder(spec, config, pd).build(compile=False)
    if built.pipeline is None or built.pipeline.stage_ids != plan.ranks[pp_rank].stages:
        raise RuntimeError(f"the fake world's rank is not one of pp rank {pp_rank}'s group")
    return built.parts


def _stage_input(span: StageSpan, config: Trainer.Config, pd: ParallelDims, mb: dict) -> tuple:
    """What the stage receives: the token ids on stage 0, else fake hidden states ``[1, T_local, D]`` in the compute
    dtype, then the carry in ``forward_stage``'s order: router statistics, MTP embeddings."""
    if span.is_first:
        return (mb["input_ids"],)
    tokens = mb["input_ids"].shape[1]
    dtype = to_torch_dtype(config.training.mixed_precision_param, field="training.mixed_precision_param")
    dim = int(config.model.dim)
    x = [torch.zeros(1, tokens // (pd.tp if pd.sp_enabled else 1), dim, dtype=dtype, requires_grad=True)]
    experts = _aux_experts(config)
    if experts:
        x.append(torch.zeros(2 * experts + 2, dtype=torch.float32, requires_grad=True))
    if getattr(config.model, "mtp", None) is not None and "mtp_input_ids" in mb.get("model_inputs", {}):
        x.append(torch.zeros(1, tokens, dim, dtype=dtype, requires_grad=True))
    return tuple(x)


def _stage_gradient_policy(part: nn.Module, *, last: bool) -> None:
    """What torch's ``PipelineStage`` does to an FSDP stage: every backward but the step's last keeps the parameters
    unsharded and accumulates unsharded gradients (``backward_maybe_with_nosync``); the last reduces and reshards
    (``perform_reduce_grad``). So from its first forward to the step's end a stage holds its whole unsharded
    parameters (and, between backwards, gradients), once, not per micro-batch."""
    for module in part.modules():
        if isinstance(module, FSDPModule):
            module.set_is_last_backward(last)
            module.set_reshard_after_backward(last, recurse=False)
            module.set_requires_gradient_sync(last, recurse=False)


def _current(tracker: Any) -> float:
    """Bytes the tracker sees now, less the unsharded parameters (a once-per-step cost under pipeline parallel)."""
    total = 0.0
    for dev in tracker.get_tracker_snapshot().values():
        total += dev.get("Total", 0)
        total -= sum(v for k, v in dev.items() if str(getattr(k, "value", k)) == "Unsharded Param")
    return float(total)


def simulate_pipeline_rank(
    spec: ModelSpec, config: Trainer.Config, pd: ParallelDims, plan: PipelinePlan, pp_rank: int,
    document_tokens: int = 0,
) -> None:
    """Simulate one step of pp rank ``pp_rank``'s stages (the fake world must be set up as the group's worst rank);
    fills the group's ``step_peak``, ``held_per_micro_batch`` and ``comm``.

    Each micro-batch runs every stage of the rank forward then backward (a later stage's input is a fresh fake tensor
    of the boundary's shape; a stage that is not the last gets ones as the gradient of its outputs); the FSDP policy
    is the pipeline schedule's (``_stage_gradient_policy``). Collectives of the first micro-batch stand for the
    ``M - 1`` before the last, as in ``step.py``.
    """
    group = plan.ranks[pp_rank]
    parts = build_stage_parts(spec, config, pd, plan, pp_rank)
    spans = [plan.spans[s] for s in group.stages]
    n_total = plan.micro_batches
    n_sim = min(n_total, 2)
    log = CommLog()
    with FakeTensorMode(allow_non_fake_inputs=True), SimulationMode(log), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        warnings.filterwarnings("ignore", message="DTensor random operators")
        container = _materialize(parts, config, materialize_with_optimizer)
        log.records = []
        if len(parts) == 1 and isinstance(parts[0], FSDPModule) and len(container) == 1:
            tracker: Any = FSDPSegmentTracker(parts[0], container.optimizers[0])
        else:
            tracker = SegmentTracker()
            tracker.track_external(*parts, *container.optimizers)
        held = 0.0
        with tracker:
            mb = micro_batch(config, pd, parts[0], document_tokens)
            runner = step_runner(spec, config, pd, parts)
            kwargs = runner.model_kwargs(mb)
            objective = step_objective(runner, mb, pd, n_total)  # the trainer's, on the last stage
            container.zero_grad()
            for i in range(n_sim):
                last = i == n_sim - 1
                log.phase = "last" if last else "first"
                tracker.micro_batch = i
                held = 0.0
                for part, span in zip(parts, spans, strict=True):
                    _stage_gradient_policy(part, last=last)
                    with runner.loss_parallel() if span.is_last else contextlib.nullcontext():
                        before = _current(tracker)
                        out = part(*_stage_input(span, config, pd, mb), **kwargs)
                        held += _current(tracker) - before
                        if span.is_last:
                            if isinstance(out, tuple):  # a stage returns tensors only (as_stage_output)
                                out = ModelOutput.from_stage_output(out)
                            loss = objective(out, mb)
                            del out
                            loss.backward()
                        else:
                            outs = [t for t in out if torch.is_tensor(t) and t.requires_grad]
                            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
                            del out, outs
                tracker.reset_mod_stats()
            log.phase = "last"
            container.step()
            container.zero_grad()
        peak = tracker.get_tracker_snapshot("peak")
    group.step_peak = float(sum(dev.get("Total", 0) for dev in peak.values()))
    group.held_per_micro_batch = max(0.0, held)
    comm: dict[tuple[str, str, int], list[float]] = {}
    for rec in log.records:
        weight = float(n_total - 1) if rec.phase == "first" else 1.0
        entry = comm.setdefault((rec.kind, rec.group, rec.group_size), [0.0, 0.0])
        entry[0] += weight
        entry[1] += weight * rec.nbytes
    group.comm = comm


def _materialize(parts: list[nn.Module], config: Trainer.Config, one: Any) -> Any:
    """The optimizer over every part, stepped once on zero gradients (steady-state state exists)."""
    if len(parts) == 1:
        return one(parts[0], config)
    for part in parts:
        part.to_empty(device=MESH_DEVICE)
        part.train()
    container = config.optimizer.build(model_parts=parts)
    for part in parts:
        for p in part.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    container.step()
    container.zero_grad()
    return container


def format_pipeline(plan: PipelinePlan, unit: tuple[str, float], budget: float) -> list[str]:
    """The per-stage table, the bubble and the p2p volume."""
    name, size = unit
    v = f", {plan.stages_per_rank} stages per rank" if plan.stages_per_rank > 1 else ""
    lines = [
        f"pipeline: {plan.schedule}, {plan.pp} pp ranks{v}, {len(plan.spans)} stages of {plan.ranks_per_stage} ranks; "
        f"{plan.micro_batches} micro-batches per step; bubble {plan.bubble:.1%} of the step "
        f"({_bubble_rule(plan)}); per-rank peaks: {plan.method}",
        f"  {'pp rank':<8}{'stages':<10}{'layers':<22}{'ranks':<10}{'in flight':>10}{'static':>10}{'step peak':>11}"
        f"{'buffers':>10}{'peak':>10}  fits ({name})",
    ]
    for g in plan.ranks:
        layers = ", ".join(f"{plan.spans[s].layers.start}-{plan.spans[s].layers.stop - 1}"
                           + ("+in" if plan.spans[s].is_first else "") + ("+out" if plan.spans[s].is_last else "")
                           for s in g.stages)  # fmt: skip
        stages = ",".join(map(str, g.stages))
        static = g.worst.static if g.worst is not None else 0.0
        peak = g.peak
        total = peak if peak is not None else static
        step = f"{g.step_peak / size:.2f}" if g.step_peak is not None else "-"
        peak_s = f"{peak / size:.2f}" if peak is not None else "-"
        lines.append(
            f"  {g.pp_rank:<8}{stages:<10}{layers:<22}{f'{g.ranks.start}-{g.ranks.stop - 1}':<10}{g.in_flight:>10.2f}"
            f"{static / size:>10.2f}{step:>11}{g.recv_buffers / size:>10.2f}{peak_s:>10}  "
            f"{'yes' if total <= budget else 'NO'}"
        )
    lines.append(
        "  in: input side (embedding), out: output side (norm, head, MTP); peak = step peak + receive buffers "
        "(torch's PipelineStage: one per micro-batch in and one back, boundary-sized) + (in flight - 1) x what one "
        "micro-batch leaves allocated after the forward (measured, its received input excepted)"
    )
    lines.append(
        f"  p2p: {_bytes(plan.boundary_bytes)} per rank, micro-batch, boundary and direction; per step "
        f"{_bytes(plan.boundary_step_bytes())} across each of the {plan.boundaries} boundaries (both directions, "
        f"{plan.ranks_per_stage} ranks); sent per rank per step: "
        + ", ".join(f"pp rank {g.pp_rank} {_bytes(plan.rank_sent_bytes(g.pp_rank))}" for g in plan.ranks)
    )
    return lines


def _bytes(n: float) -> str:
    for name, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {name}"
    return f"{n:.0f} B"


def _bubble_rule(plan: PipelinePlan) -> str:
    p, m, v = plan.pp, plan.micro_batches, plan.stages_per_rank
    if plan.schedule == "ZBVZeroBubble":
        return "ZB-V: none with M >= P and equal F/B/W times"
    if plan.schedule == "DualPipeV":
        return "DualPipeV: (P-1)(F&B+B-3W), none with M >= 2P and equal F/B/W times"
    if plan.schedule == "Interleaved1F1B":
        return f"(P-1)/(vM+P-1) = {p - 1}/({v}x{m}+{p - 1})"
    return f"(P-1)/(M+P-1) = {p - 1}/({m}+{p - 1})"
