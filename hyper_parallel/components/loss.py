"""Losses. ``CrossEntropyLoss`` is the token-level LM loss the trainer uses.

Exact global token mean. Each micro-batch returns ``sum of per-token CE / num_tokens`` where
``num_tokens`` is the number of labelled tokens (``labels != ignore_index``) of the whole optimizer
step: all micro-batches on all data-parallel ranks. Summing those micro-batch losses (gradient
accumulation) then gives exactly the global token mean, whatever the per-micro-batch token counts.
The parallelize pipeline makes FSDP2 SUM gradients over data-parallel ranks (``fsdp.sum_gradients``:
no averaging, plain SUM, which gloo supports too), so the trainer passes the global count itself and
the gradient is exactly that of the global token mean.

Loss parallel. When ``logits`` are a DTensor sharded on the vocab (last) dim, the CE runs through
``torch.distributed.tensor.parallel.loss_parallel`` without gathering the vocab. The backward must
run under that context as well, so the trainer wraps forward and backward in
``CrossEntropyLoss.parallel_context(enabled)``.
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

__all__ = ["BaseLoss", "CrossEntropyLoss", "loss_parallel_active"]


def loss_parallel_active() -> bool:
    """Whether a ``loss_parallel()`` context is open (it is not re-entrant, so we check before entering)."""
    # torch registers its vocab-parallel CE handlers on the DTensor dispatcher only inside the context.
    handlers = DTensor._op_dispatcher._custom_op_handlers
    return torch.ops.aten.nll_loss_forward.default in handlers


def _is_vocab_sharded(logits: torch.Tensor) -> bool:
    return isinstance(logits, DTensor) and any(
        p.is_shard() and p.dim % logits.ndim == logits.ndim - 1 for p in logits.placements
    )


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


class CrossEntropyLoss(BaseLoss):
    """fp32 token cross entropy: ``sum(CE over labelled tokens) / num_tokens``.

    ``logits [..., V]`` and ``labels [...]`` (already shifted: ``labels[t]`` is predicted at ``t``).
    ``num_tokens=None`` normalises by this call's own labelled-token count (a plain mean).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        ignore_index: int = -100
        """Label value that carries no loss (padding, prompts, document boundaries)."""

    def __init__(self, config: Config, **runtime_objects: object) -> None:
        super().__init__(config, **runtime_objects)
        self.config: CrossEntropyLoss.Config = config

    def sum_and_count(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum of per-token CE in fp32, number of labelled tokens)`` of one micro-batch."""
        if logits.shape[:-1] != labels.shape:
            raise ValueError(
                f"CrossEntropyLoss: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree; "
                "logits must be [..., vocab] with the labels' leading shape"
            )
        ignore = self.config.ignore_index
        flat_logits = logits.reshape(-1, logits.shape[-1]).float()
        flat_labels = labels.reshape(-1)
        count = (flat_labels != ignore).sum()
        if _is_vocab_sharded(logits):
            if not loss_parallel_active():
                raise RuntimeError(
                    "CrossEntropyLoss got vocab-sharded DTensor logits outside loss_parallel: wrap forward "
                    "and backward in `with CrossEntropyLoss.parallel_context(enabled=True):`"
                )
            total = F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore, reduction="sum")
        else:
            if isinstance(flat_logits, DTensor):  # replicated or batch-sharded: plain CE on full logits
                flat_logits = flat_logits.full_tensor()
            total = F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore, reduction="sum")
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
