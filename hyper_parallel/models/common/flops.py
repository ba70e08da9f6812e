"""Training FLOPs of a step, from its real documents: the one convention the model, the trainer's metrics and the
``FlopCounterMode`` check share.

Convention (model FLOPs, the numerator of MFU):

- A matmul costs ``2 m n k`` forward; its backward ``2 m n k`` for the input gradient (when the input needs one)
  plus ``2 m n k`` for the weight gradient (when the weight trains): ``6 x`` the parameters a token uses for a
  trained layer, ``4 x`` for a frozen one (LoRA's base), ``2 x`` for a tower run without gradients. Recomputation
  (activation checkpointing, flash attention's backward) is not counted: it is work, not model FLOPs.
- Routed experts count at ``top_k / num_experts`` of their parameters (dropless routing: every token visits exactly
  ``top_k`` experts); an embedding lookup is free, a (tied) head is a matmul.
- Attention counts the query-key pairs that are computed: **causal** attention over a packed document of ``L``
  tokens has ``L (L + 1) / 2`` pairs (packed documents never attend to each other), bidirectional attention (a
  vision frame) ``L^2``. Per pair and head: ``QK^T`` ``2 d_qk``, ``PV`` ``2 d_v`` forward, twice that backward, so
  ``6 (d_qk + d_v)`` training FLOPs (:func:`attention_flops`).
- Chunked linear attention (Gated DeltaNet) computes every document in whole chunks (fla's tiles and the torch
  path alike), so a short document costs a whole chunk (the mixer's ``flops``).

``flop_counter_formulas()`` gives ``torch.utils.flop_counter.FlopCounterMode`` the same convention for the kernels
it counts differently or not at all: the CPU flash SDPA (uncounted by torch), causal masks (torch counts the full
rectangle) and backward without the score recompute (torch counts it), ``grouped_mm`` (uncounted) and triangular
solves (uncounted)::

    with FlopCounterMode(display=False, custom_mapping=flop_counter_formulas()) as counter:
        loss.backward()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "attention_flops",
    "attention_pairs",
    "chunked_delta_rule_flops",
    "document_lengths",
    "flop_counter_formulas",
    "matmul_flops",
]

aten = torch.ops.aten


def attention_pairs(lengths: Sequence[int], *, causal: bool) -> int:
    """Query-key pairs softmax attention computes over segments of these lengths (causal: ``L (L + 1) / 2`` each,
    bidirectional: ``L^2``); segments never attend to each other."""
    if causal:
        return sum(n * (n + 1) // 2 for n in lengths)
    return sum(n * n for n in lengths)


def attention_flops(lengths: Sequence[int], *, heads: int, qk_dim: int, v_dim: int, causal: bool = True) -> float:
    """Training FLOPs (forward + backward, no recompute) of ``QK^T`` and ``PV`` over packed segments: ``6 (d_qk +
    d_v)`` per query-key pair and query head (module docstring)."""
    return 6.0 * heads * (qk_dim + v_dim) * attention_pairs(lengths, causal=causal)


def chunked_delta_rule_flops(doc_lens: Sequence[int], *, heads: int, k_dim: int, v_dim: int, chunk: int) -> float:
    """Training FLOPs (fwd + bwd = 3x fwd) of the chunked gated delta rule over packed documents, each in whole
    ``chunk``-token chunks (the last zero-padded, as the torch path and fla's tiles compute it).

    Per value head and chunk slot, forward: ``K K^T``, ``Q K^T`` (2*L*Dk each), the two triangular solves
    (L*(Dv+Dk)), ``W S``/``Q S``/``K^T v'`` (2*Dk*Dv each) and ``attn v'`` (2*L*Dv), ``L = chunk``.
    """
    L = chunk
    slots = sum(-(-int(n) // L) * L for n in doc_lens)
    fwd = 4 * L * k_dim + L * (k_dim + v_dim) + 6 * k_dim * v_dim + 2 * L * v_dim
    return 3.0 * heads * fwd * slots


def matmul_flops(module: torch.nn.Module, tokens: int, *, input_grad: bool = True, backward: bool = True) -> float:
    """Training FLOPs of ``module``'s parameter matmuls over ``tokens`` tokens: ``2`` forward, ``+2`` for the input
    gradient (``input_grad``: something before the module trains), ``+2`` for each trained weight's gradient, per
    parameter; ``backward=False``: forward only. Norm scales and biases count like weights (a negligible excess)."""
    total = 0.0
    for p in module.parameters():
        per = 2.0
        if backward:
            per += (2.0 if input_grad else 0.0) + (2.0 if p.requires_grad else 0.0)
        total += per * p.numel()
    return total * tokens


def document_lengths(batch: Mapping[str, Any]) -> list[int]:
    """Lengths of a micro-batch's attention segments (the batch contract, ``data/packing.py``): its documents and its
    padding run, from ``cu_seqlens_host`` (else ``cu_seqlens``), else one segment per row of ``input_ids``."""
    bounds = batch.get("cu_seqlens_host")
    if bounds is None and batch.get("cu_seqlens") is not None:
        bounds = batch["cu_seqlens"].tolist()
    if bounds is not None:
        return [int(b) - int(a) for a, b in zip(bounds[:-1], bounds[1:]) if int(b) > int(a)]
    B, T = batch["input_ids"].shape
    return [int(T)] * int(B)


# ---------------------------------------------------------------------------------------------- FlopCounterMode


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _sdpa_pairs(q_shape: Sequence[int], k_shape: Sequence[int], causal: bool) -> int:
    """Pairs of one SDPA call ``[B, H, Lq, d] x [B, Hk, Lk, d]`` per (batch, head): causal is top-left aligned, as
    torch's ``is_causal`` (query ``i`` sees keys ``0..i``)."""
    lq, lk = int(q_shape[-2]), int(k_shape[-2])
    if not causal:
        return lq * lk
    m = min(lq, lk)
    return m * (m + 1) // 2 + (lq - m) * lk


def _sdpa_fwd(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int], causal: bool) -> int:
    heads = _numel(q_shape[:-2])  # batch x query heads
    return 2 * heads * (int(q_shape[-1]) + int(v_shape[-1])) * _sdpa_pairs(q_shape, k_shape, causal)


