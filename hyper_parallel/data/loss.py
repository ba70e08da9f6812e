"""The dyn_bsz loss: an exact token mean over every micro-batch of a step on every DP rank.

Per micro-batch the loss is the fp32 SUM of token cross-entropies (``ignore_index=-100``) divided
by the step's GLOBAL number of target tokens (:func:`global_token_count`, one all-reduce per
step). Backpropagating each micro-batch's loss and summing the gradients over micro-batches and DP
ranks then gives exactly the gradient of the mean over all target tokens of the step, whatever
the split into micro-batches and ranks.

The DP gradient reduction must therefore SUM, not average: with FSDP2 call
``fully_shard_module.set_gradient_divide_factor(1.0)`` (or multiply the loss by the DP world size
when the reduction averages). The step's logged loss is the all-reduced SUM of the per-micro-batch
losses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyper_parallel.data.sample import IGNORE_INDEX

__all__ = ["global_token_count", "global_token_mean_ce"]


def global_token_count(
    micro_batches: Iterable[Mapping[str, Any]],
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Number of non-ignored labels in this step over all micro-batches and all ranks of ``group``.

    Returns an int64 scalar tensor on ``device`` (default: the labels' device, which must suit the
    backend: CUDA tensors for NCCL). Does one ``all_reduce`` when torch.distributed is initialised,
    else counts the local micro-batches only.
    """
    micro_batches = list(micro_batches)
    if not micro_batches:
        raise ValueError("global_token_count needs the step's micro-batches (got none)")
    if device is None:
        device = micro_batches[0]["labels"].device
    count = torch.zeros((), dtype=torch.int64, device=device)
    for mb in micro_batches:
        count += (mb["labels"] != IGNORE_INDEX).sum().to(device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return count


def global_token_mean_ce(logits: torch.Tensor, labels: torch.Tensor, global_num_tokens: torch.Tensor | int) -> torch.Tensor:
    """``sum(CE over this micro-batch's target tokens) / global_num_tokens``, computed in fp32.

    ``logits`` ``[..., V]`` and ``labels`` ``[...]`` (already shifted, -100 = ignored). Summed over
    the step's micro-batches and DP ranks this is the exact token mean of the step. A step without
    any target token (``global_num_tokens == 0``) gives a zero loss with zero gradients.
    """
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    if isinstance(global_num_tokens, torch.Tensor):
        denom = global_num_tokens.to(device=ce.device, dtype=torch.float32).clamp_min(1)
    else:
        denom = float(max(int(global_num_tokens), 1))
    return ce / denom
