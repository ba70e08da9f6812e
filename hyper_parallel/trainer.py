"""The Trainer: builds a whole run from ``Trainer.Config`` and runs the training loop.

Order of construction (nothing heavy happens before the layout is validated): process group -> the run's model
config -> ParallelDims (validated against world size and model facts) -> mesh -> data (its config checked against
the layout) -> the model (``components/model_builder.py``: meta, stages, LoRA freeze, parallelize, materialise, init
or HF load) -> optimizer, LR schedule, EMA -> the step's mechanics (``components/step.py``, shared with validation and
the dry run) -> validator -> checkpoint manager (resume) -> metrics.
"""

from __future__ import annotations

import logging
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.distributed as dist
import tyro
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from hyper_parallel.components import (
    EMA,
    CheckpointManager,
    CrossEntropyLoss,
    LRSchedulersContainer,
    MetricsProcessor,
    OptimizersContainer,
    Profiler,
    assert_finite,
)
from hyper_parallel.components.model_builder import ModelBuilder, resolve_model, validate_model_layout
from hyper_parallel.components.source_metrics import SourceLossMeter
from hyper_parallel.components.step import StepObjective, StepRunner
from hyper_parallel.components.validate import Validator
from hyper_parallel import torch_features
from hyper_parallel.config import (
    ActivationCheckpointConfig,
    CommConfig,
    CompileConfig,
    Configurable,
    DebugConfig,
    ParallelismConfig,
    TrainingConfig,
)
from hyper_parallel.config.dtypes import to_torch_dtype
from hyper_parallel.config.errors import ConfigError
from hyper_parallel.config.lora import LoRAConfig
from hyper_parallel.data import DataConfig, DataStateMismatch
from hyper_parallel.data.tokenizer_check import check_run_tokenizer
from hyper_parallel.distributed.env import init_distributed, set_determinism, set_pg_timeouts, world_info
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.pipeline_parallel import PipelineParallel, check_microbatches
from hyper_parallel.models.common.lora_policy import LoRAPolicy
from hyper_parallel.hf.folder import MODEL_COPY, resumed_folder_config
from hyper_parallel.hf.serving import write_serving_files
from hyper_parallel.hf.save import save_pretrained
from hyper_parallel.hf.lora_export import export_lora
from hyper_parallel.protocols.model import BaseModel
from hyper_parallel.protocols.model_spec import ModelSpec, discover_model_spec

__all__ = ["NonFiniteError", "Trainer"]

logger = logging.getLogger("hyper_parallel")

class NonFiniteError(RuntimeError):
    """The loss or the gradient norm of a step was NaN/inf."""


