"""A held-out fraction of a corpus (``--validation.split``), chosen by sample id on every rank alike.

A record's **sample id** is ``<shard file name>/<record key>`` (the key is the record's name inside its
tar shard). A seeded 64-bit hash of the id decides its side: the record is held out when
``hash / 2**64 < fraction``. So the split depends on the data alone (never on the DP degree, the worker
count or the data seed), every rank computes it from the shard indexes without reading a record, a resumed
run sees the same split, and the pieces of a split long document stay on one side.

The training loader is built with ``Holdout(fraction, "train")`` (it skips the held-out records) and the
validator's loader with ``Holdout(fraction, "validation")`` (it reads only them); the records a side
skips are not bad samples and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["Holdout", "sample_hash"]

_FNV_OFFSET, _FNV_PRIME = 0xCBF29CE484222325, 0x100000001B3
_SALT = b"hyper_parallel.holdout\x00"
_MASK64 = (1 << 64) - 1


def sample_hash(shard_name: str, keys: np.ndarray) -> np.ndarray:
    """uint64 hash of every sample id ``<shard_name>/<key>`` (``keys``: a bytes array ``S<w>``).

    FNV-1a over the id's bytes (vectorised over the records; the NUL padding of the fixed-width array is
    skipped, so the width does not matter), then the splitmix64 finaliser for well-mixed high bits.
    """
    h0 = _FNV_OFFSET
    for b in _SALT + shard_name.encode() + b"/":
        h0 = ((h0 ^ b) * _FNV_PRIME) & _MASK64
    n = len(keys)
    h = np.full(n, h0, dtype=np.uint64)
    if n:
        keys = np.ascontiguousarray(keys, dtype=np.bytes_)
        width = keys.dtype.itemsize
        matrix = keys.view(np.uint8).reshape(n, width)
        prime = np.uint64(_FNV_PRIME)
        for j in range(width):
            col = matrix[:, j].astype(np.uint64)
            h = np.where(col != 0, (h ^ col) * prime, h)
    h ^= h >> np.uint64(30)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(27)
    h *= np.uint64(0x94D049BB133111EB)
    h ^= h >> np.uint64(31)
    return h


@dataclass(frozen=True, slots=True)
class Holdout:
    """Which side of a held-out split a loader reads: ``train`` (all but the held-out records) or
    ``validation`` (only them)."""

    fraction: float
    """Share of the records held out, in (0, 1)."""
    side: Literal["train", "validation"]

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"validation.split={self.fraction} must lie in (0, 1) (0 turns the split off)")
        if self.side not in ("train", "validation"):
            raise ValueError(f"Holdout.side={self.side!r} must be 'train' or 'validation'")

    def held_out(self, shard_name: str, keys: np.ndarray) -> np.ndarray:
        """bool per record: held out for validation."""
        u = (sample_hash(shard_name, keys) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        return u < self.fraction

    def keeps(self, shard_name: str, keys: np.ndarray) -> np.ndarray:
        """bool per record: read by a loader of this side."""
        held = self.held_out(shard_name, keys)
        return held if self.side == "validation" else ~held

    def order(self) -> list:
        """What the data order depends on (part of the loader's checkpointed ``order``)."""
        return [float(self.fraction), self.side]
