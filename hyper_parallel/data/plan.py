"""The global packing plan: which records form global micro-batch ``g``, for every ``g``, on every rank.

The plan is a function of the corpus index, the data config and the seed only (never of the DP
degree or the worker count), and every rank computes all of it from the indexes, without reading
a record:

1. **Epoch order.** Epoch ``e`` visits the shards in a permutation seeded by ``(seed, e)``; the
   records of each shard follow in file order. This record sequence is cut into *windows* of
   ``window`` records; window ``k`` is permuted with ``(seed, e, k)`` when ``shuffle`` is on.
2. **Validation.** A record the source marks bad (from its index statistics) raises with
   ``on_bad_sample=error`` or is dropped, and counted per kind in the first epoch (so each bad
   record counts once); the counts are part of the plan. A record outside the loader's side of a
   held-out split (kind code -1, :mod:`.holdout`) is skipped silently.
3. **Packing.** Good records (or their pieces, when long documents are split) go through one
   :class:`~hyper_parallel.data.packing.FirstFitPacker` that runs across windows and epochs; the
   bins it emits are the global micro-batches ``g = 0, 1, 2, ...`` in order.

A :class:`Cursor` is the planner's state before a window (epoch, window, the number of the next
micro-batch, the open bins, the bad-sample counts): a few hundred bytes. Restarting from the cursor
of the window that emitted micro-batch ``g`` re-plans one window and skips to ``g``, so jumping to
any step costs no replay of earlier ones.

**Single pass** (``epochs=1``, a validation pass): after the last window of the last epoch the open bins
are emitted too, and the plan ends; :meth:`Planner.pass_length` counts its micro-batches.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hyper_parallel.data.bad_samples import BadSampleError
from hyper_parallel.data.packing import FirstFitPacker

__all__ = ["Cursor", "Planner", "RecordTable", "Ref"]

Ref = tuple[int, int, int]
"""``(shard index, record index in the shard, piece)``; piece > 0 only for split long documents."""

_SHARD_ORDER_TAG, _WINDOW_TAG = 0x5A4D, 0x57AF


class RecordTable(Protocol):
    """What the planner needs to know of a corpus (built from the shard indexes)."""

    num_records: np.ndarray
    """int64 ``[S]``: records of each shard."""
    kinds: tuple[str, ...]
    """Bad-sample kinds; ``units`` marks a bad record with ``1 + index`` into this tuple."""

    def units(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """``(lengths, kind_codes)`` of every record of ``shard`` (kind 0: a good record)."""
        ...

    def describe(self, shard: int, record: int, kind: str) -> str:
        """A message naming the shard and the key of a bad record."""
        ...


@dataclass(slots=True)
class Cursor:
    """The planner's state before window ``window`` of epoch ``epoch`` (plain data: picklable)."""

    epoch: int = 0
    window: int = 0
    next_bin: int = 0
    """Global number of the next micro-batch the planner emits."""
    open_bins: list[list[list[int]]] = field(default_factory=list)
    """The packer's open bins: ``[[length, shard, record, piece], ...]`` each."""
    bad: dict[str, int] = field(default_factory=dict)
    """Distinct records dropped so far, per kind."""
    good_in_epoch: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "window": self.window,
            "next_bin": self.next_bin,
            "open_bins": [[list(item) for item in b] for b in self.open_bins],
            "bad": dict(self.bad),
            "good_in_epoch": self.good_in_epoch,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cursor:
        return cls(
            epoch=int(d["epoch"]),
            window=int(d["window"]),
            next_bin=int(d["next_bin"]),
            open_bins=[[[int(v) for v in item] for item in b] for b in d["open_bins"]],
            bad={str(k): int(v) for k, v in d["bad"].items()},
            good_in_epoch=int(d["good_in_epoch"]),
        )


