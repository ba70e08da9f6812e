"""Dry run at scale: validate and size any recipe on N simulated ranks, without GPUs.

    python -m hyper_parallel.dry_run --module glm_image_moe --config glm_image_moe_a3b_ep8 --world_size 32 \\
        [--device_memory_gib 80] [--full_depth] [--no_step] \\
        [any training override, e.g. --parallelism.tensor_parallel_degree 2]

What it does, in one process on CPU:

1. parses the run config like ``python -m hyper_parallel.train`` (``ConfigManager``: recipe, run file, overrides);
2. validates the layout with the Trainer's own checks (``ParallelDims.from_config`` and the model spec's
   layout check), so an invalid layout fails with the message a real run prints;
3. on a fake N-rank process group, builds the model on the meta device and applies the model's real
   parallelize path (CP, AC, TP, EP, FSDP2) as rank 0; every rank's parameter, gradient and optimizer
   bytes then follow exactly from the DTensor shards (``layout.py``);
4. simulates one training step of the rank with the most static memory under ``FakeTensorMode`` with
   ``FSDPMemTracker`` for the peak memory, logging every collective by mesh axis (``step.py``);
5. prints the per-rank table, the peak, the collectives, and whether it fits ``--device_memory_gib``
   (naming the knob that would help when it does not).

With ``--lora.rank`` the model is ``apply_lora`` of the resolved one and its base is frozen before parallelizing, as
in the Trainer: the census counts the frozen base once in the dtype it is stored in, with no gradient or optimizer
state, and the report adds a LoRA line (``lora_memory.py``).

With ``--parallelism.pipeline_parallel_degree P`` every pipeline rank group builds and parallelizes its own stage
models (``Decoder.restrict_to_stage`` of the trainer's split), the census counts each rank's own stage, every group's
step is simulated on its stages, and the report adds the per-stage table, the schedule's bubble and the p2p bytes
(``pipeline.py``); the advice can name a pipeline degree whose stages would fit.

Nothing here names a model: everything comes from the registered ``ModelSpec`` and the config.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Sequence

from torch._subclasses.fake_tensor import FakeTensorMode

from hyper_parallel.components.model_builder import resolve_model
from hyper_parallel.config.errors import ConfigError
from hyper_parallel.config.manager import ConfigManager
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.config.dtypes import to_torch_dtype
from hyper_parallel.dry_run.advice import fit_advice
from hyper_parallel.dry_run.deltanet import DeltaNetPath, describe_path, document_bounds, has_deltanet, with_path
from hyper_parallel.dry_run.deltanet import deltanet_path as deltanet_path_for
from hyper_parallel.dry_run.hf_memory import hf_io_memory
from hyper_parallel.dry_run.layout import ParamLayout, ShardCensus, optimizer_state_layout, param_layouts, rank_memory
from hyper_parallel.dry_run.lora_memory import lora_memory
from hyper_parallel.dry_run.pipeline import PipelinePlan, build_stage_parts, pipeline_plan, simulate_pipeline_rank
from hyper_parallel.dry_run.report import CommVolume, DryRunReport, format_report
from hyper_parallel.dry_run.simulation import SimulationMode
from hyper_parallel.dry_run.step import (
    LayerPlan,
    builds_at_depth,
    layer_plan,
    materialize_with_optimizer,
    micro_batches_per_step,
    model_config_at_depth,
    simulate_step,
)
from hyper_parallel.dry_run.world import MESH_DEVICE, axis_labels, build_parallel_model, fake_world, validate_layout
from hyper_parallel.hf.folder import folder_family
from hyper_parallel.protocols.model_spec import ModelSpec, discover_model_spec
from hyper_parallel.trainer import Trainer

__all__ = ["DEFAULT_DEVICE_MEMORY_GIB", "DryRunReport", "dry_run", "format_report", "main"]

DEFAULT_DEVICE_MEMORY_GIB = 80.0
"""H100/H200-class accelerator memory used for the fit verdict unless ``--device_memory_gib`` says otherwise."""

_USAGE = """\
python -m hyper_parallel.dry_run --module M --config R --world_size N [options] [training overrides]

