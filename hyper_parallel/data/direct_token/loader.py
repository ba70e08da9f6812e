"""``TokenDataLoader``: the ``direct_token`` source (VQ image + text webdataset shards, docs/design.md section 5).

The model facts it needs: ``vocab_size`` (the text vocabulary; image targets are ``code +
vocab_size``), ``codebook_size`` and ``placeholder_token_id``. Everything else is the shared
shard machinery (:mod:`hyper_parallel.data.sharded`): a layout-independent global plan from the
shard indexes, each rank reading its own records by offset. Micro-batches carry the generic
contract plus ``visual_indices`` and ``vq_codes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from hyper_parallel.data.bad_samples import IGNORE_INDEX
from hyper_parallel.data.direct_token.sample import (
    DIRECT_TOKEN_BAD_KINDS,
    DirectTokenCodec,
    SampleSpec,
    classify,
    direct_token_index_spec,
)
from hyper_parallel.data.index import IndexSpec
from hyper_parallel.data.shards import resolve_shards
from hyper_parallel.data.sharded import ShardedDataLoader

__all__ = ["TokenDataLoader"]


class TokenDataLoader(ShardedDataLoader):
    """DirectToken shards (or the embedded toy corpus when ``data.path`` is empty) for one DP rank."""

    source: ClassVar[str] = "direct_token"
    bad_kinds = DIRECT_TOKEN_BAD_KINDS

    def _prepare(self) -> None:
        config = self.config
        self.spec = SampleSpec(
            lang_vocab_size=int(self.fact("vocab_size")),
            codebook_size=int(self.fact("codebook_size")),
            placeholder_token_id=int(self.fact("placeholder_token_id")),
            max_tokens=config.max_tokens_per_microbatch,
        )
        self._check_pad_token(self.spec.lang_vocab_size, self.spec.placeholder_token_id)
        if config.text.split_long_documents:
            raise ValueError(
                "data.text.split_long_documents is for text: a DirectToken document cannot be cut (its images would "
                "be split from their codes); raise data.max_tokens_per_microbatch or split the documents offline"
            )

    def _resolve_shards(self) -> list[str]:
        if self.config.path:
            return resolve_shards(self.config.path)
        from hyper_parallel.data.direct_token.toy_corpus import ToyCorpusSpec, cached_toy_corpus

        s = self.spec
        toy = ToyCorpusSpec(
            lang_vocab_size=s.lang_vocab_size, codebook_size=s.codebook_size, placeholder_token_id=s.placeholder_token_id
        )
        return resolve_shards(cached_toy_corpus(self.config.cache_dir, toy))

    def _index_spec(self) -> IndexSpec:
        return direct_token_index_spec(self.spec.placeholder_token_id)

    def _classify(self, stats: Mapping[str, np.ndarray]) -> np.ndarray:
        return classify(stats, self.spec)

    def _codec(self) -> DirectTokenCodec:
        return DirectTokenCodec(self.spec)

    def finish(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``data.direct_token.loss_on``: `image` keeps only the image targets (code + vocab_size), `text` only the
        text targets; `document` leaves the labels as the documents set them."""
        loss_on = self.config.direct_token.loss_on
        if loss_on in ("image", "text"):
            labels = batch["labels"]
            image = labels >= self.spec.lang_vocab_size
            drop = (labels != IGNORE_INDEX) & (~image if loss_on == "image" else image)
            batch["labels"] = labels.masked_fill(drop, IGNORE_INDEX)
        return batch

    def _order(self) -> dict[str, Any]:
        s = self.spec
        return {**super()._order(), "vocab_size": s.lang_vocab_size, "codebook_size": s.codebook_size}
