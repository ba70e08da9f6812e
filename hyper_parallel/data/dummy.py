"""``DummyDataLoader``: random tokens in the batch contract, for smoke runs and benchmarks.

Global micro-batch ``g`` is drawn from a generator seeded by ``(data.seed, g)``: a full row of
``max_tokens_per_microbatch`` uniform token ids in ``[0, vocab_size)``, cut into 1-4 documents at
random points, or into log-normal document lengths (``document_tokens``, the GPU check's realistic mix). No files, no workers, nothing to learn; the same batches on every layout, and a
resume is just the micro-batch number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from hyper_parallel.data.base import BaseDataLoader
from hyper_parallel.data.packing import TokenDocument, collate_packed, shift_labels

__all__ = ["DummyDataLoader"]

_TAG = 0xD0D0


class DummyDataLoader(BaseDataLoader):
    """Random documents that fill every micro-batch exactly (model fact: ``vocab_size``)."""

    source: ClassVar[str] = "dummy"

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        source: Literal["direct_token", "text", "preset_pt", "dummy"] = "dummy"
        """`direct_token`: VQ image+text webdataset shards (docs/design.md section 5); `text`: pre-tokenised shards or raw jsonl/parquet/arrow files; `preset_pt`: replay a torch.save'd list of micro-batches; `dummy`: random tokens (smoke runs, benchmarks)."""
        document_tokens: int = 0
        """Mean document length of a realistic packed mix: lengths drawn log-normal (sigma 1, as packed SFT and
        pre-training corpora are long-tailed) until the micro-batch is full. 0: each micro-batch is cut into 1-4
        documents at random points."""

    def __init__(self, config: BaseDataLoader.Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.vocab_size = int(self.fact("vocab_size"))
        # a model with an image placeholder needs a code for each one: random text never holds it
        placeholder = self.model_facts.get("placeholder_token_id")
        self.placeholder = None if placeholder is None or not 0 <= placeholder < self.vocab_size else int(placeholder)
        self._check_pad_token(self.vocab_size)

    def micro_batch(self, g: int) -> dict[str, Any]:
        """Global micro-batch ``g``."""
        rng = np.random.default_rng([self.config.seed, g, _TAG])
        n = self.config.max_tokens_per_microbatch
        tokens = rng.integers(0, self.vocab_size, size=n, dtype=np.int64)
        if self.placeholder is not None:
            tokens[tokens == self.placeholder] = (self.placeholder + 1) % self.vocab_size
        if self.config.document_tokens > 0:
            bounds = _lognormal_bounds(rng, n, self.config.document_tokens)
        else:
            cuts = np.sort(rng.choice(np.arange(1, n), size=min(int(rng.integers(0, 4)), n - 1), replace=False))
            bounds = [0, *cuts.tolist(), n]
        docs = [
            TokenDocument(f"dummy{g}-{i}", "dummy", tokens[a:b], shift_labels(tokens[a:b]))
            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
        ]
        return collate_packed(docs, pad_token_id=self.config.pad_token_id, pad_to_multiple_of=self.pad_multiple)

    def _micro_batches(self, gs: range) -> list[dict[str, Any]]:
        return [self.micro_batch(g) for g in gs]

    def _order(self) -> dict[str, Any]:
        return {**super()._order(), "vocab_size": self.vocab_size}


def _lognormal_bounds(rng: np.random.Generator, n: int, mean: int, sigma: float = 1.0) -> list[int]:
    """Document boundaries of a row of ``n`` tokens: log-normal lengths of mean ``mean`` (at least 1 token)."""
    mu = np.log(mean) - sigma**2 / 2  # E[exp(N(mu, sigma))] = exp(mu + sigma^2 / 2) = mean
    bounds = [0]
    while bounds[-1] < n:
        bounds.append(min(n, bounds[-1] + max(1, int(rng.lognormal(mu, sigma)))))
    return bounds
