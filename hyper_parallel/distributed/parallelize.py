"""The parallelisation pipeline every decoder model shares; a model's ``parallelize.py`` only supplies its
declared placements and model facts.

Order: CP -> TP/SP -> EP -> activation checkpointing -> compile -> FSDP2 (torchtitan's order).

Activation checkpointing swaps each chosen layer's class for one whose ``forward`` runs under
``torch.utils.checkpoint`` (``activation_checkpoint.py``): the layer's own hooks (TP input layouts, FSDP) stay
outside the recomputed region, so its place in the order no longer matters for correctness; it comes right
before compile, which captures each block's ``forward`` (checkpoint included) as one graph.

FSDP units: every decoder layer, the token embedding, the LM head, the root (which holds the rest, and
ignores frozen parameters). Parameters of a layer whose gradients differ across tp ranks are sharded over a
mesh that includes tp, so FSDP's SUM completes them; a compiled layer is ONE unit where they form param groups
(FSDP2's per-parameter mesh: no FSDP hook inside the block's graph), an eager one nests units for them: under
TP the replicated weights inside TP blocks (MLA's latent projections and norms: their activation gradients are
partial sums), and, as the MoE runs on the rank's sequence shard, the router, the routed experts and any other
plain MoE weight (a shared-expert gate). Statistics over a forward's tokens (the MoE aux loss) are summed over
the cp x tp ranks that split them (``token_split.py``). With EP the routed experts are sharded on dim 1 over
``efsdp``. A bf16 run gathers routers in bf16 like every weight of the layer (their master
copy stays fp32; ``Router.forward`` computes in fp32, as Megatron's fp32 router does) and stores frozen
parameters (a LoRA base) in bf16: no fp32 master copy, no gradient, no reduce-scatter for them.
Gradients are summed, not averaged, over data-parallel ranks (see ``fsdp.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from hyper_parallel import torch_features
from hyper_parallel.config.parallelism import ParallelismConfig
from hyper_parallel.config.training import ActivationCheckpointConfig, CompileConfig, TrainingConfig
from hyper_parallel.distributed.activation_checkpoint import apply_activation_checkpointing
from hyper_parallel.distributed.compile import apply_compile
from hyper_parallel.distributed.context_parallel import apply_context_parallel
from hyper_parallel.distributed.expert_parallel import apply_expert_parallel_dispatch
from hyper_parallel.distributed.fsdp import (
    cast_inputs_to_param_dtype,
    mixed_precision_policy,
    reshard_policy,
    set_prefetch,
    shard_module,
    store_frozen_in_param_dtype,
    tied_groups,
)
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.tensor_parallel import apply_sharding_configs
from hyper_parallel.distributed.token_split import apply_token_split
from hyper_parallel.protocols.sharding import MeshAxisName, ShardingConfig

__all__ = ["declared_shardings", "layout_shardings", "parallelize_decoder"]


def declared_shardings(config) -> dict[str, ShardingConfig]:
    """FQN -> ``sharding_config`` of every module config in ``config``'s tree that declares one."""
    out = {}
    for fqn, cfg, _, _ in config.traverse():
        sc = getattr(cfg, "sharding_config", None)
        if sc is not None:
            out[fqn] = sc
    return out


def layout_shardings(
    config: Any, set_sharding: Callable[..., Any], parallel_dims: ParallelDims
) -> dict[str, ShardingConfig]:
    """FQN -> placements that a model's ``set_sharding(config, loss_parallel=, enable_sp=, ep_degree=)``
    declares for this layout, checked against what ``config`` (the built model's) already carries."""
    declared = declared_shardings(
        set_sharding(
            config,
            loss_parallel=parallel_dims.loss_parallel_enabled,
            enable_sp=parallel_dims.sp_enabled,
            ep_degree=parallel_dims.ep,
        )
    )
    # A model built from an already-sharded config carries its placements in module.config; they must be
    # the ones this layout needs (a config sharded for another layout would silently mis-shard).
    carried = declared_shardings(config)
    if carried and carried != declared:
        differ = sorted(k for k in carried.keys() | declared.keys() if carried.get(k) != declared.get(k))
        raise ValueError(
            f"the model was built from a config sharded for another layout (first differences: {differ[:3]}): "
            f"build it from the unsharded config or from {set_sharding.__name__}(config, ...) with this run's "
            "parallelism"
        )
    return declared


