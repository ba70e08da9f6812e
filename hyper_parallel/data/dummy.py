"""``DummyDataLoader``: random tokens in the batch contract, for smoke runs and benchmarks.

Global micro-batch ``g`` is drawn from a generator seeded by ``(data.seed, g)``: a full row of
``max_tokens_per_microbatch`` uniform token ids in ``[0, vocab_size)``, cut into 1-4 documents at
random points. No files, no workers, nothing to learn; the same batches on every layout, and a
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

    def __init__(self, config: BaseDataLoader.Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.vocab_size = int(self.fact("vocab_size"))
        self._check_pad_token(self.vocab_size)

    def micro_batch(self, g: int) -> dict[str, Any]:
        """Global micro-batch ``g``."""
        rng = np.random.default_rng([self.config.seed, g, _TAG])
        n = self.config.max_tokens_per_microbatch
        tokens = rng.integers(0, self.vocab_size, size=n, dtype=np.int64)
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
