"""The Trainer: builds a whole run from ``Trainer.Config`` and runs the training loop.

Order of construction (nothing heavy happens before the layout is validated):
process group -> ParallelDims (validated against world size and model facts) -> mesh -> data (its
config checked against the layout) -> model on the meta device -> parallelize (CP -> AC -> TP -> EP ->
compile -> FSDP; AC's hooks must come first) -> materialise and initialise (or load HF weights) ->
optimizer, LR schedule, EMA -> validator -> checkpoint manager (resume) -> metrics.
"""

from __future__ import annotations

import copy
import dataclasses
import json
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

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
from hyper_parallel.components.loss import top1_correct
from hyper_parallel.components.source_metrics import SourceLossMeter
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
from hyper_parallel.config.lora import LoRAConfig, apply_lora, freeze_lora_base, lora_targets, lora_trainable_names
from hyper_parallel.data import DataConfig, DataStateMismatch
from hyper_parallel.data.packing import add_mtp_targets, batch_to_device
from hyper_parallel.data.tokenizer_check import check_run_tokenizer
from hyper_parallel.distributed.context_parallel import split_batch_for_cp
from hyper_parallel.distributed.env import init_distributed, set_determinism, set_pg_timeouts, world_info
from hyper_parallel.distributed.fsdp import set_gradient_reduction
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.pipeline_parallel import PipelineParallel, check_microbatches
from hyper_parallel.distributed.utils import clip_grad_norm_, dist_sum
from hyper_parallel.models.common.lora import init_adapters_, is_lora_param
from hyper_parallel.protocols.hf_model import (
    MODEL_COPY,
    RunModel,
    check_mtp_tensors,
    has_checkpoint,
    resolve_run_model,
    resumed_folder_config,
)
from hyper_parallel.protocols.hf_serving import write_serving_files
from hyper_parallel.protocols.hf_storage import pipeline_stages
from hyper_parallel.protocols.hf_lora import export_lora
from hyper_parallel.protocols.model import BaseModel, ModelOutput, split_output
from hyper_parallel.protocols.model_spec import ModelSpec, discover_model_spec
from hyper_parallel.protocols.module import unwrapped_name

__all__ = ["NonFiniteError", "Trainer", "validate_model_layout"]

logger = logging.getLogger("hyper_parallel")