def _cpu_flash(query, key, value, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> int:
    return _sdpa_fwd(query, key, value, bool(is_causal))


def _cpu_flash_backward(grad_out, query, key, value, out, lse, dropout_p=0.0, is_causal=False, *args,
                        out_shape=None, **kwargs) -> int:  # fmt: skip
    return 2 * _sdpa_fwd(query, key, value, bool(is_causal))


def _flash_backward(grad_out, query, key, value, out, lse, cq, ck, mq, mk, dropout_p, is_causal, *args,
                    out_shape=None, **kwargs) -> int:  # fmt: skip
    return 2 * _sdpa_fwd(query, key, value, bool(is_causal))


def _efficient(query, key, value, bias, lse, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> int:
    return _sdpa_fwd(query, key, value, bool(is_causal))


def _efficient_backward(grad_out, query, key, value, bias, out, lse, seed, offset, dropout_p, mask, is_causal=False,
                        *args, out_shape=None, **kwargs) -> int:  # fmt: skip
    return 2 * _sdpa_fwd(query, key, value, bool(is_causal))


def _cudnn(query, key, value, bias, lse, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> int:
    return _sdpa_fwd(query, key, value, bool(is_causal))


def _cudnn_backward(grad_out, query, key, value, out, lse, seed, offset, bias, cq, ck, mq, mk, dropout_p, is_causal,
                    *args, out_shape=None, **kwargs) -> int:  # fmt: skip
    return 2 * _sdpa_fwd(query, key, value, bool(is_causal))


def _grouped_mm(a, b, offs=None, *args, out_shape=None, **kwargs) -> int:
    """``2 x`` output elements x the reduced dim: ``[S, K] x [E, K, N]`` (experts' forward / input gradient),
    ``[K, S] x [S, N]`` grouped over S (the weight gradient: ``[E, K, N]`` out, S summed over the groups) or 3-D
    batched operands."""
    if len(a) == 2 and len(b) == 2:  # the reduced dim is ragged over the groups: each of S rows counts once
        return 2 * int(a[0]) * int(a[1]) * int(b[1])
    return 2 * _numel(out_shape) * int(a[-1])


def _solve_triangular(A, B, *args, out_shape=None, **kwargs) -> int:
    """``n^2`` per right-hand side of an ``n x n`` triangular system (``n^2 / 2`` multiply-adds)."""
    n = int(A[-1])
    return n * n * (_numel(B) // n)


def _raw(f: Callable[..., int]) -> Callable[..., int]:
    f._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode hands it the tensors, not their shapes
    return f


def _bounds(cu: torch.Tensor | None, batch: int, seqlen: int) -> list[int]:
    return [b - a for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:])] if cu is not None else [seqlen] * batch


@_raw
def _sdpa_packed(q, k, v, cu_seqlens, scale, *args, out_val=None, **kwargs) -> int:
    """``hyper_parallel::sdpa_packed``: causal per document; MLA's smaller v is zero-padded to the qk dim inside."""
    B, H, T, dqk = q.shape
    lengths = _bounds(cu_seqlens, B, T)
    return 2 * H * (dqk + max(int(v.shape[-1]), dqk)) * attention_pairs(lengths, causal=True)


@_raw
def _sdpa_packed_backward(grad, q, k, v, cu_seqlens, scale, *args, out_val=None, **kwargs) -> int:
    return 2 * _sdpa_packed(q, k, v, cu_seqlens, scale)


@_raw
def _frame_attention(q, k, v, cu_seqlens_cpu, order, scale, *args, out_val=None, **kwargs) -> int:
    """``hyper_parallel::vision_frame_attention``: q ``[H, N, d]``, bidirectional inside each frame."""
    H, N, d = q.shape
    return 2 * H * 2 * d * attention_pairs(_bounds(cu_seqlens_cpu, 1, N), causal=False)


@_raw
def _frame_attention_backward(grad_out, q, k, v, out, lse, cu_seqlens_cpu, order, scale, *args, out_val=None,
                              **kwargs) -> int:  # fmt: skip
    return 2 * _frame_attention(q, k, v, cu_seqlens_cpu, order, scale)


def _delta_rule_fwd(qkv, g, cu_seqlens_cpu, head_k_dim, head_v_dim, chunk_size) -> float:
    B, T = qkv.shape[:2]
    lengths = _bounds(cu_seqlens_cpu, B, T)
    heads = int(g.shape[-1])
    return chunked_delta_rule_flops(lengths, heads=heads, k_dim=head_k_dim, v_dim=head_v_dim, chunk=chunk_size) / 3


@_raw
def _gated_delta_rule(qkv, g, beta, conv_weight, cu_seqlens, cu_seqlens_cpu, head_k_dim, head_v_dim, chunk_size,
                      *args, out_val=None, **kwargs) -> int:  # fmt: skip
    """``hyper_parallel::gated_delta_rule``: the chunked rule's forward (the depthwise conv is not a matmul)."""
    return int(_delta_rule_fwd(qkv, g, cu_seqlens_cpu, head_k_dim, head_v_dim, chunk_size))


@_raw
def _gated_delta_rule_backward(grad, qkv, g, beta, conv_weight, cu_seqlens, cu_seqlens_cpu, head_k_dim, head_v_dim,
                               chunk_size, *args, out_val=None, **kwargs) -> int:  # fmt: skip
    return int(2 * _delta_rule_fwd(qkv, g, cu_seqlens_cpu, head_k_dim, head_v_dim, chunk_size))


_CUSTOM_OPS = {
    "sdpa_packed": _sdpa_packed,
    "sdpa_packed_backward": _sdpa_packed_backward,
    "vision_frame_attention": _frame_attention,
    "vision_frame_attention_backward": _frame_attention_backward,
    "gated_delta_rule": _gated_delta_rule,
    "gated_delta_rule_backward": _gated_delta_rule_backward,
}
"""The project's ``torch.library`` ops (``hyper_parallel::*``, used under torch.compile): opaque to
``FlopCounterMode``, which counts nothing inside them."""


def flop_counter_formulas() -> dict[Any, Callable[..., int]]:
    """``FlopCounterMode(custom_mapping=...)`` entries that count attention, grouped GEMMs, triangular solves and the
    project's custom ops (those registered by the modules imported so far) by this module's convention (module
    docstring)."""
    table: dict[Any, Callable[..., int]] = {
        aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
        aten._scaled_dot_product_flash_attention: _cpu_flash,  # the same leading arguments
        aten._scaled_dot_product_flash_attention_backward: _flash_backward,
        aten._scaled_dot_product_efficient_attention: _efficient,
        aten._scaled_dot_product_efficient_attention_backward: _efficient_backward,
        aten._scaled_dot_product_cudnn_attention: _cudnn,
        aten._scaled_dot_product_cudnn_attention_backward: _cudnn_backward,
        aten.linalg_solve_triangular: _solve_triangular,
    }
    if hasattr(aten, "_grouped_mm"):
        table[aten._grouped_mm] = _grouped_mm
    namespace = torch.ops.hyper_parallel
    for name, formula in _CUSTOM_OPS.items():
        try:
            table[getattr(namespace, name)] = formula
        except (AttributeError, RuntimeError):  # not registered (its module not imported, or not in this version)
            continue
    return table