class Trainer(Configurable):
    """A training run. ``Trainer.Config`` is the whole run config a recipe returns."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        model_spec: str
        """Registered model spec (the model package's parallelize function and HF adapter)."""
        model: BaseModel.Config
        """The model's config tree (the recipe builds it with the package's flavor builder). With --checkpoint.initial_load_path DIR (an HF folder) the model is DIR's config.json: these values are the recipe's, used without a folder; only the training-only options (use_mtp, mtp_loss_weight, router_aux_loss_coef, freeze) apply on top of a folder."""
        training: TrainingConfig = field(default_factory=TrainingConfig)
        """Training loop options."""
        parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
        """Parallel layout."""
        activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
        """Activation checkpointing per decoder layer."""
        compile: CompileConfig = field(default_factory=CompileConfig)
        """torch.compile per decoder layer."""
        comm: CommConfig = field(default_factory=CommConfig)
        """Process-group set-up."""
        debug: DebugConfig = field(default_factory=DebugConfig)
        """Seeds and determinism."""
        data: DataConfig = field(default_factory=DataConfig)
        """Training data (a source the model spec accepts: DirectToken shards, text, preset batches ...)."""
        optimizer: OptimizersContainer.Config = field(default_factory=OptimizersContainer.Config)
        """Optimizer (AdamW, or Muon for hidden matrices with AdamW for the rest)."""
        lr_scheduler: LRSchedulersContainer.Config = field(default_factory=LRSchedulersContainer.Config)
        """Warmup and decay of the learning rate."""
        loss: CrossEntropyLoss.Config = field(default_factory=CrossEntropyLoss.Config)
        """Token cross entropy (exact global token mean over micro-batches and ranks)."""
        ema: EMA.Config = field(default_factory=EMA.Config)
        """Exponential moving average of the trainable weights."""
        lora: LoRAConfig = field(default_factory=LoRAConfig)
        """LoRA: adapters on --lora.targets, the rest of the model frozen."""
        checkpoint: CheckpointManager.Config = field(default_factory=CheckpointManager.Config)
        """DCP checkpoints, resume, HF import and export."""
        validation: Validator.Config = field(default_factory=Validator.Config)
        """Validation loss during training (held-out split or own data), best checkpoint, early stop."""
        metrics: MetricsProcessor.Config = field(default_factory=MetricsProcessor.Config)
        """Console, metrics.jsonl, TensorBoard and the loss curve."""
        profiling: Profiler.Config = field(default_factory=Profiler.Config)
        """torch.profiler traces per rank and CUDA memory snapshots (torchtitan's --profiling.* flags)."""
        dump_folder: str = "outputs"
        """Folder for checkpoints, metrics.jsonl, plots and the HF export (relative to the current folder)."""
        explicit_model_fields: Annotated[tuple[str, ...], tyro.conf.Suppress] = ()
        """Dotted paths under ``model`` that the command line or run file set (``ConfigManager`` records them):
        with an HF folder as ``checkpoint.initial_load_path`` the folder is the model, and such a field that
        contradicts it is an error (training-only options excepted)."""

        def validate(self) -> None:
            """Cheap checks of the run config that need no process group."""
            if self.training.steps < 1:
                raise ConfigError(f"--training.steps {self.training.steps}: the run needs at least 1 step (>= 1)")
            if self.training.moe_bias_update_rate < 0:
                raise ValueError(f"training.moe_bias_update_rate={self.training.moe_bias_update_rate} must be >= 0")
            self.validation.check()
            ac = self.activation_checkpoint
            if self.lora.enabled and self.lora.dropout > 0 and ac.mode != "none" and not ac.preserve_rng_state:
                raise ValueError(
                    f"lora.dropout={self.lora.dropout} with activation_checkpoint.mode={ac.mode!r}: the recomputed "
                    "forward would draw other dropout masks (wrong gradients); add "
                    "--activation_checkpoint.preserve_rng_state or set --lora.dropout 0"
                )
            if self.checkpoint.keep_best and not (self.validation.enabled and self.checkpoint.enable):
                raise ValueError(
                    "checkpoint.keep_best keeps the checkpoint of the best validation loss: it needs "
                    "--validation.freq N and --checkpoint.enable"
                )

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.config: Trainer.Config = config
        config.validate()
        # close() destroys the default group only if this trainer created it (not a caller's, e.g. a test pool's).
        self._owns_process_group = not (dist.is_available() and dist.is_initialized())
        self.device = init_distributed(config.comm)
        try:
            self._build(config)
        except BaseException:
            # A run that fails to start (a bad layout, data or checkpoint) frees what it made, so the caller's
            # process can build another trainer without a leftover default group, mesh groups or data workers.
            if getattr(self, "data", None) is not None:
                self.data.close()
            if getattr(self, "validator", None) is not None:
                self.validator.close()
            self._release_distributed()
            raise

    def _build(self, config: Config) -> None:
        """Everything after the process group: layout, data, model, optimizer, checkpoints, metrics."""
        self.rank, _, self.world_size = world_info()
        set_determinism(config.debug.seed, deterministic=config.debug.deterministic)
        torch.autograd.set_detect_anomaly(config.debug.detect_anomaly)
        self.spec: ModelSpec = discover_model_spec(config.model_spec)
        self._log(torch_features.describe())  # what this torch lacks of the APIs we use, and the fallback taken
        # 0. the model: an HF folder's (checkpoint.initial_load_path) or, without one, the recipe's, with the LoRA
        # adapters; a resumed run started from a folder rebuilds that folder's model even when the command leaves
        # the path out
        config, self.run_model = resolve_model(self.spec, resumed_folder_config(config), rank=self.rank, log=self._log)
        self.config = config
        # the data's tokenizer is the folder's (--data.allow_foreign_tokenizer: another on purpose)
        check_run_tokenizer(self.run_model.folder, config.data)
        if config.validation.data.path or config.validation.data.sources:  # validation data of its own: the same rule
            check_run_tokenizer(self.run_model.folder, config.validation.data, allow=config.data.allow_foreign_tokenizer)
        self.lora = LoRAPolicy(config.lora, config.checkpoint.initial_load_path)
        """Every LoRA decision of the run (adapters, frozen base, checkpoints, resume, export)."""

        # 1. layout, validated before anything is built
        self.parallel_dims = ParallelDims.from_config(config.parallelism, self.world_size)
        validate_model_layout(self.spec, config.model, self.parallel_dims)
        self.parallel_dims.build_mesh(self.device.type)

        # 2. data: its config is checked against the layout and the model's facts before the model is built
        for source in config.data.source_types():  # data.source, or the type of every data.sources entry
            if source not in self.spec.data_sources:
                raise ValueError(
                    f"data source type {source!r} is not one model {self.spec.name!r} takes; use one of "
                    f"{list(self.spec.data_sources)} (--data.source or data.sources[*].source)"
                )
        pd = self.parallel_dims
        self.dp_rank, self.dp_world = (0, 1) if pd.dp == 1 else (pd.mesh_coordinate("dp"), pd.dp)
        # CP splits every row into equal chunks, and SP splits each chunk again over TP ranks. Any model may get
        # the balanced CP order (2 pieces per rank, see context_parallel.apply_context_parallel): rows are padded
        # to 2 x cp.
        cp_pieces = 2 if pd.cp > 1 else 1
        seq_multiple = cp_pieces * pd.cp * (pd.tp if pd.sp_enabled else 1)
        if pd.pp_enabled:  # the stages' receive buffers are shaped once: every micro-batch is padded to the budget
            seq_multiple = math.lcm(seq_multiple, config.data.max_tokens_per_microbatch)
        data_kwargs = dict(
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world,
            seq_multiple=seq_multiple,
            model_facts=self.spec.data_facts(config.model),
        )
        # validation.split: the held-out samples leave the training stream
        self.data = config.data.build(**data_kwargs, **config.validation.training_data_kwargs())
        if pd.pp_enabled:  # before the model is built
            check_microbatches(pd, config.parallelism.pipeline_schedule, self.data.micro_batches_per_step,
                               tokens_per_microbatch=config.data.max_tokens_per_microbatch)  # fmt: skip

        # 3. model: meta -> (pipeline stages) -> LoRA freeze -> parallelize -> materialise -> init or load
        builder = ModelBuilder(self.spec, config, pd, log=self._log)
        built = builder.build(device=self.device, whole_copy=True)
        self.lora_trainable: frozenset[str] = built.trainable
        """LoRA: names of the parameters trained (adapters + --lora.modules_to_save); empty without LoRA."""
        self.flops_model: BaseModel = built.whole
        """A meta copy of the whole model (never a pipeline stage, never wrapped by the parallelisms) that counts each
        step's FLOPs from its documents (``BaseModel.training_flops``)."""
        nparams, self.flops_per_token = self.flops_model.get_nparams_and_flops(config.data.max_tokens_per_microbatch)
        self._log(f"model {config.model_spec}: {nparams:,} parameters, {self.flops_per_token:.3g} training FLOPs/token "
                  f"at one {config.data.max_tokens_per_microbatch}-token document (each step logs its own)")  # fmt: skip
        if self.lora.enabled:
            self._log(self.lora.summary(self.flops_model, self.run_model.config, config.training.mixed_precision_param))
        self.pipeline: PipelineParallel | None = built.pipeline
        """Pipeline parallel (``--parallelism.pipeline_parallel_degree > 1``): this rank's stages and schedule."""
        self.model_parts: list[nn.Module] = built.parts
        """This rank's model: the whole model, or (pipeline parallel) its stages, each parallelized on its own."""
        self.model: nn.Module = self.model_parts[0]
        """The model (under pipeline parallel this rank's first stage; ``model_parts`` holds all of them)."""
        builder.init_weights(self.model_parts, self.run_model)
        for part in self.model_parts:
            part.train()

        # 4. loss, optimizer, schedule, EMA, the step's mechanics
        self.loss_fn = config.loss.build()
        self.optimizers = config.optimizer.build(model_parts=self.model_parts)
        self.lr_schedulers = config.lr_scheduler.build(optimizers=self.optimizers, total_steps=config.training.steps)
        self.ema = config.ema.build(model=self.model_parts)
        self.mtp_config = getattr(config.model, "mtp", None)
        """The model's multi-token-prediction block (None = off): the batch gets MTP targets, the loss its term."""
        mp = config.training.mixed_precision_param
        self.runner = StepRunner(
            self.model_parts, model_cls=self.spec.model, parallel_dims=pd, device=self.device, loss_fn=self.loss_fn,
            mtp=self.mtp_config, defer_grad_reduce=config.training.defer_grad_reduce, pipeline=self.pipeline,
            micro_batches_per_step=self.data.micro_batches_per_step,
            compute_dtype=to_torch_dtype(mp, field="training.mixed_precision_param"),
        )  # fmt: skip
        """Host prep, device copy, forward/backward, the objective and its reductions (shared with validation)."""

        # 5. checkpoints (resume from the newest complete one), metrics
        self.step = 0
        self.model_has_aux_loss: bool | None = None  # learnt from the first step's output
        self._nonfinite_state: torch.Tensor | None = None  # device: first non-finite step since the last read
        self._step_mode = (True, True)  # train_step's default (read_stats, logged); train() sets it per step
        self.validator = config.validation.build(
            runner=self.runner, training_data=config.data, data_kwargs=data_kwargs,
            accepted_sources=self.spec.data_sources,
        )  # fmt: skip
        self.dump_folder = Path(config.dump_folder)
        self.checkpointer = config.checkpoint.build(
            dump_folder=self.dump_folder, model_parts=self.model_parts, optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers, states={"ema": self.ema},
            global_states={"dataloader": self.data, **({"validation": self.validator} if self.validator.enabled else {})},
            run_config=config,
            # LoRA from an HF folder: the frozen base is the folder's (re-read by the builder on resume), so only
            # the adapters, --lora.modules_to_save and the buffers are saved; a random base (no folder) is saved too
            save_frozen=self.lora.saves_frozen,
        )
        resumed = self._resume()
        if resumed is not None:
            self.step = resumed
            self._log(f"resumed from {self.checkpointer.step_dir(resumed)} at step {resumed}")
        self.metrics = config.metrics.build(
            dump_folder=self.dump_folder, total_steps=config.training.steps, flops_per_token=self.flops_per_token,
            device=self.device, run_config=config,
            compute_dtype=torch.float32 if config.training.mixed_precision_param == "float32" else torch.bfloat16,
        )  # fmt: skip

    def _resume(self) -> int | None:
        """Load the newest checkpoint; a data state made with other data gets a hint of what to do."""
        source = self.dump_folder / MODEL_COPY / "source.json"
        self.lora.check_resume(source, self.checkpointer.complete_steps)  # (no collective: a local listing)
        try:
            return self.checkpointer.load_latest()
        except DataStateMismatch as e:
            raise DataStateMismatch(
                f"{e}. The checkpoints in {self.checkpointer.folder} were made with other data: start in a fresh "
                "--dump_folder, or resume the model and optimizer with --checkpoint.restart_data_stream (the data "
                "starts from its beginning)"
            ) from None

    def _log(self, msg: str) -> None:
        if self.rank == 0:
            logger.info(msg)

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, Any]:
        """Run until ``training.steps``; return a summary (first/last loss, steps run)."""
        cfg = self.config
        first_loss = last_loss = None
        losses: list[float] = []
        self.metrics.reset_timer()
        stopped_early = False
        with cfg.profiling.build(dump_folder=self.dump_folder, global_step=self.step, device=self.device) as profiler:
            if self.step == 0 and self.validator.due(0):  # where the run starts (validation.at_start)
                self._validate()
            pending: list[tuple[int, dict[str, Any]]] = []  # steps whose stats are still on the device

            def flush() -> None:  # read the pending steps' stats (one device->host copy) and log them in order
                nonlocal first_loss, last_loss
                for step, stats in zip([st for st, _ in pending], self._read_stats(pending), strict=True):
                    losses.append(stats["loss"])
                    first_loss = stats["loss"] if first_loss is None else first_loss
                    last_loss = stats["loss"]
                    # log() accumulates tokens and time every step and emits every log_freq steps
                    self.metrics.log(
                        step, loss=stats["loss"], grad_norm=stats["grad_norm"], lr=stats["lr"],
                        num_tokens=stats["num_tokens"], expert_load=stats["expert_load"], extra=stats["extra"],
                        flops_per_token=stats.get("flops_per_token"),
                    )  # fmt: skip
                pending.clear()

            while self.step < cfg.training.steps:
                self.step += 1
                last = self.step == cfg.training.steps
                # Stats are read back only where they are used: log steps, checkpoint steps, the last step.
                due = last or self.metrics.should_log(self.step) or self.checkpointer.should_save(self.step)
                self._step_mode = (False, due)  # (read_stats, logged) of the train_step() call below
                try:
                    pending.append((self.step, self.train_step()))
                finally:
                    self._step_mode = (True, True)
                if due:
                    flush()
                if self.step == 1 and self.world_size > 1:
                    set_pg_timeouts(cfg.comm.train_timeout_seconds, self.parallel_dims.world_mesh)
                best = self._validate() if self.validator.due(self.step, last_step=last) else False
                stopped_early = self.validator.should_stop and not last
                last = last or stopped_early
                if self.checkpointer.should_save(self.step, last_step=last) or best:
                    flush()  # applies the non-finite policy before anything is written
                    assert_finite(self.model_parts)  # never write a poisoned checkpoint
                    self.checkpointer.save(self.step, last_step=last, force=best, best=best)
                profiler.step()
                if stopped_early:
                    flush()
                    self._log(
                        f"early stop at step {self.step}: no better val/loss in {cfg.validation.early_stop_patience} "
                        f"evaluations (best {self.validator.best_loss:.4f} at step {self.validator.best_step})"
                    )
                    break
        if cfg.checkpoint.export_hf:
            self.export_hf(self.dump_folder / "hf")
        return {"first_loss": first_loss, "last_loss": last_loss, "steps": self.step, "losses": losses,
                "stopped_early": stopped_early}  # fmt: skip

    def _validate(self) -> bool:
        """Evaluate the validation data now and log it; returns whether to keep this step as the best checkpoint."""
        result = self.validator.validate(self.step)
        self.metrics.log_validation(self.step, result.record)
        return result.improved and self.config.checkpoint.keep_best

    def train_step(self, *, read_stats: bool | None = None, logged: bool | None = None) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches (dyn_bsz accumulation); returns its stats.

        ``read_stats=False`` leaves the stats on the device (tensors) and reads nothing back: ``_read_stats`` reads
        them later, all pending steps at once (``train``). ``logged``: the step's record is emitted, so it gathers
        the per-layer expert loads and per-source losses too (else ``expert_load`` is None). Both default to what
        ``train`` chose for this step (``_step_mode``), else True."""
        read_stats = self._step_mode[0] if read_stats is None else read_stats
        logged = (self._step_mode[1] if read_stats is False else True) if logged is None else logged
        cfg, steps = self.config, self.runner
        data_batches = self.data.next_step()
        # FLOPs per token of this rank's micro-batches from their real documents (host data: no sync)
        flops_per_token = sum(self.flops_model.training_flops(mb) for mb in data_batches) / max(
            sum(mb["input_ids"].numel() for mb in data_batches), 1
        )
        host_batches = [steps.prepare(mb) for mb in data_batches]
        # Exact global token mean: labelled tokens counted on the host (no device sync), one all-reduce.
        counts = steps.count_tokens(host_batches)
        micro_batches = [steps.to_device(mb) for mb in host_batches]
        self.optimizers.zero_grad()
        names = self.data.source_names  # a mixture: per-source token losses for the metrics
        per_source = SourceLossMeter(names, device=self.device, ignore_index=cfg.loss.ignore_index) if names else None
        # The step's scalars stay on the device (one all-reduce for all of them); the host reads them only when
        # the stats are read (``read_stats``: log steps), so no scalar read stalls the optimizer step.
        sums = steps.forward_backward(micro_batches, StepObjective(steps, counts, per_source))
        global_loss = sums[0]
        grad_norm = steps.clip_grad_norm(cfg.training.max_norm)
        nonfinite = ~(torch.isfinite(global_loss) & torch.isfinite(grad_norm))
        # The same on every rank (the loss and the norm are global), so every rank skips or applies alike.
        if self._skip_on_device(nonfinite):  # the optimizer drops a non-finite update itself
            self.optimizers.step()
            self._note_nonfinite(nonfinite, global_loss, grad_norm)
            finite = None  # known on the device only; read with the stats
        else:  # the optimizer cannot skip on the device: decide on the host (one read, before the step)
            finite = not bool(nonfinite)
            if not finite:
                self._nonfinite(self.step, float(global_loss), float(grad_norm))
                self.optimizers.zero_grad()
            else:
                self.optimizers.step()
        lr = self.lr_schedulers.get_last_lr()[0]
        self.lr_schedulers.step()
        if finite:  # (None: no EMA, see _skip_on_device)
            self.ema.update(self.model_parts)
        expert_load = steps.expert_load_and_balance(rate=cfg.training.moe_bias_update_rate, read=logged)
        extra: dict[str, Any] = {"skipped": nonfinite.float() if finite is None else float(not finite),
                                 **self.data.metrics()}  # fmt: skip
        # share of the step's positions that carry loss (assistant-only chat data trains a fraction)
        tokens, inputs, mtp_tokens = counts.tokens, counts.inputs, counts.mtp
        extra["tokens/trained"] = tokens / max(inputs, 1.0) if isinstance(inputs, float) else (
            tokens / inputs.clamp(min=1.0))
        if per_source is not None and logged:  # (a collective and a read: log steps only; the meter sums
            extra.update(per_source.reduce(steps.sum_over_loss_ranks))  # the steps since: loss/<name>)
        if self.mtp_config is not None:  # loss/mtp is not part of `loss` (the LM loss); the objective adds it weighted
            extra["loss/mtp"] = sums[2]
            extra["mtp/top1"] = sums[3] / (max(mtp_tokens, 1.0) if isinstance(mtp_tokens, float) else
                                           mtp_tokens.clamp(min=1.0))  # fmt: skip
        aux = sums[1] if self.model_has_aux_loss is not False else None
        stats = {
            "loss": global_loss,
            "grad_norm": grad_norm,
            "lr": lr,
            # tokens per device, so tokens/s and MFU compare across layouts (torchtitan's convention)
            "num_tokens": inputs,
            "expert_load": expert_load,
            "extra": extra,
            "aux": aux,
            "flops_per_token": flops_per_token,
        }
        return self._read_stats([(self.step, stats)])[0] if read_stats else stats

    def _skip_on_device(self, nonfinite: torch.Tensor) -> bool:
        """Hand ``nonfinite`` to every optimizer that skips a step on the device (torch's fused Adam/AdamW:
        ``found_inf``, as under a GradScaler); True when all of them do. Otherwise (or with an EMA, whose update
        must skip the step too) the host decides."""
        opts = list(self.optimizers)
        able = bool(opts) and not self.ema.enabled and all(
            isinstance(o, torch.optim.Adam | torch.optim.AdamW) and all(g.get("fused") for g in o.param_groups)
            for o in opts
        )
        for o in opts:
            if able:
                o.found_inf = nonfinite.float()
            elif hasattr(o, "found_inf"):
                del o.found_inf
        return able

    def _note_nonfinite(self, nonfinite: torch.Tensor, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Keep, on the device, the first non-finite step since the stats were last read (step, loss, grad norm)
        and how many steps were skipped; ``_read_stats`` acts on them (policy ``on_nonfinite``)."""
        now = torch.stack([torch.full((), float(self.step), dtype=torch.float64, device=self.device),
                           loss.double(), grad_norm.double(), nonfinite.double()])  # fmt: skip
        if self._nonfinite_state is None:
            self._nonfinite_state = torch.zeros(4, dtype=torch.float64, device=self.device)
        first = self._nonfinite_state
        take = nonfinite & (first[0] == 0)
        self._nonfinite_state = torch.cat([torch.where(take, now[:3], first[:3]), first[3:] + now[3:]])

    def _nonfinite(self, step: int, loss: float, grad_norm: float, skipped: int = 1) -> None:
        """Apply ``training.on_nonfinite`` to step ``step``, whose update was not applied."""
        if self.config.training.on_nonfinite == "error":
            raise NonFiniteError(
                f"step {step}: loss={loss} grad_norm={grad_norm} is not finite; the step was not "
                "applied and no checkpoint was written (set --training.on_nonfinite skip to drop such steps)"
            )
        more = f" ({skipped} such steps since the last log)" if skipped > 1 else ""
        self._log(f"step {step}: non-finite loss={loss} grad_norm={grad_norm}; update skipped{more}")

    def _read_stats(self, pending: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
        """The host values of the steps' stats (``train_step(read_stats=False)`` leaves them on the device): ONE
        device->host copy for all of them, plus the device non-finite record, whose policy is applied here."""
        scalars: list[torch.Tensor] = []

        def slot(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                scalars.append(value.detach().reshape(()).double())
                return len(scalars) - 1
            return value

        plans = []
        for step, st in pending:
            plan = {k: slot(st[k]) for k in ("loss", "grad_norm", "num_tokens", "aux")}
            plan["extra"] = {k: slot(v) for k, v in st["extra"].items()}
            plans.append(plan)
        state = self._nonfinite_state
        if state is not None:
            scalars.extend(state)
            self._nonfinite_state = None
        values = torch.stack(scalars).tolist() if scalars else []

        def get(planned: Any, raw: Any) -> Any:
            return values[planned] if isinstance(raw, torch.Tensor) and raw.numel() == 1 else raw

        if state is not None:
            step, loss, norm, skipped = values[-4:]
            if skipped:
                self._nonfinite(int(step), loss, norm, int(skipped))
        out = []
        for (step, st), plan in zip(pending, plans, strict=True):
            read = {**st, **{k: get(plan[k], st[k]) for k in ("loss", "grad_norm", "num_tokens", "aux")}}
            read["extra"] = {k: get(plan["extra"][k], v) for k, v in st["extra"].items()}
            read["num_tokens"] = int(read["num_tokens"]) // self.world_size
            aux = read.pop("aux")
            if aux is not None:
                self.model_has_aux_loss = self.model_has_aux_loss or aux != 0.0
                if self.model_has_aux_loss:
                    read["extra"]["aux_loss"] = aux
            out.append(read)
        return out

    # ------------------------------------------------------------------ export / close
    def export_hf(self, path: str | os.PathLike) -> None:
        """Write the HF format of the weights (EMA weights when EMA is on) from every rank: one tensor at a
        time is gathered, and each rank writes the safetensors files it owns (rank 0 the index and config),
        so no rank holds the whole model (``hf.save.save_pretrained``).

        The run's one export path (``--checkpoint.export_hf`` writes ``<dump_folder>/hf`` after the last step).
        Beside the weights and config.json, rank 0 writes what a server needs (``hf.serving``): the run's
        tokenizer and chat template (``--data.tokenizer``, else the loaded folder's own), and the loaded folder's
        generation and processor configs.

        A LoRA run (``--lora.rank > 0``) writes ``<path>/adapter`` (the PEFT adapter folder), with
        ``--lora.export_vllm`` ``<path>/adapter_vllm`` (vLLM's per-expert 2-D form) and with ``--lora.export_merged``
        ``<path>/merged`` (the base with the adapters folded in), each with the server files
        (``hf/lora_export.py``).
        """
        if self.spec.hf is None:
            raise NotImplementedError(
                f"model spec {self.spec.name!r} has no HF exporter: set --checkpoint.export_hf False"
            )
        ctx = self.ema.swap(self.model_parts) if self.ema.enabled else nullcontext()
        pp = self.parallel_dims.mesh("pp")
        # Write inside the swap: on the CPU the gathered tensors may alias the parameters, which the swap
        # restores to the live weights on exit. Pipeline parallel: every rank hands in its own stages' tensors,
        # and each stage's ranks write that stage's files (``stages``: the pp group).
        stages = pp.get_group() if pp is not None else None
        with ctx:
            sd = {k: v for part in self.model_parts for k, v in get_model_state_dict(part).items()}  # sharded, ungathered
            dtype = to_torch_dtype(self.config.checkpoint.export_dtype, field="checkpoint.export_dtype")
            folders = [Path(path)]
            lora = self.lora.export_form(self.lora_trainable)
            if lora is not None:  # path/adapter (PEFT), adapter_vllm, merged: hf/lora_export.py
                folders = export_lora(
                    self.spec, self.model, path, state_dict=sd, dtype=dtype, vllm=lora.vllm, merged=lora.merged,
                    base_model_name_or_path=lora.base_model_name_or_path, modules_to_save=lora.modules_to_save,
                    stages=stages,
                )  # fmt: skip
            else:
                # every rank; config + passthrough
                save_pretrained(self.model, path, spec=self.spec, state_dict=sd, dtype=dtype, stages=stages)
        if self.rank == 0:
            for out in folders:
                served = write_serving_files(out, folder=self.config.checkpoint.initial_load_path,
                                             tokenizer=self._run_tokenizer())  # fmt: skip
                self._log(f"HF export written to {out}" + (f" (with {', '.join(served)})" if served else ""))
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()

    def _run_tokenizer(self) -> str | None:
        """The tokenizer the run's data used: ``data.tokenizer``, else the first a mixture's source names."""
        data = self.config.data
        if data.tokenizer:
            return data.tokenizer
        return next((s.tokenizer for s in data.sources if s.tokenizer), None)

    def close(self) -> None:
        """Finish async saves, stop data workers, write the loss curve, destroy the process groups.

        Every group the run's meshes made is destroyed (``ParallelDims.close``), and the default group too
        when this trainer created it; so a process can build trainer after trainer without leaking groups
        (threads on gloo, communicators on NCCL). Parameters stay readable afterwards, but the model can no
        longer communicate. Idempotent.
        """
        self.checkpointer.close()
        self.data.close()
        self.validator.close()
        self.metrics.close()
        self._release_distributed()

    def _release_distributed(self) -> None:
        """Destroy the groups of this run's meshes, and the default group when this trainer created it."""
        parallel_dims = getattr(self, "parallel_dims", None)  # absent when construction failed before it
        if parallel_dims is not None:
            parallel_dims.close()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False

