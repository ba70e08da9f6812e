"""The rank's sample stream: its logical readers interleaved chunk by chunk, resumably.

A rank owns ``W = max(1, data.num_workers)`` logical readers (global reader index
``dp_rank * W + i``). Chunks are consumed round-robin in a fixed order: reader ``next_reader``,
then the next one, and so on. With ``num_workers=0`` the readers run in this process; otherwise
each runs in a ``torch.utils.data.DataLoader`` worker. The DataLoader hands out worker outputs
round-robin in worker order, so on (re)start worker ``w`` plays logical reader
``(next_reader + w) % W``: the first chunk again comes from ``next_reader``.

Exact resume despite workers running ahead: the stream keeps, per logical reader, the state carried
by the last chunk it *consumed*, plus the consumed chunks' samples not yet handed on (``pending``).
Prefetched chunks are simply dropped on a restart and read again.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch.utils.data

from hyper_parallel.data.reader import Chunk, ReaderState, ShardReader
from hyper_parallel.data.sample import Sample, SampleSpec
from hyper_parallel.data.shards import ShardPlan

__all__ = ["SampleStream"]

logger = logging.getLogger("hyper_parallel.data")


def _passthrough(item: Any) -> Any:
    """Collate of the worker DataLoader: keep chunks as they are (no tensor conversion)."""
    return item


class _ReaderDataset(torch.utils.data.IterableDataset):
    """What each DataLoader worker runs: one logical reader, chunk after chunk."""

    def __init__(self, plan: ShardPlan, first_reader: int, states: list[dict], next_reader: int, spec: SampleSpec, skip_bad: bool):
        self.plan, self.first_reader, self.states = plan, first_reader, states
        self.next_reader, self.spec, self.skip_bad = next_reader, spec, skip_bad

    def __iter__(self) -> Iterator[Chunk]:
        info = torch.utils.data.get_worker_info()
        assert info is not None, "_ReaderDataset only runs inside DataLoader workers"
        local = (self.next_reader + info.id) % info.num_workers
        reader = ShardReader(
            self.plan, self.first_reader + local, self.spec, skip_bad=self.skip_bad,
            state=ReaderState.from_dict(self.states[local]),
        )
        while True:
            yield reader.next_chunk()


class SampleStream:
    """Validated samples of one rank in a deterministic order, with an exact ``state_dict``."""

    def __init__(self, plan: ShardPlan, *, dp_rank: int, num_workers: int, spec: SampleSpec, skip_bad: bool) -> None:
        self.plan, self.spec, self.skip_bad, self.num_workers = plan, spec, skip_bad, num_workers
        self.num_local = max(1, num_workers)
        self.first_reader = dp_rank * self.num_local
        self.reader_states = [ReaderState().to_dict() for _ in range(self.num_local)]
        self.next_reader = 0
        self.pending: deque[Sample] = deque()
        self._chunks: Iterator[Chunk] | None = None

    # -- consumption -------------------------------------------------------------------------
    def next(self) -> Sample:
        while not self.pending:
            self._consume(next(self._source()))
        return self.pending.popleft()

    def _consume(self, chunk: Chunk) -> None:
        local = chunk.reader - self.first_reader
        if local != self.next_reader:  # the round-robin contract is what makes resume exact
            raise RuntimeError(f"data stream out of order: got reader {local}, expected {self.next_reader}")
        self.reader_states[local] = chunk.state
        self.next_reader = (self.next_reader + 1) % self.num_local
        self.pending.extend(chunk.samples)
        for message in chunk.skipped:
            logger.warning("skipped %s (total skipped on this rank: %d)", message, sum(self.bad_counts().values()))

    def _source(self) -> Iterator[Chunk]:
        if self._chunks is None:
            self._chunks = self._start()
        return self._chunks

    def _start(self) -> Iterator[Chunk]:
        if self.num_workers == 0:
            reader = ShardReader(
                self.plan, self.first_reader, self.spec, skip_bad=self.skip_bad,
                state=ReaderState.from_dict(self.reader_states[0]),
            )
            return iter(reader.next_chunk, None)
        dataset = _ReaderDataset(
            self.plan, self.first_reader, [dict(s) for s in self.reader_states], self.next_reader, self.spec, self.skip_bad
        )
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=None, num_workers=self.num_workers, collate_fn=_passthrough, prefetch_factor=2
        )
        return iter(loader)

    def close(self) -> None:
        """Stop the readers (workers exit); the next ``next()`` restarts them from the state."""
        self._chunks = None

    # -- state ---------------------------------------------------------------------------------
    def bad_counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for state in self.reader_states:
            for kind, n in state["bad"].items():
                total[kind] = total.get(kind, 0) + n
        return total

    def state_dict(self) -> dict[str, Any]:
        return {
            "readers": [ReaderState.from_dict(s).to_dict() for s in self.reader_states],
            "next_reader": self.next_reader,
            "pending": [s.to_dict() for s in self.pending],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["readers"]) != self.num_local:
            raise ValueError(
                f"the data state holds {len(state['readers'])} reader(s) per rank but data.num_workers="
                f"{self.num_workers} needs {self.num_local}: resume with the same data.num_workers"
            )
        self.close()
        self.reader_states = [ReaderState.from_dict(s).to_dict() for s in state["readers"]]
        self.next_reader = int(state["next_reader"])
        self.pending = deque(Sample.from_dict(s) for s in state["pending"])
