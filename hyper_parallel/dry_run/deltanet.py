"""Which Gated DeltaNet path the dry run assumes, and the memory of each.

The sequence core (``GatedDeltaRule``) has two paths whose memory differs:

- **torch** (ours; every CPU, a GPU without fla, and every context-parallel state-passing run): each packed
  document is laid out in its own 64-token chunks, the last one zero-padded, so a micro-batch of short documents
  holds up to ``sum(ceil(L / 64)) * 64`` chunk slots (the toy corpus' ~36-token documents: ~1.7x the tokens) in
  every chunk tensor it saves for the backward. The simulated step runs this path itself: with packed documents
  (``--document_tokens``) the padding is in the measured peak.
- **fla** (CUDA with ``flash-linear-attention`` and ``causal-conv1d`` installed): the kernels run on the flat stream
  with ``cu_seqlens``, no padded layout. The simulated step replaces the core with :class:`FlaMemoryModel`, which
  allocates what fla's ``chunk_gated_delta_rule`` (and ``causal_conv1d_fn``) keep and what their backward makes,
  on the same shapes (fla 0.3-0.4, ``ops/gated_delta_rule/chunk.py``; ``use_qk_l2norm_in_kernel=True``):

  forward, kept: the conv output ``[T, C]``, l2-normalised q and k ``[T, Hk, Dk]`` with their fp32 inverse norms
  ``[T, Hk]``, the chunk-local cumulative decay ``[T, Hv]`` (fp32), the solved ``A`` ``[T, Hv, 64]`` and the
  output ``[T, Hv, Dv]``; forward, transient: ``w [T, Hv, Dk]``, ``u`` and ``v_new [T, Hv, Dv]``, the chunk states
  ``h [N, Hv, Dk, Dv]`` (``N = sum(ceil(L / 64))`` chunks). Backward, transient: ``w``, ``u``, ``h`` and ``v_new``
  recomputed, ``dh [N, Hv, Dk, Dv]`` (fp32), ``dv`` twice, then the input gradients.

``--deltanet_path auto`` takes fla when this machine could run it (CUDA and both packages), else torch; the report
says which it assumed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hyper_parallel.models.common.attention import AttentionMeta, CPShard
from hyper_parallel.models.common.gated_delta_rule import GatedDeltaRule

__all__ = ["DeltaNetPath", "FlaMemoryModel", "deltanet_path", "describe_path", "document_bounds", "with_path"]

DeltaNetPath = Literal["auto", "torch", "fla"]

CHUNK = 64
"""fla's chunk (``BT``) and the torch path's default ``chunk_size``."""


def deltanet_path(choice: str, *, compute_dtype: str = "bfloat16", model_config: Any = None) -> Literal["torch", "fla"]:
    """The path a run on this machine takes: ``auto`` = fla when CUDA and both kernel packages are present, the
    compute dtype is bf16/fp16 (fla's chunked kernel rejects fp32) and no core is configured ``backend='torch'``."""
    if choice not in ("auto", "torch", "fla"):
        raise ValueError(f"--deltanet_path {choice!r}: use auto, torch or fla")
    if choice != "auto":
        return choice  # type: ignore[return-value]
    from hyper_parallel.models.common import gated_delta_rule as gdr

    installed = gdr.fla_chunk_gated_delta_rule is not None and (gdr.causal_conv1d_fn or gdr.fla_causal_conv1d) is not None
    forced = any(isinstance(c, GatedDeltaRule.Config) and c.backend == "torch" for c in _configs(model_config))
    half = compute_dtype in ("bfloat16", "float16")
    return "fla" if installed and torch.cuda.is_available() and half and not forced else "torch"


def document_bounds(seqlen: int, document_tokens: int) -> list[int]:
    """Boundaries of a micro-batch of ``seqlen`` tokens packed with ``document_tokens``-token documents (the last one
    shorter); ``0``: one document."""
    if document_tokens < 0:
        raise ValueError(f"--document_tokens {document_tokens} must be >= 0 (0: one document per micro-batch)")
    step = document_tokens or seqlen
    return [*range(0, seqlen, step), seqlen]


def has_deltanet(model_config: Any) -> bool:
    """Whether the model config holds a Gated DeltaNet core anywhere."""
    return any(isinstance(c, GatedDeltaRule.Config) for c in _configs(model_config))


def describe_path(path: str, seqlen: int, document_tokens: int) -> str:
    """The report's line on the DeltaNet path and the documents the step assumed."""
    bounds = document_bounds(seqlen, document_tokens)
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    slots = sum(-(-n // CHUNK) * CHUNK for n in lengths)
    docs = (f"{len(lengths)} documents of {document_tokens} tokens per {seqlen}-token micro-batch"
            if document_tokens else f"one {seqlen}-token document per micro-batch")  # fmt: skip
    if path == "fla":
        return (f"Gated DeltaNet: fla path assumed (flat stream, no chunk padding; its kept tensors and backward chunk "
                f"states modelled, {sum(-(-n // CHUNK) for n in lengths)} chunks), {docs}")  # fmt: skip
    return (f"Gated DeltaNet: torch path assumed ({CHUNK}-token chunks per document: {slots} chunk slots for "
            f"{seqlen} tokens, {slots / seqlen:.2f}x), {docs}"
            + ("" if document_tokens else "; packed short documents pad more: --document_tokens N models them"))


def with_path(model_config: Any, path: str) -> Any:
    """``model_config`` with every ``GatedDeltaRule`` core simulated by the path's memory (a copy; the torch path is
    the model's own)."""
    if path == "torch":
        return model_config
    return _replace_rules(model_config)


def _configs(value: Any) -> list[Any]:
    out = []
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out.append(value)
        for f in dataclasses.fields(value):
            out += _configs(getattr(value, f.name))
    elif isinstance(value, (list, tuple)):
        for item in value:
            out += _configs(item)
    return out


def _replace_rules(value: Any) -> Any:
    if isinstance(value, GatedDeltaRule.Config) and not isinstance(value, FlaMemoryModel.Config):
        return FlaMemoryModel.Config(**{f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            if not f.init:
                continue
            old = getattr(value, f.name)
            new = _replace_rules(old)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    if isinstance(value, list):
        new = [_replace_rules(v) for v in value]
        return new if any(a is not b for a, b in zip(new, value)) else value
    return value


class FlaMemoryModel(GatedDeltaRule):
    """The dry run's stand-in for the fla path (module docstring): the same outputs' shapes, fla's allocations.
    Context-parallel state passing runs the torch path on every machine, so it stays the parent's."""

    @dataclass(kw_only=True, slots=True)
    class Config(GatedDeltaRule.Config):
        pass

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
        if cp is not None:
            return super().forward(qkv, g, beta, conv_weight=conv_weight, meta=meta, cp=cp)
        B, T = qkv.shape[:2]
        cu = [*range(0, B * T + 1, T)]  # one document per row
        if meta is not None and getattr(meta, "cu_seqlens_host", None) is not None:
            cu = list(meta.cu_seqlens_host)
        elif meta is not None and meta.cu_seqlens is not None:
            cu = meta.cu_seqlens.tolist()  # host data in the dry run (SimulationMode keeps integer tensors real)
        chunks = sum(-(-(b - a) // CHUNK) for a, b in zip(cu[:-1], cu[1:]))
        return _FlaMemory.apply(qkv, g, beta, conv_weight, self.head_k_dim, self.head_v_dim, chunks)


def _empty(shape: Sequence[int], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype or like.dtype, device=like.device)


class _FlaMemory(torch.autograd.Function):
    """Allocations of ``causal_conv1d_fn`` + fla's ``chunk_gated_delta_rule`` (values are not computed: fake)."""

    @staticmethod
    def forward(ctx, qkv, g, beta, conv_weight, Dk: int, Dv: int, chunks: int):  # noqa: ANN001, ANN205, D102
        B, T, Hk, G = qkv.shape
        Hv = g.shape[-1]
        n = B * T
        y = _empty((B, T, Hk, G), qkv)  # the conv + SiLU output (fla's q, k, v are views of it)
        qn, kn = _empty((n, Hk, Dk), qkv), _empty((n, Hk, Dk), qkv)  # l2-normalised copies, kept
        q_rstd, k_rstd = _empty((n, Hk), qkv, torch.float32), _empty((n, Hk), qkv, torch.float32)
        g_cum = _empty((n, Hv), qkv, torch.float32)
        A = _empty((n, Hv, CHUNK), qkv)
        w, u = _empty((n, Hv, Dk), qkv), _empty((n, Hv, Dv), qkv)  # transient
        h, v_new = _empty((chunks, Hv, Dk, Dv), qkv), _empty((n, Hv, Dv), qkv)
        o = _empty((B, T, Hv, Dv), qkv)
        del w, u, h, v_new
        ctx.save_for_backward(qkv, g, conv_weight, y, qn, kn, q_rstd, k_rstd, g_cum, A, beta)
        ctx.dims = (Dk, Dv, chunks)
        return o

    @staticmethod
    def backward(ctx, grad_o):  # noqa: ANN001, ANN205, D102
        qkv, g, conv_weight, y, qn, kn, q_rstd, k_rstd, g_cum, A, beta = ctx.saved_tensors
        Dk, Dv, chunks = ctx.dims
        n, Hv = g_cum.shape
        w, u = _empty((n, Hv, Dk), qkv), _empty((n, Hv, Dv), qkv)  # recomputed
        h, v_new = _empty((chunks, Hv, Dk, Dv), qkv), _empty((n, Hv, Dv), qkv)
        dh = _empty((chunks, Hv, Dk, Dv), qkv, torch.float32)
        dv, dv2 = _empty((n, Hv, Dv), qkv), _empty((n, Hv, Dv), qkv)
        dy = torch.empty_like(y)  # dq, dk, dv of the rule, in the conv output's layout
        del w, u, h, v_new, dh, dv, dv2
        dqkv = torch.empty_like(qkv)
        dg = torch.empty_like(g)
        dbeta, dweight = torch.empty_like(beta), torch.empty_like(conv_weight)
        del dy
        return dqkv, dg, dbeta, dweight, None, None, None
