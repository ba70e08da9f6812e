"""``DirectTokenWriter``: DirectToken samples into numbered webdataset tar shards."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import webdataset as wds

from hyper_parallel.data.bad_samples import BadSample
from hyper_parallel.data.direct_token.sample import SampleSpec, direct_token_index_spec, encode_files, make_sample
from hyper_parallel.data.index import build_index, sidecar_path, write_index

__all__ = ["DirectTokenWriter", "write_shards"]

_UNBOUNDED = 2**62


class DirectTokenWriter:
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
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
        self.out_dir, self.prefix, self.samples_per_shard = out_dir, prefix, samples_per_shard
        self.spec = SampleSpec(
            lang_vocab_size=lang_vocab_size or _UNBOUNDED,
            codebook_size=codebook_size or _UNBOUNDED,
            placeholder_token_id=placeholder_token_id,
            max_tokens=_UNBOUNDED,
        )
        self.validate, self.write_index = validate, write_index
        self.shards: list[str] = []
        self.num_samples = 0
        self._tar: wds.TarWriter | None = None
        self._keys: set[str] = set()
        os.makedirs(out_dir, exist_ok=True)

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
        key = f"{self.num_samples:09d}" if key is None else str(key)
        if "." in key or "/" in key or not key:
            raise ValueError(f"sample key {key!r} must be non-empty without '.' or '/' (webdataset splits on them)")
        meta = {"image_grids": [list(map(int, g)) for g in image_grids], **meta}
        tokens, vq_codes = np.asarray(tokens), np.asarray(vq_codes, dtype=np.int64).reshape(-1)
        if self.validate:
            try:
                make_sample(key, "<writer>", tokens, vq_codes, meta, self.spec)
            except BadSample as e:
                raise ValueError(f"refusing to write sample {key!r}: {e.detail} [{e.kind}]") from None
        if self._tar is None or len(self._keys) >= self.samples_per_shard:
            self._next_shard()
        if key in self._keys:
            raise ValueError(f"sample key {key!r} is already in shard {self.shards[-1]!r}")
        self._keys.add(key)
        self._tar.write({"__key__": key, **encode_files(tokens, vq_codes, meta)})
        self.num_samples += 1
        return key

    def _next_shard(self) -> None:
        self._close_tar()
        path = os.path.join(self.out_dir, f"{self.prefix}-{len(self.shards):06d}.tar")
        self._tar = wds.TarWriter(path, mtime=0)  # fixed int mtime: reproducible bytes, no PAX header per file
        self.shards.append(path)
        self._keys = set()

    def _close_tar(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None
            if self.write_index:
                shard = self.shards[-1]
                spec = direct_token_index_spec(self.spec.placeholder_token_id)
                write_index(build_index(shard, spec), sidecar_path(shard), shard_size=os.path.getsize(shard), spec=spec)

    def close(self) -> list[str]:
        """Finish the last shard; returns the shard paths."""
        self._close_tar()
        return self.shards

    def __enter__(self) -> DirectTokenWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_shards(out_dir: str, samples: Iterable[Mapping[str, Any]], **writer_kwargs: Any) -> list[str]:
    """Write ``samples`` (mappings with ``tokens``, ``vq_codes``, ``image_grids``, optional ``key``
    and extra json fields) with a :class:`DirectTokenWriter`; returns the shard paths."""
    with DirectTokenWriter(out_dir, **writer_kwargs) as writer:
        for s in samples:
            s = dict(s)
            writer.write(s.pop("tokens"), s.pop("vq_codes", ()), s.pop("image_grids", ()), key=s.pop("key", None), **s)
    return writer.shards
