"""Validation during training (``--validation.*``): the exact token-mean loss of held-out data.

The validator runs the trainer's micro-batch path (``StepRunner``, ``components/step.py``: the host-side MTP targets
and context-parallel split, the model call, the loss under loss parallel), without gradients:

- **Data**: ``validation.data`` (any source the model takes, or a ``data.sources`` mixture: then also a loss
  per source), or ``validation.split``: a held-out fraction of the training data, chosen by sample id
  (:mod:`hyper_parallel.data.holdout`) and removed from the training stream.
- **How much**: ``validation.steps`` global micro-batches (the same ones on any layout: the data order does
  not depend on it), or ``-1``: one full pass (a mixture: every source's full pass). Every evaluation
  starts the validation data from its beginning, so each one sees the same micro-batches.
- **The loss**: ``val/loss`` is the sum of per-token cross entropy over every labelled token of those
  micro-batches (the training masks: assistant-only SFT, ``loss_on``, image tokens) divided by their number,
  summed over the ranks that hold different tokens: equal on one process and on any layout. DP rank ``r`` of
  ``D`` reads global micro-batches ``r, r + D, ...``; in the last round a rank past the end runs a micro-batch
  whose labels are all ignored, so every rank runs the same forwards (FSDP's collectives). With MTP also
  ``val/loss_mtp`` and ``val/mtp/top1``; a mixture adds ``val/<source>/loss``. The MoE aux loss is no part of
  it.
- **No side effects**: ``torch.no_grad``, the model in eval mode and back, the RNG states restored, the MoE
  routers' load counters dropped (no bias update or expert-load metric sees validation tokens); the training
  loader is not touched.
- **Best and early stop**: the best ``val/loss`` and its step (evaluations after step 0) and the evaluations
  since are checkpointed with the run (``state_dict``); ``early_stop_patience`` ends the run after that many
  evaluations without a new best; the trainer keeps the best checkpoint with ``--checkpoint.keep_best``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hyper_parallel.components.checkpoint import get_rng_state, set_rng_state
from hyper_parallel.components.loss import top1_correct
from hyper_parallel.components.source_metrics import SourceLossMeter
from hyper_parallel.components.step import StepRunner
from hyper_parallel.config.configurable import Configurable
from hyper_parallel.data.base import BaseDataLoader, DataConfig
from hyper_parallel.data.holdout import Holdout
from hyper_parallel.protocols.model import split_output

__all__ = ["ValidationResult", "Validator"]


@dataclass(slots=True)
class ValidationResult:
    """One evaluation: the metrics record (``val/...`` keys) and whether it set a new best."""

    step: int
    record: dict[str, float]
    improved: bool


@dataclass(slots=True)
class _Stream:
    """Validation micro-batches read from one loader: ``total`` global ones, each passed through ``finish``."""

    loader: BaseDataLoader
    total: int
    finish: Callable[[dict[str, Any]], dict[str, Any]]
    start: dict[str, Any]
    """The loader's state before its first micro-batch: every evaluation starts there."""


