"""``ShardWriter``: records into numbered webdataset tar shards, each finished shard indexed.

The data sources' writers (DirectToken, vision-language, pre-tokenised text) subclass it: they validate
and encode a record into its member files, then call :meth:`ShardWriter._add`.

A write is all or nothing: every shard is written under a temporary name (``<shard>.partial``, which no reader
takes) and renamed into place, with its index, only when the whole write completes (:meth:`ShardWriter.close`,
the end of a ``with`` block); a write stopped by an error (a bad record, a missing image) removes its partial
shards and leaves nothing behind (:meth:`ShardWriter.abort`, what a ``with`` block does on an exception).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any, Self

import webdataset as wds

from hyper_parallel.data.index import IndexSpec, build_index, sidecar_path, write_index

__all__ = ["PARTIAL_SUFFIX", "ShardWriter", "partial_path"]

PARTIAL_SUFFIX = ".partial"
"""Suffix of a shard being written (renamed away when the write completes)."""


class ShardWriter:
    """Writes records into ``<out_dir>/<prefix>-NNNNNN.tar``, ``samples_per_shard`` each; ``shards`` lists
    the files written. Each shard gets its index side file ``<shard>.idx.npz`` (record offsets, lengths and
    statistics: what a loader needs to plan without reading) for :meth:`_index_spec`. Nothing is in place
    before :meth:`close` (see the module doc): use it as a context manager, or call ``close`` / ``abort``."""

    def __init__(self, out_dir: str, *, samples_per_shard: int, prefix: str) -> None:
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
        self.out_dir, self.prefix, self.samples_per_shard = out_dir, prefix, samples_per_shard
        self.shards: list[str] = []
        self.num_samples = 0
        self._tar: wds.TarWriter | None = None
        self._keys: set[str] = set()
        self._finished: list[str] = []  # shards written under their partial name, moved into place by close()
        self._aborted = False
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
        # fixed int mtime: reproducible bytes, no PAX header per file; the final name only once the write completes
        self._tar = wds.TarWriter(partial_path(path), mtime=0)
        self.shards.append(path)
        self._keys = set()

    def _close_tar(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None
            self._finished.append(self.shards[-1])

    def _commit(self) -> None:
        """Called once every shard is in place (and indexed): subclasses write their dataset files here."""

    def close(self) -> list[str]:
        """Finish the last shard and move every shard (and its index) into place; returns the shard paths."""
        if self._aborted:
            raise ValueError(f"this writer of {self.out_dir!r} was aborted by an error: nothing was written")
        self._close_tar()
        spec = self._index_spec()
        for shard in self._finished:
            os.replace(partial_path(shard), shard)
            if spec is not None:
                write_index(build_index(shard, spec), sidecar_path(shard), shard_size=os.path.getsize(shard), spec=spec)
        self._finished = []
        self._commit()
        return self.shards

    def abort(self) -> None:
        """Drop the write: remove every partial shard; nothing a reader would take is left."""
        if self._tar is not None:
            try:
                self._tar.close()
            except Exception:  # noqa: BLE001 - the file is removed anyway
                pass
            self._tar = None
            self._finished.append(self.shards[-1])
        for shard in self._finished:
            with contextlib.suppress(FileNotFoundError):
                os.remove(partial_path(shard))
        self._finished, self._aborted = [], True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()


def partial_path(shard: str) -> str:
    """Where a shard is written until its writer completes (a name no reader takes)."""
    return shard + PARTIAL_SUFFIX
