"""Statistics over one forward's tokens, pooled over the ranks that split those tokens.

One process routes a micro-batch's whole rows through every MoE layer. Context parallel gives each CP rank its
pieces of every row, and under tensor parallel the MoE runs on each tp rank's sequence shard
(``parallelize.py``): the tokens one process sees in a forward are those of the ``cp x tp`` ranks of one
data-parallel rank. A statistic over them (the Switch load-balancing loss's per-expert routed counts and
probability sums, ``models/common/moe.py``) is the sum of the ranks' local ones, and any product of such sums
must be taken after that sum, never averaged per rank. ``apply_token_split`` hands every module that pools
such statistics (it has ``set_token_split(pool)``) one differentiable sum over those ranks, ``pool(x)``:

- forward: all-reduce (sum) over the cp group, then over the tp group: every rank of the block holds the
  one-process sums, bitwise the same;
- backward: all-reduce (sum) of the gradient over the cp group only.

Why the backward leaves tp out. A loss built from the pooled sums is the same on every rank of the block, and
the summed gradients differentiate what the trainer adds up: a copy per CP rank (the trainer weights each by
``1 / (micro-batches x dp x cp)``: CP ranks hold different tokens, ``StepRunner.token_ranks``), but ONE copy per
set of tp ranks (tensor-parallel ranks compute the same loss and count as one token rank; the gradient of a
weight that sees only the rank's tokens, the router, covers that rank's shard and FSDP sums it over tp). So a
rank's local sums get the gradient summed over the cp copies (the adjoint of the forward's cp sum) and passed
through unchanged over tp (Megatron's reduce-from-tensor-parallel-region: forward all-reduce, backward identity).
Summed over the ranks, the router gradient is exactly the one-process gradient of the pooled loss times the
trainer's ``1 / micro-batches``. One process, or data parallel alone, gets no pool: the modules compute what
they compute on one rank.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.distributed.parallel_dims import ParallelDims

__all__ = ["apply_token_split", "pooled_sum", "token_split_pool"]


class _PooledSum(torch.autograd.Function):
    """Sum over ``groups`` (in turn); backward: the gradient summed over ``grad_groups``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups: tuple, grad_groups: tuple) -> torch.Tensor:  # noqa: D102
        out = x.contiguous().clone()
        for group in groups:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        ctx.grad_groups = grad_groups
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        grad = grad.contiguous().clone()
        for group in ctx.grad_groups:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        return grad, None, None


def pooled_sum(
    x: torch.Tensor, *, groups: tuple[dist.ProcessGroup, ...], grad_groups: tuple[dist.ProcessGroup, ...]
) -> torch.Tensor:
    """``x`` summed over every rank of ``groups`` (one after the other: their product of ranks); its backward sums
    the gradient over ``grad_groups`` only (a subset of ``groups``; see the module docstring)."""
    return _PooledSum.apply(x, tuple(groups), tuple(grad_groups))


def token_split_pool(parallel_dims: ParallelDims) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The differentiable sum over the ranks that split one forward's tokens (context parallel, and tensor
    parallel, whose ranks run the MoE on their sequence shards), or None when no rank shares them."""
    pd = parallel_dims
    cp = pd.mesh("cp").get_group() if pd.cp > 1 else None
    tp = pd.mesh("tp").get_group() if pd.tp > 1 else None
    if cp is None and tp is None:
        return None
    return partial(
        pooled_sum, groups=tuple(g for g in (cp, tp) if g is not None), grad_groups=(cp,) if cp is not None else ()
    )


def apply_token_split(model: nn.Module, parallel_dims: ParallelDims) -> int:
    """Give every module of ``model`` with ``set_token_split(pool)`` this layout's pool (one shared callable);
    returns how many got it (0 when the layout splits no forward's tokens)."""
    pool = token_split_pool(parallel_dims)
    if pool is None:
        return 0
    modules = [m for m in model.modules() if callable(getattr(m, "set_token_split", None))]
    for module in modules:
        module.set_token_split(pool)
    return len(modules)
