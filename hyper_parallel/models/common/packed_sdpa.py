"""Causal SDPA over packed documents: the per-document loop, and the same loop as a ``torch.library`` custom op.

``sdpa_documents`` runs one fused causal SDPA call per document on 4-D ``[1, H, L, d]`` views (the layout
SDPA's fused kernels take; see ``attention.py``). Its Python loop follows the document boundaries, so
dynamo must not trace it: a traced loop would bake the boundaries into the graph and recompile for every
packing. Under ``torch.compile`` the attention core calls ``hyper_parallel::sdpa_packed`` instead: an opaque
op whose boundaries arrive as an int tensor on the host (``AttentionMeta.cu_seqlens_cpu``), so the graph
sees only its (dynamic) length, and a block stays one graph (``--compile.fullgraph``).

The op's backward recomputes each document's attention with autograd (the forward keeps no per-document
state): one extra attention forward per layer, on the path that has no varlen kernel (CPU, fp32 CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["sdpa_documents", "sdpa_packed"]


def sdpa_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cu: Sequence[int]) -> torch.Tensor:
    """q ``[B, H, T, dqk]``, k/v ``[B, Hk, T, d]``, ``cu`` host boundaries over the flat ``B*T`` stream (every row
    boundary among them) -> ``[B, T, H, dv]`` (contiguous), causal inside each document."""
    B, H, T, dqk = q.shape
    dv = v.shape[-1]
    if dv < dqk:
        # SDPA's fused kernels need one head dim for q, k and v: with MLA's smaller v they fall back to the
        # math kernel. Zero-padding v and dropping the padded output channels is exact.
        v = F.pad(v, (0, dqk - dv))
    gqa = k.shape[1] != H
    if len(cu) == B + 1:  # one document per row: plain batched causal attention
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        out = out.transpose(1, 2)
    else:
        outs = []
        for s, e in zip(cu[:-1], cu[1:]):
            b, lo = divmod(s, T)
            hi = e - b * T  # a document never crosses a row, so [lo, hi) lies in row b
            o = F.scaled_dot_product_attention(
                q[b : b + 1, :, lo:hi], k[b : b + 1, :, lo:hi], v[b : b + 1, :, lo:hi],
                is_causal=True, scale=scale, enable_gqa=gqa,
            )  # fmt: skip
            outs.append(o.transpose(1, 2))  # [1, L, H, d]
        # token-major concatenation [1, B*T, H, d] -> [B, T, H, d] (rows are consecutive in the stream)
        out = torch.cat(outs, dim=1).view(B, T, H, dqk)
    # contiguous whichever branch ran: compiled code after the call is specialised on the output's strides
    return out.contiguous() if dv == dqk else out[..., :dv].contiguous()


def _boundaries(cu_seqlens: torch.Tensor) -> list[int]:
    # a host tensor (AttentionMeta.cu_seqlens_cpu) costs no device sync; a device one syncs once per call
    return cu_seqlens.tolist()


@torch.library.custom_op("hyper_parallel::sdpa_packed", mutates_args=())
def sdpa_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """``sdpa_documents`` as an opaque op: ``cu_seqlens`` is an int tensor of the boundaries, preferably on the
    host (then the op never syncs with the device)."""
    with torch.no_grad():
        return sdpa_documents(q, k, v, scale, _boundaries(cu_seqlens))


@sdpa_packed.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    B, H, T, _ = q.shape
    return q.new_empty(B, T, H, v.shape[-1])


@torch.library.custom_op("hyper_parallel::sdpa_packed_backward", mutates_args=())
def sdpa_packed_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``sdpa_packed`` w.r.t. q, k, v (the forward recomputed with autograd)."""
    cu = _boundaries(cu_seqlens)
    # functorch's vjp, not torch.autograd: an op's kernel runs below the autograd dispatch key, where tensors
    # record no graph; the vjp transform differentiates regardless
    _, vjp = torch.func.vjp(lambda q_, k_, v_: sdpa_documents(q_, k_, v_, scale, cu), q, k, v)
    dq, dk, dv = vjp(grad)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@sdpa_packed_backward.register_fake
def _(grad, q, k, v, cu_seqlens, scale):
    # contiguous like the kernel's results (empty_like would copy the strides of q/k/v, often transposed views)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, scale = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens)
    ctx.scale = scale


def _backward(ctx, grad: torch.Tensor):
    q, k, v, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = sdpa_packed_backward(grad.contiguous(), q, k, v, cu_seqlens, ctx.scale)
    return dq, dk, dv, None, None


sdpa_packed.register_autograd(_backward, setup_context=_setup_context)
