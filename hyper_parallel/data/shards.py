"""Shard lists, raw tar records with their byte offsets, and reads by offset.

``data.path`` names webdataset shards as a directory (every ``*.tar`` in it), a glob
(``shards/train-*.tar``) or a brace pattern (``shards/train-{000000..000127}.tar``); the list is
sorted so every rank sees the same order. Only ``.tar`` (``.tar.gz``, ``.tgz``) files are shards;
index side files (``*.idx.npz``, :mod:`.index`) never are.
"""

from __future__ import annotations

import glob
import hashlib
import os
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import braceexpand
from webdataset.tariterators import base_plus_ext

__all__ = ["INDEX_SUFFIX", "SpanReader", "TarRecord", "iter_tar_records", "resolve_shards", "shards_digest"]

INDEX_SUFFIX = ".idx.npz"
"""Suffix of a shard's index side file: ``train-000000.tar`` -> ``train-000000.tar.idx.npz``."""

_SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def resolve_shards(path: str) -> list[str]:
    """Expand ``data.path`` (directory, glob or brace pattern) into a sorted list of tar files."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        shards = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(_SHARD_SUFFIXES))
        if not shards:
            raise FileNotFoundError(f"data.path={path!r} is a directory without .tar shards")
        return shards
    found: set[str] = set()
    missing: list[str] = []
    for pattern in braceexpand.braceexpand(path):
        if glob.has_magic(pattern):
            found.update(p for p in glob.glob(pattern) if p.endswith(_SHARD_SUFFIXES))
        elif os.path.isfile(pattern) and pattern.endswith(_SHARD_SUFFIXES):
            found.add(pattern)
        else:
            missing.append(pattern)
    if missing:
        raise FileNotFoundError(
            f"data.path={path!r} names {len(missing)} shard(s) that do not exist or are not "
            f"{'/'.join(_SHARD_SUFFIXES)} files, e.g. {missing[0]!r}"
        )
    if not found:
        raise FileNotFoundError(f"data.path={path!r} matches no shard files ({'/'.join(_SHARD_SUFFIXES)})")
    return sorted(found)


def shards_digest(shards: list[str]) -> str:
    """A short fingerprint of the shard list (names and sizes), stored in the loader state."""
    h = hashlib.sha256()
    for s in shards:
        size = os.path.getsize(s) if os.path.exists(s) else -1
        h.update(f"{os.path.basename(s)}:{size}\n".encode())
    return h.hexdigest()[:16]


@dataclass(slots=True)
class TarRecord:
    """One webdataset sample of a tar: its members ``(ext, data offset, size)`` and, if read, their bytes."""

    index: int
    key: str
    members: list[tuple[str, int, int]]
    files: dict[str, bytes] | None


def iter_tar_records(
    path: str, want: Callable[[int], bool] = lambda i: True, *, require_plain: bool = False
) -> Iterator[TarRecord]:
    """Yield every sample of a webdataset tar, in file order.

    Files are grouped by key with webdataset's ``<key>.<ext>`` rule. ``files`` is ``None`` when
    ``want(index)`` is false: the member data is then skipped without being read (the tar is opened
    seekable). Member offsets are byte offsets into the file, valid for :func:`read_span` when the
    tar is not compressed (``require_plain`` raises ``ValueError`` for a compressed one). Tar errors
    propagate, including a missing end-of-archive block (a truncated shard).
    """
    with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:*") as tar:
        if require_plain and tar.fileobj is not f:
            raise ValueError(
                f"shard {path!r} is compressed: records are read by byte offset, so shards must be plain .tar "
                "files (decompress it, e.g. `gunzip -k`)"
            )
        record: TarRecord | None = None
        for member in tar:
            if not member.isreg():
                continue
            prefix, suffix = base_plus_ext(member.name)
            if prefix is None or os.path.basename(member.name).startswith("__"):
                continue  # webdataset metadata entries
            if record is None or prefix != record.key:
                if record is not None:
                    yield record
                index = 0 if record is None else record.index + 1
                record = TarRecord(index, prefix, [], {} if want(index) else None)
            ext = suffix.lower()
            record.members.append((ext, member.offset_data, member.size))
            if record.files is not None:
                record.files[ext] = tar.extractfile(member).read()
            tar.members = []  # do not keep every header of a large shard in memory
        # tarfile ends iteration quietly on a truncated or garbled header; a complete archive ends
        # with a zero block. Check before handing out the last sample, which may be incomplete.
        tar.fileobj.seek(tar.offset)
        end = tar.fileobj.read(tarfile.BLOCKSIZE)
        if len(end) < tarfile.BLOCKSIZE or end.count(0) != tarfile.BLOCKSIZE:
            raise tarfile.ReadError(f"truncated or corrupt archive: no end-of-archive block at byte {tar.offset}")
        if record is not None:
            yield record


class SpanReader:
    """Reads byte ranges of shard files with ``os.pread``, keeping a few files open (one per process)."""

    def __init__(self, max_open: int = 32) -> None:
        self.max_open = max_open
        self._fds: dict[str, int] = {}

    def read(self, path: str, offset: int, size: int) -> bytes:
        fd = self._fds.pop(path, None)
        if fd is None:
            if len(self._fds) >= self.max_open:
                os.close(self._fds.pop(next(iter(self._fds))))  # least recently used
            fd = os.open(path, os.O_RDONLY)
        self._fds[path] = fd  # most recently used last
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise OSError(f"short read of {path!r}: {len(data)} of {size} bytes at offset {offset} (file truncated?)")
        return data

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __getstate__(self) -> dict:
        return {"max_open": self.max_open}  # file descriptors do not travel to worker processes

    def __setstate__(self, state: dict) -> None:
        self.max_open, self._fds = state["max_open"], {}
