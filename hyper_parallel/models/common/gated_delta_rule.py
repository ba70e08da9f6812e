"""The gated delta rule (Gated DeltaNet's recurrence) in chunked fp32 form, exact for packed documents.

Legend: B batch, T tokens, Hk key heads, Hv value heads (``Hv % Hk == 0``; value head ``h`` reads key
head ``h // (Hv / Hk)``), Dk/Dv key/value head dims, C channels of the causal conv, K conv taps,
L chunk length, N chunks.

Per value head, with state ``S [Dk, Dv]`` starting at 0 at every document start (HF reference doc 1.5)::

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
    q, k = l2norm(q) * Dk^-0.5, l2norm(k)    (eps 1e-6, fp32)

Chunked form (HF ``torch_chunk_gated_delta_rule``): inside a chunk, ``gamma = cumsum(g)``,
``Gam_ij = exp(gamma_i - gamma_j)`` (j <= i), ``A = (beta K K^T) * Gam`` and, with the unit-lower-triangular
``(I + strict_lower(A))^-1``, ``U = (I + A)^-1 beta V``, ``W = (I + A)^-1 beta K e^gamma``; then per chunk in order
``v' = U - W S``, ``o = (Q e^gamma) S + (Q K^T * Gam) v'``, ``S <- e^gamma_L S + (K e^(gamma_L - gamma))^T v'``.

Packing: ``cu_seqlens`` over the flattened ``B*T`` stream (documents never cross rows). Every document
is cut into its own chunks (the last one zero-padded), so no chunk mixes two documents; the only
sequential part, the scan over chunks, runs all documents side by side: step ``j`` processes chunk
``j`` of every document that has one (documents sorted by length, so those are a prefix). The causal
conv restarts the same way: taps never reach before a document's start. Both are exactly "run each
document alone", with no Python loop over tokens.

Implementations (``GatedDeltaRule.Config.backend``): ours above (any device, fp32 inside), or on CUDA with
fp16/bf16 inputs the ``causal-conv1d`` and ``flash-linear-attention`` kernels (the optional ``gpu`` extra;
``seq_idx`` / ``cu_seqlens`` keep packing exact there too). ``auto`` takes the kernels when they can run.

No device-to-host sync on any path: the bounds come as host ints (``AttentionMeta.boundaries``, from the batch's
``cu_seqlens_host``) plus the same bounds already on the device (``AttentionMeta.cu_seqlens``); every index
tensor (chunk layout, conv boundary rows, ``seq_idx``) is computed from them by device ops with host-known sizes,
once per micro-batch (``deltanet_plan``). Under ``torch.compile`` the core is one custom op,
``hyper_parallel::gated_delta_rule`` (bounds as tensors: a new packing reuses the graph).
"""

from __future__ import annotations

import bisect
import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from hyper_parallel.models.common.attention import AttentionMeta, CPShard, check_boundaries
from hyper_parallel.models.common.deltanet_plan import (
    ConvPlan,
    cached,
    chunk_plan,
    conv_plan,
    device_bounds,
    host_index,
)
from hyper_parallel.protocols.module import Module

try:  # optional CUDA kernels (the ``gpu`` extra); the torch path below never needs them
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
except ImportError:  # pragma: no cover - depends on the environment
    fla_chunk_gated_delta_rule = None
try:
    from causal_conv1d import causal_conv1d_fn
except ImportError:  # pragma: no cover - depends on the environment
    causal_conv1d_fn = None
try:  # fla's own Triton conv: the kernel path without a compiled causal-conv1d (pure Python + Triton wheels)
    from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d
except ImportError:  # pragma: no cover - depends on the environment
    fla_causal_conv1d = None

__all__ = [
    "GatedDeltaRule",
    "causal_conv1d_silu",
    "chunk_gated_delta_rule",
    "cuda_kernels_can_run",
    "document_bounds",
    "gated_delta_rule_cp",
]


def document_bounds(cu_seqlens: torch.Tensor | list[int] | None, batch: int, seqlen: int) -> list[int]:
    """Document starts/ends over the flat ``B*T`` stream as a host list (rows when ``cu_seqlens`` is None).

    A tensor is read back (a device-to-host sync on an accelerator): layers take the host bounds from
    ``AttentionMeta.boundaries`` instead; this is for tests and host-side callers."""
    if cu_seqlens is None:
        return list(range(0, batch * seqlen + 1, seqlen))
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    check_boundaries(cu, batch, seqlen)
    return cu


def _recompute_rows(out_NC: torch.Tensor, x_NC: torch.Tensor, w_CK: torch.Tensor, windows: tuple) -> None:
    """``out[rows] = sum_j w[:, j] * x[src[:, j]]`` over the in-document taps of a ``ConvPlan`` window,
    accumulated by fused multiply-adds for ``j = 0 .. K-1`` (the stream's order and rounding)."""
    rows, src, valid = windows
    if not rows.numel():
        return
    x_RKC = x_NC.index_select(0, src.flatten()).view(*src.shape, -1) * valid.unsqueeze(-1).to(x_NC.dtype)
    fixed = x_NC.new_zeros(rows.numel(), x_NC.shape[1])
    for j in range(w_CK.shape[-1]):
        fixed.addcmul_(x_RKC[:, j], w_CK[:, j])
    out_NC.index_copy_(0, rows, fixed)


def _conv_input_grad(g_NC: torch.Tensor, w_CK: torch.Tensor, plan: ConvPlan) -> torch.Tensor:
    """``grad_x[u] = sum_j w[:, j] * g[u + K-1-j]`` over ``u``'s own document, on the flat channel-last
    stream: K fused multiply-adds over the whole stream (memory-bound: no transposes, no padded copy), then
    the rows before each document boundary recomputed from in-document terms only (exact)."""
    N, K = g_NC.shape[0], w_CK.shape[-1]
    out = torch.empty_like(g_NC)
    s0 = min(K - 1, N)  # the farthest shift that has a source row
    out[N - s0 :].zero_()
    torch.mul(g_NC[s0:], w_CK[:, K - 1 - s0], out=out[: N - s0])
    for s in range(s0 - 1, -1, -1):
        out[: N - s].addcmul_(g_NC[s:], w_CK[:, K - 1 - s])
    _recompute_rows(out, g_NC, w_CK, plan.backward)
    return out


def _conv_weight_grad(g_NC: torch.Tensor, x_NC: torch.Tensor, K: int, plan: ConvPlan) -> torch.Tensor:
    """``grad_w[:, K-1-s] = sum_t g[t] * x[t - s]`` over pairs inside one document (cross-document pairs of
    the full-stream product are zeroed before the sum, not subtracted after)."""
    N = g_NC.shape[0]
    grad_w = g_NC.new_zeros(g_NC.shape[1], K)
    # one product buffer for every shift (a fresh one each costs page faults), with a spare row that takes the
    # plan's candidate rows pairing no two documents
    buf = g_NC.new_empty(N + 1, g_NC.shape[1])
    for s in range(min(K, N)):
        prod = torch.mul(g_NC[s:], x_NC[: N - s], out=buf[: N - s])
        if s:
            buf[: N - s + 1].index_fill_(0, plan.crossing[s - 1], 0)
        grad_w[:, K - 1 - s] = prod.sum(0)
    return grad_w