@dataclass(slots=True)
class PlannedWindow:
    """The micro-batches one window emitted, and the cursors before and after it."""

    before: Cursor
    after: Cursor
    bins: list[list[Ref]]

    @property
    def first_bin(self) -> int:
        return self.before.next_bin

    @property
    def end_bin(self) -> int:
        return self.after.next_bin


class Planner:
    """Computes the global micro-batches lazily, window by window (see the module docstring)."""

    def __init__(
        self,
        table: RecordTable,
        *,
        seed: int,
        max_tokens: int,
        open_bins: int,
        window: int,
        shuffle: bool,
        split_long: bool,
        skip_bad: bool,
        source: str,
        cursor: Cursor | None = None,
        log: Callable[[str], None] | None = None,
        epochs: int | None = None,
    ) -> None:
        """``epochs``: None plans epoch after epoch (training); a number ends the plan after that many."""
        self.table, self.seed, self.max_tokens, self.open_bins = table, seed, max_tokens, open_bins
        self.epochs = epochs
        self.window, self.shuffle, self.split_long, self.skip_bad = max(1, window), shuffle, split_long, skip_bad
        self.source, self.log = source, log
        self.num_records = int(table.num_records.sum())
        if self.num_records == 0:
            raise BadSampleError(f"the {source} corpus holds no record: check data.path")
        self.windows_per_epoch = math.ceil(self.num_records / self.window)
        self._next = cursor if cursor is not None else Cursor()
        self._planned: deque[PlannedWindow] = deque()
        self._layout: tuple[int, np.ndarray, np.ndarray] | None = None

    # -- lookup ------------------------------------------------------------------------------
    def window_of(self, g: int) -> PlannedWindow:
        """The planned window that emitted micro-batch ``g`` (plans ahead as needed)."""
        if self._planned and g < self._planned[0].first_bin or not self._planned and g < self._next.next_bin:
            raise ValueError(f"micro-batch {g} was released from the plan (the planner starts at a later one)")
        while not self._planned or g >= self._planned[-1].end_bin:
            if self.exhausted:
                raise IndexError(f"micro-batch {g} is past the end of the single pass ({self._next.next_bin} micro-batches)")
            self._plan_next()
        for w in self._planned:
            if w.first_bin <= g < w.end_bin:
                return w
        raise AssertionError(g)  # unreachable: windows cover [first, end) contiguously

    def bin(self, g: int) -> list[Ref]:
        w = self.window_of(g)
        return w.bins[g - w.first_bin]

    @property
    def exhausted(self) -> bool:
        """Whether a plan of ``epochs`` epochs has emitted its last micro-batch."""
        return self.epochs is not None and self._next.epoch >= self.epochs

    def pass_length(self) -> int:
        """Micro-batches of a plan of ``epochs`` epochs, counted on a fresh copy of this planner (reads
        only the indexes; this planner is not advanced)."""
        if self.epochs is None:
            raise ValueError("pass_length() needs a planner of a fixed number of epochs")
        copy = Planner(
            self.table, seed=self.seed, max_tokens=self.max_tokens, open_bins=self.open_bins, window=self.window,
            shuffle=self.shuffle, split_long=self.split_long, skip_bad=self.skip_bad, source=self.source,
            epochs=self.epochs,
        )  # fmt: skip
        while not copy.exhausted:
            copy._plan_next()
            copy._planned.clear()
        return copy._next.next_bin

    def release(self, g: int) -> None:
        """Forget windows whose micro-batches all come before ``g``."""
        while self._planned and self._planned[0].end_bin <= g:
            self._planned.popleft()

    # -- planning ----------------------------------------------------------------------------
    def _epoch_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if self._layout is None or self._layout[0] != epoch:
            order = np.random.default_rng([self.seed, epoch, _SHARD_ORDER_TAG]).permutation(len(self.table.num_records))
            ends = np.cumsum(self.table.num_records[order])
            self._layout = (epoch, order, ends)
        return self._layout[1], self._layout[2]

    def _window_records(self, epoch: int, k: int) -> tuple[list[int], list[int], list[int], list[int]]:
        """Shard, record, length and kind code of every record of window ``k``, in window order."""
        order, ends = self._epoch_layout(epoch)
        lo, hi = k * self.window, min((k + 1) * self.window, self.num_records)
        shards, records, lengths, kinds = [], [], [], []
        i = int(np.searchsorted(ends, lo, side="right"))
        pos = lo
        while pos < hi:
            s = int(order[i])
            start = int(ends[i]) - int(self.table.num_records[s])
            a, b = pos - start, min(hi, int(ends[i])) - start
            if b > a:
                unit_lengths, unit_kinds = self.table.units(s)
                shards.append(np.full(b - a, s, np.int64))
                records.append(np.arange(a, b, dtype=np.int64))
                lengths.append(unit_lengths[a:b])
                kinds.append(unit_kinds[a:b])
                pos = start + b
            i += 1
        cols = [np.concatenate(c) for c in (shards, records, lengths, kinds)]
        if self.shuffle and len(cols[0]) > 1:
            perm = np.random.default_rng([self.seed, epoch, k, _WINDOW_TAG]).permutation(len(cols[0]))
            cols = [c[perm] for c in cols]
        return tuple(c.tolist() for c in cols)  # type: ignore[return-value]

    def _plan_next(self) -> None:
        before = self._next
        shards, records, lengths, kinds = self._window_records(before.epoch, before.window)
        packer: FirstFitPacker[Ref] = FirstFitPacker(
            self.max_tokens, self.open_bins, [[(n, (s, r, p)) for n, s, r, p in b] for b in before.open_bins]
        )
        bad = dict(before.bad)
        good = before.good_in_epoch
        items: list[tuple[int, Ref]] = []
        max_tokens = self.max_tokens
        for s, r, n, kind in zip(shards, records, lengths, kinds):
            if kind < 0:  # the other side of a held-out split
                continue
            if kind:
                name = self.table.kinds[kind - 1]
                if not self.skip_bad:
                    raise BadSampleError(
                        self.table.describe(s, r, name)
                        + ". Fix the data, or set --data.on_bad_sample skip to drop and count such samples."
                    )
                if before.epoch == 0:  # count and log each bad record once, not once per epoch
                    bad[name] = bad.get(name, 0) + 1
                    if self.log is not None:
                        self.log(f"skipped {self.table.describe(s, r, name)} (total skipped: {sum(bad.values())})")
                continue
            good += 1
            if n <= max_tokens:
                items.append((n, (s, r, 0)))
            elif self.split_long:  # cut into pieces of at most max_tokens (the source allowed it)
                items += [(min(max_tokens, n - p * max_tokens), (s, r, p)) for p in range(-(-n // max_tokens))]
            else:  # the source's classification must have marked it too_long
                raise AssertionError(f"record {r} of shard {s} has {n} > max_tokens={max_tokens} tokens")
        bins = [[ref for _, ref in b] for b in packer.add_many(items)]
        epoch, window = before.epoch, before.window + 1
        if window == self.windows_per_epoch:
            if good == 0:
                raise BadSampleError(
                    f"the {self.source} corpus has no usable record in a whole epoch "
                    f"({self.num_records} records, skipped: {bad}): check the data and the skipped-sample log"
                )
            epoch, window, good = epoch + 1, 0, 0
            if self.epochs is not None and epoch >= self.epochs:  # the end of a single pass: flush the open bins
                bins += [[ref for _, ref in b] for b in packer.bins if b]
                packer.bins, packer.used = [], []
        after = Cursor(
            epoch=epoch,
            window=window,
            next_bin=before.next_bin + len(bins),
            open_bins=[[[n, *ref] for n, ref in b] for b in packer.bins],
            bad=bad,
            good_in_epoch=good,
        )
        self._planned.append(PlannedWindow(before, after, bins))
        self._next = after

