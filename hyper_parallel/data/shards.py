"""Shard lists, their split into read units, and raw tar records.

``data.path`` names the shards as a directory (every ``*.tar`` in it), a glob
(``shards/train-*.tar``) or a brace pattern (``shards/train-{000000..000127}.tar``); the list is
sorted so every rank sees the same order.

Splitting: a *unit* is one shard, or one part of a shard when there are fewer shards than readers
(``parts = ceil(readers / shards)``; part ``p`` holds the samples whose index in the shard is
``p (mod parts)``). Each epoch permutes the units with a generator seeded by ``(seed, epoch)``;
reader ``r`` of ``R`` (``r = dp_rank * workers + worker``) takes ``units[r::R]``. Every sample thus
belongs to exactly one reader per epoch, and each epoch has a new order.
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import braceexpand
import numpy as np
from webdataset.tariterators import base_plus_ext

__all__ = ["ShardPlan", "iter_tar_records", "resolve_shards"]


def resolve_shards(path: str) -> list[str]:
    """Expand ``data.path`` (directory, glob or brace pattern) into a sorted list of tar files."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        shards = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith((".tar", ".tar.gz", ".tgz")))
        if not shards:
            raise FileNotFoundError(f"data.path={path!r} is a directory without .tar shards")
        return shards
    shards: set[str] = set()
    missing: list[str] = []
    for pattern in braceexpand.braceexpand(path):
        if glob.has_magic(pattern):
            shards.update(glob.glob(pattern))
        elif os.path.isfile(pattern):
            shards.add(pattern)
        else:
            missing.append(pattern)
    if missing:
        raise FileNotFoundError(
            f"data.path={path!r} names {len(missing)} shard(s) that do not exist, e.g. {missing[0]!r}"
        )
    if not shards:
        raise FileNotFoundError(f"data.path={path!r} matches no shard files")
    return sorted(shards)


def shards_digest(shards: list[str]) -> str:
    """A short fingerprint of the shard list (names and sizes), stored in the loader state."""
    h = hashlib.sha256()
    for s in shards:
        size = os.path.getsize(s) if os.path.exists(s) else -1
        h.update(f"{os.path.basename(s)}:{size}\n".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Which units (shard, part) a reader visits in each epoch (see the module docstring)."""

    shards: tuple[str, ...]
    num_readers: int
    seed: int

    @property
    def parts_per_shard(self) -> int:
        return max(1, math.ceil(self.num_readers / len(self.shards)))

    def units(self, epoch: int, reader: int) -> list[tuple[int, int]]:
        """``(shard_index, part)`` pairs reader ``reader`` reads in ``epoch``, in order."""
        parts = self.parts_per_shard
        num_units = len(self.shards) * parts
        order = np.random.default_rng([self.seed, epoch, 0xDA7A]).permutation(num_units)
        return [(int(u) // parts, int(u) % parts) for u in order[reader :: self.num_readers]]


def iter_tar_records(
    path: str, want: Callable[[int], bool]
) -> Iterator[tuple[int, str, dict[str, bytes] | None]]:
    """Yield ``(index, key, files)`` for each sample of a webdataset tar, in file order.

    Files are grouped by key with webdataset's ``<key>.<ext>`` rule. ``files`` is ``None`` when
    ``want(index)`` is false: the member data is then skipped without being read (the tar is opened
    seekable), which makes resuming at a sample offset cheap. Tar errors propagate, including a
    missing end-of-archive block (a truncated shard).
    """
    with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:*") as tar:
        key: str | None = None
        index = -1
        files: dict[str, bytes] | None = None
        for member in tar:
            if not member.isreg():
                continue
            prefix, suffix = base_plus_ext(member.name)
            if prefix is None or os.path.basename(member.name).startswith("__"):
                continue  # webdataset metadata entries
            if prefix != key:
                if key is not None:
                    yield index, key, files
                key, index = prefix, index + 1
                files = {} if want(index) else None
            if files is not None:
                files[suffix.lower()] = tar.extractfile(member).read()
            tar.members = []  # do not keep every header of a large shard in memory
        # tarfile ends iteration quietly on a truncated or garbled header; a complete archive ends
        # with a zero block. Check before handing out the last sample, which may be incomplete.
        tar.fileobj.seek(tar.offset)
        end = tar.fileobj.read(tarfile.BLOCKSIZE)
        if len(end) < tarfile.BLOCKSIZE or end.count(0) != tarfile.BLOCKSIZE:
            raise tarfile.ReadError(f"truncated or corrupt archive: no end-of-archive block at byte {tar.offset}")
        if key is not None:
            yield index, key, files