# A full copy of the model is initialised on every rank (then sharded) when it is at most this big,
# so that every parallel layout starts from bit-identical weights; bigger models initialise in place.
_FULL_INIT_MAX_BYTES = 4 << 30


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
        # 0. the model: an HF folder's (checkpoint.initial_load_path) or, without one, the recipe's; a resumed run
        # started from a folder rebuilds that folder's model even when the command leaves the path out
        config = self.config = resumed_folder_config(config)
        self.run_model = self._resolve_model(config)
        # the data's tokenizer is the folder's (--data.allow_foreign_tokenizer: another on purpose)
        check_run_tokenizer(self.run_model.folder, config.data)
        if config.validation.data.path or config.validation.data.sources:  # validation data of its own: the same rule
            check_run_tokenizer(self.run_model.folder, config.validation.data, allow=config.data.allow_foreign_tokenizer)
        # LoRA changes the model config only here, after the folder/recipe resolution: the folder's model is what
        # the adapters sit on, and a resume compares models without them.
        config = self.config = dataclasses.replace(config, model=apply_lora(self.run_model.config, config.lora))

        # 1. layout, validated before anything is built
        self.parallel_dims = ParallelDims.from_config(config.parallelism, self.world_size)
        self._validate_model_layout()
        self.parallel_dims.build_mesh(self.device.type)

        # 2. data: its config is checked against the layout and the model's facts before the model is built
        for source in config.data.source_types():  # data.source, or the type of every data.sources entry
            if source not in self.spec.data_sources:
                raise ValueError(
                    f"data source type {source!r} is not one model {self.spec.name!r} takes; use one of "
                    f"{list(self.spec.data_sources)} (--data.source or data.sources[*].source)"
                )
        self.dp_rank, self.dp_world = self._dp_coordinates()
        # CP splits every row into equal chunks, and SP splits each chunk again over TP ranks. Any model may get
        # the balanced CP order (2 pieces per rank, see context_parallel.apply_context_parallel): rows are padded
        # to 2 x cp.
        pd = self.parallel_dims
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

        # 3. model: meta -> (pipeline stages) -> parallelize -> materialise -> init or load
        with torch.device("meta"):
            model = config.model.build()
        self.lora_trainable: frozenset[str] = frozenset()
        """LoRA: names of the parameters trained (adapters + --lora.modules_to_save); empty without LoRA."""
        if config.lora.enabled:
            self.lora_trainable = frozenset(lora_trainable_names(model, config.lora.modules_to_save))
            freeze_lora_base(model, self.lora_trainable)
        nparams, self.flops_per_token = model.get_nparams_and_flops(config.data.max_tokens_per_microbatch)
        self._log(f"model {config.model_spec}: {nparams:,} parameters, {self.flops_per_token:.3g} training FLOPs/token "
                  f"at one {config.data.max_tokens_per_microbatch}-token document (each step logs its own)")  # fmt: skip
        self.flops_model: BaseModel = copy.deepcopy(model)
        """A meta copy of the whole model (never a pipeline stage, never wrapped by the parallelisms) that counts each
        step's FLOPs from its documents (``BaseModel.training_flops``)."""
        if config.lora.enabled:
            self._log_lora(model)
        self.pipeline: PipelineParallel | None = None
        """Pipeline parallel (``--parallelism.pipeline_parallel_degree > 1``): this rank's stages and schedule."""
        parts = [model]
        if pd.pp_enabled:
            self.pipeline = PipelineParallel(config.model, pd, config.parallelism,
                                             seq_len=config.data.max_tokens_per_microbatch)  # fmt: skip
            self._log(self.pipeline.describe())
            parts = self.pipeline.parts
            if config.lora.enabled:
                for part in parts:
                    freeze_lora_base(part, self.lora_trainable)
        self.model_parts: list[nn.Module] = []
        """This rank's model: the whole model, or (pipeline parallel) its stages, each parallelized on its own."""
        for part in parts:
            part = self.spec.parallelize_fn(
                part,
                parallel_dims=self.parallel_dims,
                training=config.training,
                parallelism=config.parallelism,
                ac_config=config.activation_checkpoint,
                compile_config=config.compile,
            )
            part.to_empty(device=self.device)
            self.model_parts.append(part)
        self.model: nn.Module = self.model_parts[0]
        """The model (under pipeline parallel this rank's first stage; ``model_parts`` holds all of them)."""
        self.model_cls: type[BaseModel] = self.spec.model
        self._init_weights()
        for part in self.model_parts:
            if config.lora.enabled:  # again on the parallelized model: no wrapper may have brought a base back
                freeze_lora_base(part, self.lora_trainable)
            part.train()

        # 4. loss, optimizer, schedule, EMA
        self.loss_fn = config.loss.build()
        self.optimizers = config.optimizer.build(model_parts=self.model_parts)
        self.lr_schedulers = config.lr_scheduler.build(optimizers=self.optimizers, total_steps=config.training.steps)
        self.ema = config.ema.build(model=self.model_parts)

        # 5. checkpoints (resume from the newest complete one), metrics
        self.step = 0
        self.model_has_aux_loss: bool | None = None  # learnt from the first step's output
        self._nonfinite_state: torch.Tensor | None = None  # device: first non-finite step since the last read
        self._step_mode = (True, True)  # train_step's default (read_stats, logged); train() sets it per step
        self.mtp_config = getattr(config.model, "mtp", None)
        """The model's multi-token-prediction block (None = off): the batch gets MTP targets, the loss its term."""
        if self.pipeline is not None:
            self._step_loss: Any = None  # the step's loss function (``_pipeline_loss``), set by each train step
            mp = config.training.mixed_precision_param
            self.pipeline.attach(
                self.model_parts, device=self.device, n_microbatches=self.data.micro_batches_per_step,
                loss_fn=lambda out, mb: self._step_loss(ModelOutput.from_stage_output(out), mb),
                compute_dtype=to_torch_dtype(mp, field="training.mixed_precision_param"), mtp=self.mtp_config is not None,
            )  # fmt: skip
        self.validator = config.validation.build(
            model=self.model_parts, loss_fn=self.loss_fn, device=self.device, training_data=config.data,
            data_kwargs=data_kwargs, accepted_sources=self.spec.data_sources, prepare=self._prepare_micro_batch,
            forward=self._forward_micro_batch, to_device=self._to_device, loss_context=self._loss_parallel,
            sum_over_ranks=self._sum_over_loss_ranks, mtp=self.mtp_config is not None,
            # pipeline parallel: the validation micro-batches run through the schedule's forwards, a step's worth
            run=self._pipeline_eval if self.pipeline is not None else None,
            group_size=self.data.micro_batches_per_step if self.pipeline is not None else 1,
        )  # fmt: skip
        self.dump_folder = Path(config.dump_folder)
        self.checkpointer = config.checkpoint.build(
            dump_folder=self.dump_folder,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"ema": self.ema},
            global_states={"dataloader": self.data, **({"validation": self.validator} if self.validator.enabled else {})},
            run_config=config,
            # LoRA from an HF folder: the frozen base is the folder's (re-read by _init_weights on resume), so only
            # the adapters, --lora.modules_to_save and the buffers are saved; a random base (no folder) is saved too
            save_frozen=not self._lora_base_from_folder(),
        )
        resumed = self._resume()
        if resumed is not None:
            self.step = resumed
            self._log(f"resumed from {self.checkpointer.step_dir(resumed)} at step {resumed}")
        self.metrics = config.metrics.build(
            dump_folder=self.dump_folder,
            total_steps=config.training.steps,
            flops_per_token=self.flops_per_token,
            device=self.device,
            compute_dtype=torch.float32 if config.training.mixed_precision_param == "float32" else torch.bfloat16,
            run_config=config,
        )

    # ------------------------------------------------------------------ construction helpers
    def _resolve_model(self, config: Config) -> RunModel:
        """The run's model config (``hf_model.resolve_run_model``): an HF folder's, read by the family's reader,
        with the recipe's training-only options on top; a resumed run rebuilds the model it started with (the
        copy of the folder's config.json in the dump folder)."""
        ck = config.checkpoint
        run_model = resolve_run_model(
            self.spec, config.model, folder=ck.initial_load_path, explicit=config.explicit_model_fields,
            dump_folder=config.dump_folder, resuming=ck.enable and has_checkpoint(Path(config.dump_folder) / ck.folder),
            write_copy=self.rank == 0,
        )  # fmt: skip
        if run_model.folder is not None:
            diff = run_model.differences
            self._log(
                f"model from {run_model.folder}/config.json"
                + (f"; differs from the recipe in: {', '.join(diff)}" if diff else " (the recipe's model)")
            )
        if self.spec.fit_to_data is not None:  # the model its data needs (an image path for image tokens)
            fitted, note = self.spec.fit_to_data(run_model.config, config.data.source_types())
            if note is not None:
                self._log(note)
                run_model = dataclasses.replace(run_model, config=fitted)
        if run_model.folder_changed and self.rank == 0:
            logger.warning(
                "%s/config.json changed since this run started: resuming the model the run started with "
                "(%s/initial_model/config.json); the folder's weights are not read again",
                run_model.folder, config.dump_folder,
            )  # fmt: skip
        return run_model

    def _log_lora(self, model: nn.Module) -> None:
        """One line a LoRA user checks first: what is adapted, and how much of the model trains."""
        lora = self.config.lora
        params = {id(p): p for p in model.parameters()}.values()  # a tied parameter once
        total = sum(p.numel() for p in params)
        adapters = sum(p.numel() for n, p in model.named_parameters() if is_lora_param(n))
        trained = sum(p.numel() for p in params if p.requires_grad)
        dtype = self.config.training.mixed_precision_param
        self._log(
            f"LoRA rank {lora.rank} (scale {lora.adapter().scale:g}) on {len(lora_targets(self.run_model.config, lora.targets))} "
            f"projections ({' '.join(lora.targets)}): {adapters:,} adapter parameters"
            + (f" + {trained - adapters:,} trained in full ({' '.join(lora.modules_to_save)})" if trained > adapters else "")
            + f" = {trained / total:.2%} of {total:,}; the rest frozen, stored in {dtype}"
        )

    def _validate_model_layout(self) -> None:
        validate_model_layout(self.spec, self.config.model, self.parallel_dims)

    def _dp_coordinates(self) -> tuple[int, int]:
        pd = self.parallel_dims
        if pd.dp == 1:
            return 0, 1
        return pd.mesh_coordinate("dp"), pd.dp

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Initialise every parameter (or load ``checkpoint.initial_load_path``), identically across layouts.

        Random init: models up to a few GiB are initialised as a full copy on every rank (same seed), then
        each rank keeps its shard, so every layout starts from bit-identical weights; bigger models
        initialise their shards in place. HF weights: every rank reads the slices of its own shards.
        """
        path = self.config.checkpoint.initial_load_path
        torch.manual_seed(self.config.debug.seed)
        if self.run_model.folder_changed and self._lora_base_from_folder():
            raise ValueError(
                f"{path}/config.json changed since this LoRA run started: its checkpoints in {self.config.dump_folder} "
                "hold the adapters only, and the frozen base they were trained on is read from that folder again on "
                "resume. Restore the folder the run started from, or start in a fresh --dump_folder"
            )
        if path and not self.run_model.folder_changed:  # changed: the resumed checkpoint holds the started model
            self._load_hf_weights(path)
            return
        self._random_init()

    @torch.no_grad()
    def _random_init(self, parts: list[nn.Module] | None = None) -> None:
        """Seeded random init of ``parts`` (default: every model part of this rank)."""
        parts = self.model_parts if parts is None else parts
        nbytes = sum(p.numel() * p.element_size() for part in self.model_parts for p in part.parameters())
        if nbytes <= _FULL_INIT_MAX_BYTES:
            full = self.config.model.build()
            full.init_weights()
            whole = full.state_dict()
            for part in parts:  # a pipeline stage takes its own entries of the whole model's
                keys = {unwrapped_name(k) for k in part.state_dict()}
                set_model_state_dict(part, {k: v for k, v in whole.items() if k in keys},
                                     options=StateDictOptions(full_state_dict=True))  # fmt: skip
                _init_buffers(part)
        else:
            for part in parts:
                part.init_weights()

    def _load_hf_weights(self, path: str) -> None:
        """Every rank reads only the slices of the HF folder that its own shards cover (in parallel; no
        rank holds the whole model) and converts them per tensor (``hf_io.load_checked``).

        A folder that does not fill every parameter (a text-only checkpoint for a model's image parts, no
        MTP weights) gets the seeded random init first, identical across layouts. Keys the model
        does not hold (``hf_passthrough``: e.g. a VQ decoder, a vision tower, MTP layers) stay as lazy
        references to the folder's files, read again by the export. A big folder can take long to read on
        a slow file system, so this phase runs under its own ``--comm.hf_load_timeout_seconds``, then the
        init timeout is restored.
        """
        if self.spec.load_hf_weights is None:
            raise NotImplementedError(
                f"model spec {self.spec.name!r} has no HF loader: drop --checkpoint.initial_load_path"
            )
        if self.run_model.mtp_from_folder:  # the folder's MTP block must be there, not started afresh in silence
            check_mtp_tensors(self.spec, self.run_model.hf_config, path, self.config.model)
        distributed = dist.is_initialized() and self.world_size > 1
        comm = self.config.comm
        if distributed:
            set_pg_timeouts(comm.hf_load_timeout_seconds, self.parallel_dims.world_mesh)
        for part in self.model_parts:  # a pipeline stage reads its own layers only
            self.spec.load_hf_weights(part, path, init_missing=lambda part=part: self._random_init([part]))
            if self.config.lora.enabled:  # the folder holds the base; the adapters start as PEFT's, on any layout
                init_adapters_(part, self.config.debug.seed)
            _init_buffers(part)
        if distributed:
            set_pg_timeouts(comm.init_timeout_seconds, self.parallel_dims.world_mesh)
        self._log(f"initialised from HF checkpoint {path}")

    def _lora_base_from_folder(self) -> bool:
        """A LoRA run whose frozen base comes from ``checkpoint.initial_load_path``: its checkpoints leave the base out
        (a resume reads it from the folder again, on any layout, before loading the checkpoint). Without a folder the
        base is the seeded random init, and it is saved: the checkpoint then does not depend on how (full copy, or
        in place for big models) a layout initialised it."""
        return self.config.lora.enabled and bool(self.config.checkpoint.initial_load_path)

    def _resume(self) -> int | None:
        """Load the newest checkpoint; a data state made with other data gets a hint of what to do."""
        source = self.dump_folder / MODEL_COPY / "source.json"
        if self.config.lora.enabled and not self._lora_base_from_folder() and source.is_file():
            started = json.loads(source.read_text()).get("initial_load_path")
            if started and self.checkpointer.complete_steps():  # (no collective: a local listing)
                raise ValueError(
                    f"this LoRA run started from the HF folder {started} ({source}): its checkpoints hold the adapters "
                    f"only, not the frozen base; resume with --checkpoint.initial_load_path {started}"
                )
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
                        step,
                        loss=stats["loss"],
                        grad_norm=stats["grad_norm"],
                        lr=stats["lr"],
                        num_tokens=stats["num_tokens"],
                        expert_load=stats["expert_load"],
                        extra=stats["extra"],
                        flops_per_token=stats.get("flops_per_token"),
                    )
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
        cfg = self.config
        mtp = self.mtp_config
        data_batches = self.data.next_step()
        # FLOPs per token of this rank's micro-batches from their real documents (host data: no sync)
        flops_per_token = sum(self.flops_model.training_flops(mb) for mb in data_batches) / max(
            sum(mb["input_ids"].numel() for mb in data_batches), 1
        )
        host_batches = [self._prepare_micro_batch(mb) for mb in data_batches]
        # Exact global token mean: labelled tokens counted on the host (no device sync), one all-reduce.
        local_tokens = sum(int((mb["labels"] != cfg.loss.ignore_index).sum()) for mb in host_batches)
        local_inputs = sum(mb["input_ids"].numel() for mb in host_batches)
        local_mtp = sum(int((mb["mtp_labels"] != cfg.loss.ignore_index).sum()) for mb in host_batches) if mtp else 0
        # One token rank: the host counts are the step's (no device round trip). Else summed on the device and kept
        # there: the loss divides by a device scalar, the metrics read the counts with the other stats.
        on_host = self._loss_group() is None
        counts = self._sum_over_token_ranks(torch.tensor(
            [local_tokens, local_inputs, local_mtp], dtype=torch.float64, device="cpu" if on_host else self.device,
        ))  # fmt: skip
        if on_host:
            global_tokens, global_inputs, global_mtp = counts.tolist()
        else:
            global_tokens, global_inputs, global_mtp = counts[0], counts[1], counts[2]
        mtp_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        mtp_correct = torch.zeros((), dtype=torch.float64, device=self.device)
        micro_batches = [self._to_device(mb) for mb in host_batches]
        self.optimizers.zero_grad()
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        aux_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        # An auxiliary loss (MoE load balancing) is a mean per forward: average it over the step's
        # forwards on every rank that holds different tokens (gradients are summed over those ranks).
        # The MoE pools its statistics over the cp x tp ranks of a forward, so the loss is the same on each
        # of them; its backward sums the cp copies only (distributed/token_split.py): weighting each by
        # 1/cp here gives the one-process gradient.
        aux_scale = 1.0 / (len(micro_batches) * self._token_ranks())
        names = self.data.source_names  # a mixture: per-source token losses for the metrics
        per_source = SourceLossMeter(names, device=self.device, ignore_index=cfg.loss.ignore_index) if names else None
        acc = {"loss": loss_sum, "aux": aux_sum, "mtp": mtp_sum, "mtp_correct": mtp_correct}

        def step_loss(out: Any, mb: dict[str, Any]) -> torch.Tensor:
            """One micro-batch's share of the step's objective (inside ``_loss_parallel()``); accumulates the
            metrics. Runs where the model's output is: every rank, or the last pipeline stage."""
            logits, aux_loss = split_output(out)
            loss = self.loss_fn(logits, mb["labels"], num_tokens=global_tokens)
            if per_source is not None:
                per_source.add(mb["labels"], mb["source_ids"], token_loss_sum=loss.detach() * global_tokens)
            if aux_loss is not None:
                acc["aux"] += aux_loss.detach().float() * aux_scale
                loss = loss + aux_loss * aux_scale
            objective = loss
            if mtp is not None:  # token mean over the step's tokens that have a target two ahead
                mtp_loss = self.loss_fn(out.mtp_logits, mb["mtp_labels"], num_tokens=global_mtp)
                objective = loss + mtp.loss_weight * mtp_loss
                acc["mtp"] += mtp_loss.detach().float()
                acc["mtp_correct"] += top1_correct(out.mtp_logits, mb["mtp_labels"], ignore_index=cfg.loss.ignore_index)
            acc["loss"] += loss.detach().float()
            return objective

        if self.pipeline is not None:
            self._run_pipeline(micro_batches, step_loss)
        else:
            n = len(micro_batches)
            for i, mb in enumerate(micro_batches):
                self._set_grad_sync(last=i == n - 1)
                with self._loss_parallel():
                    step_loss(self._forward_micro_batch(mb), mb).backward()
        loss_sum, aux_sum, mtp_sum, mtp_correct = acc["loss"], acc["aux"], acc["mtp"], acc["mtp_correct"]
        # The step's scalars stay on the device (one all-reduce for all of them); the host reads them only when
        # the stats are read (``read_stats``: log steps), so no scalar read stalls the optimizer step.
        sums = self._sum_over_loss_ranks(torch.stack([loss_sum.double(), aux_sum.double(), mtp_sum.double(),
                                                      mtp_correct.double()]))  # fmt: skip
        global_loss = sums[0]
        pp_mesh = self.parallel_dims.mesh("pp")
        grad_norm = clip_grad_norm_(
            [p for part in self.model_parts for p in part.parameters() if p.requires_grad], cfg.training.max_norm,
            other_parts=pp_mesh.get_group() if pp_mesh is not None else None,
        )
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
        expert_load = self._expert_load_and_balance(read=logged)
        extra: dict[str, Any] = {"skipped": nonfinite.float() if finite is None else float(not finite),
                                 **self.data.metrics()}  # fmt: skip
        # share of the step's positions that carry loss (assistant-only chat data trains a fraction)
        extra["tokens/trained"] = global_tokens / max(global_inputs, 1.0) if isinstance(global_inputs, float) else (
            global_tokens / global_inputs.clamp(min=1.0))
        if per_source is not None and logged:  # (a collective and a read: log steps only; the meter sums
            extra.update(per_source.reduce(self._sum_over_loss_ranks))  # the steps since: loss/<name>)
        if mtp is not None:  # loss/mtp is not part of `loss` (the LM loss); the objective adds it weighted
            extra["loss/mtp"] = sums[2]
            extra["mtp/top1"] = sums[3] / (max(global_mtp, 1.0) if isinstance(global_mtp, float) else
                                           global_mtp.clamp(min=1.0))  # fmt: skip
        aux = sums[1] if self.model_has_aux_loss is not False else None
        stats = {
            "loss": global_loss,
            "grad_norm": grad_norm,
            "lr": lr,
            # tokens per device, so tokens/s and MFU compare across layouts (torchtitan's convention)
            "num_tokens": global_inputs,
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

    def _prepare_micro_batch(self, mb: dict[str, Any]) -> dict[str, Any]:
        """The host side of one micro-batch (training and validation alike).

        Multi-token prediction: the next ids and the targets two ahead, per document, on the host and before
        the CP split (which slices them like the labels). Context parallel: each CP rank keeps its pieces of
        every row (one chunk, or two in the balanced order), the model's own inputs split to match; split on
        the host so only the pieces are copied to the device.
        """
        pd = self.parallel_dims
        if mb.get("cu_seqlens") is not None and mb.get("cu_seqlens_host") is None:
            # the layers read document bounds from the host copy: made here from the host batch, never read back
            mb = {**mb, "cu_seqlens_host": mb["cu_seqlens"].tolist()}
        if self.mtp_config is not None:
            mb = add_mtp_targets(mb, ignore_index=self.config.loss.ignore_index)
        mb = {**mb, **self.model.host_inputs(mb)}  # the model's host facts (e.g. VL image geometry), before the split
        shard = getattr(self.model, "cp_shard", None)  # the batch order context parallel chose
        return split_batch_for_cp(
            mb, pd.mesh_coordinate("cp") if pd.cp > 1 else 0, pd.cp, split_inputs=self.model_cls.split_inputs_for_cp,
            model_keys=self.model_cls.input_keys, balanced=shard is not None and shard.balanced,
        )  # fmt: skip

    def _forward_micro_batch(self, mb: dict[str, Any]) -> Any:
        """The model's output on one device micro-batch (call inside ``_loss_parallel()``)."""
        return self.model(mb["input_ids"], **self._model_kwargs(mb))

    def _model_kwargs(self, mb: dict[str, Any]) -> dict[str, Any]:
        """The model's keyword inputs of a device micro-batch (every pipeline stage gets them all)."""
        inputs = {k: mb[k] for k in self.model_cls.input_keys if k in mb}
        return dict(
            position_ids=mb["position_ids"],
            cu_seqlens=mb["cu_seqlens"],
            max_seqlen=mb["max_seqlen"],
            cu_seqlens_host=mb.get("cu_seqlens_host"),
            token_mask=mb.get("token_mask"),  # padding out of the MoE router statistics
            **inputs,
            **({"mtp_input_ids": mb["mtp_input_ids"]} if self.mtp_config is not None else {}),
        )

    def _run_pipeline(self, micro_batches: list[dict[str, Any]], step_loss: Any, *, train: bool = True) -> None:
        """One pass of the pipeline schedule over the step's micro-batches: stage 0 takes the token ids, every
        stage the keyword inputs, the last stage ``step_loss(output, micro-batch)`` (forward and backward, or
        forwards only)."""
        pipeline = self.pipeline
        args = [(mb["input_ids"],) if pipeline.has_first else () for mb in micro_batches]
        kwargs = [self._model_kwargs(mb) for mb in micro_batches]
        self._step_loss = step_loss
        try:
            with self._loss_parallel():
                pipeline.step(args, kwargs, micro_batches if pipeline.has_last else None, train=train)
        finally:
            self._step_loss = None

    def _set_grad_sync(self, *, last: bool) -> None:
        set_gradient_reduction(
            self.model,
            last=last,
            defer=self.config.training.defer_grad_reduce,
            replicated=self.parallel_dims.dp_replicate > 1,
        )

    def _token_ranks(self) -> int:
        group = self._loss_group()
        return 1 if group is None else dist.get_world_size(group)

    def _to_device(self, mb: dict[str, Any]) -> dict[str, Any]:
        # pinned host copies on CUDA (the non_blocking copies then overlap compute); a CPU run copies nothing
        return batch_to_device(mb, self.device, non_blocking=True)

    def _loss_group(self) -> dist.ProcessGroup | None:
        """Ranks whose tokens differ: data-parallel x context-parallel (None on a single such rank).

        Tensor-parallel ranks hold the same tokens, so they are not in it.
        """
        mesh = self.parallel_dims.mesh("dp_cp")
        return mesh.get_group() if mesh is not None else None

    def _sum_over_token_ranks(self, value: torch.Tensor | float) -> torch.Tensor:
        """Sum over the ranks that hold different tokens (no reduction when there is only one)."""
        group = self._loss_group()
        if group is None:
            return value.detach().clone() if torch.is_tensor(value) else torch.tensor(value, dtype=torch.float64)
        return dist_sum(value, group)

    def _pipeline_eval(self, micro_batches: list[dict[str, Any]], take: Any) -> None:
        """Validation through the pipeline: forwards only; ``take(output, micro-batch)`` on the last stage."""

        def step_loss(out: Any, mb: dict[str, Any]) -> torch.Tensor:
            take(out, mb)
            return torch.zeros((), device=self.device)

        self._run_pipeline(micro_batches, step_loss, train=False)

    def _sum_over_loss_ranks(self, value: torch.Tensor | float) -> torch.Tensor:
        """``_sum_over_token_ranks``, then (pipeline parallel) over the stages: the loss terms live on the last
        stage only, so the sum hands every rank the step's values."""
        total = self._sum_over_token_ranks(value)
        pp = self.parallel_dims.mesh("pp")
        return total if pp is None else dist_sum(total, pp.get_group())

    def _loss_parallel(self):
        if self.parallel_dims.loss_parallel_enabled:
            return CrossEntropyLoss.parallel_context(True)
        return nullcontext()

    @torch.no_grad()
    def _expert_load_and_balance(self, *, read: bool = True) -> dict[str, torch.Tensor] | None:
        """Per-MoE-layer routed counts (summed over data ranks; ONE all-reduce for every layer); optional
        aux-loss-free bias update. ``read=False`` (a step that does not log): the counts are only needed for the bias
        update, so without one nothing is reduced and None is returned."""
        rate = self.config.training.moe_bias_update_rate
        moes = [(name, module) for part in self.model_parts for name, module in part.named_modules()
                if callable(getattr(module, "pop_tokens_per_expert", None))]  # fmt: skip
        popped = [module.pop_tokens_per_expert().float() for _, module in moes]  # every step: resets the counts
        if not read and rate <= 0:
            return None
        # Every rank must apply the same bias update: sum the counts over all ranks whose routers saw
        # different tokens (sequence parallel splits tokens over TP ranks as well).
        pd = self.parallel_dims
        mesh = pd.mesh("dp_cp", "tp") if pd.sp_enabled else pd.mesh("dp_cp")
        moe_group = None if mesh is None else (mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group())
        flat = torch.cat(popped) if popped else torch.zeros(0, device=self.device)
        if moe_group is not None and popped:
            dist.all_reduce(flat, group=moe_group)
        load: dict[str, torch.Tensor] = {}
        for (name, module), counts in zip(moes, flat.split([c.numel() for c in popped]) if popped else (), strict=True):
            load[unwrapped_name(name)] = counts
            if rate > 0:
                module.update_bias_correction(counts, rate)
        pp = pd.mesh("pp")
        if not read:
            return None
        if pp is not None:  # every stage's layers in the metrics (rank 0 logs them): log steps only
            gathered: list[Any] = [None] * pd.pp
            dist.all_gather_object(gathered, {k: v.cpu() for k, v in load.items()}, group=pp.get_group())
            load = {k: v.to(self.device) for part in gathered for k, v in part.items()}
            load = dict(sorted(load.items(), key=lambda kv: _layer_order(kv[0])))
        return load

    # ------------------------------------------------------------------ export / close
    def export_hf(self, path: str | os.PathLike) -> None:
        """Write the HF format of the weights (EMA weights when EMA is on) from every rank: one tensor at a
        time is gathered, and each rank writes the safetensors files it owns (rank 0 the index and config),
        so no rank holds the whole model (``hf_io.save_converted``).

        The run's one export path (``--checkpoint.export_hf`` writes ``<dump_folder>/hf`` after the last step).
        Beside the weights and config.json, rank 0 writes what a server needs (``hf_serving``): the run's
        tokenizer and chat template (``--data.tokenizer``, else the loaded folder's own), and the loaded folder's
        generation and processor configs.

        A LoRA run (``--lora.rank > 0``) writes ``<path>/adapter`` (the PEFT adapter folder), with
        ``--lora.export_vllm`` ``<path>/adapter_vllm`` (vLLM's per-expert 2-D form) and with ``--lora.export_merged``
        ``<path>/merged`` (the base with the adapters folded in), each with the server files
        (``protocols/hf_lora.py``).
        """
        if self.spec.save_pretrained is None:
            raise NotImplementedError(
                f"model spec {self.spec.name!r} has no HF exporter: set --checkpoint.export_hf False"
            )
        ctx = self.ema.swap(self.model_parts) if self.ema.enabled else nullcontext()
        pp = self.parallel_dims.mesh("pp")
        # Write inside the swap: on the CPU the gathered tensors may alias the parameters, which the swap
        # restores to the live weights on exit. Pipeline parallel: every rank hands in its own stages' tensors,
        # and each stage's ranks write that stage's files (``hf_storage.pipeline_stages``).
        with ctx, pipeline_stages(pp.get_group() if pp is not None else None):
            sd = {k: v for part in self.model_parts for k, v in get_model_state_dict(part).items()}  # sharded, ungathered
            dtype = to_torch_dtype(self.config.checkpoint.export_dtype, field="checkpoint.export_dtype")
            folders = [Path(path)]
            if self.config.lora.enabled:  # path/adapter (PEFT), adapter_vllm, merged: protocols/hf_lora.py
                lora = self.config.lora
                folders = export_lora(
                    self.spec, self.model, path, state_dict=sd, dtype=dtype, vllm=lora.export_vllm,
                    merged=lora.export_merged, base_model_name_or_path=self.config.checkpoint.initial_load_path,
                    modules_to_save=sorted(n for n in self.lora_trainable if not is_lora_param(n)),
                )  # fmt: skip
            else:
                self.spec.save_pretrained(self.model, path, state_dict=sd, dtype=dtype)  # every rank; config + passthrough
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
        named = [s.get("tokenizer", "") if isinstance(s, dict) else s.tokenizer for s in data.sources]
        return next((t for t in named if t), None)

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


def validate_model_layout(spec: ModelSpec, model_config: Any, parallel_dims: ParallelDims) -> None:
    """Check a layout against model facts before the model exists: the spec's own check if it has one, else
    the generic one (heads, key/value heads and routed experts of the first layers that have them)."""
    if spec.validate_layout is not None:
        spec.validate_layout(model_config, parallel_dims)
        return
    layers = getattr(model_config, "layers", [])
    attn = next((layer.self_attn for layer in layers if hasattr(layer.self_attn, "n_heads")), None)
    moe = next((layer.mlp for layer in layers if hasattr(layer.mlp, "num_experts")), None)
    if attn is None:
        return
    parallel_dims.validate_model(
        n_heads=attn.n_heads,
        n_kv_heads=getattr(attn, "n_kv_heads", None),
        n_routed_experts=moe.num_experts if moe is not None else None,
    )


def _layer_order(name: str) -> tuple:
    """Sort key of a module name: ``layers.10`` after ``layers.9`` (numbers compared as numbers)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


@torch.no_grad()
def _init_buffers(model: nn.Module) -> None:
    """Recompute non-persistent buffers (RoPE tables, load counters) after ``to_empty``.

    A full state dict carries only persistent entries; parameter-free modules that own
    non-persistent buffers recompute them in ``init_own_weights``.
    """
    for module in model.modules():
        if module._non_persistent_buffers_set and not any(True for _ in module.parameters(recurse=False)):
            init = getattr(module, "init_own_weights", None)
            if callable(init):
                init()