dry-run options:
  --world_size N            ranks to simulate (required)
  --device_memory_gib G     accelerator memory for the fit verdict (default 80)
  --full_depth              simulate the step with every layer (default: scale two shallow copies per layer)
  --no_step                 only validate and size parameters, gradients and optimizer state
  --document_tokens N       pack each simulated micro-batch with N-token documents (default 0: one document);
                            the torch Gated DeltaNet path pads every document to 64-token chunks
  --deltanet_path P         auto (default: fla when CUDA and fla + causal-conv1d are installed here, else torch),
                            torch or fla: the Gated DeltaNet path whose memory the step models
"""


def dry_run(
    config: Trainer.Config,
    *,
    world_size: int,
    device_memory_gib: float = DEFAULT_DEVICE_MEMORY_GIB,
    simulate: bool = True,
    full_depth: bool = False,
    title: str = "",
    document_tokens: int = 0,
    deltanet_path: DeltaNetPath = "auto",
) -> DryRunReport:
    """Validate ``config``'s layout on ``world_size`` simulated ranks and size every rank.

    Raises the Trainer's ``ConfigError`` for an invalid layout. ``simulate=False`` skips the simulated step
    (no peak or collectives); ``full_depth`` simulates every layer instead of scaling two shallow copies.
    ``document_tokens``: the simulated micro-batches pack documents of that many tokens (0: one document);
    ``deltanet_path``: the Gated DeltaNet path whose memory the step models (``deltanet.py``; the report says which).
    """
    spec = discover_model_spec(config.model_spec)
    # the trainer's run model: an HF folder's (--checkpoint.initial_load_path) or the recipe's, the model its data
    # needs (GlmImageMoe: an image path), the LoRA adapters on top (the builder freezes the base)
    config, _ = resolve_model(spec, config, in_run=False)
    document_bounds(config.data.max_tokens_per_microbatch, document_tokens)  # checks the value
    path = None
    if has_deltanet(config.model):
        path = deltanet_path_for(deltanet_path, compute_dtype=config.training.mixed_precision_param,
                                 model_config=config.model)  # fmt: skip
    if path is not None:  # the fla path: the core's memory is fla's (a copy of the model config)
        config = dataclasses.replace(config, model=with_path(config.model, path))
    pd = ParallelDims.from_config(config.parallelism, world_size)
    validate_layout(spec, config, pd)
    layers = list(getattr(config.model, "layers", None) or [])
    plan = layer_plan(layers, full=full_depth, buildable=builds_at_depth(config))
    n_micro = micro_batches_per_step(config, pd)
    pipe = pipeline_plan(config, pd, n_micro) if pd.pp_enabled else None
    census, layouts = _static_census(spec, config, pd, plan, world_size, pipe)
    tc, ac = config.training, config.activation_checkpoint
    report = DryRunReport(
        title=title or config.model_spec,
        layout=str(pd),
        world_size=world_size,
        num_layers=len(layers),
        model_numel=census.model_numel,
        distinct_shard_numel=census.distinct_shard_numel,
        replicated_numel=census.replicated_numel,
        ranks=census.ranks,
        micro_batches_per_step=n_micro,
        tokens_per_micro_batch=config.data.max_tokens_per_microbatch,
        settings=(
            f"compute {tc.mixed_precision_param}, gradient reduce {tc.mixed_precision_reduce}, activation "
            f"checkpointing {ac.mode}, optimizer {config.optimizer.name}"
        ),
        device_memory_gib=device_memory_gib,
        notes=[
            ("micro-batches are text-only single documents" if not document_tokens else
             f"micro-batches are text-only, packed with {document_tokens}-token documents")
            + " (with MTP on: one document, one image per context-parallel piece where the model takes images); the "
            "trainer's scalar all-reduces (token count, loss, gradient norm, expert load) are not counted"
        ],
    )
    if path is not None:
        report.notes.append(describe_path(path, config.data.max_tokens_per_microbatch, document_tokens))
    if config.lora.enabled:
        report.lora = lora_memory(layouts, config.lora)
    report.hf_io = hf_io_memory(
        census, world_size=world_size,
        export_itemsize=to_torch_dtype(config.checkpoint.export_dtype, field="checkpoint.export_dtype").itemsize,
    )  # fmt: skip
    if config.compile.enable:
        report.notes.append("torch.compile is not simulated: the step ran eagerly (compiled kernels may need less)")
    if pipe is not None:
        report.pipeline = pipe
        if simulate:
            _simulate_pipeline(spec, config, pd, pipe, report, world_size, document_tokens)
    elif simulate:
        # Simulate the rank with the most static memory (ties: the lowest), e.g. the one with the most experts.
        rank = max(census.ranks, key=lambda m: (m.static, -m.rank)).rank
        with fake_world(world_size, rank=rank):
            pd.build_mesh(MESH_DEVICE)
            labels = axis_labels(pd)
            measured = simulate_step(spec, config, pd, plan, document_tokens=document_tokens)
        head = plan.head
        if plan.scaled and (plan.num_layers - head) % plan.period:
            report.notes.append(
                f"the layer stack repeats every {plan.period} layers after {head}, but {plan.num_layers - head} is "
                "not a multiple of it: the last partial period is scaled fractionally (approximate)"
            )
        report.simulated_rank = rank
        report.peak = measured.peak
        # FSDPMemTracker tracks FSDP's parameters only; parameters outside FSDP live through the whole step.
        outside = census.ranks[rank].outside_fsdp
        if outside and measured.fsdp_tracker:
            report.peak["Params outside FSDP"] = float(outside)
            report.peak["Total"] = report.peak.get("Total", 0.0) + outside
        report.depths = plan.depths
        report.comm = [
            CommVolume(kind, labels.get(group, f"group {group}"), size, calls, nbytes)
            for (kind, group, size), (calls, nbytes) in measured.comm.items()
        ]
    report.advice = fit_advice(report, config, pd)
    return report


def _simulate_pipeline(
    spec: ModelSpec, config: Trainer.Config, pd: ParallelDims, pipe: PipelinePlan, report: DryRunReport,
    world_size: int, document_tokens: int = 0,
) -> None:
    """Simulate every pipeline rank group's step as its fullest rank; the report's peak and collectives are those
    of the group with the highest estimated peak."""
    comm: dict[int, list[CommVolume]] = {}
    for group in pipe.ranks:
        rank = group.worst.rank
        with fake_world(world_size, rank=rank):
            pd.build_mesh(MESH_DEVICE)
            labels = axis_labels(pd)
            simulate_pipeline_rank(spec, config, pd, pipe, group.pp_rank, document_tokens)
        comm[group.pp_rank] = [
            CommVolume(kind, labels.get(name, f"group {name}"), size, calls, nbytes)
            for (kind, name, size), (calls, nbytes) in group.comm.items()
        ]
    pipe.method = (
        "simulated: every pp rank's stage models (restrict_to_stage) stepped one micro-batch at a time, all their "
        "layers, then the schedule's micro-batches in flight added"
    )
    top = max(pipe.ranks, key=lambda g: (g.peak, -g.pp_rank))
    report.simulated_rank = top.worst.rank
    report.depths = (sum(len(pipe.spans[s].layers) for s in top.stages),)
    buffers = top.recv_buffers - top.received
    report.peak = {"Step (one micro-batch at a time)": top.step_peak, "Pipeline receive buffers": buffers,
                   "Further micro-batches in flight": top.peak - top.step_peak - buffers, "Total": top.peak}  # fmt: skip
    report.notes.append(
        "pipeline stages after the first are simulated on fake hidden states of the boundary's shape; the schedule's "
        "own bookkeeping (besides its receive buffers) is not counted"
    )
    report.comm = comm[top.pp_rank]


def _static_census(
    spec: ModelSpec, config: Trainer.Config, pd: ParallelDims, plan: LayerPlan, world_size: int,
    pipe: PipelinePlan | None = None,
) -> tuple[ShardCensus, list[ParamLayout]]:
    """Every rank's parameter, gradient and optimizer bytes, from the model parallelized (on meta) as rank 0 (with
    pipeline parallel: every pp rank group's stage models, as a rank of that group); and the parameters' layouts."""
    groups: list[list[ParamLayout]] = []
    if pipe is not None:
        for group in pipe.ranks:
            with fake_world(world_size, rank=group.ranks.start), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
                pd.build_mesh(MESH_DEVICE)
                groups.append([p for part in build_stage_parts(spec, config, pd, pipe, group.pp_rank)
                               for p in param_layouts(part)])  # fmt: skip
    with fake_world(world_size, rank=0), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        pd.build_mesh(MESH_DEVICE)
        layouts = param_layouts(build_parallel_model(spec, config, pd)) if pipe is None else []
        # The optimizer's state layout per parameter, read after one real optimizer step on a fake copy; a deep
        # model steps its shallow copy (layers repeat, see LayerPlan) and deeper layers take their repeat's layout.
        model = build_parallel_model(spec, config, pd, model_config_at_depth(config, plan.depths[0]))
        with FakeTensorMode(allow_non_fake_inputs=True), SimulationMode():
            state = optimizer_state_layout(model, materialize_with_optimizer(model, config))
    if pipe is not None:
        return _pipeline_census(groups, pipe, plan, state, world_size)
    trainable = {p.fqn: plan.representative(p.fqn) for p in layouts if p.trainable}
    missing = [fqn for fqn, rep in trainable.items() if rep not in state]
    if missing:
        raise RuntimeError(f"the optimizer kept no state for the trainable parameters {missing[:4]}")
    return rank_memory(layouts, world_size, {fqn: state[rep] for fqn, rep in trainable.items()}), layouts


def _pipeline_census(
    groups: list[list[ParamLayout]], pipe: PipelinePlan, plan: LayerPlan, state: dict, world_size: int
) -> tuple[ShardCensus, list[ParamLayout]]:
    """The census of every pp rank group from its stage models' layouts: each global rank takes its own group's."""
    ranks = []
    model = distinct = largest = 0
    for group, layouts in zip(pipe.ranks, groups, strict=True):
        trainable = {p.fqn: plan.representative(p.fqn) for p in layouts if p.trainable}
        missing = [fqn for fqn, rep in trainable.items() if rep not in state]
        if missing:
            raise RuntimeError(f"the optimizer kept no state for the trainable parameters {missing[:4]}")
        census = rank_memory(layouts, world_size, {fqn: state[rep] for fqn, rep in trainable.items()})
        ranks += [census.ranks[r] for r in group.ranks]
        group.worst = max((census.ranks[r] for r in group.ranks), key=lambda m: (m.static, -m.rank))
        model += census.model_numel
        distinct += census.distinct_shard_numel
        largest = max(largest, census.largest_numel)
    census = ShardCensus(ranks=ranks, model_numel=model, distinct_shard_numel=distinct,
                         replicated_numel=sum(m.local_numel for m in ranks), largest_numel=largest)  # fmt: skip
    return census, [p for layouts in groups for p in layouts]


def _pop(args: list[str], name: str, *, flag: bool = False) -> str | None:
    for i, arg in enumerate(args):
        if arg == name:
            if flag:
                del args[i]
                return "true"
            if i + 1 >= len(args):
                raise ConfigError(f"{name} needs a value")
            value = args[i + 1]
            del args[i : i + 2]
            return value
        if not flag and arg.startswith(name + "="):
            del args[i]
            return arg.split("=", 1)[1]
    return None


def main(argv: Sequence[str] | None = None) -> DryRunReport:
    """Parse ``--world_size`` and friends plus the run config (as ``hyper_parallel.train`` does); print the report."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--help" in args or "-h" in args:
        print(_USAGE)
    world_size = _pop(args, "--world_size")
    memory = _pop(args, "--device_memory_gib")
    full_depth = _pop(args, "--full_depth", flag=True) is not None
    no_step = _pop(args, "--no_step", flag=True) is not None
    document_tokens = _pop(args, "--document_tokens")
    path = _pop(args, "--deltanet_path") or "auto"
    if document_tokens is not None and not document_tokens.isdigit():
        raise ConfigError(
            f"--document_tokens N (tokens per packed document, 0 = one per micro-batch); got {document_tokens!r}"
        )
    if path not in ("auto", "torch", "fla"):
        raise ConfigError(f"--deltanet_path must be auto, torch or fla; got {path!r}")
    manager = ConfigManager(folder_family=folder_family)  # the HF folder opened here, once
    config = manager.parse_args(args)
    if world_size is None or not world_size.isdigit() or int(world_size) < 1:
        raise ConfigError(f"--world_size N (the number of ranks to simulate, >= 1) is required; got {world_size!r}")
    try:
        budget = DEFAULT_DEVICE_MEMORY_GIB if memory is None else float(memory)
    except ValueError:
        raise ConfigError(f"--device_memory_gib must be a number of GiB, got {memory!r}") from None
    report = dry_run(
        config,
        world_size=int(world_size),
        device_memory_gib=budget,
        simulate=not no_step,
        full_depth=full_depth,
        title=f"{manager.module}.{manager.recipe}",
        document_tokens=int(document_tokens or 0),
        deltanet_path=path,  # type: ignore[arg-type]
    )
    print(format_report(report))
    return report
