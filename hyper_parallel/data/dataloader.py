"""``TokenDataLoader``: the training data of one data-parallel rank, step by step, resumable.

Pipeline (``source=direct_token``), per rank::

    shards --split--> W logical readers (DataLoader workers or in-process) --decode+validate-->
    round-robin chunks --> seeded shuffle buffer --> first-fit packer --> collate --> steps

- **Split** (:mod:`.shards`): epoch ``e`` permutes the read units (shards, or shard parts when
  there are fewer shards than readers) with ``(seed, e)``; global reader ``dp_rank * W + w`` of
  ``R = dp_world_size * W`` takes every R-th unit. Each sample is read by one reader per epoch.
- **Order**: deterministic for a given seed and layout (dp_world_size, num_workers, shards).
- **dyn_bsz**: a step is ``micro_batches_per_step = global_batch_tokens / (dp_world_size *
  max_tokens_per_microbatch)`` micro-batches on every rank, each one packed row of at most
  ``max_tokens_per_microbatch`` tokens: every step has the same token budget
  ``global_batch_tokens`` over all ranks, and every rank runs the same number of forward/backward
  passes, so collectives line up. The real (non-padding) token count varies slightly per step; the
  loss divides by the step's global target count (:mod:`.loss`), so it is the exact token mean.
- **Resume** (:meth:`TokenDataLoader.state_dict`): reader positions of the last consumed chunks,
  chunk samples not yet consumed, shuffle buffer + RNG, open packing bins. Workers that prefetched
  further are restarted from those positions, so a resumed loader yields exactly the batches the
  uninterrupted one would have, with any number of workers. The state is per rank and picklable
  (numpy arrays inside); save one per DP rank.

``source=preset_pt`` replays saved batches instead (:mod:`.preset`).
"""

from __future__ import annotations

import math

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from hyper_parallel.config.configurable import Configurable
from hyper_parallel.data.packing import Packer, collate_packed
from hyper_parallel.data.preset import PresetBatches
from hyper_parallel.data.sample import SampleSpec
from hyper_parallel.data.shards import ShardPlan, resolve_shards, shards_digest
from hyper_parallel.data.shuffle import ShuffleBuffer
from hyper_parallel.data.stream import SampleStream
from hyper_parallel.data.toy_corpus import ToyCorpusSpec, cached_toy_corpus

__all__ = ["DataConfig", "TokenDataLoader"]

_STATE_VERSION = 1


