"""``MixtureDataLoader``: several weighted sources (``data.sources``) in one layout-independent stream.

Each source is a shard-backed loader of its own (``direct_token``, ``text``, ``vision_language``)
with its own global packing plan (:mod:`.plan`): its global micro-batches ``k = 0, 1, 2, ...``
(single-source rows, its own collate and model inputs). A small source repeats (its plan runs epoch
after epoch), a large one streams. The mixture's global micro-batch ``g`` is micro-batch ``k`` of
source ``s``, chosen by a deterministic token-deficit schedule (Megatron's blending, by tokens):

    s(g) = argmax_s  w_s * (T - T0) - (t_s - t0_s)      (ties: the larger weight, then the first)

``t_s`` the document tokens source ``s`` has given so far, ``T = sum t_s``, ``w`` the normalised
weights, ``t0``/``T0`` the counts when the weights last changed. So the realised token share of every
source stays within one micro-batch of its weight at every point, the seed (``data.seed``, each
source's shard order and shuffle) decides which documents come, and the whole sequence is a function
of the config alone: the same global batches on any DP degree and worker count; DP rank ``r`` reads
only its own micro-batches (:mod:`.base`). Token counts come from the indexes, so scheduling reads
no record.

Every micro-batch gets ``source_ids`` (int64 ``[1, T]``: the source's index in
:attr:`MixtureDataLoader.source_names` at every position), so the trainer can split the loss by
source without knowing the model or the sources (:mod:`hyper_parallel.components.source_metrics`).

**State** (global, plain data): the schedule counters at the next micro-batch, each source's next
micro-batch and planner cursor, and the weights. Resuming with other weights (a curriculum step) is
allowed with a warning and takes effect from the next step; resuming with a source added or removed
is a :class:`~hyper_parallel.data.base.DataStateMismatch` that says how to start the stream fresh.

**Metrics** (every step): ``bad_samples_skipped`` (all sources), and per source ``data/<name>/tokens``
(document tokens so far), ``data/<name>/share`` (of the last step's document tokens),
``data/<name>/epoch`` (the epoch of its latest micro-batch, from 0) and
``data/<name>/bad_samples_skipped``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.data

from hyper_parallel.data.bad_samples import BadSampleError
from hyper_parallel.data.base import BaseDataLoader, DataStateMismatch
from hyper_parallel.data.sharded import MicroBatchReader, ReadItem, ShardedDataLoader, WorkerReads
from hyper_parallel.data.source_config import MIXTURE_SOURCE_TYPES, SECTION_SOURCES, SourceConfig, first_set_option

__all__ = ["MixtureDataLoader", "MixtureSchedule", "parse_sources"]

logger = logging.getLogger("hyper_parallel.data")


def parse_sources(entries: Sequence[SourceConfig]) -> list[SourceConfig]:
    """Check ``data.sources`` (run files' tables became :class:`SourceConfig` when the config was read);
    errors name the entry and the field."""
    out: list[SourceConfig] = []
    for i, entry in enumerate(entries):
        where = f"data.sources[{i}]"
        if not isinstance(entry, SourceConfig):
            raise ValueError(f"{where} must be a SourceConfig (a [[data.sources]] table), got {type(entry).__name__}")
        name = entry.name
        if not name or not isinstance(name, str) or any(c in name for c in "/ \t\n"):
            raise ValueError(f"{where} needs a `name` without '/' or spaces (metric keys use it), got {name!r}")
        where = f"data source {name!r}"
        if entry.source not in MIXTURE_SOURCE_TYPES:
            raise ValueError(
                f"{where}: source={entry.source!r} is not a source type a mixture can hold; use one of "
                f"{', '.join(MIXTURE_SOURCE_TYPES)}"
            )
        weight = entry.weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"{where}: weight={weight!r} must be a number > 0")
        if entry.chat.loss_on not in ("document", "assistant", "all"):
            raise ValueError(
                f"{where}: loss_on={entry.chat.loss_on!r} (chat.loss_on) must be document, assistant or all; image and "
                "text targets are a direct_token source's direct_token.loss_on"
            )
        if entry.direct_token.loss_on not in ("document", "image", "text"):
            raise ValueError(
                f"{where}: loss_on={entry.direct_token.loss_on!r} (direct_token.loss_on) must be document, image or "
                "text; conversations are a text or vision_language source's chat.loss_on"
            )
        for section, readers in SECTION_SOURCES.items():
            options = getattr(entry, section)
            changed = first_set_option(options) if entry.source not in readers else None
            if changed is not None:
                raise ValueError(
                    f"{where}: {changed}={getattr(options, changed)!r} ({section}.{changed}) is an option of "
                    f"{' and '.join(readers)} sources, not of a {entry.source} source: remove it"
                )
        if entry.on_bad_sample not in ("", "error", "skip"):
            raise ValueError(f"{where}: on_bad_sample={entry.on_bad_sample!r} must be error, skip or empty")
        clash = [j for j, o in enumerate(out) if o.name == name]
        if clash:
            raise ValueError(
                f"two data.sources are named {name!r} (entries {clash[0]} and {i}): give each a unique name"
            )
        out.append(entry)
    if not out:
        raise ValueError("data.sources is empty: list at least one source")
    return out


# -- the schedule --------------------------------------------------------------------------------
@dataclass(slots=True)
class _Counters:
    """Schedule counters before a micro-batch: tokens and next micro-batch per source, weight base."""

    tokens: list[int]
    next: list[int]
    base: list[int]

    def copy(self) -> _Counters:
        return _Counters(list(self.tokens), list(self.next), list(self.base))

    def to_dict(self) -> dict[str, list[int]]:
        return {"tokens": list(self.tokens), "next": list(self.next), "base": list(self.base)}


class MixtureSchedule:
    """Which source (and which of its micro-batches) is mixture micro-batch ``g``: see the module doc.

    ``bin_tokens(s, k)`` gives the document tokens of micro-batch ``k`` of source ``s``. Entries are
    planned lazily from ``first`` on and released once consumed; :meth:`counters` gives the
    counters before any planned ``g`` (the checkpointed state).
    """

    def __init__(
        self,
        weights: Sequence[float],
        bin_tokens: Callable[[int, int], int],
        *,
        first: int = 0,
        counters: _Counters | None = None,
    ) -> None:
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        self.bin_tokens = bin_tokens
        n = len(weights)
        self.first = first
        self._front = counters.copy() if counters is not None else _Counters([0] * n, [0] * n, [0] * n)
        self._tail = self._front.copy()
        self._entries: deque[tuple[int, int, int]] = deque()  # (source, k, tokens) of g = first + i

    def _plan_next(self) -> None:
        c, w = self._tail, self.weights
        total = sum(c.tokens) - sum(c.base)
        best = max(range(len(w)), key=lambda s: (w[s] * total - (c.tokens[s] - c.base[s]), w[s], -s))
        k = c.next[best]
        n = int(self.bin_tokens(best, k))
        self._entries.append((best, k, n))
        c.tokens[best] += n
        c.next[best] = k + 1

    def entry(self, g: int) -> tuple[int, int, int]:
        """``(source, k, tokens)`` of mixture micro-batch ``g`` (plans ahead as needed)."""
        if g < self.first:
            raise ValueError(f"mixture micro-batch {g} was released from the schedule (it starts at {self.first})")
        while g >= self.first + len(self._entries):
            self._plan_next()
        return self._entries[g - self.first]

    def counters(self, g: int) -> _Counters:
        """The counters before micro-batch ``g`` (``first <= g``; plans ahead as needed)."""
        if g > self.first:
            self.entry(g - 1)
        c = self._front.copy()
        for s, k, n in list(self._entries)[: g - self.first]:
            c.tokens[s] += n
            c.next[s] = k + 1
        return c

    def release(self, g: int) -> None:
        """Forget the entries before ``g``."""
        if g > self.first:
            self.entry(g - 1)
        while self.first < g:
            s, k, n = self._entries.popleft()
            self._front.tokens[s] += n
            self._front.next[s] = k + 1
            self.first += 1


# -- the loader ----------------------------------------------------------------------------------
class _MixtureReader(torch.utils.data.Dataset):
    """Reads ``(source, ReadItem)`` with that source's reader (main process or DataLoader worker)."""

    def __init__(self, readers: Sequence[MicroBatchReader]) -> None:
        self.readers = list(readers)

    def __getitem__(self, item: tuple[int, ReadItem]) -> tuple[int, dict[str, Any]]:
        s, read = item
        return self.readers[s][read]


class MixtureDataLoader(WorkerReads, BaseDataLoader):
    """The sources of ``data.sources`` mixed by weight (module docstring); built by ``DataConfig.build``
    whenever ``data.sources`` is set."""

    mixes_sources = True
    supports_holdout = True  # each source holds out its own records (the children get ``holdout``)

    def __init__(self, config: BaseDataLoader.Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        c = config
        if c.path:
            raise ValueError(
                f"data.path={c.path!r} and data.sources are both set: give the path of each source in its "
                "data.sources entry (a single --data.path is a one-source run without data.sources)"
            )
        for section in SECTION_SOURCES:  # each source has its own: one left in the data section would be unused
            changed = first_set_option(getattr(c, section))
            if changed is not None:
                raise ValueError(
                    f"data.{section}.{changed}={getattr(getattr(c, section), changed)!r} and data.sources are both "
                    f"set: a mixture reads each source's own {section} section; set {section}.{changed} in the "
                    "data.sources entries"
                )
        self.sources = parse_sources(c.sources)
        self.source_names = tuple(s.name for s in self.sources)
        self.children: list[ShardedDataLoader] = [self._build_child(s, kwargs) for s in self.sources]
        for child, src in zip(self.children, self.sources):
            self._check_readable(child, src)
        total = sum(float(s.weight) for s in self.sources)
        self.weights = [float(s.weight) / total for s in self.sources]
        """Normalised weights (shares of the tokens), in ``source_names`` order."""
        self._schedule = self._new_schedule(0, None)
        self._reader = _MixtureReader([ch._reader for ch in self.children])

    # -- construction --------------------------------------------------------------------------
    def _build_child(self, src: SourceConfig, kwargs: Mapping[str, Any]) -> ShardedDataLoader:
        c = self.config
        child_config = dataclasses.replace(
            c, source=src.source, path=src.path, sources=[], global_batch_tokens=0,
            num_workers=0,  # the mixture runs the workers (one DataLoader over every source)
            on_bad_sample=src.on_bad_sample or c.on_bad_sample, tokenizer=src.tokenizer or c.tokenizer,
            **{section: getattr(src, section) for section in SECTION_SOURCES},  # the source's own sections
        )  # fmt: skip
        try:
            child = child_config.build(**kwargs)
        except (ValueError, OSError) as e:  # BadSampleError and FileNotFoundError included
            message = f"data source {src.name!r} ({src.source}, path {src.path!r}): {e}"
            try:
                error = type(e)(message)
            except Exception:  # noqa: BLE001 - an exception type with another constructor
                error = ValueError(message)
            raise error from None
        if not isinstance(child, ShardedDataLoader):  # pragma: no cover - MIXTURE_SOURCE_TYPES are sharded
            raise TypeError(f"data source {src.name!r}: {src.source} is not a shard-backed source")
        return child

    @staticmethod
    def _check_readable(child: ShardedDataLoader, src: SourceConfig) -> None:
        """A source must have at least one usable record (otherwise its schedule could never advance)."""
        table = child.table
        for shard in range(len(table.shards)):
            if (table.units(shard)[1] == 0).any():
                return
        raise BadSampleError(
            f"data source {src.name!r} ({src.source}, path {src.path!r}) has no readable sample "
            f"({int(table.num_records.sum())} records, all unusable; skipped: {child.bad_sample_counts}): "
            "check its path and data"
        )

    def _bin_tokens(self, s: int, k: int) -> int:
        child = self.children[s]
        table, max_tokens = child.table, child.config.max_tokens_per_microbatch
        n = 0
        for shard, record, piece in child._planner.bin(k):
            length = int(table.units(shard)[0][record])
            n += min(max_tokens, length - piece * max_tokens) if length > max_tokens else length
        return n

    def _new_schedule(self, first: int, counters: _Counters | None) -> MixtureSchedule:
        return MixtureSchedule(self.weights, self._bin_tokens, first=first, counters=counters)

    # -- reading -------------------------------------------------------------------------------
    def _item(self, g: int) -> tuple[int, ReadItem]:
        s, k, _ = self._schedule.entry(g)
        child = self.children[s]
        return s, ReadItem(g, tuple(child.table.span(ref) for ref in child._planner.bin(k)))

    def _finish(self, g: int, batch: dict[str, Any]) -> dict[str, Any]:
        s = self._schedule.entry(g)[0]
        return self.finish_source(s, self.children[s].finish(batch))

    def finish_source(self, s: int, batch: dict[str, Any]) -> dict[str, Any]:
        """A micro-batch of source ``s`` as its child loader gives it (its own label policy applied,
        :meth:`ShardedDataLoader.finish`), tagged as the mixture tags it: ``source_ids`` added (a validator reads
        each source's own pass this way)."""
        batch["source_ids"] = torch.full(batch["labels"].shape, s, dtype=torch.int64)
        return batch

    def _micro_batches(self, gs: range) -> list[dict[str, Any]]:
        out = [self._finish(g, batch) for g, batch in zip(gs, self._read(gs))]
        step_start = gs[0] - self.dp_rank * self.micro_batches_per_step
        self._schedule.entry(step_start + self.global_micro_batches - 1)  # the whole step: metrics need it
        self._release(step_start)
        return out

    def _release(self, g: int) -> None:
        """Forget the schedule before ``g`` and each source's plan before its micro-batch there."""
        self._schedule.release(g)
        for child, k in zip(self.children, self._schedule._front.next):
            if k > 0:
                child._planner.release(k - 1)

    # -- metrics -------------------------------------------------------------------------------
    def _next_counters(self) -> _Counters:
        return self._schedule.counters(self.next_micro_batch)

    def _source_bad(self, s: int, k: int) -> dict[str, int]:
        child = self.children[s]
        counts = dict(child._startup_bad)
        if k > 0:
            for kind, n in child._planner.window_of(k - 1).after.bad.items():
                counts[kind] = counts.get(kind, 0) + n
        return counts

    @property
    def bad_sample_counts(self) -> dict[str, int]:
        nxt = self._next_counters().next
        counts: dict[str, int] = {}
        for s in range(len(self.children)):
            for kind, n in self._source_bad(s, nxt[s]).items():
                counts[kind] = counts.get(kind, 0) + n
        return counts

    def step_tokens(self) -> list[int]:
        """Document tokens of every source in the last step (zeros before the first step)."""
        out = [0] * len(self.children)
        start = self.next_micro_batch - self.global_micro_batches
        if start < self._schedule.first:
            return out
        for g in range(start, self.next_micro_batch):
            s, _, n = self._schedule.entry(g)
            out[s] += n
        return out

    def metrics(self) -> dict[str, float]:
        nxt = self._next_counters()
        step = self.step_tokens()
        total = max(sum(step), 1)
        out: dict[str, float] = {}
        bad_total = 0
        for s, name in enumerate(self.source_names):
            bad = sum(self._source_bad(s, nxt.next[s]).values())
            bad_total += bad
            k = nxt.next[s]
            epoch = self.children[s]._planner.window_of(k - 1).before.epoch if k > 0 else 0
            out[f"data/{name}/tokens"] = float(nxt.tokens[s])
            out[f"data/{name}/share"] = step[s] / total
            out[f"data/{name}/epoch"] = float(epoch)
            out[f"data/{name}/bad_samples_skipped"] = float(bad)
        return {"bad_samples_skipped": float(bad_total), **out}

    # -- state ---------------------------------------------------------------------------------
    def _order(self) -> dict[str, Any]:
        c = self.config
        return {
            "source": "mixture",
            "seed": c.seed,
            "max_tokens_per_microbatch": c.max_tokens_per_microbatch,
            "sources": list(self.source_names),
            # weights and the label policies (loss_on) are not part of the order: they may change on resume
            **{f"source/{name}": child._order() for name, child in zip(self.source_names, self.children)},
        }

    def _plan_state(self) -> dict[str, Any]:
        counters = self._next_counters()
        cursors = []
        for child, k in zip(self.children, counters.next):
            cursors.append(None if k == 0 else child._planner.window_of(k - 1).before.to_dict())
        return {"counters": counters.to_dict(), "cursors": cursors, "weights": list(self.weights)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("order", {}).get("sources") if isinstance(state.get("order"), Mapping) else None
        if saved is not None and list(saved) != list(self.source_names):
            added = [n for n in self.source_names if n not in saved]
            removed = [n for n in saved if n not in self.source_names]
            what = "; ".join(
                part
                for part in (f"added {added}" if added else "", f"removed {removed}" if removed else "")
                if part
            ) or f"reordered (saved {list(saved)}, now {list(self.source_names)})"
            raise DataStateMismatch(
                f"cannot resume the data mixture: data.sources changed ({what}). A mixture resumes with the same "
                "sources (weights may change); to train on other sources, start the data stream fresh with "
                "--checkpoint.restart_data_stream (model and optimizer resume, the data starts from its beginning)"
            )
        super().load_state_dict(state)

    def _load_plan_state(self, plan: Mapping[str, Any] | None) -> None:
        if plan is None:  # saved before the first step
            plan = {"counters": None, "cursors": [None] * len(self.children), "weights": list(self.weights)}
        for child, cursor in zip(self.children, plan["cursors"]):
            child._load_plan_state(cursor)
        c = plan["counters"]
        counters = None if c is None else _Counters(*([int(v) for v in c[k]] for k in ("tokens", "next", "base")))
        saved_weights = [float(w) for w in plan["weights"]]
        if counters is not None and not np.allclose(saved_weights, self.weights, rtol=1e-9, atol=0):
            if self.dp_rank == 0:
                logger.warning(
                    "data.sources weights changed on resume: %s -> %s; the new weights apply from the next step",
                    dict(zip(self.source_names, saved_weights)),
                    dict(zip(self.source_names, self.weights)),
                )
            counters.base = list(counters.tokens)
        self._schedule = self._new_schedule(self.next_micro_batch, counters)

    def _skip_to(self, g: int) -> None:
        self.close()
        if g > self._schedule.first:
            self._release(g)
        for child, k in zip(self.children, self._schedule._front.next):
            child._skip_to(k)