def _conv_forward(x_NC: torch.Tensor, w_CK: torch.Tensor, plan: ConvPlan) -> torch.Tensor:
    """Pre-activation causal conv per document on the flat channel-last stream: ``y[t] = x[t-K+1] w[:, 0]``,
    then ``y[t] += x[t-K+1+j] w[:, j]`` as fused multiply-adds for ``j = 1 .. K-1`` (taps before the
    document start add nothing). That is ``F.conv1d``'s accumulation order on CPU (oneDNN), so the result
    is HF's, bit for bit where the CPU fuses the same way, with no transposes or padded copies (memory-bound:
    K passes over the stream). The first rows of every later document are recomputed from in-document taps.
    """
    N, K = x_NC.shape[0], w_CK.shape[-1]
    y = torch.empty_like(x_NC)
    s0 = min(K - 1, N)  # tap 0 reads K-1 rows back
    y[:s0].zero_()
    torch.mul(x_NC[: N - s0], w_CK[:, 0], out=y[s0:])
    for j in range(1, K):
        s = K - 1 - j
        if s < N:
            y[s:].addcmul_(x_NC[: N - s], w_CK[:, j])
    _recompute_rows(y, x_NC, w_CK, plan.forward)
    return y


class _CausalConvSiLU(torch.autograd.Function):
    """``silu(causal depthwise conv)`` per document of ``x [B, T, C]`` with ``w [C, K]``:
    ``y[t] = sum_j w[:, j] * x[t - K + 1 + j]`` over rows of ``t``'s own document (zeros before its start).

    Both directions are shifted multiply-adds over the flat channel-last stream (on CPU several times faster
    than the depthwise ``convolution`` / ``convolution_backward`` with their transposes), exact per document.
    Forward (``_conv_forward``): ``F.conv1d``'s accumulation order, in the weight's dtype, returned in ``x``'s
    dtype. Backward (``_conv_input_grad``, ``_conv_weight_grad``): in fp32. ``plan``: the document bounds'
    ``ConvPlan`` (device index tensors, made once per micro-batch).
    """

    @staticmethod
    def forward(ctx, x_BTC: torch.Tensor, w_CK: torch.Tensor, plan: ConvPlan) -> torch.Tensor:  # noqa: D102
        B, T, C = x_BTC.shape
        x = x_BTC.to(w_CK.dtype).reshape(B * T, C).contiguous()
        y = _conv_forward(x, w_CK, plan)
        ctx.save_for_backward(x, w_CK, y)
        ctx.plan, ctx.in_dtype = plan, x_BTC.dtype
        return F.silu(y).view(B, T, C).to(x_BTC.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # noqa: D102
        x_NC, w, y_NC = ctx.saved_tensors
        f32 = torch.float32
        g = torch.ops.aten.silu_backward(grad.reshape(y_NC.shape).to(f32), y_NC.to(f32)).contiguous()
        grad_x = _conv_input_grad(g, w.to(f32), ctx.plan)
        grad_w = _conv_weight_grad(g, x_NC.to(f32), w.shape[-1], ctx.plan)
        return grad_x.view(grad.shape).to(ctx.in_dtype), grad_w.to(w.dtype), None


def causal_conv1d_silu(
    x_BTC: torch.Tensor, weight_CK: torch.Tensor, cu: list[int], cu_dev: torch.Tensor | None = None
) -> torch.Tensor:
    """``silu(depthwise causal conv)`` per document of the flat ``B*T`` stream (``cu``: host bounds, e.g. from
    ``AttentionMeta.boundaries``; ``cu_dev``: the same bounds on the device when the caller has them);
    ``w[:, K-1]`` multiplies the current token. Packed documents are exact."""
    plan = conv_plan(cu, cu_dev, weight_CK.shape[-1], x_BTC)
    return _CausalConvSiLU.apply(x_BTC, weight_CK, plan)


class _UnitLowerSolve(torch.autograd.Function):
    """``X_i = (I + strict_lower(A))^-1 B_i`` for two right-hand sides and a batch of ``[L, L]`` matrices
    (diagonal and upper part of A ignored).

    Forward: one unit-lower-triangular solve per right-hand side (column-wise, so bitwise the same as one
    solve against ``[B_1 | B_2]``, without the cat and split copies; ``X = T B`` with the explicit inverse
    ``T`` is faster on CPU, but its rounding drifts about twice as far from HF's gradients). Backward with
    ``T`` (one solve against the identity): ``dB_i = T^T dX_i`` and ``dA = -sum_i dB_i X_i^T`` on the strict
    lower triangle, as batched matmuls (on CPU, autograd's transposed triangular solve against a strided
    gradient is several times slower).
    """

    @staticmethod
    def forward(ctx, A: torch.Tensor, B1: torch.Tensor, B2: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: D102
        X1, X2 = (torch.linalg.solve_triangular(A, B, upper=False, unitriangular=True) for B in (B1, B2))
        ctx.save_for_backward(A, X1, X2)
        return X1, X2

    @staticmethod
    def backward(ctx, grad1: torch.Tensor | None, grad2: torch.Tensor | None):  # noqa: D102
        A, X1, X2 = ctx.saved_tensors
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A).contiguous()
        T_inv = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
        grad1 = torch.zeros_like(X1) if grad1 is None else grad1
        grad2 = torch.zeros_like(X2) if grad2 is None else grad2
        grad_B1, grad_B2 = T_inv.mT @ grad1, T_inv.mT @ grad2
        grad_A = grad_B1 @ X1.mT + grad_B2 @ X2.mT
        return -grad_A.tril(-1), grad_B1, grad_B2


def _steps_to_run(docs_per_step: list[int], like: torch.Tensor) -> list[bool]:
    """Which steps of a chunk scan (in loop order) to execute: all of them, unless ``like`` holds no data (a fake
    or meta tensor: the dry run sizing a step). Then only allocations matter, and every step with the same number
    of documents allocates the same temporaries into the same preallocated outputs: the first two of each count
    (the first may grow or replace the state, the second is the steady state) stand for the rest, with the same
    peak and a handful of dispatches instead of ~30 per chunk (a 128k-token sequence has 2048 chunks)."""
    if not (is_fake(like) or like.device.type == "meta"):
        return [True] * len(docs_per_step)
    seen: dict[int, int] = {}
    run = []
    for n in docs_per_step:
        seen[n] = seen.get(n, 0) + 1
        run.append(seen[n] <= 2)
    return run


class _ChunkScan(torch.autograd.Function):
    """The only sequential part of the chunked form, for chunks in step-major order (step ``j`` holds chunk
    ``j`` of the first ``docs_per_step[j]`` documents), per value head::

        v'_n = U_n - W_n S_n;   o_n = Qd_n S_n + P_n v'_n;   S_next = d_n S_n + Kd_n^T v'_n
        (S = 0 at every document start)

    ``U [N, H, L, Dv]``, ``W``/``Qd``/``Kd [N, H, L, Dk]``, ``P [N, H, L, L]``, ``d [N, H, 1, 1]``. Backward is
    the reverse recurrence, written out (autograd over the Python loop would launch ~20 tiny ops per step and
    write a zero-filled full-size gradient for every slice)::

        dv'_n = P_n^T dO_n + Kd_n dS_next;   dS_n = d_n dS_next + Qd_n^T dO_n - W_n^T dv'_n
        dW_n = -dv'_n S_n^T;  dQd_n = dO_n S_n^T;  dP_n = dO_n v'_n^T;  dKd_n = v'_n dS_next^T
        dd_n = <dS_next, S_n>

    Every product runs inside its step, on one step's chunks (cache-resident on CPU; batching the
    non-sequential ones over all chunks was measured no faster), writing into preallocated outputs.
    """

    @staticmethod
    def forward(ctx, U, W, Qd, P, Kd, decay, docs_per_step: list[int]) -> torch.Tensor:  # noqa: D102
        N, H, _, Dv = U.shape
        states = U.new_empty(N, H, W.shape[-1], Dv)  # S_n of every chunk, for the backward
        v_new, out = torch.empty_like(U), U.new_empty(U.shape)  # v' laid out like U (rounding of P v')
        S = U.new_zeros(docs_per_step[0], H, W.shape[-1], Dv)
        a = 0
        for n, run in zip(docs_per_step, _steps_to_run(docs_per_step, U)):
            b = a + n
            if run:
                S = S[:n]
                states[a:b] = S
                torch.sub(U[a:b], W[a:b] @ S, out=v_new[a:b])
                torch.add(Qd[a:b] @ S, P[a:b] @ v_new[a:b], out=out[a:b])
                S = S * decay[a:b] + Kd[a:b].mT @ v_new[a:b]
            a = b
        ctx.save_for_backward(W, Qd, P, Kd, decay, states, v_new)
        ctx.docs_per_step = docs_per_step
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # noqa: D102
        W, Qd, P, Kd, decay, states, v_new = ctx.saved_tensors
        dO = grad_out.contiguous()
        grads = [t.new_empty(t.shape) for t in (v_new, W, Qd, P, Kd, decay)]  # contiguous: written by slices
        dU, dW, dQd, dP, dKd, dd = grads
        dS = states.new_zeros(0, *states.shape[1:])  # gradient of the state after the current step
        b = states.shape[0]
        steps = ctx.docs_per_step[::-1]
        for n, run in zip(steps, _steps_to_run(steps, dO)):
            a = b - n
            if dS.shape[0] < n:  # documents whose last chunk this is: nothing flows back from after it
                dS = torch.cat([dS, dS.new_zeros(n - dS.shape[0], *dS.shape[1:])])
            if run:
                S, dO_j, v_j = states[a:b], dO[a:b], v_new[a:b]
                torch.add(P[a:b].mT @ dO_j, Kd[a:b] @ dS, out=dU[a:b])  # dv' = dU
                torch.bmm(v_j.flatten(0, 1), dS.mT.flatten(0, 1), out=dKd[a:b].flatten(0, 1))
                torch.sum(dS * S, dim=(-1, -2), keepdim=True, out=dd[a:b])
                torch.bmm(dO_j.flatten(0, 1), S.mT.flatten(0, 1), out=dQd[a:b].flatten(0, 1))
                torch.bmm(dO_j.flatten(0, 1), v_j.mT.flatten(0, 1), out=dP[a:b].flatten(0, 1))
                torch.bmm(dU[a:b].flatten(0, 1), S.mT.flatten(0, 1), out=dW[a:b].flatten(0, 1)).neg_()
                dS = dS * decay[a:b] + Qd[a:b].mT @ dO_j - W[a:b].mT @ dU[a:b]
            b = a
        return dU, dW, dQd, dP, dKd, dd, None


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def chunk_gated_delta_rule(
    q_BTHD: torch.Tensor,
    k_BTHD: torch.Tensor,
    v_BTHD: torch.Tensor,
    g_BTH: torch.Tensor,
    beta_BTH: torch.Tensor,
    *,
    cu: list[int],
    chunk_size: int = 64,
) -> torch.Tensor:
    """Gated delta rule with l2-normalised q/k (HF ``use_qk_l2norm_in_kernel=True``), state reset per document.

    q/k ``[B, T, Hk, Dk]``, v ``[B, T, Hv, Dv]``, g (log decay, fp32) and beta ``[B, T, Hv]`` ->
    ``[B, T, Hv, Dv]`` in q's dtype. ``cu`` = document bounds over the flat stream (``document_bounds``).
    Everything inside runs in fp32.
    """
    B, T, Hk, Dk = k_BTHD.shape
    Hv, Dv = v_BTHD.shape[-2:]
    grouped = torch.cat([q_BTHD, k_BTHD, v_BTHD.reshape(B, T, Hk, -1)], dim=-1)  # [B, T, Hk, 2Dk + r*Dv]
    return _chunk_rule(grouped.reshape(B, T, -1), g_BTH, beta_BTH, Hk=Hk, Dk=Dk, Dv=Dv, cu=cu, chunk_size=chunk_size,
                       out_dtype=q_BTHD.dtype)  # fmt: skip


def _intra_chunk(
    qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, Hk: int, Dk: int, Dv: int, L: int
) -> tuple[torch.Tensor, ...]:
    """The intra-chunk quantities of every chunk at once, from inputs laid out in chunks ``[N, L, F]``:
    ``(U, W, Q e^gamma, P, K e^(gamma_L - gamma), e^gamma_L)``, each ``[N, Hv, ...]`` (the scan's operands)."""
    Hv = g.shape[-1]
    r = Hv // Hk
    q, k, v = qkv.reshape(-1, L, Hk, 2 * Dk + r * Dv).split([Dk, Dk, r * Dv], dim=-1)
    # [N, H, L, d]; value head h reads key head h // r (block grouping)
    # (head-major and contiguous: every matmul and solve below then reads them without a copy)
    q = (_l2norm(q) * Dk**-0.5).transpose(1, 2).repeat_interleave(r, dim=1)
    k = _l2norm(k).transpose(1, 2).repeat_interleave(r, dim=1)
    v = v.reshape(-1, L, Hv, Dv).transpose(1, 2).contiguous()
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [N, Hv, L]
    gamma = g.cumsum(dim=-1)
    upper = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
    decay_LL = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    A = (k_beta @ k.transpose(-1, -2)) * decay_LL
    P = (q @ k.transpose(-1, -2)) * decay_LL
    # The unit-lower-triangular solve for both right-hand sides, beta V and beta K e^gamma.
    U, W = _UnitLowerSolve.apply(A, v * beta.unsqueeze(-1), k_beta * gamma.exp().unsqueeze(-1))
    Qd = q * gamma.exp().unsqueeze(-1)
    Kd = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)
    decay = gamma[..., -1].exp()[..., None, None]
    return U, W, Qd, P, Kd, decay