class TokenDataLoader(Configurable):
    """Yields, per training step, this rank's list of micro-batches (dicts in the batch contract).

    Build with ``DataConfig(...).build(dp_rank=, dp_world_size=, lang_vocab_size=, codebook_size=,
    placeholder_token_id=)``; the last three are model facts the trainer reads from the model config.
    Iterating never ends (epochs repeat); ``next_step()`` returns one step.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        source: Literal["direct_token", "preset_pt"] = "direct_token"
        """`direct_token`: webdataset tar shards (DESIGN.md section 5); `preset_pt`: replay a torch.save'd list of ready micro-batches."""
        path: str = ""
        """direct_token: a shard directory, glob or brace pattern (`shards/train-{000000..000127}.tar`); empty = the embedded toy corpus. preset_pt: the .pt file."""
        cache_dir: str = "~/.cache/hyper_parallel"
        """Where the embedded toy corpus is written on first use (when `path` is empty)."""
        max_tokens_per_microbatch: int = 4096
        """Token budget of one packed micro-batch (one [1, T] row, T <= this); longer samples are bad samples."""
        global_batch_tokens: int = 0
        """Token budget of one step over all DP ranks; a multiple of dp_world_size x max_tokens_per_microbatch. 0 = one micro-batch per rank."""
        pad_to_multiple_of: int = 1
        """Pad each micro-batch's length to a multiple of this (e.g. the context-parallel degree x 2); must divide max_tokens_per_microbatch."""
        pad_token_id: int = 0
        """Input id of padding positions (their labels are -100)."""
        shuffle_buffer: int = 1024
        """Samples kept in the seeded shuffle buffer; <= 1 disables shuffling within the shard order."""
        packing_bins: int = 8
        """Partly filled micro-batches the first-fit packer keeps open; 1 = pack in arrival order."""
        num_workers: int = 0
        """DataLoader worker processes that read and decode shards (0 = in the training process). Part of the data order."""
        seed: int = 0
        """Seed of the shard order per epoch and of the shuffle buffer."""
        on_bad_sample: Literal["error", "skip"] = "error"
        """A malformed sample or unreadable shard: `error` stops naming shard and key; `skip` drops it, counts and logs it."""

    def __init__(
        self,
        config: Config,
        *,
        lang_vocab_size: int,
        codebook_size: int,
        placeholder_token_id: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        seq_multiple: int = 1,
    ) -> None:
        """``seq_multiple``: what the parallel layout needs micro-batch lengths to be a multiple of
        (context parallel x sequence parallel); combined with ``pad_to_multiple_of`` by lcm."""
        super().__init__(config)
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.pad_multiple = math.lcm(max(config.pad_to_multiple_of, 1), max(seq_multiple, 1))
        self.lang_vocab_size, self.codebook_size = lang_vocab_size, codebook_size
        self.placeholder_token_id = placeholder_token_id
        self.micro_batches_per_step = self._check(config)
        self.steps_done = 0
        self._preset: PresetBatches | None = None
        self._stream: SampleStream | None = None
        if config.source == "preset_pt":
            if not config.path:
                raise ValueError("data.source=preset_pt needs data.path: the .pt file of saved batches")
            self._preset = PresetBatches(
                config.path, dp_rank=dp_rank, dp_world_size=dp_world_size,
                micro_batches_per_step=self.micro_batches_per_step, lang_vocab_size=lang_vocab_size,
                codebook_size=codebook_size, placeholder_token_id=placeholder_token_id,
            )
            self._layout = {"source": "preset_pt", "dp_rank": dp_rank, "dp_world_size": dp_world_size}
            return
        path = config.path or cached_toy_corpus(
            config.cache_dir,
            ToyCorpusSpec(
                lang_vocab_size=lang_vocab_size, codebook_size=codebook_size, placeholder_token_id=placeholder_token_id
            ),
        )
        self.shards = resolve_shards(path)
        num_local = max(1, config.num_workers)
        plan = ShardPlan(tuple(self.shards), num_readers=dp_world_size * num_local, seed=config.seed)
        spec = SampleSpec(lang_vocab_size, codebook_size, placeholder_token_id, config.max_tokens_per_microbatch)
        self._stream = SampleStream(
            plan, dp_rank=dp_rank, num_workers=config.num_workers, spec=spec, skip_bad=config.on_bad_sample == "skip"
        )
        self._shuffle = ShuffleBuffer(self._stream.next, config.shuffle_buffer, seed=(config.seed, dp_rank))
        self._packer = Packer(self._shuffle.next, config.max_tokens_per_microbatch, config.packing_bins)
        self._layout = {
            "source": "direct_token",
            "dp_rank": dp_rank,
            "dp_world_size": dp_world_size,
            "num_workers": num_local,
            "seed": config.seed,
            "shards": shards_digest(self.shards),
            "max_tokens_per_microbatch": config.max_tokens_per_microbatch,
        }

    def _check(self, c: Config) -> int:
        """Validate the config against the run; returns micro-batches per rank per step."""
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
        if not 0 <= c.pad_token_id < self.lang_vocab_size or c.pad_token_id == self.placeholder_token_id:
            raise ValueError(
                f"data.pad_token_id={c.pad_token_id} must be a text id in [0, lang_vocab_size={self.lang_vocab_size}) "
                f"other than placeholder_token_id={self.placeholder_token_id}"
            )
        if c.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {c.num_workers}")
        return global_tokens // per_step

    # -- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        while True:
            yield self.next_step()

    def next_step(self) -> list[dict[str, Any]]:
        """This rank's ``micro_batches_per_step`` micro-batches of the next step."""
        if self._preset is not None:
            step = self._preset.next_step()
        else:
            c = self.config
            step = [
                collate_packed(
                    self._packer.next(), placeholder_token_id=self.placeholder_token_id,
                    pad_token_id=c.pad_token_id, pad_to_multiple_of=self.pad_multiple,
                )
                for _ in range(self.micro_batches_per_step)
            ]
        self.steps_done += 1
        return step

    @property
    def bad_sample_counts(self) -> dict[str, int]:
        """Samples skipped so far on this rank, per kind (``data.on_bad_sample=skip``)."""
        return self._stream.bad_counts() if self._stream is not None else {}

    def close(self) -> None:
        """Stop worker processes (they restart from the current state on the next step)."""
        if self._stream is not None:
            self._stream.close()

    # -- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position after the last returned step (picklable; one per DP rank)."""
        state: dict[str, Any] = {"version": _STATE_VERSION, "layout": dict(self._layout), "steps_done": self.steps_done}
        if self._preset is not None:
            state["preset"] = self._preset.state_dict()
        else:
            state["stream"] = self._stream.state_dict()
            state["shuffle"] = self._shuffle.state_dict()
            state["packer"] = self._packer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the loader that produced ``state`` stopped."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"data state version {state.get('version')!r} is not {_STATE_VERSION}")
        diff = {k: (state["layout"].get(k), v) for k, v in self._layout.items() if state["layout"].get(k) != v}
        if diff:
            changes = ", ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in diff.items())
            raise ValueError(f"cannot resume the data pipeline with a different layout ({changes})")
        self.steps_done = int(state["steps_done"])
        if self._preset is not None:
            self._preset.load_state_dict(state["preset"])
            return
        self._stream.load_state_dict(state["stream"])
        self._shuffle.load_state_dict(state["shuffle"])
        self._packer.load_state_dict(state["packer"])


DataConfig = TokenDataLoader.Config
"""The ``data`` section of a run config (``--data.path``, ``--data.max_tokens_per_microbatch``, ...)."""
