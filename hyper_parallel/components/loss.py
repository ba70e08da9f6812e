"""Losses. ``CrossEntropyLoss`` is the token-level LM loss the trainer uses.

Exact global token mean. Each micro-batch returns ``sum of per-token CE / num_tokens`` where
``num_tokens`` is the number of labelled tokens (``labels != ignore_index``) of the whole optimizer
step: all micro-batches on all data-parallel ranks. Summing those micro-batch losses (gradient
accumulation) then gives exactly the global token mean, whatever the per-micro-batch token counts.
The parallelize pipeline makes FSDP2 SUM gradients over data-parallel ranks (``fsdp.sum_gradients``:
no averaging, plain SUM, which gloo supports too), so the trainer passes the global count itself and
the gradient is exactly that of the global token mean.

Chunked fp32. The CE runs ``chunk_tokens`` rows of the logits at a time in fp32 (``_ChunkedCrossEntropy``):
neither an fp32 copy of all logits nor the ``[tokens, vocab]`` fp32 log-softmax that ``F.cross_entropy``
keeps for backward ever exists (at vocab 171k x 8k tokens each is 5.6 GB). It saves the logits (in their
own dtype) and one logsumexp per token, and its backward writes ``softmax - onehot`` chunk by chunk
into a gradient of the logits' dtype. Same math as ``F.cross_entropy`` on ``logits.float()``: the loss
agrees to float rounding (<= 1e-6), the gradient too.

Loss parallel. When ``logits`` are a DTensor sharded on the vocab (last) dim, the CE runs through
``torch.distributed.tensor.parallel.loss_parallel`` without gathering the vocab. The backward must
run under that context as well, so the trainer wraps forward and backward in
``CrossEntropyLoss.parallel_context(enabled)``. That path is NOT chunked: torch's vocab-parallel CE
handles whole DTensor ops, and each rank already holds only ``vocab / tp`` columns of the logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hyper_parallel.config.configurable import Function

__all__ = ["BaseLoss", "CrossEntropyLoss", "loss_parallel_active", "top1_correct"]


def loss_parallel_active() -> bool:
    """Whether a ``loss_parallel()`` context is open (it is not re-entrant, so we check before entering)."""
    # torch registers its vocab-parallel CE handlers on the DTensor dispatcher only inside the context.
    handlers = DTensor._op_dispatcher._custom_op_handlers
    return torch.ops.aten.nll_loss_forward.default in handlers


def _is_vocab_sharded(logits: torch.Tensor) -> bool:
    return isinstance(logits, DTensor) and any(
        p.is_shard() and p.dim % logits.ndim == logits.ndim - 1 for p in logits.placements
    )


@torch.no_grad()
def top1_correct(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
    """How many labelled tokens have their label as the arg-max of ``logits [..., V]`` (float64, 0-dim).

    Vocab-sharded DTensor logits (loss parallel) are not gathered: each rank takes the max of its own
    columns and the ranks' maxima are compared (ties go to the lowest vocabulary index, as ``argmax``).
    """
    valid = labels != ignore_index
    if _is_vocab_sharded(logits):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh = logits.device_mesh
        if mesh.ndim != 1:
            raise NotImplementedError("top1_correct: vocab-sharded logits on a multi-dimensional mesh")
        _, offset = compute_local_shape_and_global_offset(logits.shape, mesh, logits.placements)
        best, arg = logits.to_local().float().max(dim=-1)
        arg = arg + offset[-1]
        group = mesh.get_group()
        world = torch.distributed.get_world_size(group)
        bests, args = [torch.empty_like(best) for _ in range(world)], [torch.empty_like(arg) for _ in range(world)]
        torch.distributed.all_gather(bests, best.contiguous(), group=group)
        torch.distributed.all_gather(args, arg.contiguous(), group=group)
        winner = torch.stack(bests).argmax(dim=0, keepdim=True)  # the first rank holding the max: lowest index
        pred = torch.stack(args).gather(0, winner).squeeze(0)
    else:
        full = logits.full_tensor() if isinstance(logits, DTensor) else logits
        pred = full.argmax(dim=-1)
    return ((pred == labels) & valid).sum().to(torch.float64)


class BaseLoss(Function):
    """A loss: ``loss_fn(logits, labels, num_tokens=...) -> scalar fp32 tensor``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Function.Config):
        pass

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor, *, num_tokens: int | float | torch.Tensor | None = None
    ) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")

    @staticmethod
    @contextlib.contextmanager
    def parallel_context(enabled: bool = True) -> Iterator[None]:
        """Open ``loss_parallel()`` around forward + backward when ``enabled`` (and not already open)."""
        if not enabled or loss_parallel_active():
            yield
            return
        with loss_parallel():
            yield


