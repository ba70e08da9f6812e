"""Muon (with auxiliary AdamW groups) that works on plain tensors and FSDP/EP-sharded DTensors.

One ``torch.optim.Optimizer`` holds every trainable parameter: groups with ``use_muon=True`` get the
Muon update (momentum, then Newton-Schulz orthogonalisation of each weight matrix), the others get
exactly ``torch.optim.AdamW``'s update (its functional kernel is called). Being one optimizer keeps
LR schedulers and ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` working
unchanged.

The Muon update of one parameter follows ``torch.optim.Muon``::

    buf    = lerp(buf, g, 1 - momentum)                 # sharded like the grad: no communication
    u      = lerp(g, buf, momentum) if nesterov else buf
    O      = NS5(u)                                     # per matrix: the last two dims
    p     *= 1 - lr * weight_decay
    p     -= adjust(lr, matrix shape) * O

Shapes. A 2-D weight ``[out, in]`` is one matrix. A 3-D grouped-expert weight ``[E, out, in]`` is E
matrices, orthogonalised independently (one batched NS). A fused weight such as ``gate_up_proj``
(``[E, 2I, H]``: gate rows then up rows) is split into ``row_blocks`` matrices along ``out`` first,
so each expert's gate and up projections are orthogonalised separately, exactly like the dense
``gate_proj``/``up_proj`` pair.

Sharded parameters (DTensor). NS needs whole matrices, so the update is redistributed to placements
where every shard of a matrix dim (the last two; ``Shard`` or FSDP-over-TP's ``_StridedShard``)
becomes ``Replicate``; shards of leading (expert) dims stay local. Cost per Muon parameter per step:
one all-gather of the update (in the grad dtype, usually fp32) over the mesh dims that shard a matrix
dim (FSDP ``Shard(0)`` of a 2-D weight, ``Shard(1)`` of an expert weight, TP), i.e. the full weight's
size once per step; expert-parallel ``Shard(0)`` needs nothing. Every rank of those mesh dims then
runs the same NS on the whole matrices (the NS FLOPs are not divided by the FSDP degree) and keeps
its own slice (``Replicate -> Shard`` is a local slice, no communication). Momentum buffers stay
sharded. Correctness first: a faster scheme would hand whole matrices to ranks round-robin and
scatter the results.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.adamw import adamw as _adamw_functional

__all__ = [
    "MuonWithAuxAdamW",
    "NS_COEFFICIENTS",
    "adjust_muon_lr",
    "orthogonalize",
    "zeropower_via_newtonschulz5",
]

NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
"""Quintic Newton-Schulz coefficients (Keller Jordan), chosen to be safe in bf16."""

AdjustLR = Literal["match_rms_adamw", "original", "none"]
_NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def zeropower_via_newtonschulz5(
    g: Tensor,
    *,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Approximately orthogonalise each matrix in the last two dims of ``g`` (plain tensor).

    Leading dims are a batch: every matrix is normalised and iterated on its own. The 2-D path uses
    the same ops as ``torch.optim.Muon`` so the two agree bit for bit in bf16.
    """
    if g.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix, got shape {tuple(g.shape)}")
    a, b, c = coefficients
    x = g.to(dtype)
    transposed = g.size(-2) > g.size(-1)
    if transposed:
        x = x.mT
    if x.ndim == 2:
        x = x.div(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, gram_update, x, beta=a)
    else:
        lead = x.shape[:-2]
        x = x.reshape(-1, *x.shape[-2:])
        x = x.div(x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = torch.bmm(x, x.mT)
            gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, gram_update, x, beta=a)
        x = x.reshape(*lead, *x.shape[-2:])
    if transposed:
        x = x.mT
    return x


