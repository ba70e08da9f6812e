"""``ShardWriter``: records into numbered webdataset tar shards, each finished shard indexed.

The data sources' writers (DirectToken, vision-language, pre-tokenised text) subclass it: they validate
and encode a record into its member files, then call :meth:`ShardWriter._add`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Self

import webdataset as wds

from hyper_parallel.data.index import IndexSpec, build_index, sidecar_path, write_index

__all__ = ["ShardWriter"]


class ShardWriter:
    """Writes records into ``<out_dir>/<prefix>-NNNNNN.tar``, ``samples_per_shard`` each; ``shards`` lists
    the files written. Each finished shard gets its index side file ``<shard>.idx.npz`` (record offsets,
    lengths and statistics: what a loader needs to plan without reading) for :meth:`_index_spec`."""

    def __init__(self, out_dir: str, *, samples_per_shard: int, prefix: str) -> None:
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
        self.out_dir, self.prefix, self.samples_per_shard = out_dir, prefix, samples_per_shard
        self.shards: list[str] = []
        self.num_samples = 0
        self._tar: wds.TarWriter | None = None
        self._keys: set[str] = set()
        os.makedirs(out_dir, exist_ok=True)

    def _index_spec(self) -> IndexSpec | None:
        """What a finished shard is indexed for; ``None``: write no index."""
        return None

    def _key(self, key: str | None) -> str:
        """``key``, or the next sample number; checked to be a webdataset key."""
        key = f"{self.num_samples:09d}" if key is None else str(key)
        if "." in key or "/" in key or not key:
            raise ValueError(f"sample key {key!r} must be non-empty without '.' or '/' (webdataset splits on them)")
        return key

    def _add(self, key: str, files: Mapping[str, Any]) -> str:
        """Write one record (``key`` from :meth:`_key`, ``files`` its members by extension)."""
        if self._tar is None or len(self._keys) >= self.samples_per_shard:
            self._next_shard()
        if key in self._keys:
            raise ValueError(f"sample key {key!r} is already in shard {self.shards[-1]!r}")
        self._keys.add(key)
        self._tar.write({"__key__": key, **files})
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
            spec = self._index_spec()
            if spec is not None:
                shard = self.shards[-1]
                write_index(build_index(shard, spec), sidecar_path(shard), shard_size=os.path.getsize(shard), spec=spec)

    def close(self) -> list[str]:
        """Finish the last shard; returns the shard paths."""
        self._close_tar()
        return self.shards

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