class _ChunkedCrossEntropy(torch.autograd.Function):
    """``sum over labelled rows of (logsumexp(x) - x[label])`` in fp32, ``chunk`` rows at a time.

    ``logits_NV`` any float dtype, ``labels_N`` integer; rows labelled ``ignore_index`` add nothing.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits_NV: torch.Tensor,
        labels_N: torch.Tensor,
        ignore_index: int,
        chunk: int,
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=logits_NV.device)
        lse_N = torch.empty(logits_NV.shape[0], dtype=torch.float32, device=logits_NV.device)
        for lo in range(0, logits_NV.shape[0], chunk):
            x_CV = logits_NV[lo : lo + chunk].float()
            labels_C = labels_N[lo : lo + chunk]
            valid_C = labels_C != ignore_index
            lse_C = torch.logsumexp(x_CV, dim=-1)
            target_C = x_CV.gather(1, torch.where(valid_C, labels_C, 0).unsqueeze(1)).squeeze(1)
            total += torch.where(valid_C, lse_C - target_C, 0.0).sum()
            lse_N[lo : lo + chunk] = lse_C
        ctx.save_for_backward(logits_NV, labels_N, lse_N)
        ctx.ignore_index, ctx.chunk = ignore_index, chunk
        return total

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits_NV, labels_N, lse_N = ctx.saved_tensors
        grad_NV = torch.empty_like(logits_NV)
        for lo in range(0, logits_NV.shape[0], ctx.chunk):
            labels_C = labels_N[lo : lo + ctx.chunk]
            valid_C = labels_C != ctx.ignore_index
            # d/dx (lse - x[label]) = softmax(x) - onehot(label); ignored rows get 0
            # out of place first: for fp32 logits .float() is the saved tensor itself
            g_CV = torch.sub(logits_NV[lo : lo + ctx.chunk].float(), lse_N[lo : lo + ctx.chunk, None]).exp_()
            g_CV.scatter_add_(1, torch.where(valid_C, labels_C, 0).unsqueeze(1), -valid_C.float().unsqueeze(1))
            g_CV.mul_(torch.where(valid_C, grad_total, 0.0).unsqueeze(1))
            grad_NV[lo : lo + ctx.chunk] = g_CV
        return grad_NV, None, None, None


class CrossEntropyLoss(BaseLoss):
    """fp32 token cross entropy: ``sum(CE over labelled tokens) / num_tokens``.

    ``logits [..., V]`` and ``labels [...]`` (already shifted: ``labels[t]`` is predicted at ``t``).
    ``num_tokens=None`` normalises by this call's own labelled-token count (a plain mean).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        ignore_index: int = -100
        """Label value that carries no loss (padding, prompts, document boundaries)."""
        chunk_tokens: int = 1024
        """Compute the fp32 loss this many tokens at a time, so no fp32 copy of all logits exists (same
        result); 0 = all at once. Not used under loss parallel (vocab-sharded logits)."""

    def __init__(self, config: Config, **runtime_objects: object) -> None:
        super().__init__(config, **runtime_objects)
        self.config: CrossEntropyLoss.Config = config
        if config.chunk_tokens < 0:
            raise ValueError(f"loss.chunk_tokens={config.chunk_tokens} must be >= 0 (0 = the whole micro-batch at once)")

    def sum_and_count(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum of per-token CE in fp32, number of labelled tokens)`` of one micro-batch."""
        if logits.shape[:-1] != labels.shape:
            raise ValueError(
                f"CrossEntropyLoss: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree; "
                "logits must be [..., vocab] with the labels' leading shape"
            )
        ignore = self.config.ignore_index
        flat_logits = logits.reshape(-1, logits.shape[-1])
        flat_labels = labels.reshape(-1)
        count = (flat_labels != ignore).sum()
        if _is_vocab_sharded(logits):
            if not loss_parallel_active():
                raise RuntimeError(
                    "CrossEntropyLoss got vocab-sharded DTensor logits outside loss_parallel: wrap forward "
                    "and backward in `with CrossEntropyLoss.parallel_context(enabled=True):`"
                )
            total = F.cross_entropy(flat_logits.float(), flat_labels, ignore_index=ignore, reduction="sum")
        else:
            if isinstance(flat_logits, DTensor):  # replicated or batch-sharded: plain CE on full logits
                flat_logits = flat_logits.full_tensor()
            chunk = self.config.chunk_tokens
            if chunk > 0:
                total = _ChunkedCrossEntropy.apply(flat_logits, flat_labels, ignore, chunk)
            else:
                total = F.cross_entropy(flat_logits.float(), flat_labels, ignore_index=ignore, reduction="sum")
        if isinstance(total, DTensor):
            total = total.full_tensor()
        return total, count

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor, *, num_tokens: int | float | torch.Tensor | None = None
    ) -> torch.Tensor:
        total, count = self.sum_and_count(logits, labels)
        if num_tokens is None:
            denom = count.clamp(min=1).to(total.dtype)
        elif isinstance(num_tokens, torch.Tensor):
            denom = num_tokens.to(device=total.device, dtype=total.dtype).clamp(min=1)
        else:
            denom = max(float(num_tokens), 1.0)  # a step with no labelled token has loss 0, not NaN
        return total / denom