def _ns_blocks(u: Tensor, row_blocks: int, **ns: Any) -> Tensor:
    """NS of a plain tensor whose matrices are split into ``row_blocks`` along the rows."""
    if row_blocks == 1:
        return zeropower_via_newtonschulz5(u, **ns)
    rows = u.size(-2)
    if rows % row_blocks:
        raise ValueError(f"row_blocks={row_blocks} does not divide the {rows} rows of a Muon matrix")
    split = u.reshape(*u.shape[:-2], row_blocks, rows // row_blocks, u.size(-1))
    return zeropower_via_newtonschulz5(split, **ns).reshape(u.shape)


def _sharded_dim(placement: Any, ndim: int) -> int | None:
    """Tensor dim a placement shards: ``Shard`` and FSDP+TP's ``_StridedShard`` (not a ``Shard``
    subclass, so ``is_shard()`` is False for it) both carry ``dim``."""
    dim = getattr(placement, "dim", None)
    return dim % ndim if isinstance(dim, int) else None


def orthogonalize(u: Tensor, *, row_blocks: int = 1, **ns: Any) -> Tensor:
    """NS of ``u`` (plain tensor or DTensor); a DTensor result keeps ``u``'s placements.

    ``ns`` are the keyword arguments of :func:`zeropower_via_newtonschulz5`.
    """
    if not isinstance(u, DTensor):
        return _ns_blocks(u, row_blocks, **ns)
    mesh, placements = u.device_mesh, u.placements
    matrix_dims = {u.ndim - 2, u.ndim - 1}
    # Gather only what NS needs: shards of the matrix dims (and any pending partial sum).
    whole = tuple(Replicate() if p.is_partial() or _sharded_dim(p, u.ndim) in matrix_dims else p for p in placements)
    local = u.redistribute(mesh, whole).to_local()
    out = _ns_blocks(local, row_blocks, **ns)
    # Replicate -> Shard is a local slice: every rank computed the same full matrices.
    out = DTensor.from_local(out, mesh, whole, run_check=False, shape=u.shape, stride=u.stride())
    # A pending partial sum was reduced above; the update is replicated on that mesh dim.
    return out.redistribute(mesh, tuple(Replicate() if p.is_partial() else p for p in placements))


def adjust_muon_lr(lr: float, rule: AdjustLR | None, matrix_shape: Sequence[int]) -> float:
    """Per-matrix LR scale: ``match_rms_adamw`` = 0.2*sqrt(max(m, n)) (Moonlight, reuses AdamW's LR),
    ``original`` = sqrt(max(1, m/n)) (Keller Jordan), ``none`` = 1."""
    m, n = matrix_shape[-2], matrix_shape[-1]
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(m, n))
    if rule == "original" or rule is None:
        return lr * math.sqrt(max(1.0, m / n))
    if rule == "none":
        return lr
    raise ValueError(f"adjust_lr={rule!r}: use 'match_rms_adamw', 'original' or 'none'")


_MUON_DEFAULTS: dict[str, Any] = {
    "lr": 0.02,
    "weight_decay": 0.0,
    "momentum": 0.95,
    "nesterov": True,
    "ns_steps": 5,
    "ns_coefficients": NS_COEFFICIENTS,
    "eps": 1e-7,
    "adjust_lr_fn": "match_rms_adamw",
    "ns_dtype": "float32",
    "row_blocks": 1,
}
_ADAMW_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.01,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "fused": None,
    "capturable": False,
    "differentiable": False,
}


class MuonWithAuxAdamW(torch.optim.Optimizer):
    """One optimizer: Muon for groups with ``use_muon=True``, AdamW for groups with ``use_muon=False``.

    Each group dict needs ``params`` and ``use_muon``; missing hyper-parameters take the Muon or
    AdamW defaults above. Muon params must be >= 2-D (the last two dims are the matrix). The AdamW
    groups run ``torch.optim.AdamW``'s own functional kernel (foreach/fused as the group says), with
    the same state keys (``step``, ``exp_avg``, ``exp_avg_sq``), so DCP and resharding treat them
    like any AdamW state.
    """

    def __init__(self, param_groups: Iterable[dict[str, Any]]) -> None:
        groups = []
        for group in param_groups:
            if "use_muon" not in group:
                raise ValueError("every MuonWithAuxAdamW param group needs a 'use_muon' key")
            defaults = _MUON_DEFAULTS if group["use_muon"] else _ADAMW_DEFAULTS
            unknown = set(group) - set(defaults) - {"params", "use_muon"}
            if unknown:
                kind = "Muon" if group["use_muon"] else "AdamW"
                raise ValueError(f"unknown {kind} group option(s) {sorted(unknown)}; known: {sorted(defaults)}")
            group = {**defaults, **group, "params": list(group["params"])}
            if group["use_muon"]:
                if group["ns_dtype"] not in _NS_DTYPES:
                    raise ValueError(f"ns_dtype={group['ns_dtype']!r}: use one of {sorted(_NS_DTYPES)}")
                for p in group["params"]:
                    if p.ndim < 2:
                        raise ValueError(
                            f"Muon got a {p.ndim}-D parameter of shape {tuple(p.shape)}: put 1-D parameters "
                            "(norms, biases) in an AdamW group"
                        )
                adjust_muon_lr(1.0, group["adjust_lr_fn"], (1, 1))  # validates the rule name
            groups.append(group)
        super().__init__(groups, defaults={})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        ns = {
            "steps": group["ns_steps"],
            "coefficients": tuple(group["ns_coefficients"]),
            "eps": group["eps"],
            "dtype": _NS_DTYPES[group["ns_dtype"]],
        }
        row_blocks = group["row_blocks"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            update = orthogonalize(update, row_blocks=row_blocks, **ns)
            matrix = (p.shape[-2] // row_blocks, p.shape[-1])
            adjusted_lr = adjust_muon_lr(lr, group["adjust_lr_fn"], matrix)
            p.mul_(1 - lr * wd)
            p.add_(update.to(p.dtype), alpha=-adjusted_lr)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            state = self.state[p]
            if len(state) == 0:
                # Same state layout as torch.optim.AdamW (step on CPU unless fused/capturable).
                on_device = group["fused"] or group["capturable"]
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                max_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        _adamw_functional(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_sqs,
            steps,
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            has_complex=any(torch.is_complex(p) for p in params),
            amsgrad=group["amsgrad"],
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )

