"""One simulated training step of one rank: peak memory (``FSDPMemTracker``) and collectives (``CommLog``).

The step is the trainer's (``components/step.py``: ``StepRunner`` and ``StepObjective``, nothing copied) on a
text-only micro-batch of ``data.max_tokens_per_microbatch``
tokens (one packed document; this rank's context-parallel chunk; with MTP on, image positions where the model
takes images, ``mtp_batch.py``): gradient-sync policy per micro-batch,
loss-parallel context, backward, optimizer step. Everything runs under ``FakeTensorMode`` on the fake
process group (see ``simulation.py``), so a 30B model costs no memory, only dispatch time.

Deep models are slow to dispatch even without data, so ``simulate_step`` may run two shallower
copies of the model instead (``layer_plan``): the prefixes ``s + 2p`` and ``s + 3p`` layers, where
``p`` is the period of the layer stack after a head of ``s`` distinct layers (GlmImageMoe: one dense
layer, then identical MoE layers: 3 and 4 layers). Memory and communication are linear in the number
of periods (every layer keeps its activations and shards; per-layer collectives repeat), so the
full depth is ``value(s+2p) + (L - s - 2p) / p * (value(s+3p) - value(s+2p))``: for the collectives
directly, for the peak per segment of the step (``timeline.py``: the moment of the peak moves with depth).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule

from hyper_parallel.components.step import StepCounts, StepObjective, StepRunner
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.dry_run.deltanet import document_bounds
from hyper_parallel.dry_run.layout import OptimizerStateLayout, optimizer_state_layout
from hyper_parallel.dry_run.mtp_batch import mtp_micro_batch
from hyper_parallel.dry_run.simulation import CommLog, SimulationMode
from hyper_parallel.dry_run.timeline import (
    FSDPSegmentTracker,
    SegmentKey,
    SegmentPeak,
    SegmentTracker,
    extrapolate_segments,
)
from hyper_parallel.dry_run.world import MESH_DEVICE, build_parallel_model
from hyper_parallel.protocols.model_spec import ModelSpec, discover_model_spec
from hyper_parallel.trainer import Trainer

__all__ = [
    "LayerPlan", "StepMeasurement", "layer_plan", "materialize_with_optimizer", "micro_batch", "micro_batches_per_step",
    "builds_at_depth", "model_config_at_depth", "simulate_step", "step_objective", "step_runner",
]

_LAYER_FQN = re.compile(r"^layers\.(\d+)\.(.*)$")

FULL_DEPTH_MAX_LAYERS = 8
"""Models with at most this many layers are always simulated at full depth."""


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """Depths to simulate; ``depths == (L,)`` means the full model."""

    num_layers: int
    depths: tuple[int, ...]
    period: int = 1
    head: int = 0
    """Layers before the repeated ones (each simulated copy holds them, then at least two periods)."""

    @property
    def scaled(self) -> bool:
        return len(self.depths) == 2

    def representative(self, fqn: str) -> str:
        """The FQN in the shallower simulated copy whose layer config equals the one of ``fqn``'s layer."""
        match = _LAYER_FQN.match(fqn)
        if not self.scaled or match is None or int(match.group(1)) < self.depths[0]:
            return fqn
        return f"layers.{self.head + (int(match.group(1)) - self.head) % self.period}.{match.group(2)}"

    def extrapolate(self, low: float, high: float) -> float:
        """The value at full depth from the values at the two simulated depths (linear in periods)."""
        k1, k2 = self.depths
        return low + (high - low) * (self.num_layers - k1) / (k2 - k1)


