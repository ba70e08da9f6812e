"""``TokenMixer``: the base of every decoder layer's token mixer (MLA, GQA, gated GQA, Gated DeltaNet).

A mixer maps ``x [B, T, D]`` to ``[B, T, D]`` and is the only part of a layer that moves information
between positions. The contract every mixer keeps, so a ``TransformerBlock`` can hold any of them:

    forward(x_BTD, *, position_ids, meta) -> [B, T, D]
        position_ids  [B, T] (1-D positions) or [3, B, T] (M-RoPE t/h/w rows); restart per document
        meta          AttentionMeta: cu_seqlens/max_seqlen of packed documents (None = one per row)
    flops(doc_lens) -> float
        training FLOPs (forward + backward) of the mixing itself beyond the parameter matmuls (which the
        model counts from its parameters), over one micro-batch whose attention segments (packed documents
        and the padding run) have these lengths: e.g. ``QK^T`` and ``PV`` of causal softmax attention over
        each document alone (``models/common/flops.py`` holds the convention: ``L (L + 1) / 2`` query-key
        pairs per document, backward twice the forward, no recompute).

RoPE is per mixer: a mixer that rotates queries and keys owns its ``rope`` child (built from its own
``RoPE.Config`` with its own rotary head dim) and computes the tables from ``position_ids``; a mixer
without positions (a linear-attention recurrence) simply has none. So layers of one model may use
different rotary dims, thetas or none at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hyper_parallel.models.common.attention import AttentionMeta
from hyper_parallel.protocols.module import Module

__all__ = ["TokenMixer"]


class TokenMixer(Module):
    """Base class of token mixers; subclasses implement ``forward`` and ``flops``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def forward(
        self, x_BTD: torch.Tensor, *, position_ids: torch.Tensor, meta: AttentionMeta | None = None
    ) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement forward(x_BTD, *, position_ids, meta)")

    def flops(self, doc_lens: Sequence[int]) -> float:
        """Training FLOPs (fwd + bwd) beyond the parameter matmuls over a micro-batch of packed segments of these
        lengths (the whole micro-batch, not per token); 0 unless overridden."""
        del doc_lens
        return 0.0

    def flops_per_token(self, seq_len: int) -> float:
        """``flops`` per token of one ``seq_len``-token document (a pipeline split's or a start-up line's estimate)."""
        return self.flops([seq_len]) / max(seq_len, 1)
