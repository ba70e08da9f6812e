"""Gradient-norm clipping across meshes and small collective helpers.

After FSDP + TP + EP, gradients are DTensors on *different* meshes (dense parameters on
``dp_shard_cp x tp``, routed experts on ``efsdp x ep``; an ignored parameter may be a plain tensor).
``torch.nn.utils.clip_grad_norm_`` cannot mix them in one foreach call, so the norm is computed per
(mesh, placements) group, each group's partial norm is reduced with ``full_tensor()``, and the groups
are combined locally. Every rank sees the same parameter order, so the per-group collectives match.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "dist_max", "dist_sum"]


def _group_key(grad: torch.Tensor) -> tuple:
    if isinstance(grad, DTensor):
        mesh = grad.device_mesh
        return ("dtensor", mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist()), grad.placements, grad.dtype)
    return ("local", grad.device, grad.dtype)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    other_parts: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip gradients in place to a global ``norm_type`` norm of ``max_norm``; return the total norm.

    ``max_norm <= 0`` only measures. The returned norm is a plain fp32 tensor, equal on every rank.
    Plain-tensor gradients are taken as replicated (every rank holds the same values). ``other_parts``: the
    group of ranks holding the model's other parts (pipeline stages): their norms join this one (every rank of
    it must call, with gradients or without).
    """
    params = [p for p in parameters if p.grad is not None]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(_group_key(p.grad), []).append(p)
    norm_type = float(norm_type)
    norms: list[torch.Tensor] = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type, False, foreach)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # reduces the Partial norm over the group's mesh
        norms.append(norm.float())
    if not norms and other_parts is None:
        return torch.tensor(0.0)
    device = norms[0].device if norms else _group_device(other_parts)
    stacked = torch.stack([n.to(device) for n in norms]) if norms else torch.zeros(1, device=device)
    if math.isinf(norm_type):
        total = stacked.max()
        if other_parts is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=other_parts)
    else:
        total = stacked.pow(norm_type).sum()
        if other_parts is not None:
            dist.all_reduce(total, group=other_parts)
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total gradient norm is {total.item()}: a NaN/inf gradient")
    if max_norm > 0:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)
    return total


def _group_device(group: dist.ProcessGroup) -> torch.device:
    """A device the group's backend communicates on (gloo: the CPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_reducible(value: torch.Tensor | float) -> torch.Tensor:
    if torch.is_tensor(value):
        return value.detach().clone()
    from hyper_parallel.distributed.env import get_device

    return torch.tensor(value, dtype=torch.float64, device=get_device())


def dist_sum(value: torch.Tensor | float, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of ``value`` over ``group`` (the default group when None), as a new tensor."""
    t = _as_reducible(value)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def dist_max(value: torch.Tensor | float, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Max of ``value`` over ``group`` (the default group when None), as a new tensor."""
    t = _as_reducible(value)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t