def layer_plan(
    layers: Sequence[Any], *, full: bool = False, buildable: Callable[[int], bool] | None = None
) -> LayerPlan:
    """Full depth for shallow models (or ``full``), else two shallow depths one period apart.

    The depths are the shortest prefixes ``head + m*p`` and ``head + (m+1)*p`` (``m >= 2``: the shallower copy has
    a first and a last period whose neighbours are repeated layers, see ``timeline.extrapolate_segments``) that
    ``buildable`` accepts: a model may need a minimum depth (Qwen3-VL adds visual features to its first few layers).
    """
    n = len(layers)
    if full or n <= FULL_DEPTH_MAX_LAYERS:
        return LayerPlan(n, (n,))
    best: tuple[int, int] | None = None
    for period in range(1, n // 2 + 1):
        for head in range(0, n - 2 * period + 1):
            if all(layers[i] == layers[i + period] for i in range(head, n - period)):
                if best is None or head + 2 * period < best[0] + 2 * best[1]:
                    best = (head, period)
                break
    if best is None:
        return LayerPlan(n, (n,))
    head, period = best
    low = head + 2 * period
    while low + period < n:
        if buildable is None or (buildable(low) and buildable(low + period)):
            return LayerPlan(n, (low, low + period), period, head)
        low += period
    return LayerPlan(n, (n,))


@dataclass(slots=True)
class StepMeasurement:
    """What one simulated step of one rank used."""

    peak: dict[str, float] = field(default_factory=dict)
    """Bytes by ``FSDPMemTracker`` category at the peak, plus ``Total``."""
    comm: dict[tuple[str, str, int], list[float]] = field(default_factory=dict)
    """(kind, group name, group size) -> [calls, bytes] per optimizer step."""
    optimizer_layout: dict[str, OptimizerStateLayout] = field(default_factory=dict)
    """State layout per parameter FQN (from the simulated model)."""
    fsdp_tracker: bool = True
    """The peak comes from ``FSDPMemTracker``, which tracks FSDP-managed parameters only."""
    segments: dict[SegmentKey, SegmentPeak] = field(default_factory=dict)
    """Peak per segment of the step (``timeline.py``), for scaling a shallow copy to full depth."""

    def combine(self, other: StepMeasurement, plan: LayerPlan) -> StepMeasurement:
        """Full depth from this measurement (``plan.depths[0]`` layers) and ``other`` (``plan.depths[1]``)."""
        comm = {}
        for k in set(self.comm) | set(other.comm):
            a, b = self.comm.get(k, [0.0, 0.0]), other.comm.get(k, [0.0, 0.0])
            comm[k] = [plan.extrapolate(a[0], b[0]), plan.extrapolate(a[1], b[1])]
        peak = extrapolate_segments(
            self.segments, other.segments, head=plan.head, period=plan.period, depths=plan.depths,
            num_layers=plan.num_layers,
        )  # fmt: skip
        return StepMeasurement(
            peak={**peak.categories, "Total": peak.total}, comm=comm,
            fsdp_tracker=self.fsdp_tracker and other.fsdp_tracker,
        )  # fmt: skip


def micro_batches_per_step(config: Trainer.Config, parallel_dims: ParallelDims) -> int:
    """``data.global_batch_tokens / (dp x max_tokens_per_microbatch)``; 0 means one micro-batch per rank."""
    data = config.data
    per_step = parallel_dims.dp * data.max_tokens_per_microbatch
    total = getattr(data, "global_batch_tokens", 0) or per_step
    return max(1, total // per_step)


def materialize_with_optimizer(model: nn.Module, config: Trainer.Config) -> Any:
    """Fake-materialize ``model``, build the run's optimizer and step it once on zero gradients.

    Must run under ``FakeTensorMode`` + ``SimulationMode``. The step creates the optimizer state, so
    its layout can be read and a tracked step starts from steady state (as every step after the first).
    """
    model.to_empty(device=MESH_DEVICE)
    model.train()
    optimizers = config.optimizer.build(model_parts=[model])
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizers.step()
    optimizers.zero_grad()
    return optimizers


def micro_batch(config: Trainer.Config, pd: ParallelDims, model: nn.Module, document_tokens: int = 0) -> dict[str, Any]:
    """This rank's part of one micro-batch of ``max_tokens_per_microbatch`` tokens, text only: one document, or packed
    ``document_tokens``-token documents (the last one shorter; ``deltanet.py``: what the torch DeltaNet path pads);
    with an MTP block one document with its targets and inputs, with image positions where the model takes images
    (``mtp_batch``)."""
    seqlen = config.data.max_tokens_per_microbatch
    if getattr(config.model, "mtp", None) is not None:  # the MTP block: its forward, head and loss count
        facts = discover_model_spec(config.model_spec).data_facts(config.model)
        return mtp_micro_batch(seqlen, pd, model, facts, ignore_index=config.loss.ignore_index)
    local = seqlen // pd.cp
    lo = pd.mesh_coordinate("cp") * local
    bounds = document_bounds(seqlen, document_tokens)
    positions = torch.cat([torch.arange(b - a, dtype=torch.int64) for a, b in zip(bounds[:-1], bounds[1:])])
    return {
        "input_ids": torch.zeros(1, local, dtype=torch.int64),
        "labels": torch.zeros(1, local, dtype=torch.int64),
        "position_ids": positions[lo : lo + local].unsqueeze(0),
        # boundaries stay global under context parallel (attention sees whole sequences)
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
        "max_seqlen": max(b - a for a, b in zip(bounds[:-1], bounds[1:])),
    }


def step_runner(spec: ModelSpec, config: Trainer.Config, pd: ParallelDims, parts: list[nn.Module]) -> StepRunner:
    """The trainer's step mechanics (``components/step.py``) over the simulated ``parts``; without a pipeline
    schedule (``pipeline.py`` steps the stages itself)."""
    return StepRunner(
        parts, model_cls=spec.model, parallel_dims=pd, device=torch.device(MESH_DEVICE), loss_fn=config.loss.build(),
        mtp=getattr(config.model, "mtp", None), defer_grad_reduce=config.training.defer_grad_reduce,
    )  # fmt: skip


def step_objective(runner: StepRunner, mb: dict[str, Any], pd: ParallelDims, n_total: int) -> StepObjective:
    """The trainer's objective of a step of ``n_total`` micro-batches like ``mb`` on every token rank; the counts are
    the simulated step's (every position labelled), not all-reduced: the report leaves the scalar all-reduces out."""
    tokens = float(mb["labels"].numel() * pd.dp * pd.cp * n_total)
    return StepObjective(runner, StepCounts(tokens, tokens, tokens, micro_batches=n_total))


def _run_step(
    spec: ModelSpec, model: nn.Module, optimizers: Any, config: Trainer.Config, pd: ParallelDims, log: CommLog,
    n_micro: int, after_backward: Callable[[], None] = lambda: None,
    before_micro_batch: Callable[[int], None] = lambda i: None,
    document_tokens: int = 0,
) -> None:
    """``n_micro`` micro-batches of the trainer's step (``StepRunner.backward``: gradient-sync policy, loss parallel,
    forward, objective, backward), then the optimizer step."""
    runner = step_runner(spec, config, pd, [model])
    mb = micro_batch(config, pd, model, document_tokens)
    objective = step_objective(runner, mb, pd, micro_batches_per_step(config, pd))
    optimizers.zero_grad()
    for i in range(n_micro):
        last = i == n_micro - 1
        log.phase = "last" if last else "first"
        before_micro_batch(i)
        runner.backward(mb, objective, last=last)
        after_backward()
    log.phase = "last"
    optimizers.step()
    optimizers.zero_grad()


def _has_multi_module_units(model: nn.Module) -> bool:
    """Whether some FSDP unit spans several modules (``fully_shard([m1, m2])``)."""
    states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
    return len(states) != len({id(s) for s in states})


def _measure(
    spec: ModelSpec, config: Trainer.Config, pd: ParallelDims, model_config: Any, n_total: int, document_tokens: int = 0
) -> StepMeasurement:
    """Simulate a steady-state step of ``model_config`` under the memory tracker; collectives are scaled to
    ``n_total`` micro-batches.

    ``FSDPMemTracker`` re-registers FSDP's forward hooks per module, which splits a multi-module FSDP unit
    (``fully_shard([m1, m2])``) into one all-gather per module; models with such units log their collectives
    in an untracked step first (which also creates the optimizer state), the others in the tracked step.
    """
    model = build_parallel_model(spec, config, pd, model_config)
    log = CommLog()
    n_sim = min(n_total, 2)  # the first micro-batch stands for every one before the last
    with FakeTensorMode(allow_non_fake_inputs=True), SimulationMode(log), warnings.catch_warnings():
        # can_use_grouped_mm reads data_ptr() (0 for a fake tensor, which is "aligned")
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        warnings.filterwarnings("ignore", message="DTensor random operators")
        untracked_comm = _has_multi_module_units(model)
        if untracked_comm:
            model.to_empty(device=MESH_DEVICE)
            model.train()
            optimizers = config.optimizer.build(model_parts=[model])
            _run_step(spec, model, optimizers, config, pd, log, n_sim, document_tokens=document_tokens)
        else:
            optimizers = materialize_with_optimizer(model, config)
        layout = optimizer_state_layout(model, optimizers)
        records, log.records = log.records, []
        fsdp_tracker = isinstance(model, FSDPModule) and len(optimizers) == 1
        if fsdp_tracker:
            tracker: FSDPSegmentTracker | SegmentTracker = FSDPSegmentTracker(model, optimizers.optimizers[0])
        else:
            tracker = SegmentTracker()
            tracker.track_external(model, *optimizers.optimizers)

        def before_micro_batch(i: int) -> None:
            tracker.micro_batch = i

        with tracker:
            # the tracker keeps its peak across micro-batches, but refuses a second root forward without a reset
            _run_step(
                spec, model, optimizers, config, pd, log, n_sim, after_backward=tracker.reset_mod_stats,
                before_micro_batch=before_micro_batch, document_tokens=document_tokens,
            )  # fmt: skip
        snapshot = tracker.get_tracker_snapshot("peak")
    if not untracked_comm:
        records = log.records
    peak = {str(getattr(k, "value", k)): float(v) for dev in snapshot.values() for k, v in dev.items()}
    comm: dict[tuple[str, str, int], list[float]] = {}
    for rec in records:
        weight = float(n_total - 1) if rec.phase == "first" else 1.0
        entry = comm.setdefault((rec.kind, rec.group, rec.group_size), [0.0, 0.0])
        entry[0] += weight
        entry[1] += weight * rec.nbytes
    return StepMeasurement(
        peak=peak, comm=comm, optimizer_layout=layout, fsdp_tracker=fsdp_tracker, segments=tracker.segments
    )


def model_config_at_depth(config: Trainer.Config, depth: int) -> Any:
    """The run's model config with its first ``depth`` layers (the full config at full depth)."""
    layers = list(getattr(config.model, "layers", None) or [])
    return config.model if depth == len(layers) else dataclasses.replace(config.model, layers=layers[:depth])


def builds_at_depth(config: Trainer.Config) -> Callable[[int], bool]:
    """``depth -> whether the model builds (on meta) with its first ``depth`` layers``, for ``layer_plan``."""

    def probe(depth: int) -> bool:
        try:
            with torch.device("meta"):
                model_config_at_depth(config, depth).build()
        except ValueError:  # the model's own check of its config (ConfigError is a ValueError too)
            return False
        return True

    return probe


def simulate_step(
    spec: ModelSpec, config: Trainer.Config, pd: ParallelDims, plan: LayerPlan, *, document_tokens: int = 0
) -> StepMeasurement:
    """Peak memory and collectives of one optimizer step of this rank (the fake world must be set up); micro-batches
    of ``document_tokens``-token documents (0: one document each)."""
    n_total = micro_batches_per_step(config, pd)
    low, *high = (_measure(spec, config, pd, model_config_at_depth(config, k), n_total, document_tokens)
                  for k in plan.depths)  # fmt: skip
    return low.combine(high[0], plan) if high else low