class Validator(Configurable):
    """Built by the trainer (``config.validation.build(...)``, see ``__init__``); ``validate(step)`` runs one
    evaluation. The trainer calls it every ``freq`` steps, at the last step and (``at_start``) before the
    first step."""

    optional_state = True
    """A checkpoint made without validation has no state for it: the run resumes with a fresh best."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        freq: int = 0
        """Validate every this many steps and at the last step; 0 = no validation."""
        at_start: bool = True
        """Also validate before the first step (logged at step 0, not counted for the best), so the curve shows where the run starts."""
        steps: int = -1
        """Global micro-batches per evaluation (the same on any layout); -1 = one full pass over the validation data (a mixture: over every source)."""
        split: float = 0.0
        """Hold out this fraction of the training data's samples (by sample id, the same on any number of ranks) and validate on them; 0 = validate on validation.data."""
        data: DataConfig = field(default_factory=DataConfig)
        """The validation data (when validation.split is 0): a source the model takes, as the data section (path, source, tokenizer, chat.loss_on, [[validation.data.sources]] ...); its global_batch_tokens is unused."""
        early_stop_patience: int = 0
        """Stop the run after this many evaluations in a row without a new best val/loss (a final checkpoint is written); 0 = never."""

        @property
        def enabled(self) -> bool:
            return self.freq > 0

        def check(self) -> None:
            """Cheap checks of the validation options (no process group needed)."""
            if self.freq < 0:
                raise ValueError(f"validation.freq={self.freq} must be >= 0 (0 = no validation)")
            if self.steps == 0 or self.steps < -1:
                raise ValueError(f"validation.steps={self.steps} must be > 0 global micro-batches, or -1 for a full pass")
            if not 0.0 <= self.split < 1.0:
                raise ValueError(f"validation.split={self.split} must lie in [0, 1)")
            if self.early_stop_patience < 0:
                raise ValueError(f"validation.early_stop_patience={self.early_stop_patience} must be >= 0 (0 = never)")
            if not self.enabled:
                if self.split > 0 or self.early_stop_patience > 0:
                    raise ValueError(
                        "validation.split / validation.early_stop_patience are set but validation is off: set "
                        "--validation.freq N (validate every N steps)"
                    )
                return
            if self.split > 0 and (self.data.path or self.data.sources):
                raise ValueError(
                    f"validation.split={self.split} and validation.data ({self.data.path or 'data.sources'}) are both "
                    "set: validate either on a held-out split of the training data or on separate data"
                )
            if self.split == 0 and not (self.data.path or self.data.sources):
                raise ValueError(
                    "validation.freq is set but there is no validation data: give --validation.data.path (with "
                    "--validation.data.source and its options, or [[validation.data.sources]] in a run file), or "
                    "hold out a share of the training data with --validation.split 0.05"
                )

        def training_data_kwargs(self) -> dict[str, Any]:
            """What the training loader's ``build`` gets: the training side of the split, if any."""
            return {"holdout": Holdout(self.split, "train")} if self.enabled and self.split > 0 else {}

    def __init__(
        self,
        config: Config,
        *,
        runner: StepRunner,
        training_data: DataConfig,
        data_kwargs: Mapping[str, Any],
        accepted_sources: Sequence[str],
    ) -> None:
        """``runner``: the trainer's step mechanics (host prep: MTP targets, CP split; device copy; the model's
        forwards under loss parallel, through the pipeline schedule a step's worth of micro-batches at a time; the
        sums over the ranks that hold different tokens and the pipeline stages); ``data_kwargs`` are the training
        loader's build arguments (DP coordinates, sequence multiple, model facts)."""
        super().__init__(config)
        self.config: Validator.Config = config
        config.check()
        self.runner = runner
        self.parts, self.model, self.loss_fn, self.device = runner.parts, runner.model, runner.loss_fn, runner.device
        self.mtp = runner.mtp is not None
        self.ignore_index = self.loss_fn.config.ignore_index
        self.best_loss: float | None = None
        self.best_step: int | None = None
        self.evals_since_best = 0
        self.last_step: int | None = None
        self.streams: list[_Stream] = []
        self.source_names: tuple[str, ...] = ()
        if not config.enabled:
            return
        self.dp_rank = int(data_kwargs.get("dp_rank", 0))
        data = training_data if config.split > 0 else config.data
        for source in data.source_types():
            if source not in accepted_sources:
                raise ValueError(
                    f"validation data source type {source!r} is not one the model takes; use one of "
                    f"{list(accepted_sources)} (--validation.data.source or validation.data.sources[*].source)"
                )
        # one micro-batch per DP rank per round; the full pass ends where the data ends
        data = dataclasses.replace(data, global_batch_tokens=0)
        holdout = {"holdout": Holdout(config.split, "validation")} if config.split > 0 else {}
        full_pass = config.steps == -1
        self.loader = data.build(**data_kwargs, **holdout, single_pass=full_pass)
        self.source_names = tuple(self.loader.source_names)
        if full_pass and self.loader.mixes_sources:  # every source's own pass, tagged as the mixture tags it
            parts = [
                (child, child.pass_micro_batches, lambda mb, s=s: self.loader.finish_source(s, mb))
                for s, child in enumerate(self.loader.children)
            ]
        else:
            total = self.loader.pass_micro_batches if full_pass else config.steps
            if total is None:
                raise ValueError(
                    f"validation.steps=-1 (one full pass) needs data that ends; data.source={data.source!r} has no "
                    "end: set --validation.steps N (global micro-batches per evaluation)"
                )
            parts = [(self.loader, total, lambda mb: mb)]
        self.streams = [_Stream(loader, int(total), finish, loader.state_dict()) for loader, total, finish in parts]

    # -- schedule ---------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def due(self, step: int, *, last_step: bool = False) -> bool:
        """Whether to validate after optimizer step ``step`` (``0``: before the first step)."""
        c = self.config
        if not c.enabled or step == self.last_step:
            return False
        if step == 0:
            return c.at_start
        return step % c.freq == 0 or last_step

    @property
    def should_stop(self) -> bool:
        """Early stop: ``early_stop_patience`` evaluations in a row without a new best."""
        patience = self.config.early_stop_patience
        return patience > 0 and self.evals_since_best >= patience

    # -- evaluation -------------------------------------------------------------------------------
    def validate(self, step: int) -> ValidationResult:
        """One evaluation after step ``step``: the record (``val/loss``, ``val/ppl``, ...) and the best so far."""
        start = time.perf_counter()
        record = self.evaluate()
        record["val/time_s"] = time.perf_counter() - start  # the metrics leave it out of the training tps window
        improved = False
        if step > 0:
            loss = record["val/loss"]
            if self.best_loss is None or loss < self.best_loss:
                self.best_loss, self.best_step, self.evals_since_best, improved = loss, step, 0, True
            else:
                self.evals_since_best += 1
        if self.best_loss is not None:
            record["val/best_loss"] = self.best_loss
        self.last_step = step
        return ValidationResult(step, record, improved)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The validation metrics of the current weights (no gradients; collective over every rank)."""
        rng = get_rng_state()
        was_training = self.model.training
        for part in self.parts:
            part.eval()
        try:
            return self._evaluate()
        finally:
            self._drop_router_counts()
            for part in self.parts:
                part.train(was_training)
            set_rng_state(rng)

    def _evaluate(self) -> dict[str, float]:
        # loss sum, labelled tokens, MTP loss sum, MTP labelled tokens, MTP top-1 hits
        sums = torch.zeros(5, dtype=torch.float64, device=self.device)
        names = self.source_names
        meter = SourceLossMeter(names, device=self.device, ignore_index=self.ignore_index) if names else None

        def take(out: Any, mb: dict[str, Any]) -> None:
            logits, _ = split_output(out)  # the aux loss is not part of the validation loss
            loss_sum, count = self.loss_fn.sum_and_count(logits, mb["labels"])
            sums[0] += loss_sum.detach().double()
            sums[1] += count.double()
            if meter is not None:
                meter.add(mb["labels"], mb["source_ids"], token_loss_sum=loss_sum.detach())
            if self.mtp:
                mtp_sum, mtp_count = self.loss_fn.sum_and_count(out.mtp_logits, mb["mtp_labels"])
                sums[2] += mtp_sum.detach().double()
                sums[3] += mtp_count.double()
                sums[4] += top1_correct(out.mtp_logits, mb["mtp_labels"], ignore_index=self.ignore_index)

        for stream in self.streams:
            loader = stream.loader
            loader.load_state_dict(stream.start)
            ranks = loader.dp_world_size
            # rounds of eval_group_size micro-batches per rank (one pipeline step each): past the data's end the same
            # forwards run on a copy without tokens
            n = math.ceil(stream.total / ranks)
            group: list[dict[str, Any]] = []
            last: dict[str, Any] = {}
            for k in range(-(-n // self.runner.eval_group_size) * self.runner.eval_group_size):
                if k < n:
                    (mb,) = loader.next_step()
                    mb = last = stream.finish(mb)
                else:
                    mb = last
                if k * ranks + self.dp_rank >= stream.total:
                    mb = {**mb, "labels": torch.full_like(mb["labels"], self.ignore_index)}
                group.append(self.runner.to_device(self.runner.prepare(mb)))
                if len(group) == self.runner.eval_group_size:
                    with self.runner.loss_parallel():
                        self.runner.evaluate(group, take)
                    group = []
        loss, tokens, mtp_loss, mtp_tokens, mtp_hits = self.runner.sum_over_loss_ranks(sums).tolist()
        mean = loss / max(tokens, 1.0)
        record = {"val/loss": mean, "val/ppl": math.exp(min(mean, 700.0)), "val/tokens": tokens}
        if self.mtp:
            record["val/loss_mtp"] = mtp_loss / max(mtp_tokens, 1.0)
            record["val/mtp/top1"] = mtp_hits / max(mtp_tokens, 1.0)
        if meter is not None:
            for key, value in meter.reduce(self.runner.sum_over_loss_ranks).items():  # loss/<name>
                record[f"val/{key[len('loss/'):]}/loss"] = value
        return record

    def _drop_router_counts(self) -> None:
        """Validation tokens must not reach the MoE bias update or the expert-load metrics of the next step."""
        for module in (m for part in self.parts for m in part.modules()):
            pop = getattr(module, "pop_tokens_per_expert", None)
            if callable(pop):
                pop()

    # -- checkpoint (a global state: the same on every rank) ---------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "best_loss": self.best_loss,
            "best_step": self.best_step,
            "evals_since_best": self.evals_since_best,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best_loss = None if state.get("best_loss") is None else float(state["best_loss"])
        self.best_step = None if state.get("best_step") is None else int(state["best_step"])
        self.evals_since_best = int(state.get("evals_since_best", 0))
        self.last_step = None if state.get("last_step") is None else int(state["last_step"])

    def close(self) -> None:
        """Stop the validation data's worker processes."""
        loader = getattr(self, "loader", None)
        if loader is not None:
            loader.close()
