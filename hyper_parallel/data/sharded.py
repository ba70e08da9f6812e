"""``ShardedDataLoader``: the machinery of shard-backed sources (DirectToken, text).

Per rank::

    shard indexes --(every rank, same result)--> global plan (:mod:`.plan`) --this rank's micro-batches-->
    read each record by byte offset --> decode + validate (the source's codec) --> collate

- **Indexes** (:mod:`.index`): each shard's record count, keys, byte offsets and statistics; the
  side file written with the shard, else built on first use into ``data.cache_dir``.
- **Plan**: the same global micro-batch sequence on every rank, from the indexes and the config.
- **Reads**: rank ``r`` reads only the records of its own micro-batches, one ``pread`` per record.
  With ``num_workers > 0`` a ``torch.utils.data.DataLoader`` of a map-style dataset reads whole
  micro-batches in worker processes; the main process hands out the work in order and gets the
  results back in order, so the workers never change the data.
- **State**: the number of the next global micro-batch plus the planner cursor of the window that
  emitted the one before it; prefetched work is simply dropped on a resume.

A subclass says which shards (:meth:`_resolve_shards`), what their index holds
(:meth:`_index_spec`), which records are bad (:meth:`_classify`) and how to decode and collate a
record (:meth:`_codec`).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch.utils.data

from hyper_parallel.data.bad_samples import BadSample, BadSampleError, bad_sample_message
from hyper_parallel.data.holdout import Holdout
from hyper_parallel.data.base import BaseDataLoader
from hyper_parallel.data.index import IndexedShard, IndexSpec, ShardIndex, ensure_indexes, load_index, load_stats
from hyper_parallel.data.packing import Document
from hyper_parallel.data.plan import Cursor, Planner, Ref
from hyper_parallel.data.shards import SpanReader, shards_digest

__all__ = ["Codec", "ReadItem", "ShardedDataLoader"]

logger = logging.getLogger("hyper_parallel.data")


class Codec(Protocol):
    """How a source turns a record's files into a document and documents into a micro-batch (picklable)."""

    label: str
    """Name of the source in messages (``DirectToken``, ``text``)."""

    def decode(self, key: str, shard: str, files: Mapping[str, bytes], piece: int) -> Document:
        """Decode and validate one record (raises ``BadSample``); ``piece`` > 0 only for split documents."""
        ...

    def collate(self, documents: Sequence[Document], *, pad_token_id: int, pad_to_multiple_of: int) -> dict[str, Any]:
        ...


@dataclass(frozen=True, slots=True)
class RecordSpan:
    """Where one record (or one piece of it) lies: enough for a worker to read it without the index."""

    shard: str
    key: str
    offset: int
    size: int
    members: tuple[tuple[str, int, int], ...]
    piece: int


@dataclass(frozen=True, slots=True)
class ReadItem:
    """One global micro-batch to read: its number and its records in packing order."""

    g: int
    records: tuple[RecordSpan, ...]


class MicroBatchReader(torch.utils.data.Dataset):
    """Reads, decodes and collates a :class:`ReadItem` (in the main process or a DataLoader worker)."""

    def __init__(self, codec: Codec, *, pad_token_id: int, pad_to_multiple_of: int) -> None:
        self.codec, self.pad_token_id, self.pad_to_multiple_of = codec, pad_token_id, pad_to_multiple_of
        self.files = SpanReader()

    def read_record(self, span: RecordSpan) -> Document:
        data = self.files.read(span.shard, span.offset, span.size)
        files = {ext: data[off : off + size] for ext, off, size in span.members}
        return self.codec.decode(span.key, span.shard, files, span.piece)

    def __getitem__(self, item: ReadItem) -> tuple[int, dict[str, Any]]:
        documents = []
        for span in item.records:
            try:
                documents.append(self.read_record(span))
            except BadSample as e:
                # The index said this record is good: the shard changed after it was indexed.
                raise BadSampleError(
                    bad_sample_message(self.codec.label, span.shard, span.key, e.kind, e.detail)
                    + ". Its index says otherwise: was the shard rewritten after it was indexed? Delete its "
                    f"index ({span.shard}.idx.npz or the copy under data.cache_dir) to rebuild it"
                ) from None
        batch = self.codec.collate(documents, pad_token_id=self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of)
        return item.g, batch


