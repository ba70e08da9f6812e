"""The mechanics of a training step, shared by the trainer, the validator and the dry run (``StepRunner``).

One micro-batch goes: host prep (``prepare``: document bounds on the host, MTP targets, the model's host facts, the
context-parallel split) -> device copy (``to_device``: pinned, non-blocking on CUDA) -> the model on the keyword
inputs of one batch dict (``model_kwargs``) -> the step's objective (``StepObjective``) -> backward. The objective
is the exact global token mean of the cross entropy over every labelled token of the step (micro-batches and ranks
that hold different tokens), plus the MoE aux loss weighted ``1 / (micro-batches x token ranks)``, plus the MTP
loss (a token mean over the step's MTP targets) times its weight. Under pipeline parallel the schedule runs the
step, and the objective travels with each micro-batch as its target (``PipelineTarget``): no state is kept between
steps.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.components.loss import CrossEntropyLoss, top1_correct
from hyper_parallel.components.source_metrics import SourceLossMeter
from hyper_parallel.data.packing import add_mtp_targets, batch_to_device
from hyper_parallel.distributed.context_parallel import split_batch_for_cp
from hyper_parallel.distributed.fsdp import set_gradient_reduction
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.pipeline_parallel import PipelineParallel
from hyper_parallel.distributed.utils import clip_grad_norm_, dist_sum
from hyper_parallel.protocols.model import BaseModel, ModelOutput, split_output
from hyper_parallel.protocols.module import unwrapped_name

__all__ = ["PipelineTarget", "StepCounts", "StepObjective", "StepRunner"]


@dataclass(slots=True)
class StepCounts:
    """A step's token counts summed over the ranks that hold different tokens: host floats on one such rank, else
    device scalars (read later with the other stats)."""

    tokens: float | torch.Tensor
    """Labelled tokens (the cross entropy's denominator)."""
    inputs: float | torch.Tensor
    """Input positions (tokens per step, labelled or not)."""
    mtp: float | torch.Tensor
    """Tokens with an MTP target (the MTP loss's denominator); 0 without MTP."""
    micro_batches: int
    """Forwards per rank in the step (the aux loss is a mean over them)."""


@dataclass(slots=True)
class PipelineTarget:
    """What the last pipeline stage's loss gets per micro-batch: the micro-batch and the step's objective."""

    batch: dict[str, Any]
    objective: Callable[[Any, dict[str, Any]], torch.Tensor]


def _pipeline_loss(out: Any, target: PipelineTarget) -> torch.Tensor:
    """The loss the pipeline schedule calls on the last stage (a stage returns tensors only)."""
    return target.objective(ModelOutput.from_stage_output(out), target.batch)


class StepObjective:
    """One step's objective; ``objective(output, micro_batch)`` is the micro-batch's share (call inside
    ``StepRunner.loss_parallel()``) and accumulates, on the device, the step's LM loss, aux loss, MTP loss and MTP
    top-1 hits for the metrics."""

    def __init__(self, runner: StepRunner, counts: StepCounts, per_source: SourceLossMeter | None = None) -> None:
        device = runner.device
        self.loss_fn, self.mtp, self.counts, self.per_source = runner.loss_fn, runner.mtp, counts, per_source
        self.loss = torch.zeros((), dtype=torch.float32, device=device)
        self.aux = torch.zeros((), dtype=torch.float32, device=device)
        self.mtp_loss = torch.zeros((), dtype=torch.float32, device=device)
        self.mtp_correct = torch.zeros((), dtype=torch.float64, device=device)
        # An auxiliary loss (MoE load balancing) is a mean per forward: average it over the step's forwards on every
        # rank that holds different tokens (gradients are summed over those ranks). The MoE pools its statistics over
        # the cp x tp ranks of a forward, so the loss is the same on each of them; its backward sums the cp copies
        # only (distributed/token_split.py): weighting each by 1/cp here gives the one-process gradient.
        self.aux_scale = 1.0 / (counts.micro_batches * runner.token_ranks())

    def __call__(self, out: Any, mb: dict[str, Any]) -> torch.Tensor:
        logits, aux_loss = split_output(out)
        tokens = self.counts.tokens
        loss = self.loss_fn(logits, mb["labels"], num_tokens=tokens)
        if self.per_source is not None:
            self.per_source.add(mb["labels"], mb["source_ids"], token_loss_sum=loss.detach() * tokens)
        if aux_loss is not None:
            self.aux += aux_loss.detach().float() * self.aux_scale
            loss = loss + aux_loss * self.aux_scale
        objective = loss
        if self.mtp is not None:  # token mean over the step's tokens that have a target two ahead
            mtp_loss = self.loss_fn(out.mtp_logits, mb["mtp_labels"], num_tokens=self.counts.mtp)
            objective = loss + self.mtp.loss_weight * mtp_loss
            self.mtp_loss += mtp_loss.detach().float()
            ignore = self.loss_fn.config.ignore_index
            self.mtp_correct += top1_correct(out.mtp_logits, mb["mtp_labels"], ignore_index=ignore)
        self.loss += loss.detach().float()
        return objective

    def sums(self) -> torch.Tensor:
        """This rank's [loss, aux, mtp loss, mtp hits] (float64, on the device)."""
        return torch.stack([self.loss.double(), self.aux.double(), self.mtp_loss.double(), self.mtp_correct.double()])


class StepRunner:
    """This rank's step mechanics over its model parts (the whole model, or its pipeline stages).

    ``model_cls``: the model's class (its ``input_keys`` and CP split); ``mtp``: the model's MTP block config
    (None = off); ``defer_grad_reduce``: ``--training.defer_grad_reduce``; ``pipeline``: the rank's stages and
    schedule (attached here: its loss is ``PipelineTarget``'s objective)."""

    def __init__(
        self,
        parts: list[nn.Module],
        *,
        model_cls: type[BaseModel],
        parallel_dims: ParallelDims,
        device: torch.device,
        loss_fn: CrossEntropyLoss,
        mtp: Any = None,
        defer_grad_reduce: bool = False,
        pipeline: PipelineParallel | None = None,
        micro_batches_per_step: int = 1,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.parts, self.model = list(parts), parts[0]
        self.model_cls = model_cls
        self.parallel_dims, self.device, self.loss_fn, self.mtp = parallel_dims, device, loss_fn, mtp
        self.defer_grad_reduce, self.pipeline = defer_grad_reduce, pipeline
        self.eval_group_size = micro_batches_per_step if pipeline is not None else 1
        """Validation micro-batches per run: a pipeline step's worth under pipeline parallel, else one."""
        if pipeline is not None:
            pipeline.attach(self.parts, device=device, n_microbatches=micro_batches_per_step, loss_fn=_pipeline_loss,
                            compute_dtype=compute_dtype, mtp=mtp is not None)  # fmt: skip

    # ------------------------------------------------------------------ one micro-batch
    def prepare(self, mb: dict[str, Any]) -> dict[str, Any]:
        """The host side of one micro-batch (training and validation alike).

        Multi-token prediction: the next ids and the targets two ahead, per document, on the host and before
        the CP split (which slices them like the labels). Context parallel: each CP rank keeps its pieces of
        every row (one chunk, or two in the balanced order), the model's own inputs split to match; split on
        the host so only the pieces are copied to the device.
        """
        pd = self.parallel_dims
        if mb.get("cu_seqlens") is not None and mb.get("cu_seqlens_host") is None:
            # the layers read document bounds from the host copy: made here from the host batch, never read back
            mb = {**mb, "cu_seqlens_host": mb["cu_seqlens"].tolist()}
        if self.mtp is not None:
            mb = add_mtp_targets(mb, ignore_index=self.loss_fn.config.ignore_index)
        mb = {**mb, **self.model.host_inputs(mb)}  # the model's host facts (e.g. VL image geometry), before the split
        shard = getattr(self.model, "cp_shard", None)  # the batch order context parallel chose
        return split_batch_for_cp(
            mb, pd.mesh_coordinate("cp") if pd.cp > 1 else 0, pd.cp, split_inputs=self.model_cls.split_inputs_for_cp,
            model_keys=self.model_cls.input_keys, balanced=shard is not None and shard.balanced,
        )  # fmt: skip

    def to_device(self, mb: dict[str, Any]) -> dict[str, Any]:
        # pinned host copies on CUDA (the non_blocking copies then overlap compute); a CPU run copies nothing
        return batch_to_device(mb, self.device, non_blocking=True)

    def model_kwargs(self, mb: dict[str, Any]) -> dict[str, Any]:
        """The model's keyword inputs of a device micro-batch (every pipeline stage gets them all)."""
        inputs = {k: mb[k] for k in self.model_cls.input_keys if k in mb}
        return dict(
            position_ids=mb["position_ids"],
            cu_seqlens=mb["cu_seqlens"],
            max_seqlen=mb["max_seqlen"],
            cu_seqlens_host=mb.get("cu_seqlens_host"),
            token_mask=mb.get("token_mask"),  # padding out of the MoE router statistics
            **inputs,
            **({"mtp_input_ids": mb["mtp_input_ids"]} if self.mtp is not None else {}),
        )

    def forward(self, mb: dict[str, Any]) -> Any:
        """The model's output on one device micro-batch (call inside ``loss_parallel()``)."""
        return self.model(mb["input_ids"], **self.model_kwargs(mb))

    def loss_parallel(self) -> AbstractContextManager[Any]:
        if self.parallel_dims.loss_parallel_enabled:
            return CrossEntropyLoss.parallel_context(True)
        return nullcontext()

    def set_grad_sync(self, *, last: bool) -> None:
        """The gradient-sync policy: reduce (and reshard) on the step's last micro-batch only, unless deferred."""
        set_gradient_reduction(
            self.model, last=last, defer=self.defer_grad_reduce, replicated=self.parallel_dims.dp_replicate > 1
        )

    def backward(self, mb: dict[str, Any], objective: Callable[[Any, dict[str, Any]], torch.Tensor], *, last: bool
                 ) -> None:
        """Forward and backward of one device micro-batch (no pipeline), under the gradient-sync policy."""
        self.set_grad_sync(last=last)
        with self.loss_parallel():
            objective(self.forward(mb), mb).backward()

    # ------------------------------------------------------------------ one step
    def count_tokens(self, host_batches: list[dict[str, Any]]) -> StepCounts:
        """The step's token counts: labelled tokens counted on the host (no device sync), one all-reduce."""
        ignore = self.loss_fn.config.ignore_index
        local_tokens = sum(int((mb["labels"] != ignore).sum()) for mb in host_batches)
        local_inputs = sum(mb["input_ids"].numel() for mb in host_batches)
        local_mtp = sum(int((mb["mtp_labels"] != ignore).sum()) for mb in host_batches) if self.mtp is not None else 0
        # One token rank: the host counts are the step's (no device round trip). Else summed on the device and kept
        # there: the loss divides by a device scalar, the metrics read the counts with the other stats.
        on_host = self.loss_group() is None
        counts = self.sum_over_token_ranks(torch.tensor(
            [local_tokens, local_inputs, local_mtp], dtype=torch.float64, device="cpu" if on_host else self.device,
        ))  # fmt: skip
        values = counts.tolist() if on_host else [counts[0], counts[1], counts[2]]
        return StepCounts(*values, micro_batches=len(host_batches))

    def forward_backward(self, micro_batches: list[dict[str, Any]], objective: StepObjective) -> torch.Tensor:
        """Forward and backward over the step's device micro-batches (the pipeline schedule, or one at a time);
        returns the step's [loss, aux, mtp loss, mtp hits] summed over every rank (one all-reduce, on the device)."""
        if self.pipeline is not None:
            self.run_pipeline(micro_batches, objective)
        else:
            for i, mb in enumerate(micro_batches):
                self.backward(mb, objective, last=i == len(micro_batches) - 1)
        return self.sum_over_loss_ranks(objective.sums())

    def run_pipeline(self, micro_batches: list[dict[str, Any]], objective: Any, *, train: bool = True) -> None:
        """One pass of the pipeline schedule over the step's micro-batches: stage 0 takes the token ids, every
        stage the keyword inputs, the last stage ``objective(output, micro-batch)`` (forward and backward, or
        forwards only)."""
        pipeline = self.pipeline
        args = [(mb["input_ids"],) if pipeline.has_first else () for mb in micro_batches]
        kwargs = [self.model_kwargs(mb) for mb in micro_batches]
        targets = [PipelineTarget(mb, objective) for mb in micro_batches] if pipeline.has_last else None
        with self.loss_parallel():
            pipeline.step(args, kwargs, targets, train=train)

    def evaluate(self, micro_batches: list[dict[str, Any]], take: Callable[[Any, dict[str, Any]], None]) -> None:
        """Forwards only (validation; call under ``torch.no_grad()``): ``take(output, micro-batch)`` where the output
        is (the last pipeline stage)."""
        if self.pipeline is None:
            for mb in micro_batches:
                take(self.forward(mb), mb)
            return

        def objective(out: Any, mb: dict[str, Any]) -> torch.Tensor:
            take(out, mb)
            return torch.zeros((), device=self.device)

        self.run_pipeline(micro_batches, objective, train=False)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the trainable gradients of every part (and pipeline stage) to ``max_norm``; the global norm."""
        pp_mesh = self.parallel_dims.mesh("pp")
        return clip_grad_norm_(
            [p for part in self.parts for p in part.parameters() if p.requires_grad], max_norm,
            other_parts=pp_mesh.get_group() if pp_mesh is not None else None,
        )  # fmt: skip

    # ------------------------------------------------------------------ reductions
    def loss_group(self) -> dist.ProcessGroup | None:
        """Ranks whose tokens differ: data-parallel x context-parallel (None on a single such rank).

        Tensor-parallel ranks hold the same tokens, so they are not in it.
        """
        mesh = self.parallel_dims.mesh("dp_cp")
        return mesh.get_group() if mesh is not None else None

    def token_ranks(self) -> int:
        group = self.loss_group()
        return 1 if group is None else dist.get_world_size(group)

    def sum_over_token_ranks(self, value: torch.Tensor | float) -> torch.Tensor:
        """Sum over the ranks that hold different tokens (no reduction when there is only one)."""
        group = self.loss_group()
        if group is None:
            return value.detach().clone() if torch.is_tensor(value) else torch.tensor(value, dtype=torch.float64)
        return dist_sum(value, group)

    def sum_over_loss_ranks(self, value: torch.Tensor | float) -> torch.Tensor:
        """``sum_over_token_ranks``, then (pipeline parallel) over the stages: the loss terms live on the last
        stage only, so the sum hands every rank the step's values."""
        total = self.sum_over_token_ranks(value)
        pp = self.parallel_dims.mesh("pp")
        return total if pp is None else dist_sum(total, pp.get_group())

    @torch.no_grad()
    def expert_load_and_balance(self, *, rate: float, read: bool = True) -> dict[str, torch.Tensor] | None:
        """Per-MoE-layer routed counts (summed over data ranks; ONE all-reduce for every layer); with ``rate > 0``
        the aux-loss-free bias update. ``read=False`` (a step that does not log): the counts are only needed for the
        bias update, so without one nothing is reduced and None is returned."""
        moes = [(name, module) for part in self.parts for name, module in part.named_modules()
                if callable(getattr(module, "pop_tokens_per_expert", None))]  # fmt: skip
        popped = [module.pop_tokens_per_expert().float() for _, module in moes]  # every step: resets the counts
        if not read and rate <= 0:
            return None
        # Every rank must apply the same bias update: sum the counts over all ranks whose routers saw
        # different tokens (sequence parallel splits tokens over TP ranks as well).
        pd = self.parallel_dims
        mesh = pd.mesh("dp_cp", "tp") if pd.sp_enabled else pd.mesh("dp_cp")
        moe_group = None if mesh is None else (mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group())
        flat = torch.cat(popped) if popped else torch.zeros(0, device=self.device)
        if moe_group is not None and popped:
            dist.all_reduce(flat, group=moe_group)
        load: dict[str, torch.Tensor] = {}
        for (name, module), counts in zip(moes, flat.split([c.numel() for c in popped]) if popped else (), strict=True):
            load[unwrapped_name(name)] = counts
            if rate > 0:
                module.update_bias_correction(counts, rate)
        pp = pd.mesh("pp")
        if not read:
            return None
        if pp is not None:  # every stage's layers in the metrics (rank 0 logs them): log steps only
            gathered: list[Any] = [None] * pd.pp
            dist.all_gather_object(gathered, {k: v.cpu() for k, v in load.items()}, group=pp.get_group())
            load = {k: v.to(self.device) for part in gathered for k, v in part.items()}
            load = dict(sorted(load.items(), key=lambda kv: _layer_order(kv[0])))
        return load


def _layer_order(name: str) -> tuple:
    """Sort key of a module name: ``layers.10`` after ``layers.9`` (numbers compared as numbers)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))
