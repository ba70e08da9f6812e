"""``DirectTokenWriter``: DirectToken samples into numbered webdataset tar shards."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from hyper_parallel.data.bad_samples import BadSample
from hyper_parallel.data.direct_token.sample import SampleSpec, direct_token_index_spec, encode_files, make_sample
from hyper_parallel.data.index import IndexSpec
from hyper_parallel.data.shard_writer import ShardWriter

__all__ = ["DirectTokenWriter", "write_shards"]

_UNBOUNDED = 2**62


class DirectTokenWriter(ShardWriter):
    """Writes DirectToken samples into ``<out_dir>/<prefix>-NNNNNN.tar``, ``samples_per_shard`` each.

    Every sample is validated before it is written (placeholder/code count, grids, emptiness; token
    and code ranges when ``lang_vocab_size`` / ``codebook_size`` are given); ``validate=False``
    writes anything (for tests that need malformed shards). ``shards`` lists the files written.
    Each finished shard gets its index side file ``<shard>.idx.npz`` (record offsets, lengths and
    statistics: what a loader needs to plan without reading), unless ``write_index=False``.
    """

    def __init__(
        self,
        out_dir: str,
        *,
        placeholder_token_id: int,
        samples_per_shard: int = 1000,
        prefix: str = "train",
        lang_vocab_size: int | None = None,
        codebook_size: int | None = None,
        validate: bool = True,
        write_index: bool = True,
    ) -> None:
        super().__init__(out_dir, samples_per_shard=samples_per_shard, prefix=prefix)
        self.spec = SampleSpec(
            lang_vocab_size=lang_vocab_size or _UNBOUNDED,
            codebook_size=codebook_size or _UNBOUNDED,
            placeholder_token_id=placeholder_token_id,
            max_tokens=_UNBOUNDED,
        )
        self.validate, self.write_index = validate, write_index

    def _index_spec(self) -> IndexSpec | None:
        return direct_token_index_spec(self.spec.placeholder_token_id) if self.write_index else None

    def write(
        self,
        tokens: Sequence[int] | np.ndarray,
        vq_codes: Sequence[int] | np.ndarray = (),
        image_grids: Sequence[Sequence[int]] = (),
        *,
        key: str | None = None,
        **meta: Any,
    ) -> str:
        """Write one sample; extra keyword arguments (e.g. ``loss_on="image"``) go into its json."""
        key = self._key(key)
        meta = {"image_grids": [list(map(int, g)) for g in image_grids], **meta}
        tokens, vq_codes = np.asarray(tokens), np.asarray(vq_codes, dtype=np.int64).reshape(-1)
        if self.validate:
            try:
                make_sample(key, "<writer>", tokens, vq_codes, meta, self.spec)
            except BadSample as e:
                raise ValueError(f"refusing to write sample {key!r}: {e.detail} [{e.kind}]") from None
        return self._add(key, encode_files(tokens, vq_codes, meta))


def write_shards(out_dir: str, samples: Iterable[Mapping[str, Any]], **writer_kwargs: Any) -> list[str]:
    """Write ``samples`` (mappings with ``tokens``, ``vq_codes``, ``image_grids``, optional ``key``
    and extra json fields) with a :class:`DirectTokenWriter`; returns the shard paths."""
    with DirectTokenWriter(out_dir, **writer_kwargs) as writer:
        for s in samples:
            s = dict(s)
            writer.write(s.pop("tokens"), s.pop("vq_codes", ()), s.pop("image_grids", ()), key=s.pop("key", None), **s)
    return writer.shards
