"""Per-parameter gradient comparison for the layout tests.

A loss curve and a global gradient norm can hide a wrong gradient: a replicated weight that misses its
tensor-parallel reduction (a norm inside a TP region, a gate that sees only the rank's tokens) barely
moves either over ten steps. So every layout also reports each parameter's first-step gradient, whole,
and the tests compare it with the single-process run.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["assert_grads_match", "whole_grads"]


def whole_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gradient as a whole tensor (a collective for sharded ones: call on every rank)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = g.detach().clone()  # a copy: a one-rank full_tensor() aliases what clipping scales
    return out


def assert_grads_match(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = 1e-5) -> str:
    """Same parameters, each gradient within ``tol`` of ``want``'s relative to its largest entry; returns
    a one-line summary (the worst parameter)."""
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    rel = {n: (got[n] - g).abs().max().item() / max(g.abs().max().item(), 1e-3) for n, g in want.items()}
    worst = max(rel, key=rel.get)
    assert rel[worst] <= tol, f"first-step gradient of {worst} differs by {rel[worst]:.2e} (relative)"
    return f"worst first-step gradient {worst} {rel[worst]:.2e}"