def _chunk_rule(
    qkv_BTC: torch.Tensor,
    g_BTH: torch.Tensor,
    beta_BTH: torch.Tensor,
    *,
    Hk: int,
    Dk: int,
    Dv: int,
    cu: list[int],
    chunk_size: int,
    out_dtype: torch.dtype,
    cu_dev: torch.Tensor | None = None,
) -> torch.Tensor:
    """``chunk_gated_delta_rule`` on q/k/v grouped by key head: ``qkv [B, T, Hk * (2Dk + r*Dv)]`` with rows
    ``[q_j | k_j | v_{j*r} .. v_{j*r+r-1}]`` per key head ``j`` (what ``GatedDeltaNet``'s conv hands on).
    ``cu``: host bounds; ``cu_dev``: the same on the device, when the caller has them (``chunk_plan``)."""
    B, T, C = qkv_BTC.shape
    Hv = g_BTH.shape[-1]
    L = chunk_size
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    n_docs = len(lengths)
    # Every per-token input laid out in chunks [N, L, F] in step-major order (chunk j of every document that
    # has one, documents sorted by length); padding slots are zeros. Each input separately: a cat of them
    # would cost a full copy forward and another backward.
    if len(set(lengths)) == 1:  # equal documents (plain rows): a reshape (a view for one row), no gather
        n = lengths[0]
        steps = -(-n // L)
        docs_per_step = [n_docs] * steps

        def to_chunks(t_BTF: torch.Tensor) -> torch.Tensor:
            t = t_BTF.reshape(n_docs, n, -1)
            if steps * L != n:
                t = F.pad(t, (0, 0, 0, steps * L - n))
            return t.view(n_docs, steps, L, -1).transpose(0, 1).reshape(steps * n_docs, L, -1)

        plan = None
    else:
        plan = chunk_plan(cu, cu_dev, L, qkv_BTC)
        docs_per_step = plan.docs_per_step

        def to_chunks(t_BTF: torch.Tensor) -> torch.Tensor:
            flat = torch.cat([t_BTF.reshape(B * T, -1), t_BTF.new_zeros(1, t_BTF.shape[-1])])
            return flat.index_select(0, plan.gather_NL.reshape(-1)).view(*plan.gather_NL.shape, -1)

    U, W, q_decay, attn, k_decay, chunk_decay = _intra_chunk(
        to_chunks(qkv_BTC.float()), to_chunks(g_BTH.float()), to_chunks(beta_BTH.float()), Hk=Hk, Dk=Dk, Dv=Dv, L=L
    )
    # The scan over chunk steps (documents side by side, finished ones drop off the end).
    o_NHLD = _ChunkScan.apply(U, W, q_decay, attn, k_decay, chunk_decay, docs_per_step)
    o_NLHD = o_NHLD.transpose(1, 2)  # [N, L, Hv, Dv]
    if plan is None:
        n = lengths[0]
        o = o_NLHD.reshape(len(docs_per_step), n_docs, L, Hv, Dv).transpose(0, 1).reshape(n_docs, -1, Hv, Dv)[:, :n]
        return o.reshape(B, T, Hv, Dv).to(out_dtype)
    o = o_NLHD.reshape(-1, Hv, Dv).index_select(0, plan.slot_of_token)
    return o.view(B, T, Hv, Dv).to(out_dtype)


def cuda_kernels_can_run(qkv: torch.Tensor) -> bool:
    """Whether the CUDA kernels take inputs like ``qkv``: ``flash-linear-attention`` installed (its Triton conv
    stands in for ``causal-conv1d`` when that is absent), CUDA, fp16/bf16 (fla's chunked kernel rejects fp32)."""
    conv = causal_conv1d_fn is not None or fla_causal_conv1d is not None
    installed = fla_chunk_gated_delta_rule is not None and conv
    return installed and qkv.is_cuda and qkv.dtype in (torch.float16, torch.bfloat16)


_FLA_FEATURES: dict[object, tuple[bool, bool]] = {}


def _fla_features(fn: object) -> tuple[bool, bool]:
    """``(grouped values, host bounds)``: whether this ``chunk_gated_delta_rule`` takes fewer q/k heads than value
    heads (fla >= 0.5: "GVA") and a ``cu_seqlens_cpu`` host copy of the bounds (fla >= 0.4.2)."""
    if fn not in _FLA_FEATURES:
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
            params = {}
        _FLA_FEATURES[fn] = ("GVA" in (getattr(fn, "__doc__", None) or ""), "cu_seqlens_cpu" in params)
    return _FLA_FEATURES[fn]


def _cuda_kernels_forward(
    qkv_BTHG: torch.Tensor, g_BTH: torch.Tensor, beta_BTH: torch.Tensor, conv_weight_CK: torch.Tensor,
    cu: list[int], *, Dk: int, Dv: int, cu_dev: torch.Tensor | None = None, cu_cpu: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``GatedDeltaRule`` through ``causal_conv1d_fn`` and fla's ``chunk_gated_delta_rule`` (HF's kernels).

    The conv runs channel-last on ``[B, C, T]`` views with ``seq_idx`` (the document of every token: taps
    never cross a boundary); the rule runs on the flat ``[1, B*T]`` stream with ``cu_seqlens`` (the state
    restarts per document). Both come from the device bounds (``cu_dev``, made once per micro-batch; the
    same int64 tensor object for every layer, so fla's own per-tensor caches hit), and fla also gets the host
    copy ``cu_seqlens_cpu`` where it takes one, so it never reads the bounds back. fla >= 0.5 maps value head
    ``h`` to key head ``h // r`` itself (grouped values); older versions get q/k repeated per value head.
    """
    B, T, Hk, G = qkv_BTHG.shape
    Hv = g_BTH.shape[-1]
    r = Hv // Hk
    cu_t = device_bounds(cu, cu_dev, qkv_BTHG)
    grouped, takes_host = _fla_features(fla_chunk_gated_delta_rule)
    if causal_conv1d_fn is not None:
        seq_idx_BT = _seq_idx(cu, cu_t, qkv_BTHG).view(B, T)
        x_BCT = qkv_BTHG.reshape(B, T, Hk * G).transpose(1, 2)  # channel-last memory, as seq_idx requires
        y_BTC = causal_conv1d_fn(x_BCT, conv_weight_CK, None, seq_idx=seq_idx_BT, activation="silu").transpose(1, 2)
    else:  # fla's Triton conv over the flat stream, restarting at every bound of cu_seqlens
        host = {"cu_seqlens_cpu": cu_cpu.long() if cu_cpu is not None else _host_bounds(cu, qkv_BTHG)}
        x_1NC = qkv_BTHG.reshape(1, B * T, Hk * G)
        y_BTC = fla_causal_conv1d(x_1NC, conv_weight_CK, activation="silu", cu_seqlens=cu_t, **host)[0].view(B, T, -1)
    q, k, v = y_BTC.reshape(B, T, Hk, G).split([Dk, Dk, r * Dv], dim=-1)
    if r > 1 and not grouped:
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v.reshape(B, T, Hv, Dv), g_BTH, beta_BTH.to(q.dtype))]
    extra = {}
    if takes_host:
        extra["cu_seqlens_cpu"] = cu_cpu.long() if cu_cpu is not None else _host_bounds(cu, qkv_BTHG)
    o, _ = fla_chunk_gated_delta_rule(*flat, scale=Dk**-0.5, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_t, **extra)
    return o.reshape(B, T, Hv, Dv)


def _seq_idx(cu: list[int], cu_t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """int32 ``[B*T]``: the document of every token (causal-conv1d's ``seq_idx``), from the device bounds."""

    def build() -> torch.Tensor:
        tok = torch.arange(cu[-1], device=like.device)
        return torch.searchsorted(cu_t[1:], tok, right=True).to(torch.int32)

    return cached(("seq_idx", tuple(cu)), like, build)


def _host_bounds(cu: list[int], like: torch.Tensor) -> torch.Tensor:
    """The host bounds as an int64 CPU tensor (fla's ``cu_seqlens_cpu``), made once per micro-batch."""
    return cached(("host_bounds", tuple(cu)), like, lambda: torch.tensor(cu, dtype=torch.long))


def _rule_forward(
    qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor, cu: list[int],
    cu_dev: torch.Tensor | None, cu_cpu: torch.Tensor | None, *, Dk: int, Dv: int, chunk_size: int, kernel: str,
) -> torch.Tensor:  # fmt: skip
    """``GatedDeltaRule`` without context parallel: conv + rule over the host bounds ``cu`` (``cu_dev``/``cu_cpu``:
    the same bounds on the device / as a CPU tensor, when the caller has them)."""
    B, T, Hk, G = qkv.shape
    if kernel == "cuda_kernels":
        return _cuda_kernels_forward(qkv, g, beta, conv_weight, cu, Dk=Dk, Dv=Dv, cu_dev=cu_dev, cu_cpu=cu_cpu)
    y = causal_conv1d_silu(qkv.reshape(B, T, Hk * G), conv_weight, cu, cu_dev)
    return _chunk_rule(y, g, beta, Hk=Hk, Dk=Dk, Dv=Dv, cu=cu, chunk_size=chunk_size, out_dtype=y.dtype, cu_dev=cu_dev)


# ---------------------------------------------------------------- torch.compile: the core as custom ops
#
# Dynamo cannot trace the core well: its Python loops run over the packing (a new packing would recompile), fla and
# causal-conv1d are opaque kernels (graph breaks). So compiled code calls ``hyper_parallel::gated_delta_rule``: the
# bounds enter as tensors (``cu_seqlens`` on the device, ``cu_seqlens_cpu`` on the host), read inside the op with
# no device sync. Its backward, ``hyper_parallel::gated_delta_rule_backward``, recomputes the forward under autograd
# and differentiates it (an op boundary cannot carry autograd's intermediates, whose chunk layout depends on the
# packing): the same gradients, bit for bit, for one more forward of the core. Eager code calls ``_rule_forward``
# directly (its intermediates kept, no recompute).


def _op_bounds(qkv: torch.Tensor, cu_cpu: torch.Tensor | None) -> list[int]:
    B, T = qkv.shape[:2]
    if cu_cpu is None:
        return document_bounds(None, B, T)
    cu = cu_cpu.tolist()  # a host tensor: no device sync
    check_boundaries(cu, B, T)
    return cu


@torch.library.custom_op("hyper_parallel::gated_delta_rule", mutates_args=())
def gated_delta_rule_op(
    qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
    cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None,
    head_k_dim: int, head_v_dim: int, chunk_size: int, kernel: str,
) -> torch.Tensor:  # fmt: skip
    """``GatedDeltaRule.forward`` (no context parallel) as one op: PRE-conv ``qkv [B, T, Hk, G]`` grouped by key
    head, ``g``/``beta [B, T, Hv]``, ``conv_weight [C, K]``; ``cu_seqlens`` (int, device) and ``cu_seqlens_cpu``
    (int, host) the same document bounds, or both None for one document per row; ``kernel`` "torch" or
    "cuda_kernels". Returns ``[B, T, Hv, head_v_dim]`` in ``qkv``'s dtype."""
    cu = _op_bounds(qkv, cu_seqlens_cpu)
    o = _rule_forward(qkv, g, beta, conv_weight, cu, cu_seqlens, cu_seqlens_cpu, Dk=head_k_dim, Dv=head_v_dim,
                      chunk_size=chunk_size, kernel=kernel)  # fmt: skip
    return o.contiguous()  # the layout the fake promises (equal documents come back as a strided view)


@gated_delta_rule_op.register_fake
def _(qkv, g, beta, conv_weight, cu_seqlens, cu_seqlens_cpu, head_k_dim, head_v_dim, *rest):  # noqa: ANN001, ANN002
    return qkv.new_empty(*qkv.shape[:2], g.shape[-1], head_v_dim)


@contextmanager
def _autograd_inside_op():
    """Autograd on inside an op's kernel: the dispatcher runs kernels below autograd (its keys excluded from the
    thread's dispatch set); put them back (autocast stays excluded, as in the forward) and enable grad mode."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    autograd = torch._C._dispatch_keyset_full() - torch._C._after_autograd_keyset
    keep = exclude - autograd
    for name in dir(torch._C.DispatchKey):
        if name.startswith("Autocast") and exclude.has(getattr(torch._C.DispatchKey, name)):
            keep = keep | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name))
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), keep), torch.enable_grad():
        yield


@torch.library.custom_op("hyper_parallel::gated_delta_rule_backward", mutates_args=())
def gated_delta_rule_backward_op(
    grad: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
    cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None,
    head_k_dim: int, head_v_dim: int, chunk_size: int, kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gradients of ``gated_delta_rule_op`` for ``qkv, g, beta, conv_weight``: the forward recomputed under
    autograd, then differentiated against ``grad``."""
    cu = _op_bounds(qkv, cu_seqlens_cpu)
    with _autograd_inside_op():
        leaves = [t.detach().requires_grad_() for t in (qkv, g, beta, conv_weight)]
        o = _rule_forward(*leaves, cu, cu_seqlens, cu_seqlens_cpu, Dk=head_k_dim, Dv=head_v_dim,
                          chunk_size=chunk_size, kernel=kernel)  # fmt: skip
        grads = torch.autograd.grad(o, leaves, grad, allow_unused=True)
    out = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) if d is None else d.contiguous()
           for t, d in zip(leaves, grads))  # fmt: skip
    return tuple(out)  # type: ignore[return-value]


@gated_delta_rule_backward_op.register_fake
def _(grad, qkv, g, beta, conv_weight, cu_seqlens, cu_seqlens_cpu, *consts):  # noqa: ANN001, ANN002
    return tuple(t.new_empty(t.shape) for t in (qkv, g, beta, conv_weight))  # contiguous, as the kernel returns


def _op_setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    qkv, g, beta, conv_weight, cu_seqlens, cu_seqlens_cpu, *consts = inputs
    ctx.save_for_backward(qkv, g, beta, conv_weight, cu_seqlens, cu_seqlens_cpu)
    ctx.consts = consts


def _op_backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN202
    qkv, g, beta, conv_weight, cu_seqlens, cu_seqlens_cpu = ctx.saved_tensors
    grads = gated_delta_rule_backward_op(grad.contiguous(), qkv, g, beta, conv_weight, cu_seqlens, cu_seqlens_cpu,
                                         *ctx.consts)  # fmt: skip
    return (*grads, None, None, None, None, None, None)


gated_delta_rule_op.register_autograd(_op_backward, setup_context=_op_setup_context)


class GatedDeltaRule(Module):
    """The sequence core of Gated DeltaNet: causal conv + SiLU, then the chunked gated delta rule.

    ``forward(qkv, g, beta, *, conv_weight, meta) -> o [B, T, Hv, Dv]`` with PRE-conv ``qkv [B, T, Hk,
    2*Dk + r*Dv]`` grouped by key head (``[q_j | k_j | v_{j*r} .. v_{j*r+r-1}]``, ``r = Hv / Hk``), fp32
    log decay g and beta ``[B, T, Hv]``, and ``conv_weight [C, K]`` with rows in the same grouped order,
    for exactly the heads given (the local ones under tensor or context parallel). Parameter-free:
    everything that needs whole sequences is here, so context parallel wraps this module (all-to-all from
    a sequence chunk with all heads to whole sequences with a chunk of key-head groups, whose conv rows
    are one contiguous block).
    """

    cp_head_split_inputs: ClassVar[int] = 3
    """Context parallel splits qkv (by key-head group), g and beta (by value head), all token-major ``[B, T,
    H, ...]`` (``context_parallel``)."""
    cp_state_passing: ClassVar[bool] = True
    """Beyond the key heads, context parallel passes ``cp=CPShard`` instead: the inputs are this rank's pieces
    of every row and the recurrent state is passed between pieces (``gated_delta_rule_cp``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        chunk_size: int = 64
        """Tokens per chunk of the chunked form (HF: 64); results agree to fp32 rounding for any value."""
        backend: Literal["auto", "torch", "cuda_kernels"] = "auto"
        """`torch`: ours (any device and dtype, fp32 inside); `cuda_kernels`: the `causal-conv1d` and
        `flash-linear-attention` kernels (the `gpu` extra; CUDA fp16/bf16); `auto`: the kernels when they can
        run, else ours."""

    def __init__(self, config: Config, *, head_k_dim: int, head_v_dim: int) -> None:
        super().__init__(config)
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim

    def forward(
        self,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        conv_weight: torch.Tensor,
        meta: AttentionMeta | None = None,
        cp: CPShard | None = None,
    ) -> torch.Tensor:
        B, T, Hk, G = qkv.shape
        Hv = g.shape[-1]
        dk, dv = self.head_k_dim, self.head_v_dim
        if Hv % Hk or G != 2 * dk + Hv // Hk * dv:
            raise ValueError(
                f"GatedDeltaRule: qkv groups of {G} channels do not hold 2 x {dk} key + {Hv // Hk} x {dv} value "
                f"channels for {Hk} key heads and {Hv} value heads"
            )
        if cp is not None:  # set by the context-parallel hook, never by a caller
            return gated_delta_rule_cp(qkv, g, beta, conv_weight_CK=conv_weight, meta=meta, cp=cp, head_k_dim=dk,
                                       head_v_dim=dv, chunk_size=self.config.chunk_size)  # fmt: skip
        packed = meta is not None and meta.cu_seqlens is not None
        kernel, L = self.kernel(qkv), self.config.chunk_size
        if torch.compiler.is_compiling():
            # One opaque op: the bounds enter as tensors whose values the graph never guards, so a new packing
            # reuses the compiled graph (its length turns dynamic after the first change).
            cu_cpu = meta.host_bounds() if packed else None
            return gated_delta_rule_op(qkv, g, beta, conv_weight, meta.cu_seqlens if packed else None, cu_cpu,
                                       dk, dv, L, kernel)  # fmt: skip
        cu = meta.boundaries(B, T) if packed else document_bounds(None, B, T)
        return _rule_forward(qkv, g, beta, conv_weight, cu, meta.cu_seqlens if packed else None, None,
                             Dk=dk, Dv=dv, chunk_size=L, kernel=kernel)  # fmt: skip

    def kernel(self, qkv: torch.Tensor) -> Literal["torch", "cuda_kernels"]:
        """The implementation ``forward`` runs for inputs like ``qkv`` (raises if the configured one cannot)."""
        backend = self.config.backend
        if backend == "torch":
            return "torch"
        can_run = cuda_kernels_can_run(qkv)
        if backend == "cuda_kernels" and not can_run:
            raise RuntimeError(
                "GatedDeltaRule.Config.backend='cuda_kernels' needs the flash-linear-attention package (its Triton "
                "conv, or causal-conv1d when installed; pip install 'hyper-parallel[gpu]') and CUDA fp16/bf16 inputs "
                f"(installed: fla {fla_chunk_gated_delta_rule is not None}, causal_conv1d {causal_conv1d_fn is not None}; device: "
                f"{qkv.device}, dtype: {qkv.dtype}); use backend='auto' or 'torch'"
            )
        return "cuda_kernels" if can_run else "torch"

    def cp_local_kwargs(self, args: tuple, kwargs: dict, *, rank: int, world: int) -> dict:
        """Context parallel: the conv weight rows of key-head chunk ``rank`` (``args`` hold every head);
        grouped rows make them one contiguous block."""
        n_k = args[0].shape[2]
        if n_k % world:
            raise ValueError(f"{n_k} key heads do not divide into {world} context-parallel chunks")
        return {**kwargs, "conv_weight": kwargs["conv_weight"].chunk(world)[rank]}

    def extra_repr(self) -> str:
        return f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, chunk_size={self.config.chunk_size}"


# ---------------------------------------------------------------- context parallel: state passing
# Gated DeltaNet context parallel beyond the key heads: pieces of a sequence pass their recurrent state.
#
# Legend as in ``gated_delta_rule``: B rows, t local tokens per row, T = t * cp global tokens, Hk/Hv key/value
# heads, Dk/Dv head dims, C conv channels, K conv taps, L chunk length; a *piece* is one of the equal parts a
# context-parallel rank holds of every row (``CPShard``), a *segment* the part of one document inside a piece.
#
# Why it is exact. Per value head, one chunk step of the rule is affine in the incoming state ``S [Dk, Dv]``::
#
#     v' = U - W S,   o = Qd S + P v',   S_next = (d I - Kd^T W) S + Kd^T U
#
# so over a whole piece ``S_out = M S_in + S_zero`` with ``M [Dk, Dk]`` the product of the step transitions and
# ``S_zero`` the final state of the piece run from a zero state. Each rank therefore
#
# 1. gets the ``K-1`` conv input rows before each of its pieces (one small all-gather of piece tails) and runs
#    the causal conv on ``[halo | piece]`` (taps still never cross a document start);
# 2. runs the chunked rule on its segments from zero, keeping only states: ``S_zero`` of every piece whose last
#    document continues into the next piece, and ``M`` of every piece that one document crosses whole;
# 3. all-gathers these ``(M, S_zero)`` summaries (``Hv * Dk * (Dk + Dv)`` floats per piece, independent of T);
# 4. composes the true incoming state of each of its pieces in piece order: zero at a document start,
#    ``S_zero(prev)`` when a document starts inside the previous piece, ``M(prev) S_in(prev) + S_zero(prev)``
#    when one document crosses the previous piece whole;
# 5. runs the rule again on its segments, the first one of each piece from its true incoming state: these
#    are the outputs (the "correction" is folded into one output pass, cheaper than zero-start outputs plus
#    a separate linear pass).
#
# Autograd differentiates all of it, through the all-gathers (whose backward sums every copy's gradient
# into the owner's, a reduce-scatter), so the backward is exact too. Everything runs in fp32.


def piece_segments(cu: list[int], B: int, T: int, ranges: list[tuple[int, int]]) -> list[dict]:
    """For every (row, local piece) in local stream order: its global range, local offset, the document
    boundaries strictly inside it (row coordinates), and whether the document at its start began earlier
    (``carry_in``) or the one at its end continues (``carry_out``)."""
    starts = set(cu)
    t = sum(hi - lo for lo, hi in ranges)
    out = []
    for b in range(B):
        row = b * T
        off = 0
        for lo, hi in ranges:
            inner = [s - row for s in cu if row + lo < s < row + hi]
            out.append({
                "row": b, "lo": lo, "hi": hi, "local": b * t + off, "inner": inner,
                "carry_in": row + lo not in starts, "carry_out": row + hi not in starts,
            })  # fmt: skip
            off += hi - lo
    return out


class _Anchor(torch.autograd.Function):
    """``out`` unchanged, with ``others`` joined to its graph (zero gradients): an all-gather whose output a rank
    happens not to use (every piece starts a document, or holds row starts only) must still run its backward
    collective, else the ranks that do use theirs wait for it forever."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return (grad, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes))


def _through(cu: list[int], row: int, lo: int, hi: int) -> bool:
    """One document crosses piece ``[lo, hi)`` whole (no document starts in it)."""
    i = bisect.bisect_left(cu, row + lo)
    return i == len(cu) or cu[i] >= row + hi


def _scan(U, W, Kd, decay, steps: list[int], S0: torch.Tensor, Qd=None, P=None):
    """The chunk steps of ``_ChunkScan`` from per-document initial states ``S0 [D, H, Dk, X]`` (documents in
    the plan's sorted order), by autograd. ``U=None``: the linear part only (the transition product when
    ``S0`` is the identity). Returns ``(outputs [N, H, L, Dv] or None, final states [D, H, Dk, X])``."""
    S = S0
    outs, finals = [], []
    a = 0
    for j, n in enumerate(steps):
        b = a + n
        S = S[:n]
        v_new = -(W[a:b] @ S) if U is None else U[a:b] - W[a:b] @ S
        if Qd is not None:
            outs.append(Qd[a:b] @ S + P[a:b] @ v_new)
        S = S * decay[a:b] + Kd[a:b].mT @ v_new
        n_next = steps[j + 1] if j + 1 < len(steps) else 0
        if n_next < n:  # documents n_next .. n-1 end with this step
            finals.append(S[n_next:])
        a = b
    return (torch.cat(outs) if outs else None), torch.cat(finals[::-1])


def _prepare(qkv_NC: torch.Tensor, g_NH: torch.Tensor, beta_NH: torch.Tensor, cu: list[int], *, Hk, Dk, Dv, L):
    """The intra-chunk quantities of ``_chunk_rule`` (same formulas) for the segments ``cu`` of a flat stream."""
    plan = chunk_plan(cu, None, L, qkv_NC)

    def to_chunks(t_NF: torch.Tensor) -> torch.Tensor:
        flat = torch.cat([t_NF, t_NF.new_zeros(1, t_NF.shape[-1])])
        return flat.index_select(0, plan.gather_NL.reshape(-1)).view(*plan.gather_NL.shape, -1)

    U, W, Qd, P, Kd, decay = _intra_chunk(
        to_chunks(qkv_NC.float()), to_chunks(g_NH.float()), to_chunks(beta_NH.float()), Hk=Hk, Dk=Dk, Dv=Dv, L=L
    )
    lengths = [e - s for s, e in zip(cu[:-1], cu[1:])]
    n_chunks = [-(-n // L) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda d: -n_chunks[d])  # _chunk_plan's document order
    return plan, order, (U, W, Qd, P, Kd, decay)


def _subset_rows(steps: list[int], keep: list[int]) -> tuple[list[int], list[int]]:
    """Chunk rows (step-major) and steps of the sorted documents ``keep`` (ascending) alone."""
    rows, sub_steps, a = [], [], 0
    for n in steps:
        active = [r for r in keep if r < n]
        rows += [a + r for r in active]
        sub_steps.append(len(active))
        a += n
    while sub_steps and sub_steps[-1] == 0:
        sub_steps.pop()
    return rows, sub_steps


def gated_delta_rule_cp(
    qkv_BTHG: torch.Tensor,
    g_BTH: torch.Tensor,
    beta_BTH: torch.Tensor,
    *,
    conv_weight_CK: torch.Tensor,
    meta: AttentionMeta | None,
    cp: CPShard,
    head_k_dim: int,
    head_v_dim: int,
    chunk_size: int,
) -> torch.Tensor:
    """``GatedDeltaRule`` on this context-parallel rank's pieces of every row, exact for the whole rows.

    Inputs as ``GatedDeltaRule.forward`` (PRE-conv ``qkv [B, t, Hk, G]`` grouped by key head, all of the rank's
    heads) for the local tokens; ``meta`` holds the GLOBAL document boundaries. Returns ``[B, t, Hv, Dv]``.
    """
    B, t, Hk, G = qkv_BTHG.shape
    Hv = g_BTH.shape[-1]
    Dk, Dv, L = head_k_dim, head_v_dim, chunk_size
    C, K = Hk * G, conv_weight_CK.shape[-1]
    T = t * cp.size
    packed = meta is not None and meta.cu_seqlens is not None
    cu_g = list(meta.boundaries(B, T)) if packed else document_bounds(None, B, T)
    cu_set = set(cu_g)
    ranges = cp.ranges(t)
    plen = ranges[0][1] - ranges[0][0]
    if plen < K - 1:
        raise ValueError(
            f"context-parallel pieces of {plen} tokens are shorter than the conv window ({K - 1} rows): use longer "
            "sequences or a smaller context_parallel_degree"
        )
    pieces = piece_segments(cu_g, B, T, ranges)
    x = qkv_BTHG.reshape(B, t, C)

    # 1. conv halo: the K-1 input rows before every piece come from the previous piece's owner
    halo = K - 1
    if halo:
        local_offsets = [0]
        for lo, hi in ranges[:-1]:
            local_offsets.append(local_offsets[-1] + hi - lo)
        tails = torch.stack([x[:, o + plen - halo : o + plen] for o in local_offsets])  # [np, B, K-1, C]
        gathered_tails = cp.all_gather(tails)  # [size, np, B, K-1, C]
        owner = {gp: (rk, i) for rk in range(cp.size) for i, gp in enumerate(cp.pieces_of(rk))}
    parts, cu_ext = [], [0]
    at = 0
    for p in pieces:
        b, lo, hi = p["row"], p["lo"], p["hi"]
        if halo:
            gp = lo // plen
            if gp == 0:
                parts.append(x.new_zeros(halo, C))
            else:
                rk, i = owner[gp - 1]
                parts.append(gathered_tails[rk, i, b])
        off = p["local"] - b * t
        parts.append(x[b, off : off + plen])
        # boundaries of the extended piece [lo - halo, hi): its start and every document start after it
        row = b * T
        cu_ext += [at + s - (row + lo - halo) for s in cu_g if row + lo - halo < s < row + hi]
        at += halo + plen
        cu_ext.append(at)
    cu_ext = sorted(set(cu_ext))
    x_ext = torch.cat(parts)[None]  # [1, N_ext, C]
    y_ext = causal_conv1d_silu(x_ext, conv_weight_CK, cu_ext)[0]
    # every extended piece is [halo | plen] rows: keep the piece rows ([B*t, C], local stream order)
    keep = torch.arange(len(pieces), device=y_ext.device)[:, None] * (halo + plen) + halo
    y = y_ext.index_select(0, (keep + torch.arange(plen, device=y_ext.device)).flatten())

    # 2. segments of the local stream: piece starts and the document starts inside pieces
    cu_loc, first_seg, last_seg = [], [], []
    for p in pieces:
        first_seg.append(len(cu_loc))
        cu_loc.append(p["local"])
        cu_loc += [p["local"] + s - p["lo"] for s in p["inner"]]
        last_seg.append(len(cu_loc) - 1)
    cu_loc.append(B * t)
    plan, order, (U, W, Qd, P, Kd, decay) = _prepare(
        y, g_BTH.reshape(B * t, Hv), beta_BTH.reshape(B * t, Hv), cu_loc, Hk=Hk, Dk=Dk, Dv=Dv, L=L
    )
    steps = plan.docs_per_step
    sorted_pos = {d: r for r, d in enumerate(order)}
    n_docs = len(order)
    f32 = dict(dtype=torch.float32, device=y.device)

    # 3. summaries: zero-start final states, and the transition of pieces one document crosses whole
    _, finals = _scan(U, W, Kd, decay, steps, torch.zeros(n_docs, Hv, Dk, Dv, **f32))
    through = [p["carry_in"] and not p["inner"] for p in pieces]
    keep_docs = sorted(sorted_pos[first_seg[i]] for i, th in enumerate(through) if th)
    M_of = {}
    if keep_docs:
        rows, sub_steps = _subset_rows(steps, keep_docs)
        idx = host_index(rows, y)  # one copy per micro-batch (cached by content), not per layer
        eye = torch.eye(Dk, **f32).expand(len(keep_docs), Hv, Dk, Dk)
        sub = [t_.index_select(0, idx) for t_ in (W, Kd, decay)]
        _, M = _scan(None, sub[0], sub[1], sub[2], sub_steps, eye)
        M_of = {r: M[j] for j, r in enumerate(keep_docs)}
    zeros_s, zeros_m = torch.zeros(Hv, Dk, Dv, **f32), torch.zeros(Hv, Dk, Dk, **f32)
    summary = []
    for i, p in enumerate(pieces):
        s_zero = finals[sorted_pos[last_seg[i]]] if p["carry_out"] else zeros_s
        m = M_of.get(sorted_pos[first_seg[i]], zeros_m) if through[i] else zeros_m
        summary.append(torch.cat([s_zero, m], dim=-1))
    n_local = len(ranges)
    summary = torch.stack(summary).view(B, n_local, Hv, Dk, Dv + Dk).transpose(0, 1)  # [np, B, ...]
    if halo:
        # Backward order: every rank must run the two all-gathers' backward collectives in the same order. The
        # tails' gradient waits for the summaries' backward only where the summaries depend on the conv output;
        # where they do not (zero summaries: no document continues out of or crosses the rank's pieces, e.g. a
        # document starts exactly on each piece boundary) the engine's schedule decides, and it differed between
        # ranks (gloo "Received data size doesn't match": hybrid CP, CP 2 x TP 2 with the aux loss). Tie them.
        summary = _Anchor.apply(summary, gathered_tails)
    gathered = cp.all_gather(summary.contiguous())  # [size, np, B, Hv, Dk, Dv + Dk]

    # 4. compose every local piece's incoming state (piece order; tiny [Dk, Dk] x [Dk, Dv] products)
    owner = {gp: (rk, i) for rk in range(cp.size) for i, gp in enumerate(cp.pieces_of(rk))}
    last_needed = max(lo // plen for lo, _ in ranges)
    S_in = {}
    for b in range(B):
        row, S = b * T, None
        for gp in range(1, last_needed + 1):
            lo = gp * plen
            if row + lo in cu_set:
                S = None
            else:
                rk, i = owner[gp - 1]
                prev = gathered[rk, i, b]
                s_zero, m = prev[..., :Dv], prev[..., Dv:]
                crossed = _through(cu_g, row, lo - plen, lo)
                S = m @ S + s_zero if (crossed and S is not None) else s_zero
            S_in[(b, gp)] = S

    # 5. outputs, every piece's first segment from its true incoming state
    S0 = [zeros_s] * n_docs
    for i, p in enumerate(pieces):
        s = S_in.get((p["row"], p["lo"] // plen))
        if p["carry_in"] and s is not None:
            S0[sorted_pos[first_seg[i]]] = s
    out, _ = _scan(U, W, Kd, decay, steps, torch.stack(S0), Qd=Qd, P=P)
    o = out.transpose(1, 2).reshape(-1, Hv, Dv).index_select(0, plan.slot_of_token)
    o = _Anchor.apply(o, gathered, *((gathered_tails,) if halo else ()))
    return o.view(B, t, Hv, Dv).to(qkv_BTHG.dtype)
