"""``Embedding``: a token lookup table whose size comes from the parent at build time."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.protocols.module import Module
from hyper_parallel.protocols.param_init import NormalInit, ParamInit

__all__ = ["Embedding"]


class Embedding(Module):
    """``weight [num_embeddings, embedding_dim]``; ``padding_idx`` rows are zero and get no gradient."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        padding_idx: int | None = None
        """Row kept at zero with zero gradient (HF ``pad_token_id``); None for none."""
        param_init: ParamInit.Config | None = field(default_factory=NormalInit.Config)
        """Weight initialiser."""

    def __init__(self, config: Config, *, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(config)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype))

    @torch.no_grad()
    def init_own_weights(self) -> None:
        super().init_own_weights()
        if self.config.padding_idx is not None:
            self.weight[self.config.padding_idx].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.config.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.config.padding_idx}"