def _passthrough(item: Any) -> Any:
    """Collate of the worker DataLoader: the reader already collated."""
    return item


class _ItemSampler:
    """The DataLoader's sampler: this rank's read items from a given micro-batch on (endless)."""

    def __init__(self, items: Iterator[ReadItem]) -> None:
        self.items = items

    def __iter__(self) -> Iterator[ReadItem]:
        return self.items


class ShardTable:
    """The corpus as the planner sees it: records per shard, lengths and kinds from the indexes.

    Lengths (int32) and kind codes (int8) of every shard stay in memory once loaded (5 bytes per
    record: planning visits every shard each epoch); full indexes (keys, offsets) are only needed
    for this rank's own records and are kept for the ``cache_size`` most recently used shards.
    """

    def __init__(
        self,
        shards: Sequence[IndexedShard],
        spec: IndexSpec,
        *,
        classify: Callable[[Mapping[str, np.ndarray]], np.ndarray],
        kinds: tuple[str, ...],
        reader: MicroBatchReader,
        cache_size: int = 64,
        holdout: Holdout | None = None,
    ) -> None:
        """``holdout``: records outside this side of a held-out split get kind code -1 (the planner skips them)."""
        self.holdout = holdout
        self.shards = list(shards)
        self.spec, self.classify, self.kinds, self.reader, self.cache_size = spec, classify, kinds, reader, cache_size
        self.num_records = np.array([s.num_records for s in self.shards], np.int64)
        self._units: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._indexes: OrderedDict[int, ShardIndex] = OrderedDict()

    def _check(self, shard: int, n: int) -> None:
        if n != self.num_records[shard]:
            raise ValueError(f"the index of {self.shards[shard].shard!r} changed while training; restart the run")

    def units(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        units = self._units.get(shard)
        if units is None:
            stats = load_stats(self.shards[shard].index_path, self.spec)
            self._check(shard, len(stats["length"]))
            kinds = self.classify(stats).astype(np.int8)
            if self.holdout is not None:
                name = os.path.basename(self.shards[shard].shard)
                kinds = np.where(self.holdout.keeps(name, self.index(shard).keys), kinds, np.int8(-1)).astype(np.int8)
            units = (stats["length"].astype(np.int32), kinds)
            self._units[shard] = units
        return units

    def index(self, shard: int) -> ShardIndex:
        index = self._indexes.pop(shard, None)
        if index is None:
            index = load_index(self.shards[shard].index_path, self.spec)
            self._check(shard, index.num_records)
            if len(self._indexes) >= self.cache_size:
                self._indexes.popitem(last=False)
        self._indexes[shard] = index
        return index

    def span(self, ref: Ref) -> RecordSpan:
        shard, record, piece = ref
        index = self.index(shard)
        offset, size, members = index.span(record)
        return RecordSpan(self.shards[shard].shard, index.key(record), offset, size, members, piece)

    def describe(self, shard: int, record: int, kind: str) -> str:
        """The message of a bad record: decoding it once gives the exact detail."""
        span = self.span((shard, record, 0))
        detail = f"the record is not usable ({kind})"
        try:
            self.reader.read_record(span)
        except BadSample as e:
            detail = e.detail if e.kind == kind else detail
        except OSError as e:
            detail = f"{type(e).__name__}: {e}"
        return bad_sample_message(self.reader.codec.label, span.shard, span.key, kind, detail)


class WorkerReads:
    """Reads a rank's micro-batches in order: in this process (``num_workers == 0``) or through a
    ``DataLoader`` of ``num_workers`` processes, (re)started at any micro-batch. A loader that mixes it in
    provides ``_reader`` (a Dataset of read items, returning ``(g, batch)``) and ``_item(g)`` (the read
    item of global micro-batch ``g``)."""

    _items: Iterator[tuple[int, dict[str, Any]]] | None = None
    _items_next: int = -1  # global number of the next micro-batch ``_items`` yields

    def _rank_items(self, first_step_g: int) -> Iterator[Any]:
        g0 = first_step_g
        while True:
            for g in self.my_micro_batches(g0):
                yield self._item(g)
            g0 += self.global_micro_batches

    def _read(self, gs: range) -> list[dict[str, Any]]:
        """The collated micro-batches ``gs`` (this rank's, consecutive)."""
        if self.config.num_workers == 0:
            return [self._reader[self._item(g)][1] for g in gs]
        if self._items is None or self._items_next != gs[0]:
            self._start_workers(gs[0])
        out = []
        for g in gs:
            got, batch = next(self._items)
            if got != g:  # the DataLoader returns work in order: this would be a bug
                raise RuntimeError(f"data workers returned micro-batch {got}, expected {g}")
            out.append(batch)
        self._items_next = gs[0] + self.global_micro_batches
        return out

    def _start_workers(self, first: int) -> None:
        """Start the workers on this rank's micro-batches from global micro-batch ``first`` on."""
        self.close()
        loader = torch.utils.data.DataLoader(
            self._reader,
            batch_size=None,
            sampler=_ItemSampler(self._rank_items(first - self.dp_rank * self.micro_batches_per_step)),
            num_workers=self.config.num_workers,
            collate_fn=_passthrough,
            prefetch_factor=2,
        )
        self._items = iter(loader)
        self._items_next = first

    def close(self) -> None:
        """Stop the worker processes (the next step restarts them at the current position)."""
        self._items = None
        self._items_next = -1


class ShardedDataLoader(WorkerReads, BaseDataLoader):
    """Shard-backed data in a layout-independent order (see the module docstring)."""

    bad_kinds: tuple[str, ...] = ()
    """Every kind :meth:`_classify` can report (code ``i + 1`` is ``bad_kinds[i]``)."""
    supports_holdout = True

    def __init__(self, config: BaseDataLoader.Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        c = config
        self._prepare()
        self.codec: Codec = self._codec()
        self._reader = MicroBatchReader(self.codec, pad_token_id=c.pad_token_id, pad_to_multiple_of=self.pad_multiple)
        # records dropped before planning: unreadable shards, raw records the tokeniser rejected
        self._startup_bad: dict[str, int] = {}
        self.shards = self._resolve_shards()
        self._shards_digest = shards_digest(self.shards)
        self.index_spec = self._index_spec()
        start = self.dp_rank * len(self.shards) // self.dp_world_size  # spreads first-use index builds
        indexed = ensure_indexes(self.shards, self.index_spec, cache_dir=c.cache_dir, start=start)
        readable = []
        for s in indexed:
            if s.index_path is not None:
                readable.append(s)
                continue
            detail = f"the tar cannot be read ({s.error})"
            message = bad_sample_message(self.codec.label, s.shard, None, "unreadable_shard", detail)
            if c.on_bad_sample == "error":
                raise BadSampleError(
                    message + ". Fix the data, or set --data.on_bad_sample skip to drop and count such samples."
                )
            self._startup_bad["unreadable_shard"] = self._startup_bad.get("unreadable_shard", 0) + 1
            if self.dp_rank == 0:
                logger.warning("skipped %s", message)
        self.table = ShardTable(
            readable, self.index_spec, classify=self._classify, kinds=self.bad_kinds, reader=self._reader,
            holdout=self.holdout,
        )  # fmt: skip
        if c.on_bad_sample == "error":
            self._check_every_record()
        if self.holdout is not None:
            self._check_holdout()
        self._planner = self._new_planner(None)
        self._pass_length: int | None = None

    # -- what a source provides ----------------------------------------------------------------
    def _prepare(self) -> None:
        """Read the model facts and check the config (before the shards are resolved and indexed)."""

    def _resolve_shards(self) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _index_spec(self) -> IndexSpec:  # pragma: no cover - abstract
        raise NotImplementedError

    def _classify(self, stats: Mapping[str, np.ndarray]) -> np.ndarray:  # pragma: no cover - abstract
        """Kind code per record from its index statistics: 0 good, ``i + 1`` for ``bad_kinds[i]``."""
        raise NotImplementedError

    def _codec(self) -> Codec:  # pragma: no cover - abstract
        raise NotImplementedError

    def _check_every_record(self) -> None:
        """``on_bad_sample=error``: fail before training on the first bad record (from the indexes alone)."""
        for shard in range(len(self.table.shards)):
            kinds = self.table.units(shard)[1]
            bad = np.flatnonzero(kinds > 0)
            if len(bad):
                name = self.bad_kinds[int(kinds[bad[0]]) - 1]
                raise BadSampleError(
                    self.table.describe(shard, int(bad[0]), name)
                    + ". Fix the data, or set --data.on_bad_sample skip to drop and count such samples."
                )

    def _check_holdout(self) -> None:
        """A side of a held-out split must keep at least one record (a small corpus and a small fraction)."""
        kept = sum(int((self.table.units(s)[1] >= 0).sum()) for s in range(len(self.table.shards)))
        if kept == 0:
            total = int(self.table.num_records.sum())
            raise ValueError(
                f"validation.split={self.holdout.fraction} leaves the {self.holdout.side} side of the {self.codec.label} "
                f"data ({self.config.path or 'the toy corpus'}) without a record ({total} records in all): "
                + ("raise the fraction" if self.holdout.side == "validation" else "lower the fraction")
            )

    # -- plan ----------------------------------------------------------------------------------
    def _new_planner(self, cursor: Cursor | None) -> Planner:
        c = self.config
        log = (lambda msg: logger.warning("%s", msg)) if self.dp_rank == 0 else None
        return Planner(
            self.table,
            seed=c.seed,
            max_tokens=c.max_tokens_per_microbatch,
            open_bins=c.packing_bins,
            window=c.shuffle_buffer if c.shuffle_buffer > 1 else 1024,
            shuffle=c.shuffle_buffer > 1,
            split_long=c.text.split_long_documents,
            skip_bad=c.on_bad_sample == "skip",
            source=self.codec.label,
            cursor=cursor,
            log=log,
            epochs=1 if self.single_pass else None,
        )

    @property
    def pass_micro_batches(self) -> int | None:
        if not self.single_pass:
            return None
        if self._pass_length is None:
            self._pass_length = self._planner.pass_length()
        return self._pass_length

    def _clamp(self, g: int) -> int:
        """A single pass repeats its last micro-batch past its end (the validator masks those)."""
        return min(g, self.pass_micro_batches - 1) if self.single_pass else g

    def _item(self, g: int) -> ReadItem:
        return ReadItem(g, tuple(self.table.span(ref) for ref in self._planner.bin(self._clamp(g))))

    def record_ids(self, g: int) -> list[str]:
        """Sample ids (``<shard file name>/<record key>``, :mod:`.holdout`) of global micro-batch ``g``'s
        records, in packing order (a split long document's pieces repeat its id)."""
        return [f"{os.path.basename(span.shard)}/{span.key}" for span in self._item(g).records]

    # -- reading -------------------------------------------------------------------------------
    def _micro_batches(self, gs: range) -> list[dict[str, Any]]:
        out = [self.finish(batch) for batch in self._read(gs)]
        self._planner.release(self._clamp(gs[0] + self.global_micro_batches - self.dp_rank * self.micro_batches_per_step - 1))
        return out

    def finish(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A read micro-batch as this source gives it (a mixture calls it on the batches it reads from this
        source); the source's own label policy goes here. Default: unchanged."""
        return batch

    # -- state ---------------------------------------------------------------------------------
    @property
    def bad_sample_counts(self) -> dict[str, int]:
        counts = dict(self._startup_bad)
        if self.next_micro_batch > 0:
            for kind, n in self._planner.window_of(self.next_micro_batch - 1).after.bad.items():
                counts[kind] = counts.get(kind, 0) + n
        return counts

    def _order(self) -> dict[str, Any]:
        c = self.config
        return {
            **super()._order(),
            "shards": self._shards_digest,
            "index": [self.index_spec.kind, dict(self.index_spec.params)],
            "shuffle_buffer": c.shuffle_buffer,
            "packing_bins": c.packing_bins,
            "split_long_documents": c.text.split_long_documents,
            # only when set: checkpoints of runs without a split keep resuming
            **({"holdout": self.holdout.order()} if self.holdout is not None else {}),
        }

    def _plan_state(self) -> dict[str, Any] | None:
        if self.next_micro_batch == 0:
            return None
        return self._planner.window_of(self.next_micro_batch - 1).before.to_dict()

    def _load_plan_state(self, plan: dict[str, Any] | None) -> None:
        self._planner = self._new_planner(None if plan is None else Cursor.from_dict(plan))

    def _skip_to(self, g: int) -> None:
        self.close()
        if g > 0:
            self._planner.window_of(g - 1)  # plans (no reads) up to the last micro-batch before g
            self._planner.release(g - 1)