def _is_partial_grad_region(sc: ShardingConfig) -> bool:
    # Modules declaring parameters count too (a region whose own per-head parameters are sharded); their
    # DTensor parameters are skipped below, only plain ones inside need the tp-wide reduction.
    grads = sc.local_map.in_grad_placements if sc.local_map is not None else None
    return any(
        isinstance(p, Partial)
        for named in (grads or ())
        if named
        for key, p in named.items()
        if str(key) == str(MeshAxisName.TP)
    )


def _tp_partial_param_modules(model: nn.Module, declared: Mapping[str, ShardingConfig]) -> list[nn.Module]:
    """Modules with plain (replicated) parameters inside a TP block whose activation gradients are partial."""
    out: list[nn.Module] = []
    for fqn, sc in declared.items():
        if not _is_partial_grad_region(sc):
            continue
        for sub in model.get_submodule(fqn).modules():
            own = list(sub.parameters(recurse=False))
            if own and not any(isinstance(p, DTensor) for p in own) and sub not in out:
                out.append(sub)
    return out


def _moe_token_shard_modules(moe: nn.Module, skip: Iterable[nn.Module | None]) -> list[nn.Module]:
    """Modules of an MoE (which runs on the rank's sequence shard under TP) with plain parameters, other than
    ``skip``: their gradients cover this rank's tokens only, so they reduce over a mesh that includes tp."""
    skipped = {id(m) for s in skip if s is not None for m in s.modules()}
    return [
        m
        for m in moe.modules()
        if id(m) not in skipped
        and (own := list(m.parameters(recurse=False)))
        and not any(isinstance(p, DTensor) for p in own)
    ]


def _layer_param_meshes(
    layer: nn.Module, pd: ParallelDims, *, tp_partial: set[int], separate_moe: bool
) -> dict[nn.Parameter, tuple[DeviceMesh, int]]:
    """The parameters of ``layer`` that FSDP shards over another mesh than the dense one, with (mesh, shard dim).

    Under TP: plain weights inside TP blocks whose activation gradients are partial (``tp_partial``), and the
    MoE's router and other plain weights (it runs on the rank's sequence shard), on a mesh including tp. Under
    EP or TP: the routed experts on ``efsdp`` (dim 1 under EP: dim 0 is the expert-parallel shard). The router
    has no unit of its own: it computes in fp32 from its weight whatever the unit's compute dtype
    (``Router.forward`` upcasts; its master copy stays fp32, as every trainable weight's)."""
    out: dict[nn.Parameter, tuple[DeviceMesh, int]] = {}

    def put(params: Iterable[nn.Parameter], mesh: DeviceMesh, dim: int = 0) -> None:
        for p in params:
            out.setdefault(p, (mesh, dim))  # the first claim wins, as the first nested unit did

    with_tp = pd.fsdp_mesh_with_tp() if pd.tp_enabled else None
    if with_tp is not None:
        put((p for m in layer.modules() if id(m) in tp_partial for p in m.parameters(recurse=False)), with_tp)
    moe = getattr(layer, "mlp", None)
    if moe is not None and hasattr(moe, "experts"):
        router = getattr(moe, "gate", None)
        if with_tp is not None:
            if router is not None:
                put(router.parameters(), with_tp)
            # e.g. a shared-expert gate: plain weights that see only this rank's tokens
            local = _moe_token_shard_modules(moe, skip=(router, moe.experts))
            put((p for m in local for p in m.parameters(recurse=False)), with_tp)
        if separate_moe:
            put(moe.experts.parameters(), pd.efsdp_mesh(), 1 if pd.ep_enabled else 0)
    dense = pd.fsdp_mesh()
    return {p: where for p, where in out.items() if where != (dense, 0)}


def _group_by_mesh(
    meshes: Mapping[nn.Parameter, tuple[DeviceMesh, int]],
) -> list[tuple[tuple[DeviceMesh, int], list[nn.Parameter]]]:
    groups: dict[tuple[int, int], tuple[tuple[DeviceMesh, int], list[nn.Parameter]]] = {}
    for p, (mesh, dim) in meshes.items():
        groups.setdefault((id(mesh), dim), ((mesh, dim), []))[1].append(p)
    return list(groups.values())


