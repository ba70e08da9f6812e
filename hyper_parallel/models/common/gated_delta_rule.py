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
conv restarts the same way: ``K - 1`` zeros are placed before every document. Both are exactly
"run each document alone", with no Python loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from hyper_parallel.models.common.attention import AttentionMeta, check_boundaries
from hyper_parallel.protocols.module import Module

__all__ = ["GatedDeltaRule", "causal_conv1d_silu", "chunk_gated_delta_rule", "document_bounds"]


def document_bounds(cu_seqlens: torch.Tensor | list[int] | None, batch: int, seqlen: int) -> list[int]:
    """Document starts/ends over the flat ``B*T`` stream as a host list (rows when ``cu_seqlens`` is None)."""
    if cu_seqlens is None:
        return list(range(0, batch * seqlen + 1, seqlen))
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    check_boundaries(cu, batch, seqlen)
    return cu


class _CausalDepthwiseConv(torch.autograd.Function):
    """Causal depthwise conv on token-major ``x [B, T, C]`` with ``w [C, K]``:
    ``y[:, t] = sum_j w[:, j] * x[:, t - K + 1 + j]`` (zeros before the start), ``y [B, T, C]``.

    Forward: HF's exact call, ``F.conv1d(x^T, padding=K-1)[..., :T]`` (bitwise the same sums). Backward: K
    shifted multiply-adds (on CPU the depthwise ``convolution_backward`` is several times slower).
    """

    @staticmethod
    def forward(ctx, x_BTC: torch.Tensor, w_CK: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(x_BTC, w_CK)
        K, T = w_CK.shape[-1], x_BTC.shape[1]
        y = F.conv1d(x_BTC.transpose(1, 2).to(w_CK.dtype), w_CK.unsqueeze(1), padding=K - 1, groups=w_CK.shape[0])
        return y[..., :T].transpose(1, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        x, w = ctx.saved_tensors
        K, T = w.shape[-1], x.shape[1]
        g = grad.float()
        x_pad = F.pad(x.float(), (0, 0, K - 1, 0))
        grad_x = torch.zeros(x_pad.shape, dtype=torch.float32, device=x.device)
        grad_w = torch.empty(w.shape, dtype=torch.float32, device=w.device)
        for j in range(K):  # tap j reads x_pad[:, t + j] for output t
            grad_x[:, j : j + T] += g * w[:, j].float()
            grad_w[:, j] = (g * x_pad[:, j : j + T]).sum(dim=(0, 1))
        return grad_x[:, K - 1 :].to(x.dtype), grad_w.to(w.dtype)


def causal_conv1d_silu(x_BTC: torch.Tensor, weight_CK: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """``silu(depthwise causal conv)`` per document; ``w[:, K-1]`` multiplies the current token.

    HF numerics: one ``F.conv1d`` in the weight dtype (fp32 accumulation inside the kernel), SiLU in the
    weight dtype, cast back to ``x``'s dtype. Packed documents get ``K - 1`` zeros in front, as if each ran
    alone.
    """
    B, T, C = x_BTC.shape
    K = weight_CK.shape[-1]
    if len(cu) == B + 1:  # one document per row
        return F.silu(_CausalDepthwiseConv.apply(x_BTC, weight_CK)).to(x_BTC.dtype)
    n_docs = len(cu) - 1
    cu_t = torch.tensor(cu, device=x_BTC.device)
    tok = torch.arange(B * T, device=x_BTC.device)
    doc = torch.searchsorted(cu_t[1:], tok, right=True)
    pos = tok + (doc + 1) * (K - 1)  # slot of each token once K-1 zeros precede every document
    x_NC = x_BTC.reshape(B * T, C)
    padded = x_NC.new_zeros(B * T + n_docs * (K - 1), C).index_copy(0, pos, x_NC)
    y = _CausalDepthwiseConv.apply(padded.unsqueeze(0), weight_CK)[0]  # the K-1 zeros restart every document
    y = F.silu(y).index_select(0, pos)
    return y.to(x_BTC.dtype).view(B, T, C)


class _UnitLowerSolve(torch.autograd.Function):
    """``X = (I + strict_lower(A))^-1 B`` for a batch of ``[L, L]`` matrices (diagonal and upper part of A ignored).

    Forward: HF's unit-lower-triangular solve. Backward with the explicit inverse ``T`` (one solve against a
    contiguous identity): ``dB = T^T dX`` and ``dA = -(dB X^T)`` on the strict lower triangle, as batched
    matmuls (on CPU, autograd's transposed triangular solve against a strided gradient is several times slower).
    """

    @staticmethod
    def forward(ctx, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:  # noqa: D102
        X = torch.linalg.solve_triangular(A, B, upper=False, unitriangular=True)
        ctx.save_for_backward(A, X)
        return X

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        A, X = ctx.saved_tensors
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A).contiguous()
        T_inv = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
        grad_B = T_inv.mT @ grad
        return -(grad_B @ X.mT).tril(-1), grad_B


class _SplitSteps(torch.autograd.Function):
    """``x.split(sizes)`` (views) whose backward is one ``cat`` of the pieces' gradients (autograd's
    split backward was measured several times slower on CPU)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:  # noqa: D102
        ctx.sizes = sizes
        return x.split(sizes)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor, None]:  # noqa: D102
        ref = next(g for g in grads if g is not None)
        parts = [
            g.contiguous() if g is not None else ref.new_zeros(n, *ref.shape[1:]) for g, n in zip(grads, ctx.sizes)
        ]
        return torch.cat(parts), None


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


@dataclass(frozen=True, slots=True)
class _ChunkPlan:
    """Where every token sits in the step-major chunk layout (see ``chunk_gated_delta_rule``)."""

    gather_NL: torch.Tensor
    """Token index of each chunk slot (``B*T`` = padding: a zero row), chunks in step-major order."""
    slot_of_token: torch.Tensor
    """Flat slot (``chunk * L + i``) of every token of the ``B*T`` stream."""
    docs_per_step: list[int]
    """Documents that still have a chunk at each scan step (a prefix of the length-sorted documents)."""


def _chunk_plan(cu: list[int], chunk: int, device: torch.device) -> _ChunkPlan:
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    n_chunks = [-(-n // chunk) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda d: -n_chunks[d])  # stable: equal lengths keep their order
    steps = n_chunks[order[0]]
    docs_per_step = [sum(1 for d in order if n_chunks[d] > j) for j in range(steps)]
    starts = torch.tensor([cu[d] for d in order], device=device)
    ends = torch.tensor([cu[d + 1] for d in order], device=device)
    # chunk (step j, sorted doc r) for r < docs_per_step[j], step-major
    step_idx = torch.cat([torch.full((n,), j, device=device) for j, n in enumerate(docs_per_step)])
    doc_idx = torch.cat([torch.arange(n, device=device) for n in docs_per_step])
    tok = starts[doc_idx, None] + step_idx[:, None] * chunk + torch.arange(chunk, device=device)
    valid = tok < ends[doc_idx, None]
    gather = torch.where(valid, tok, cu[-1])
    slot_of_token = torch.empty(cu[-1], dtype=torch.long, device=device)
    slot_of_token[tok[valid]] = torch.arange(gather.numel(), device=device).view_as(gather)[valid]
    return _ChunkPlan(gather_NL=gather, slot_of_token=slot_of_token, docs_per_step=docs_per_step)


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
    L = chunk_size
    out_dtype = q_BTHD.dtype
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    n_docs = len(lengths)
    # One fp32 tensor with every per-token input, laid out in chunks [N, L, F] in step-major order (chunk j
    # of every document that has one, documents sorted by length); padding slots are zeros.
    x_BTF = torch.cat(
        [q_BTHD.reshape(B, T, -1), k_BTHD.reshape(B, T, -1), v_BTHD.reshape(B, T, -1), g_BTH, beta_BTH.to(g_BTH.dtype)],
        dim=-1,
    ).float()
    width = x_BTF.shape[-1]
    if len(set(lengths)) == 1:  # equal documents (plain rows): a reshape, no gather
        n = lengths[0]
        steps = -(-n // L)
        x = F.pad(x_BTF.reshape(n_docs, n, width), (0, 0, 0, steps * L - n))
        x_NLF = x.view(n_docs, steps, L, width).transpose(0, 1).reshape(steps * n_docs, L, width)
        docs_per_step = [n_docs] * steps
        plan = None
    else:
        plan = _chunk_plan(cu, L, x_BTF.device)
        flat = torch.cat([x_BTF.reshape(B * T, width), x_BTF.new_zeros(1, width)])
        x_NLF = flat.index_select(0, plan.gather_NL.reshape(-1)).view(*plan.gather_NL.shape, width)
        docs_per_step = plan.docs_per_step
    q, k, v, g, beta = x_NLF.split([Hk * Dk, Hk * Dk, Hv * Dv, Hv, Hv], dim=-1)

    r = Hv // Hk
    # [N, H, L, d]; value head h reads key head h // r (block grouping)
    q = (_l2norm(q.reshape(-1, L, Hk, Dk)) * Dk**-0.5).repeat_interleave(r, dim=2).transpose(1, 2)
    k = _l2norm(k.reshape(-1, L, Hk, Dk)).repeat_interleave(r, dim=2).transpose(1, 2)
    v = v.reshape(-1, L, Hv, Dv).transpose(1, 2)
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [N, Hv, L]

    # Intra-chunk quantities for all chunks at once.
    gamma = g.cumsum(dim=-1)
    upper = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
    decay_LL = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    A = (k_beta @ k.transpose(-1, -2)) * decay_LL
    attn = (q @ k.transpose(-1, -2)) * decay_LL
    # One unit-lower-triangular solve for both right-hand sides [beta V | beta K e^gamma].
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * gamma.exp().unsqueeze(-1)], dim=-1)
    U, W = _UnitLowerSolve.apply(A, rhs).split([Dv, Dk], dim=-1)
    q_decay = q * gamma.exp().unsqueeze(-1)
    k_decay = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)
    chunk_decay = gamma[..., -1].exp()[..., None, None]

    # Scan over chunk steps; documents ride side by side, finished ones drop off the end. One split per
    # tensor (its backward is one cat) rather than a slice per step (each slice's backward would write a
    # zero-filled full-size gradient: quadratic in the number of steps).
    tensors = (U, W, q_decay, attn, k_decay.transpose(-1, -2).contiguous(), chunk_decay)
    steps = zip(*(_SplitSteps.apply(t, docs_per_step) for t in tensors))
    S = q.new_zeros(docs_per_step[0], Hv, Dk, Dv)
    outs = []
    for U_j, W_j, q_j, attn_j, kT_j, decay_j in steps:
        S = S[: U_j.shape[0]]
        v_new = U_j - W_j @ S
        outs.append(q_j @ S + attn_j @ v_new)
        S = S * decay_j + kT_j @ v_new
    o_NLHD = torch.cat(outs).transpose(1, 2)  # [N, L, Hv, Dv]
    if plan is None:
        n = lengths[0]
        o = o_NLHD.reshape(len(docs_per_step), n_docs, L, Hv, Dv).transpose(0, 1).reshape(n_docs, -1, Hv, Dv)[:, :n]
        return o.reshape(B, T, Hv, Dv).to(out_dtype)
    o = o_NLHD.reshape(-1, Hv, Dv).index_select(0, plan.slot_of_token)
    return o.view(B, T, Hv, Dv).to(out_dtype)


class GatedDeltaRule(Module):
    """The sequence core of Gated DeltaNet: causal conv + SiLU, then the chunked gated delta rule.

    ``forward(q, k, v, g, beta, *, conv_weight, meta) -> o [B, T, Hv, Dv]`` with PRE-conv q/k
    ``[B, T, Hk, Dk]``, v ``[B, T, Hv, Dv]``, fp32 log decay g and beta ``[B, T, Hv]``, and
    ``conv_weight [C, K]`` whose rows are ``[Q | K | V]`` head-major for exactly the heads given (the
    local ones under tensor or context parallel). Parameter-free: everything that needs whole
    sequences is here, so context parallel wraps this module (all-to-all from a sequence chunk with all
    heads to whole sequences with a head chunk, and ``conv_weight_for_heads`` for the weight rows).
    """

    cp_head_split_inputs: ClassVar[int] = 5
    """Context parallel splits q, k, v, g, beta (token-major ``[B, T, H, ...]``) by heads (``context_parallel``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        chunk_size: int = 64
        """Tokens per chunk of the chunked form (HF: 64); results agree to fp32 rounding for any value."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        conv_weight: torch.Tensor,
        meta: AttentionMeta | None = None,
    ) -> torch.Tensor:
        B, T, Hk, Dk = k.shape
        Hv, Dv = v.shape[-2:]
        if Hv % Hk:
            raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
        cu = document_bounds(meta.cu_seqlens if meta is not None else None, B, T)
        qkv = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        qkv = causal_conv1d_silu(qkv, conv_weight, cu)
        q, k, v = qkv.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
        return chunk_gated_delta_rule(
            q.view(B, T, Hk, Dk), k.view(B, T, Hk, Dk), v.view(B, T, Hv, Dv), g, beta,
            cu=cu, chunk_size=self.config.chunk_size,
        )  # fmt: skip

    def cp_local_kwargs(self, args: tuple, kwargs: dict, *, rank: int, world: int) -> dict:
        """Context parallel: the conv weight rows of head chunk ``rank`` (``args`` hold every head)."""
        q, _, v = args[:3]
        weight = self.conv_weight_for_heads(
            kwargs["conv_weight"], head_k_dim=q.shape[-1], head_v_dim=v.shape[-1], n_k_heads=q.shape[2], rank=rank,
            world=world,
        )  # fmt: skip
        return {**kwargs, "conv_weight": weight}

    @staticmethod
    def conv_weight_for_heads(
        conv_weight: torch.Tensor, *, head_k_dim: int, head_v_dim: int, n_k_heads: int, rank: int, world: int
    ) -> torch.Tensor:
        """Rows of ``conv_weight [C, K]`` (``[Q | K | V]`` head-major, ``n_k_heads`` key heads) that belong to
        head chunk ``rank`` of ``world`` equal chunks, in the same segment order (what context parallel hands
        the core after its all-to-all)."""
        key_dim = n_k_heads * head_k_dim
        value_dim = conv_weight.shape[0] - 2 * key_dim
        if n_k_heads % world or value_dim % (world * head_v_dim):
            raise ValueError(
                f"{n_k_heads} key heads and {value_dim // head_v_dim} value heads must both divide into {world} chunks"
            )
        wq, wk, wv = conv_weight.split([key_dim, key_dim, value_dim])
        return torch.cat([w.chunk(world)[rank] for w in (wq, wk, wv)])
