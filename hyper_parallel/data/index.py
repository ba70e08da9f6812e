"""Per-shard index: record count, keys, byte offsets and per-record statistics of a tar shard.

Every rank computes the same global packing plan from the indexes alone (lengths, and whether a
record is valid), then reads only its own records by byte offset. An index is an uncompressed
``.npz`` (no pickles) holding:

- ``meta``: a JSON string ``{"format", "kind", "params", "shard_size", "num_records"}``; ``kind``
  (e.g. ``"direct_token/1"``) names the statistics and ``params`` what they depend on (the
  the image token id of a DirectToken index), so a source only uses an index whose statistics it understands;
- ``keys`` (bytes ``[n]``); ``member_start`` (int64 ``[n+1]``: record ``i`` owns members
  ``member_start[i]:member_start[i+1]``); ``member_ext`` (bytes ``[m]``), ``member_offset`` and
  ``member_size`` (int64 ``[m]``: where each member's data lies in the shard file);
- one int64 ``[n]`` column per statistic (``length`` at least; a negative value marks a record
  whose tokens are missing or undecodable).

Where it lives: next to the shard (``<shard>.idx.npz``, written by the shard writers) or, for
shards without one, built on first use into ``<cache_dir>/shard_index/`` under a name keyed by the
shard's absolute path, size and mtime and the index kind/params. An index whose recorded shard size
differs from the file is stale and ignored. Builds are written atomically, so ranks that build
the same index at once do not clash; each rank starts at its own offset in the shard list
(:func:`ensure_indexes`), which spreads first-use builds over the ranks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hyper_parallel.data.shards import INDEX_SUFFIX, iter_tar_records

__all__ = ["IndexSpec", "ShardIndex", "build_index", "ensure_indexes", "load_index", "load_stats", "write_index"]

logger = logging.getLogger("hyper_parallel.data")

INDEX_FORMAT = 1

StatsFn = Callable[[str, Mapping[str, bytes]], Mapping[str, int]]


@dataclass(frozen=True, slots=True)
class IndexSpec:
    """Which statistics an index holds: ``stats(key, files) -> {column: int}`` for every record."""

    kind: str
    """Name and version of the statistics (bump the version when ``stats`` changes)."""
    columns: tuple[str, ...]
    stats: StatsFn
    params: Mapping[str, Any] = field(default_factory=dict)
    """JSON-able values the statistics depend on (an index with other params is rebuilt)."""

    def matches(self, meta: Mapping[str, Any]) -> bool:
        return meta.get("kind") == self.kind and meta.get("params") == dict(self.params)


@dataclass(slots=True)
class ShardIndex:
    """The index of one shard (see the module docstring)."""

    keys: np.ndarray
    member_start: np.ndarray
    member_ext: np.ndarray
    member_offset: np.ndarray
    member_size: np.ndarray
    stats: dict[str, np.ndarray]

    @property
    def num_records(self) -> int:
        return int(self.keys.shape[0])

    def key(self, i: int) -> str:
        return self.keys[i].decode()

    def span(self, i: int) -> tuple[int, int, tuple[tuple[str, int, int], ...]]:
        """``(offset, size, members)`` of record ``i``: one read of ``size`` bytes at ``offset`` holds
        every member; ``members`` are ``(ext, offset inside that read, size)``."""
        lo, hi = int(self.member_start[i]), int(self.member_start[i + 1])
        offs, sizes = self.member_offset[lo:hi], self.member_size[lo:hi]
        start = int(offs.min())
        end = int((offs + sizes).max())
        members = tuple(
            (self.member_ext[j].decode(), int(self.member_offset[j]) - start, int(self.member_size[j]))
            for j in range(lo, hi)
        )
        return start, end - start, members


def build_index(shard: str, spec: IndexSpec) -> ShardIndex:
    """Scan ``shard`` once and compute its index (raises on an unreadable or compressed tar)."""
    keys: list[str] = []
    starts = [0]
    exts: list[str] = []
    offsets: list[int] = []
    sizes: list[int] = []
    columns: dict[str, list[int]] = {c: [] for c in spec.columns}
    for record in iter_tar_records(shard, require_plain=True):
        keys.append(record.key)
        for ext, off, size in record.members:
            exts.append(ext)
            offsets.append(off)
            sizes.append(size)
        starts.append(len(exts))
        values = spec.stats(record.key, record.files or {})
        for c in spec.columns:
            columns[c].append(int(values[c]))
    return ShardIndex(
        keys=np.array([k.encode() for k in keys], dtype=np.bytes_) if keys else np.zeros(0, "S1"),
        member_start=np.array(starts, np.int64),
        member_ext=np.array([e.encode() for e in exts], dtype=np.bytes_) if exts else np.zeros(0, "S1"),
        member_offset=np.array(offsets, np.int64),
        member_size=np.array(sizes, np.int64),
        stats={c: np.array(v, np.int64) for c, v in columns.items()},
    )


def write_index(index: ShardIndex, path: str, *, shard_size: int, spec: IndexSpec) -> None:
    """Save ``index`` to ``path`` atomically (a temporary file renamed into place)."""
    meta = {
        "format": INDEX_FORMAT,
        "kind": spec.kind,
        "params": dict(spec.params),
        "shard_size": int(shard_size),
        "num_records": index.num_records,
    }
    arrays = {
        "meta": np.array(json.dumps(meta, sort_keys=True)),
        "keys": index.keys,
        "member_start": index.member_start,
        "member_ext": index.member_ext,
        "member_offset": index.member_offset,
        "member_size": index.member_size,
        **{f"stat_{c}": v for c, v in index.stats.items()},
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_meta(path: str) -> dict[str, Any] | None:
    """The ``meta`` of an index file, or None if it cannot be read."""
    try:
        with np.load(path, allow_pickle=False) as f:
            return json.loads(str(f["meta"]))
    except Exception:  # noqa: BLE001 - a missing, partial or foreign file is simply not a usable index
        return None


def load_index(path: str, spec: IndexSpec) -> ShardIndex:
    """Load a full index written by :func:`write_index`."""
    with np.load(path, allow_pickle=False) as f:
        return ShardIndex(
            keys=f["keys"],
            member_start=f["member_start"],
            member_ext=f["member_ext"],
            member_offset=f["member_offset"],
            member_size=f["member_size"],
            stats={c: f[f"stat_{c}"] for c in spec.columns},
        )


def load_stats(path: str, spec: IndexSpec) -> dict[str, np.ndarray]:
    """Only the statistics columns of an index (what planning needs)."""
    with np.load(path, allow_pickle=False) as f:
        return {c: f[f"stat_{c}"] for c in spec.columns}


def sidecar_path(shard: str) -> str:
    return shard + INDEX_SUFFIX


def cache_path(shard: str, spec: IndexSpec, cache_dir: str) -> str:
    st = os.stat(shard)
    ident = json.dumps([os.path.abspath(shard), st.st_size, st.st_mtime_ns, spec.kind, dict(spec.params)], sort_keys=True)
    digest = hashlib.sha256(ident.encode()).hexdigest()[:24]
    return os.path.join(os.path.expanduser(cache_dir), "shard_index", f"{os.path.basename(shard)}-{digest}{INDEX_SUFFIX}")


def _usable(path: str, shard_size: int, spec: IndexSpec) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    meta = read_meta(path)
    if meta is None or meta.get("format") != INDEX_FORMAT or not spec.matches(meta):
        return None
    if meta.get("shard_size") != shard_size:  # the shard changed since it was indexed
        return None
    return meta


@dataclass(slots=True)
class IndexedShard:
    """A shard and where its usable index is (``index_path`` None: the tar cannot be read)."""

    shard: str
    index_path: str | None
    num_records: int
    error: str = ""


def ensure_indexes(shards: Sequence[str], spec: IndexSpec, *, cache_dir: str, start: int = 0) -> list[IndexedShard]:
    """A usable index for every shard: its side file, else the cache, else built now into the cache.

    Builds go in shard order starting at ``start`` (e.g. ``dp_rank * len(shards) // dp_world_size``)
    and wrap around, checking for each shard whether another process wrote it meanwhile. A shard
    that cannot be read gets ``index_path=None`` and the error text.
    """
    found: list[IndexedShard | None] = [None] * len(shards)
    n = len(shards)
    built = 0
    for j in range(n):
        i = (start + j) % n if n else 0
        shard = shards[i]
        size = os.path.getsize(shard)
        side = sidecar_path(shard)
        meta = _usable(side, size, spec)
        path = side
        if meta is None:
            path = cache_path(shard, spec, cache_dir)
            meta = _usable(path, size, spec)
        if meta is None:
            try:
                index = build_index(shard, spec)
            except Exception as e:  # noqa: BLE001 - any tar/IO failure makes the whole shard unreadable
                found[i] = IndexedShard(shard, None, 0, f"{type(e).__name__}: {e}")
                continue
            write_index(index, path, shard_size=size, spec=spec)
            meta = {"num_records": index.num_records}
            built += 1
        found[i] = IndexedShard(shard, path, int(meta["num_records"]))
    if built:
        logger.info("built %d shard index(es) of kind %s under %s", built, spec.kind, os.path.expanduser(cache_dir))
    return [f for f in found if f is not None]
