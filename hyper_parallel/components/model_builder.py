"""Building the run's model, shared by the trainer and the dry run (``ModelBuilder``).

The sequence, written once: resolve the run's model (an HF folder's config.json or the recipe's, the model its
data needs, LoRA adapters on top: ``resolve_model``) -> build on the meta device -> cut this rank's pipeline
stages -> freeze the LoRA base (once, before any wrapper: the parallelize path keeps every ``requires_grad``)
-> parallelize (CP -> TP -> EP -> AC -> compile -> FSDP) -> materialise -> random init or the HF folder's weights
(``ModelBuilder.init_weights``).

Random init is bit-identical across layouts: models up to a few GiB are initialised as a full copy on every rank
(same seed), then each rank keeps its shard; bigger models initialise their shards in place.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from hyper_parallel.distributed.env import set_pg_timeouts
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.pipeline_parallel import PipelineParallel
from hyper_parallel.hf.folder import RunModel, check_mtp_tensors, has_checkpoint, resolve_run_model
from hyper_parallel.hf.load import load_hf_weights
from hyper_parallel.models.common.lora_policy import LoRAPolicy
from hyper_parallel.protocols.model_spec import ModelSpec
from hyper_parallel.protocols.module import unwrapped_name

__all__ = ["BuiltModel", "ModelBuilder", "init_buffers", "resolve_model", "validate_model_layout"]

logger = logging.getLogger("hyper_parallel")

# A full copy of the model is initialised on every rank (then sharded) when it is at most this big,
# so that every parallel layout starts from bit-identical weights; bigger models initialise in place.
_FULL_INIT_MAX_BYTES = 4 << 30


def _no_log(msg: str) -> None:
    pass


def resolve_model(
    spec: ModelSpec, config: Any, *, rank: int = 0, in_run: bool = True, log: Callable[[str], None] = _no_log
) -> tuple[Any, RunModel]:
    """The run config with the run's model, and where that model came from (``hf.folder.resolve_run_model``): an HF
    folder's config.json read by the family's reader with the recipe's training-only options on top, or the recipe's;
    then the model its data needs (``ModelSpec.fit_to_data``); then the LoRA adapters (``--lora.*``). ``in_run``: a
    training run (a resumed run rebuilds the model it started with, rank 0 keeps a copy of the folder's config); the
    dry run reads only."""
    ck = config.checkpoint
    resuming = in_run and ck.enable and has_checkpoint(Path(config.dump_folder) / ck.folder)
    run = dict(dump_folder=config.dump_folder, write_copy=rank == 0, resuming=resuming) if in_run else {}
    run_model = resolve_run_model(
        spec, config.model, folder=ck.initial_load_path, explicit=config.explicit_model_fields, **run
    )  # fmt: skip
    if run_model.folder is not None:
        diff = run_model.differences
        log(f"model from {run_model.folder}/config.json"
            + (f"; differs from the recipe in: {', '.join(diff)}" if diff else " (the recipe's model)"))  # fmt: skip
    if spec.fit_to_data is not None:  # the model its data needs (an image path for image tokens)
        fitted, note = spec.fit_to_data(run_model.config, config.data.source_types())
        if note is not None:
            log(note)
            run_model = dataclasses.replace(run_model, config=fitted)
    if run_model.folder_changed and rank == 0:
        logger.warning(
            "%s/config.json changed since this run started: resuming the model the run started with "
            "(%s/initial_model/config.json); the folder's weights are not read again",
            run_model.folder, config.dump_folder,
        )  # fmt: skip
    # LoRA changes the model config only here, after the folder/recipe resolution: the folder's model is what
    # the adapters sit on, and a resume compares models without them.
    lora = LoRAPolicy(config.lora, ck.initial_load_path)
    return dataclasses.replace(config, model=lora.apply(run_model.config)), run_model


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


@dataclass(slots=True)
class BuiltModel:
    """This rank's model as ``ModelBuilder.build`` made it."""

    parts: list[nn.Module]
    """The whole model, or (pipeline parallel) this rank's stages, each parallelized on its own."""
    pipeline: PipelineParallel | None
    """Pipeline parallel: this rank's stages and schedule (``parts`` are its parallelized stages)."""
    trainable: frozenset[str]
    """LoRA: names of the parameters trained (adapters + --lora.modules_to_save); empty without LoRA."""
    whole: nn.Module | None = None
    """``build(whole_copy=True)``: a meta copy of the whole model (never a stage, never wrapped), base frozen."""


class ModelBuilder:
    """Builds and initialises the model of ``config`` (a run config whose model ``resolve_model`` made) on
    ``parallel_dims``; ``log`` takes the run-log lines (rank 0's)."""

    def __init__(
        self, spec: ModelSpec, config: Any, parallel_dims: ParallelDims, *, log: Callable[[str], None] = _no_log
    ) -> None:
        self.spec, self.config, self.parallel_dims, self.log = spec, config, parallel_dims, log
        self.lora = LoRAPolicy(config.lora, config.checkpoint.initial_load_path)

    def build(
        self, model_config: Any = None, *, device: torch.device | None = None, compile: bool = True,
        whole_copy: bool = False, stages: bool = True,
    ) -> BuiltModel:
        """meta -> (pipeline stages) -> LoRA base frozen -> parallelize -> (``device``: materialised, not initialised).

        ``model_config``: another model than the run's (the dry run's shallow copies); ``compile=False`` leaves
        ``torch.compile`` out (the dry run steps eagerly); ``stages=False``: the whole model even under pipeline
        parallel (the dry run's optimizer-state probe)."""
        cfg, pd = self.config, self.parallel_dims
        model_config = cfg.model if model_config is None else model_config
        with torch.device("meta"):
            whole = model_config.build()
        pipeline = None
        if pd.pp_enabled and stages:
            pipeline = PipelineParallel(model_config, pd, cfg.parallelism, seq_len=cfg.data.max_tokens_per_microbatch)
            self.log(pipeline.describe())
        parts = pipeline.parts if pipeline is not None else [whole]
        trainable = self.lora.trainable_names(whole)  # read off the whole model, before stages are cut
        for module in dict.fromkeys([whole, *parts]):  # the one LoRA freeze (wrappers keep requires_grad)
            self.lora.freeze(module, trainable)
        kept = copy.deepcopy(whole) if whole_copy else None
        compile_config = cfg.compile if compile else dataclasses.replace(cfg.compile, enable=False)
        built = []
        for part in parts:
            part = self.spec.parallelize_fn(
                part, parallel_dims=pd, training=cfg.training, parallelism=cfg.parallelism,
                ac_config=cfg.activation_checkpoint, compile_config=compile_config,
            )  # fmt: skip
            if device is not None:
                part.to_empty(device=device)
            built.append(part)
        return BuiltModel(built, pipeline, trainable, kept)

    # ------------------------------------------------------------------ initialisation
    @torch.no_grad()
    def init_weights(self, parts: list[nn.Module], run_model: RunModel) -> None:
        """Initialise every parameter of ``parts`` (or load ``checkpoint.initial_load_path``), identically across
        layouts. HF weights: every rank reads the slices of its own shards."""
        cfg = self.config
        path = cfg.checkpoint.initial_load_path
        torch.manual_seed(cfg.debug.seed)
        if run_model.folder_changed and self.lora.base_from_folder:
            raise ValueError(
                f"{path}/config.json changed since this LoRA run started: its checkpoints in {cfg.dump_folder} "
                "hold the adapters only, and the frozen base they were trained on is read from that folder again on "
                "resume. Restore the folder the run started from, or start in a fresh --dump_folder"
            )
        if path and not run_model.folder_changed:  # changed: the resumed checkpoint holds the started model
            self._load_hf_weights(parts, run_model, path)
            return
        self._random_init(parts, parts)

    @torch.no_grad()
    def _random_init(self, all_parts: list[nn.Module], parts: list[nn.Module]) -> None:
        """Seeded random init of ``parts`` (of this rank's ``all_parts``)."""
        nbytes = sum(p.numel() * p.element_size() for part in all_parts for p in part.parameters())
        if nbytes <= _FULL_INIT_MAX_BYTES:
            full = self.config.model.build()
            full.init_weights()
            whole = full.state_dict()
            for part in parts:  # a pipeline stage takes its own entries of the whole model's
                keys = {unwrapped_name(k) for k in part.state_dict()}
                set_model_state_dict(part, {k: v for k, v in whole.items() if k in keys},
                                     options=StateDictOptions(full_state_dict=True))  # fmt: skip
                init_buffers(part)
        else:
            for part in parts:
                part.init_weights()

    def _load_hf_weights(self, parts: list[nn.Module], run_model: RunModel, path: str) -> None:
        """Every rank reads only the slices of the HF folder that its own shards cover (in parallel; no
        rank holds the whole model) and converts them per tensor (``hf.load.load_hf_weights``).

        A folder that does not fill every parameter (a text-only checkpoint for a model's image parts, no
        MTP weights) gets the seeded random init first, identical across layouts. Keys the model
        does not hold (``hf_passthrough``: e.g. a VQ decoder, a vision tower, MTP layers) stay as lazy
        references to the folder's files, read again by the export. A big folder can take long to read on
        a slow file system, so this phase runs under its own ``--comm.hf_load_timeout_seconds``, then the
        init timeout is restored.
        """
        spec, cfg = self.spec, self.config
        if spec.hf is None:
            raise NotImplementedError(f"model spec {spec.name!r} has no HF loader: drop --checkpoint.initial_load_path")
        if run_model.mtp_from_folder:  # the folder's MTP block must be there, not started afresh in silence
            check_mtp_tensors(spec, run_model.hf_config, path, cfg.model)
        distributed = dist.is_initialized() and self.parallel_dims.world_size > 1
        if distributed:
            set_pg_timeouts(cfg.comm.hf_load_timeout_seconds, self.parallel_dims.world_mesh)
        for part in parts:  # a pipeline stage reads its own layers only
            load_hf_weights(part, path, spec=spec, init_missing=lambda part=part: self._random_init(parts, [part]))
            # the folder holds the base; the adapters start as PEFT's, on any layout
            self.lora.init_adapters(part, cfg.debug.seed)
            init_buffers(part)
        if distributed:
            set_pg_timeouts(cfg.comm.init_timeout_seconds, self.parallel_dims.world_mesh)
        self.log(f"initialised from HF checkpoint {path}")


@torch.no_grad()
def init_buffers(model: nn.Module) -> None:
    """Recompute non-persistent buffers (RoPE tables, load counters) after ``to_empty``.

    A full state dict carries only persistent entries; parameter-free modules that own
    non-persistent buffers recompute them in ``init_own_weights``.
    """
    for module in model.modules():
        if module._non_persistent_buffers_set and not any(True for _ in module.parameters(recurse=False)):
            init = getattr(module, "init_own_weights", None)
            if callable(init):
                init()
