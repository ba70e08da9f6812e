"""Comparing a parallel layout's run with the single-process run (the layout tests of every family).

A loss curve and a global gradient norm can hide a wrong gradient: a replicated weight that misses its
tensor-parallel reduction (a norm inside a TP region, a gate that sees only the rank's tokens) barely
moves either over ten steps. So every layout also reports each parameter's first-step gradient, whole,
and ``assert_matches_reference`` compares it with the single-process run's, besides losses and norms.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["assert_grads_match", "assert_matches_reference", "whole_grads"]


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


def assert_matches_reference(out: dict[str, Any], reference: dict[str, Any], label: str, *, learns_by: float) -> None:
    """A fp32 layout run equals the single-process run: every first-step gradient (1e-5 relative), step-1
    |dloss| <= 1e-5, every step <= 1e-4, clipped gradient norms within 1e-4 relative; and the reference
    itself learns (its loss falls by ``learns_by``)."""
    dloss = [abs(a - b) for a, b in zip(out["losses"], reference["losses"], strict=True)]
    dnorm = [abs(a - b) / b for a, b in zip(out["grad_norms"], reference["grad_norms"], strict=True)]
    print(f"\n{label}: step-1 |dloss| {dloss[0]:.2e}, max |dloss| {max(dloss):.2e}, grad-norm rel {max(dnorm):.2e}")
    print("  " + assert_grads_match(out["first_grads"], reference["first_grads"]))
    assert dloss[0] <= 1e-5, dloss
    assert max(dloss) <= 1e-4, dloss
    assert max(dnorm) <= 1e-4, dnorm
    assert reference["losses"][-1] < reference["losses"][0] - learns_by, reference["losses"]
