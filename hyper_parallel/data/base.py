"""``BaseDataLoader``: the interface of every data source, and the run config's ``data`` section.

The trainer builds the data as ``config.data.build(dp_rank=, dp_world_size=, seq_multiple=,
model_facts=)``; ``data.source`` picks the class (:data:`DATA_SOURCES`). Every step it calls
:meth:`BaseDataLoader.next_step` (this rank's micro-batches), logs :meth:`~BaseDataLoader.metrics`
and checkpoints :meth:`~BaseDataLoader.state_dict`.

**The data order does not depend on the layout.** Every source defines one sequence of *global
micro-batches* ``g = 0, 1, 2, ...`` from the data config and the seed alone. A step takes the next
``M = global_batch_tokens / max_tokens_per_microbatch`` of them; DP rank ``r`` of ``R`` runs the
``m = M / R`` consecutive ones ``[g0 + r*m, g0 + (r+1)*m)``. So the concatenation over DP ranks of
a step's micro-batches is the same for every DP degree and every ``num_workers``, and the state
(the number of the next global micro-batch, plus a source's planner cursor) is the same on every
rank: save it once, load it on any number of ranks.

``model_facts`` are what the model says about its inputs (``{"vocab_size": ...}``, plus whatever a
model's own source needs). A source reads the facts it needs and names any that are missing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from hyper_parallel.config.configurable import Configurable
from hyper_parallel.data.holdout import Holdout
from hyper_parallel.data.source_config import (
    ChatOptions,
    DirectTokenOptions,
    SourceConfig,
    TextOptions,
    coerce_sources,
)

__all__ = ["DATA_SOURCES", "BaseDataLoader", "DataConfig", "DataStateMismatch"]

_STATE_VERSION = 2

DATA_SOURCES: dict[str, type[BaseDataLoader]] = {}
"""``data.source`` -> the loader class (filled as the source modules are imported)."""

_MIXTURE_LOADER: list[type[BaseDataLoader]] = []
"""The loader of ``data.sources`` (a subclass that sets ``mixes_sources``), registered like a source so
this base module knows no subclass by name."""


class DataStateMismatch(ValueError):
    """A saved data state was made with other data (path, seed, source or packing budget)."""


class BaseDataLoader(Configurable):
    """Per training step, this rank's list of micro-batches (dicts in the batch contract); resumable.

    Subclasses set ``source`` (the ``data.source`` value they serve) and implement
    :meth:`_micro_batches`; shard-backed ones also :meth:`_order`, :meth:`_plan_state`,
    :meth:`_load_plan_state` and :meth:`_skip_to`. Iterating never ends (epochs repeat).
    """

    source: ClassVar[str] = ""
    mixes_sources: ClassVar[bool] = False
    """True for the loader that serves ``data.sources`` (a weighted mixture of sources)."""
    supports_holdout: ClassVar[bool] = False
    """Whether the loader can take a held-out split (``holdout=``, :mod:`.holdout`): shard-backed sources."""
    source_names: tuple[str, ...] = ()
    """A mixture's source names: its micro-batches carry ``source_ids`` (int64 ``[B, T]``, an index into
    this tuple per position); empty for a single source (no ``source_ids``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        source: Literal["direct_token", "text", "vision_language", "preset_pt", "dummy"] = "direct_token"
        """`direct_token`: VQ image+text webdataset shards (docs/design.md section 5); `text`: pre-tokenised shards or raw jsonl/parquet/arrow files; `vision_language`: images + text webdataset shards; `preset_pt`: replay a torch.save'd list of micro-batches; `dummy`: random tokens (smoke runs, benchmarks)."""
        path: str = ""
        """Shards: a directory, glob or brace pattern (`shards/train-{000000..000127}.tar`); text may also name .jsonl/.json/.parquet/.arrow files; preset_pt: the .pt file; empty = the source's embedded toy corpus."""
        cache_dir: str = "~/.cache/hyper_parallel"
        """Where toy corpora, shard indexes built on first use and tokenised text are cached."""
        max_tokens_per_microbatch: int = 4096
        """Token budget of one packed micro-batch (one [1, T] row, T <= this); longer documents are bad samples (or split, see split_long_documents)."""
        global_batch_tokens: int = 0
        """Token budget of one step over all DP ranks; a multiple of dp_world_size x max_tokens_per_microbatch. 0 = one micro-batch per DP rank (the step then grows with the DP degree: set it for layout-independent steps)."""
        pad_to_multiple_of: int = 1
        """Pad each micro-batch's length to a multiple of this (e.g. the context-parallel degree x 2); must divide max_tokens_per_microbatch."""
        pad_token_id: int = 0
        """Input id of padding positions (their labels are -100)."""
        shuffle_buffer: int = 1024
        """Records shuffled together: each epoch visits the shards in a seeded order and permutes every window of this many consecutive records; <= 1 keeps the file order."""
        packing_bins: int = 8
        """Partly filled micro-batches the first-fit packer keeps open; 1 = pack in arrival order."""
        num_workers: int = 0
        """DataLoader worker processes that read, decode and collate records (0 = in the training process). Does not change the data order."""
        seed: int = 0
        """Seed of the shard order per epoch and of the shuffle (the data order depends on nothing else but the data)."""
        on_bad_sample: Literal["error", "skip"] = "error"
        """A malformed sample or unreadable shard: `error` stops naming shard and key; `skip` drops it, counts and logs it."""
        tokenizer: str = ""
        """text: the tokenizer (a tokenizer.json file or an HF folder) that tokenises raw .jsonl/.parquet/.arrow files; empty = the toy tokenizer (toy corpus only)."""
        allow_foreign_tokenizer: bool = False
        """Train with a tokenizer other than the model folder's (data.tokenizer, a source's, VL shards'). Off: one that differs (vocabulary, special tokens, chat template) is an error."""
        text: TextOptions = field(default_factory=TextOptions)
        """Source text: record columns, long documents."""
        chat: ChatOptions = field(default_factory=ChatOptions)
        """Sources text and vision_language: conversations."""
        direct_token: DirectTokenOptions = field(default_factory=DirectTokenOptions)
        """Source direct_token: which targets train."""
        sources: list[SourceConfig] = field(default_factory=list)
        """A weighted mixture of sources (run file: `[[data.sources]]` entries with name, source, path, weight, on_bad_sample, tokenizer and the source's own text / chat / direct_token sections); when set, data.source and data.path are unused and the data section's text / chat / direct_token sections must keep their defaults (each entry has its own). Empty = the single source data.source/data.path."""

        def __post_init__(self) -> None:
            # the one place data.sources entries given as mappings (Python dicts) become SourceConfig
            self.sources = coerce_sources(self.sources)

        def source_types(self) -> tuple[str, ...]:
            """The source types this config reads: ``(source,)``, or every ``data.sources`` entry's type."""
            if not self.sources:
                return (self.source,)
            return tuple(dict.fromkeys(s.source for s in self.sources))

        def build(self, **runtime_objects: Any) -> BaseDataLoader:
            """Construct the loader of ``source`` (:data:`DATA_SOURCES`) from this config plus runtime objects."""
            cls = DATA_SOURCES.get(self.source)
            if self.sources:
                if not _MIXTURE_LOADER:
                    raise ValueError("data.sources is set but no mixture loader is registered: import hyper_parallel.data")
                cls = _MIXTURE_LOADER[-1]
            if cls is None:
                raise ValueError(f"data.source={self.source!r} is not a data source; use one of {sorted(DATA_SOURCES)}")
            clash = sorted({f.name for f in fields(self)} & runtime_objects.keys())
            if clash:
                raise ValueError(
                    f"{cls.__name__}.Config.build() got {clash} as keyword arguments, but they are fields of the "
                    "data config: put these values in the Config, not in build()"
                )
            return cls(self, **runtime_objects)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("source"):
            DATA_SOURCES[cls.source] = cls
        if cls.__dict__.get("mixes_sources"):
            _MIXTURE_LOADER.append(cls)

    def __init__(
        self,
        config: Config,
        *,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        seq_multiple: int = 1,
        model_facts: Mapping[str, Any] | None = None,
        holdout: Holdout | None = None,
        single_pass: bool = False,
    ) -> None:
        """``seq_multiple``: what the parallel layout needs micro-batch lengths to be a multiple of
        (context parallel x sequence parallel); combined with ``pad_to_multiple_of`` by lcm.
        ``model_facts``: what the model says about its inputs (``ModelSpec.data_facts``).
        ``holdout``: read one side of a held-out split (``--validation.split``).
        ``single_pass``: one epoch, then the data ends (a validation pass; :attr:`pass_micro_batches`)."""
        super().__init__(config)
        if holdout is not None and not self.supports_holdout:
            raise ValueError(
                f"validation.split needs a shard-backed training source (direct_token, text, vision_language or "
                f"data.sources), not data.source={config.source!r}: give the validation data as validation.data"
            )
        self.holdout, self.single_pass = holdout, single_pass
        if self.source and config.source != self.source:  # the mixture (source "") serves data.sources
            raise ValueError(f"{type(self).__name__} serves data.source={self.source!r}, got {config.source!r}")
        self.model_facts: dict[str, Any] = dict(model_facts or {})
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.pad_multiple = math.lcm(max(config.pad_to_multiple_of, 1), max(seq_multiple, 1))
        self.global_micro_batches = self._check_layout(config)
        self.micro_batches_per_step = self.global_micro_batches // dp_world_size
        self.steps_done = 0
        self.next_micro_batch = 0  # global number of the first micro-batch of the next step

    # -- checks ------------------------------------------------------------------------------
    def _check_layout(self, c: Config) -> int:
        """Validate the config against the run; returns global micro-batches per step (M)."""
        if not 0 <= self.dp_rank < self.dp_world_size:
            raise ValueError(f"dp_rank={self.dp_rank} must lie in [0, dp_world_size={self.dp_world_size})")
        if c.max_tokens_per_microbatch < 1:
            raise ValueError(f"data.max_tokens_per_microbatch must be >= 1, got {c.max_tokens_per_microbatch}")
        if c.pad_to_multiple_of < 1 or c.max_tokens_per_microbatch % self.pad_multiple:
            raise ValueError(
                f"data.pad_to_multiple_of={c.pad_to_multiple_of} must be >= 1, and its lcm with what the parallel "
                f"layout needs ({self.pad_multiple}) must divide data.max_tokens_per_microbatch="
                f"{c.max_tokens_per_microbatch}"
            )
        per_step = self.dp_world_size * c.max_tokens_per_microbatch
        global_tokens = c.global_batch_tokens or per_step
        if global_tokens < 0 or global_tokens % per_step:
            raise ValueError(
                f"data.global_batch_tokens={c.global_batch_tokens} must be a positive multiple of dp_world_size "
                f"({self.dp_world_size}) x data.max_tokens_per_microbatch ({c.max_tokens_per_microbatch}) = {per_step} "
                "(or 0 for one micro-batch per rank)"
            )
        if c.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {c.num_workers}")
        if c.seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {c.seed}")
        return global_tokens // c.max_tokens_per_microbatch

    @property
    def pass_micro_batches(self) -> int | None:
        """Global micro-batches of one pass over the data (a ``single_pass`` loader); None when the data has
        no end the loader knows of. Micro-batches past the end repeat earlier ones (a validator masks them)."""
        return None

    def fact(self, name: str) -> Any:
        """A model fact this source needs; a clear error when the model does not give it."""
        if name not in self.model_facts:
            raise ValueError(
                f"data.source={self.source} needs the model fact {name!r}, but the model gives only "
                f"{sorted(self.model_facts) or 'none'} (ModelSpec.data_facts)"
            )
        return self.model_facts[name]

    def _check_pad_token(self, vocab_size: int, *reserved: int) -> None:
        pad = self.config.pad_token_id
        if not 0 <= pad < vocab_size or pad in reserved:
            other = f" other than {list(reserved)}" if reserved else ""
            raise ValueError(f"data.pad_token_id={pad} must be a token id in [0, vocab_size={vocab_size}){other}")

    # -- iteration ---------------------------------------------------------------------------
    def my_micro_batches(self, first: int) -> range:
        """Global numbers of this rank's micro-batches in the step that starts at micro-batch ``first``."""
        m = self.micro_batches_per_step
        return range(first + self.dp_rank * m, first + (self.dp_rank + 1) * m)

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        while True:
            yield self.next_step()

    def next_step(self) -> list[dict[str, Any]]:
        """This rank's ``micro_batches_per_step`` micro-batches of the next step."""
        step = self._micro_batches(self.my_micro_batches(self.next_micro_batch))
        self.next_micro_batch += self.global_micro_batches
        self.steps_done += 1
        return step

    def advance(self, steps: int) -> None:
        """Move ``steps`` steps ahead without reading any data (the plan alone says where they end)."""
        if steps < 0:
            raise ValueError(f"advance(steps={steps}) cannot go back")
        self.next_micro_batch += steps * self.global_micro_batches
        self.steps_done += steps
        self._skip_to(self.next_micro_batch)

    def _micro_batches(self, gs: range) -> list[dict[str, Any]]:  # pragma: no cover - abstract
        """The micro-batches with global numbers ``gs`` (consecutive, increasing)."""
        raise NotImplementedError

    def _skip_to(self, g: int) -> None:
        """Continue at global micro-batch ``g`` (after ``advance`` or ``load_state_dict``)."""

    def metrics(self) -> dict[str, float]:
        """Logged every step: ``bad_samples_skipped`` (distinct bad records met so far, over all ranks)."""
        return {"bad_samples_skipped": float(sum(self.bad_sample_counts.values()))}

    @property
    def bad_sample_counts(self) -> dict[str, int]:
        """Distinct records skipped so far per kind (``data.on_bad_sample=skip``); the same on every rank."""
        return {}

    def close(self) -> None:
        """Stop worker processes (they restart from the current position on the next step)."""

    # -- checkpointing -------------------------------------------------------------------------
    def _order(self) -> dict[str, Any]:
        """What the global micro-batch sequence depends on (a resume with other values is refused)."""
        c = self.config
        return {"source": self.source, "seed": c.seed, "max_tokens_per_microbatch": c.max_tokens_per_microbatch}

    def _plan_state(self) -> Any:
        """The source's own state after ``next_micro_batch - 1`` (plain data); None if it has none."""
        return None

    def _load_plan_state(self, plan: Any) -> None:
        """Restore :meth:`_plan_state` output (called before ``_skip_to``)."""

    def state_dict(self) -> dict[str, Any]:
        """The position after the last returned step: the same on every rank, for any layout."""
        return {
            "version": _STATE_VERSION,
            "order": self._order(),
            "steps_done": self.steps_done,
            "next_micro_batch": self.next_micro_batch,
            "plan": self._plan_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue exactly where the loader that produced ``state`` stopped (any DP degree, any workers)."""
        if state.get("version") != _STATE_VERSION:
            raise DataStateMismatch(
                f"data state version {state.get('version')!r} is not {_STATE_VERSION} (a checkpoint of an older data "
                "pipeline)"
            )
        saved, now = dict(state["order"]), self._order()
        diff = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
        diff.update({k: (v, None) for k, v in saved.items() if k not in now})
        if diff:
            changes = ", ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in diff.items())
            raise DataStateMismatch(f"cannot resume the data stream: it was made with other data ({changes})")
        self.close()
        self.steps_done = int(state["steps_done"])
        self.next_micro_batch = int(state["next_micro_batch"])
        self._load_plan_state(state["plan"])
        self._skip_to(self.next_micro_batch)


DataConfig = BaseDataLoader.Config
"""The ``data`` section of a run config (``--data.source``, ``--data.path``, ...)."""
