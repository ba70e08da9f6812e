"""Pipeline parallel on torch.distributed.pipelining: this rank's stages, their schedule, one step.

``PipelineParallel`` plans the stages (``pipeline_plan.plan_stages`` over the model's cost facts), builds this
rank's stage models (the model class itself, restricted: ``Decoder.restrict_to_stage``, FQNs unchanged) and,
once the caller has parallelized and materialised them, wraps each in a ``PipelineStage`` on the ``pp`` group
and builds the schedule (``Schedule1F1B``, ``ScheduleGPipe``, ``ScheduleInterleaved1F1B``,
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``: ``pipeline_plan.SCHEDULES``). DualPipeV's overlapped
forward-backward pairs run one after the other (torch's default without an overlap callback). FSDP, TP, EP and
CP live inside each stage model, unchanged: the stage's root is an FSDP module, so the schedule holds its
gradient reduction back to the step's last backward.

A step's micro-batches are the data loader's (each with its own documents, ``cu_seqlens``, images), so the
schedule is driven with them as they are (``_step_microbatches``: ``step()`` would cut one batch into equal
chunks along dim 0, which packed micro-batches are not). Every micro-batch has the same shape (the data is
padded to ``max_tokens_per_microbatch`` under pipeline parallel), so the receive buffers the schedule shapes
on the first step fit every later one. The loss function runs on the last stage; it returns the micro-batch's
share of the step's objective (token sums over the GLOBAL token count), so the schedule does not rescale
gradients (``scale_grads=False``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from hyper_parallel.config.errors import ConfigError
from hyper_parallel.config.parallelism import ParallelismConfig
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.pipeline_plan import (
    min_microbatches,
    plan_stages,
    schedule_rules,
    stage_ranks,
    stages_of_rank,
)
from hyper_parallel.protocols.pipeline_stage import StageSpan

__all__ = ["PipelineParallel", "check_microbatches"]

_P = "--parallelism."


def check_microbatches(
    parallel_dims: ParallelDims, schedule: str, n: int, *, tokens_per_microbatch: int | None
) -> None:
    """The schedule's micro-batches per step (``pipeline_plan.SCHEDULES``): at least ``pp`` (GPipe: 1; DualPipeV:
    one per stage), Interleaved1F1B a multiple of ``pp``. ``ConfigError`` names the ``--data.global_batch_tokens``
    that fits (given ``tokens_per_microbatch``)."""
    pd = parallel_dims
    multiple = schedule_rules(schedule).multiple_of_pp
    need = min_microbatches(schedule, pd.pp, pd.pp_stages_per_rank)
    if n >= need and not (multiple and n % pd.pp):
        return
    rule = f"a multiple of {pd.pp}" if multiple else f">= {need}"
    fit = -(-max(n, need) // need) * need
    hint = f" to {fit * pd.dp * tokens_per_microbatch}" if tokens_per_microbatch else ""
    raise ConfigError(
        f"pipeline schedule {schedule} over {pd.pp} ranks needs {rule} micro-batches per step, but the step has {n} "
        f"(data.global_batch_tokens / (data-parallel degree {pd.dp} x data.max_tokens_per_microbatch)): raise "
        f"--data.global_batch_tokens{hint}"
    )


class PipelineParallel:
    """This rank's pipeline stages and their schedule.

    Usage: ``pp = PipelineParallel(model_config, parallel_dims, parallelism, seq_len=)``; parallelize and
    materialise each of ``pp.parts`` (meta stage models); ``pp.attach(parts, ...)``; then
    ``pp.step(args, kwargs, targets)`` per training step.
    """

    def __init__(
        self, model_config: Any, parallel_dims: ParallelDims, parallelism: ParallelismConfig, *, seq_len: int
    ) -> None:
        pd = parallel_dims
        self.parallel_dims = pd
        self.schedule_name = parallelism.pipeline_schedule
        with torch.device("meta"):
            whole = model_config.build()
        for hook in ("restrict_to_stage", "stage_costs"):
            if not callable(getattr(whole, hook, None)):
                raise ConfigError(
                    f"{type(whole).__name__} has no pipeline stages ({hook}): set {_P}pipeline_parallel_degree 1"
                )
        self.spans: list[StageSpan] = plan_stages(whole.stage_costs(seq_len), pd.num_stages, parallelism.pipeline_split)
        """Every stage of the model (index, layers)."""
        self.pp_rank = pd.mesh_coordinate("pp")
        self.stage_ids = stages_of_rank(self.pp_rank, pd.num_stages, pd.pp, self.schedule_name)
        """The stages this rank runs, in increasing order."""
        del whole
        self.parts: list[nn.Module] = []
        """This rank's stage models (meta until the caller materialises them), one per ``stage_ids`` entry."""
        for s in self.stage_ids:
            with torch.device("meta"):
                part = model_config.build()
            part.restrict_to_stage(self.spans[s])
            self.parts.append(part)
        self.stages: list[PipelineStage] = []
        self.schedule: Any = None
        self._eval: tuple[list[PipelineStage], Any] | None = None  # forward-only stages and schedule (validation)

    @property
    def has_first(self) -> bool:
        """Whether this rank runs stage 0 (it takes the token ids)."""
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        """Whether this rank runs the last stage (it computes the loss)."""
        return len(self.spans) - 1 in self.stage_ids

    def describe(self) -> str:
        """One line per stage: its layers and rank (for the run log)."""
        ranks = stage_ranks(len(self.spans), self.parallel_dims.pp, self.schedule_name)
        parts = [f"stage {s.index} (pp rank {ranks[s.index]}): layers {s.layers.start}-{s.layers.stop - 1}" for s in self.spans]
        return f"pipeline {self.schedule_name}, {len(self.spans)} stages: " + "; ".join(parts)

    def attach(
        self,
        parts: Sequence[nn.Module],
        *,
        device: torch.device,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        n_microbatches: int,
        compute_dtype: torch.dtype,
        mtp: bool,
    ) -> None:
        """Take the parallelized, materialised ``parts``; the ``PipelineStage``s on the pp group and the schedule
        over ``n_microbatches`` micro-batches per step follow at the first step (their shapes come from its
        micro-batches). ``compute_dtype``: the activations' dtype; ``mtp``: the MTP embeddings travel too."""
        check_microbatches(self.parallel_dims, self.schedule_name, n_microbatches, tokens_per_microbatch=None)
        self.parts = list(parts)
        self._device, self._loss_fn, self._n_microbatches = device, loss_fn, n_microbatches
        self._compute_dtype, self._mtp = compute_dtype, mtp

    def _build_schedule(self, tokens_BT: tuple[int, int], *, train: bool) -> tuple[list[PipelineStage], Any]:
        """The stages with static shapes (no trial forward: the shapes follow from the model's facts) and the
        schedule. ``tokens_BT``: the token ids one rank's micro-batch holds. Training and evaluation get stages of
        their own: a stage's receive buffers are made once, with gradients or without."""
        pd = self.parallel_dims
        group = pd.mesh("pp").get_group()
        shards = pd.tp if pd.sp_enabled else 1
        first = self.parts[0]
        boundary = first.stage_boundary_meta(tokens_BT, dtype=self._compute_dtype, sequence_shards=shards, mtp=self._mtp)
        if train:
            boundary = tuple(t.requires_grad_() for t in boundary)  # static shapes: the gradients come back too
        ids = torch.empty(tokens_BT, dtype=torch.int64, device="meta")
        last_out = tuple(torch.empty(0, device="meta") for _ in range(3))  # the loss takes them; never sent
        stages = [
            PipelineStage(
                part, stage_index=s, num_stages=len(self.spans), device=self._device, group=group,
                input_args=(ids,) if s == 0 else boundary,
                output_args=last_out if s == len(self.spans) - 1 else boundary,
            )  # fmt: skip
            for s, part in zip(self.stage_ids, self.parts, strict=True)
        ]
        rules = schedule_rules(self.schedule_name)
        cls = getattr(torch_schedules, rules.torch_class)
        one = rules.stages_per_rank == (1, 1)  # a single-stage schedule takes the stage, the others a list
        schedule = cls(
            stages[0] if one else stages, n_microbatches=self._n_microbatches, loss_fn=self._loss_fn,
            scale_grads=False,
        )  # fmt: skip
        self._tokens_BT = tokens_BT
        return stages, schedule

    def step(self, args: list[tuple], kwargs: list[dict[str, Any]], targets: list[Any] | None, *, train: bool = True) -> None:
        """Run the schedule over one step's micro-batches: ``args`` feed stage 0 (ignored elsewhere), ``kwargs``
        every stage, ``targets`` the loss function on the last stage. ``train=False`` runs forwards only (call
        under ``torch.no_grad()``), through stages of its own."""
        tokens_BT = tuple(args[0][0].shape) if self.has_first else tuple(kwargs[0]["position_ids"].shape[-2:])
        if train and self.schedule is None:
            self.stages, self.schedule = self._build_schedule(tokens_BT, train=True)
        if not train and self._eval is None:
            self._eval = self._build_schedule(tokens_BT, train=False)
        if tokens_BT != self._tokens_BT:
            raise ValueError(
                f"a pipeline step's micro-batches hold {list(tokens_BT)} token ids per rank, the first step's held "
                f"{list(self._tokens_BT)}: the stages exchange fixed shapes (the data pads every micro-batch to "
                "data.max_tokens_per_microbatch under pipeline parallel; preset batches must have one shape)"
            )
        if len(args) != self._n_microbatches:
            raise ValueError(f"a pipeline step takes {self._n_microbatches} micro-batches, got {len(args)}")
        stages, schedule = (self.stages, self.schedule) if train else self._eval
        # what PipelineSchedule*.step does around _step_microbatches, without cutting one batch into chunks
        has_backward = schedule._has_backward
        schedule._has_backward = train and has_backward
        try:
            for stage in stages:
                stage.has_backward = schedule._has_backward
                stage.clear_runtime_states()
            schedule._step_microbatches(args, kwargs, targets, None, return_outputs=False)
        finally:
            schedule._has_backward = has_backward
            schedule._internal_losses.clear()
