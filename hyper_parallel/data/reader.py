"""One logical reader: its units, epoch after epoch, decoded into validated samples.

The reader's whole position is a small dict (:class:`ReaderState`): epoch, cursor into the epoch's
unit list, raw-sample offset inside the current unit and the bad-sample counts. It emits samples in
chunks; each chunk carries the state *after* its last sample, so whoever consumes chunks (the main
process, possibly fed by a DataLoader worker running ahead) knows exactly where to resume.
"""

from __future__ import annotations

import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from hyper_parallel.data.sample import (
    BadSample,
    BadSampleError,
    Sample,
    SampleSpec,
    bad_sample_message,
    decode_sample,
)
from hyper_parallel.data.shards import ShardPlan, iter_tar_records

__all__ = ["Chunk", "ReaderState", "ShardReader"]


# What reading a damaged tar can raise (truncation, bad headers, broken compression, I/O).
_TAR_ERRORS = (tarfile.TarError, OSError, EOFError, zlib.error)

CHUNK_SAMPLES = 32
"""Samples per chunk (the transfer unit between a worker and the main process; part of the layout)."""


@dataclass(slots=True)
class ReaderState:
    """Where a reader stands; plain ints so it pickles and checkpoints cheaply."""

    epoch: int = 0
    cursor: int = 0
    """Index of the current unit in this epoch's unit list."""
    offset: int = 0
    """Raw samples of the current unit already consumed (good or bad)."""
    good_in_epoch: int = 0
    """Good samples emitted in this epoch (an epoch with none is an error, not an endless loop)."""
    bad: dict[str, int] = field(default_factory=dict)
    """Skipped samples per kind (see ``BAD_SAMPLE_KINDS``)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bad"] = dict(self.bad)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReaderState:
        return cls(**{**d, "bad": dict(d["bad"])})


@dataclass(slots=True)
class Chunk:
    """Samples a reader produced, plus its state after them and the skips they include."""

    reader: int
    samples: list[Sample]
    state: dict[str, Any]
    skipped: list[str]


class ShardReader:
    """Reads the units of logical reader ``reader`` (global index) from ``state`` onward."""

    def __init__(
        self,
        plan: ShardPlan,
        reader: int,
        spec: SampleSpec,
        *,
        skip_bad: bool,
        state: ReaderState | None = None,
        chunk_samples: int = CHUNK_SAMPLES,
    ) -> None:
        self.plan, self.reader, self.spec, self.skip_bad = plan, reader, spec, skip_bad
        self.state = state if state is not None else ReaderState()
        self.chunk_samples = chunk_samples
        self._skipped: list[str] = []
        self._samples = self._iter_samples()

    def next_chunk(self) -> Chunk:
        """The next ``chunk_samples`` good samples (reading on into later epochs as needed)."""
        samples = [next(self._samples) for _ in range(self.chunk_samples)]
        skipped, self._skipped = self._skipped, []
        return Chunk(self.reader, samples, self.state.to_dict(), skipped)

    def _bad(self, shard: str, key: str | None, kind: str, detail: str) -> None:
        message = bad_sample_message(shard, key, kind, detail)
        if not self.skip_bad:
            raise BadSampleError(
                message + ". Fix the data, or set --data.on_bad_sample skip to drop and count such samples."
            )
        self.state.bad[kind] = self.state.bad.get(kind, 0) + 1
        self._skipped.append(message)

    def _iter_samples(self) -> Iterator[Sample]:
        st = self.state
        parts = self.plan.parts_per_shard
        while True:
            units = self.plan.units(st.epoch, self.reader)
            while st.cursor < len(units):
                shard_index, part = units[st.cursor]
                shard = self.plan.shards[shard_index]
                start = st.offset
                want = lambda i, start=start, part=part: i >= start and i % parts == part  # noqa: E731
                key = None
                try:
                    for index, key, files in iter_tar_records(shard, want):
                        if files is None:
                            continue
                        try:
                            sample = decode_sample(key, shard, files, self.spec)
                        except BadSample as e:
                            st.offset = index + 1
                            self._bad(shard, key, e.kind, e.detail)
                            continue
                        st.offset = index + 1
                        st.good_in_epoch += 1
                        yield sample
                except _TAR_ERRORS as e:
                    after = f" after key {key!r}" if key is not None else ""
                    self._bad(shard, None, "unreadable_shard", f"the tar cannot be read{after} ({type(e).__name__}: {e})")
                st.cursor, st.offset = st.cursor + 1, 0
            if st.good_in_epoch == 0:
                raise BadSampleError(
                    f"DirectToken reader {self.reader} of {self.plan.num_readers} found no usable sample in a whole "
                    f"epoch over {len(units)} unit(s) of {len(self.plan.shards)} shard(s): use more samples, fewer "
                    "data-parallel ranks x data.num_workers, or check the skipped-sample log"
                )
            st.epoch, st.cursor, st.offset, st.good_in_epoch = st.epoch + 1, 0, 0, 0

