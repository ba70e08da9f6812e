"""``TokenMixer``: the base of every decoder layer's token mixer (MLA, GQA, gated GQA, Gated DeltaNet).

A mixer maps ``x [B, T, D]`` to ``[B, T, D]`` and is the only part of a layer that moves information
between positions. The contract every mixer keeps, so a ``TransformerBlock`` can hold any of them:

    forward(x_BTD, *, position_ids, meta) -> [B, T, D]
        position_ids  [B, T] (1-D positions) or [3, B, T] (M-RoPE t/h/w rows); restart per document
        meta          AttentionMeta: cu_seqlens/max_seqlen of packed documents (None = one per row)
    flops_per_token(seq_len) -> float
        training FLOPs per token of the mixing itself beyond the parameter matmuls (which
        ``6 * active params`` already counts), e.g. ``QK^T`` and ``PV`` of softmax attention.

RoPE is per mixer: a mixer that rotates queries and keys owns its ``rope`` child (built from its own
``RoPE.Config`` with its own rotary head dim) and computes the tables from ``position_ids``; a mixer
without positions (a linear-attention recurrence) simply has none. So layers of one model may use
different rotary dims, thetas or none at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyper_parallel.models.common.attention import AttentionMeta
from hyper_parallel.protocols.module import Module

__all__ = ["TokenMixer"]


class TokenMixer(Module):
    """Base class of token mixers; subclasses implement ``forward`` and ``flops_per_token``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def forward(
        self, x_BTD: torch.Tensor, *, position_ids: torch.Tensor, meta: AttentionMeta | None = None
    ) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement forward(x_BTD, *, position_ids, meta)")

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token beyond the parameter matmuls (fwd + bwd); 0 unless overridden."""
        del seq_len
        return 0.0
