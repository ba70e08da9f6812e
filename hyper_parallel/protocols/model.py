"""``BaseModel``: the root Module of a model, with parameter and FLOP counting for MFU."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hyper_parallel.protocols.module import Module

__all__ = ["BaseModel"]


class BaseModel(Module):
    """A whole model. Subclasses refine ``get_nparams_and_flops`` for their architecture."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def count_params(self, *, exclude_embeddings: bool = False) -> int:
        """Total parameter count (works on the meta device)."""
        skip = {id(p) for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        return sum(p.numel() for p in self.parameters() if not (exclude_embeddings and id(p) in skip))

    def get_nparams_and_flops(self, seq_len: int) -> tuple[int, float]:
        """Return ``(total params, training FLOPs per token)`` at sequence length ``seq_len``.

        The generic estimate is ``6 * non-embedding params`` (forward + backward of every matmul);
        models with sparse layers or special attention override this.
        """
        del seq_len
        return self.count_params(), 6.0 * self.count_params(exclude_embeddings=True)