def _owners(layer: nn.Module, params: list[nn.Parameter]) -> list[nn.Module]:
    """The smallest modules of ``layer`` whose parameters are exactly among ``params`` (a nested FSDP unit)."""
    wanted = {id(p) for p in params}
    owners: list[nn.Module] = []
    covered: set[int] = set()
    for m in layer.modules():
        own = [id(p) for p in m.parameters()]
        if own and set(own) <= wanted and not set(own) <= covered:
            owners.append(m)
            covered.update(own)
    return owners


def _check_sequence_hook(parallel_dims: ParallelDims):
    tp = parallel_dims.tp

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = args[0] if args else kwargs.get("input_ids")
        if input_ids is not None and input_ids.is_floating_point():
            return  # a later pipeline stage: the hidden states arrive already cut (stage 0 checked the ids)
        if input_ids is not None and input_ids.shape[-1] % tp:
            raise ValueError(
                f"sequence parallel splits each row over tensor_parallel_degree={tp} ranks, but the (per "
                f"context-parallel rank) sequence length is {input_ids.shape[-1]}: pad batches to a multiple of "
                f"context_parallel_degree x tensor_parallel_degree = {parallel_dims.cp * tp}"
            )

    return hook


def parallelize_decoder(
    model: nn.Module,
    *,
    declared: Mapping[str, ShardingConfig],
    parallel_dims: ParallelDims,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    ac_config: ActivationCheckpointConfig,
    compile_config: CompileConfig,
    layers: Iterable[nn.Module],
    embeddings: Iterable[nn.Module] = (),
    head: Iterable[nn.Module] = (),
    ignored_params: Iterable[nn.Parameter] = (),
    cast_input_modules: Iterable[nn.Module] = (),
) -> nn.Module:
    """Apply CP, AC, TP/SP, EP, compile and FSDP2 to ``model`` in place (it may live on the meta device).

    ``declared`` maps module FQN -> ``ShardingConfig`` (from the model's ``sharding.py``). ``layers`` are
    the decoder layers (AC/compile/FSDP units); MoE layers are found by their ``experts`` child.
    ``embeddings`` and ``head`` are FSDP units each (every rank must call them in every forward).
    ``cast_input_modules`` (inside a bigger unit) get FSDP's mixed-precision input cast.
    ``ignored_params`` stay whole on every rank, outside FSDP (frozen parameters). Other frozen parameters (a
    LoRA base) are FSDP-sharded and stored in the compute dtype (``store_frozen_in_param_dtype``).
    """
    pd = parallel_dims
    # A pipeline stage holds a part of the model: the parts it does not hold are None, and their declared
    # placements go (the kept layers keep their FQNs, so the rest of the declarations apply unchanged).
    layers = [m for m in layers if m is not None]
    embeddings = [m for m in embeddings if m is not None]
    head = [m for m in head if m is not None]
    cast_input_modules = [m for m in cast_input_modules if m is not None]
    ignored_params = list(ignored_params)
    if getattr(model, "pipeline_stage", None) is not None:
        held = {name for name, _ in model.named_modules()}
        declared = {fqn: sc for fqn, sc in declared.items() if fqn in held}

    # 1. context parallel around every sequence core: Ulysses all-to-all over heads where they divide, else
    # K/V all-gather (attention) or state passing (Gated DeltaNet); chosen per core and logged
    if pd.cp_enabled:
        apply_context_parallel(model, pd.mesh("cp"), tp=pd.tp, hybrid=pd.cp_hybrid_meshes())

    # statistics over a forward's tokens (the MoE aux loss's) sum over the ranks that split them: cp x tp
    apply_token_split(model, pd)

    # 2. tensor / sequence parallel
    if pd.tp_enabled:
        apply_sharding_configs(model, pd, MeshAxisName.TP, declared)
        if pd.sp_enabled:
            model.register_forward_pre_hook(_check_sequence_hook(pd), with_kwargs=True)

    # 3. expert parallel
    if pd.ep_enabled:
        sharded = apply_sharding_configs(model, pd, MeshAxisName.EP, declared)
        # (a pipeline stage may hold dense layers only; the layout check saw the whole model's experts)
        if not sharded and getattr(model, "pipeline_stage", None) is None:
            raise ValueError("expert_parallel_degree > 1 but the model declares no expert-parallel placements")
        apply_expert_parallel_dispatch(model, pd.mesh("ep"))

    # frozen weights (a LoRA base) are stored in the compute dtype: no fp32 master copy (routers keep fp32)
    mp = mixed_precision_policy(training)
    routers = [m.mlp.gate for m in layers if hasattr(getattr(m, "mlp", None), "experts") and hasattr(m.mlp, "gate")]
    store_frozen_in_param_dtype(model, mp, keep=routers, ignored=ignored_params)

    # 4. activation checkpointing (a class swap: the layers' forward runs under torch.utils.checkpoint, hooks
    # stay outside it) and compile (one graph per block kind), then FSDP: torchtitan's AC -> compile -> FSDP
    apply_activation_checkpointing(layers, ac_config)
    apply_compile(layers, compile_config)

    # 5. FSDP2 / HSDP
    reshard = reshard_policy(parallelism.fsdp_reshard_after_forward, pipeline=pd.pp_enabled)
    dense_mesh = pd.fsdp_mesh()
    # Parameters whose gradients differ across tp ranks reduce over a mesh that includes tp: replicated
    # weights inside TP blocks (partial activation gradients) and, as the MoE runs on the rank's sequence
    # shard, the router and the routed experts (``_layer_param_meshes``).
    tp_partial = {id(m) for m in _tp_partial_param_modules(model, declared)} if pd.tp_enabled else set()
    separate_moe = pd.ep_enabled or pd.tp_enabled
    # Tied embedding and head share one parameter: one FSDP unit for both, sharded where the head is.
    units = tied_groups([*embeddings, *head])
    head_units = [u for u in units if any(m in head for m in u)]
    for unit in units:
        if unit not in head_units:
            shard_module(unit if len(unit) > 1 else unit[0], dense_mesh, mp_policy=mp, reshard_after_forward=reshard)
    for module in cast_input_modules:
        cast_inputs_to_param_dtype(module, mp)
    # A compiled block is ONE unit (no FSDP hooks inside its graph): parameters reducing over another mesh
    # (experts on efsdp, tp-reduced weights) are param groups of it. Eager blocks keep nested units: the same
    # collectives, and torch's FSDPMemTracker (the dry run) knows one param group per unit only.
    one_unit = compile_config.enable and torch_features.has("fsdp_per_param_mesh")
    for layer in layers:
        meshes = _layer_param_meshes(layer, pd, tp_partial=tp_partial, separate_moe=separate_moe)
        if one_unit or not meshes:
            shard_module(layer, dense_mesh, mp_policy=mp, reshard_after_forward=reshard, param_meshes=meshes)
            continue
        # nested units (under compile only with a torch without per-parameter meshes: the block then breaks
        # its graph at their hooks)
        for (mesh, shard_dim), params in _group_by_mesh(meshes):
            shard_module(_owners(layer, params), mesh, mp_policy=mp, reshard_after_forward=reshard, shard_dim=shard_dim)
        shard_module(layer, dense_mesh, mp_policy=mp, reshard_after_forward=reshard)
    for unit in head_units:
        shard_module(unit if len(unit) > 1 else unit[0], dense_mesh, mp_policy=mp, reshard_after_forward=reshard)
    shard_module(model, dense_mesh, mp_policy=mp, reshard_after_forward=reshard, ignored_params=list(ignored_params))
    set_prefetch(_prefetch_chain(model, layers))
    return model


def _prefetch_chain(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """The FSDP units every forward runs in this order: the token embedding, the decoder's own layers (not a
    vision tower's, which runs only with images, nor the MTP block's), the LM head. A tied embedding and head
    (one unit, run first and last) stay out of it."""
    held = {id(m) for m in layers}
    chain = [m for m in getattr(model, "layers", ()) if id(m) in held]
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    tied = embed is not None and head is not None and any(p is q for p in embed.parameters() for q in head.parameters())
    if chain and not tied:
        chain = [*([embed] if embed is not None else []), *chain, *([head] if head is not None else [])]
    return chain
