"""FSDP2 / HSDP helpers shared by every model's ``parallelize.py``.

Gradient reduction SUMS over the data-parallel ranks (divide factor 1): the loss of each rank is
``sum of its token losses / global token count`` (``components/loss.py``, ``data/loss.py``), so the
sum over ranks is exactly the global token mean. Expert weights reduce over their own mesh
(``efsdp``), whose ranks together with the expert all-to-all cover the same data: with SUM there is
no per-mesh factor to get wrong. The SUM is forced for the collectives too (``set_force_sum_reduction_for_comms``:
no AVG / pre-multiplied sum, which gloo lacks, and no division to undo).

Gradients reduce in fp32 by default (``--training.mixed_precision_reduce``), also under bf16 parameters, as
torchtitan does: FSDP casts each bf16 gradient to fp32 before the reduce-scatter, so the sum over ranks keeps
fp32's mantissa. Explicit prefetch (``set_prefetch``) chains the units every forward runs in order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from hyper_parallel import torch_features
from hyper_parallel.config.dtypes import TORCH_DTYPE_MAP
from hyper_parallel.config.errors import ConfigError
from hyper_parallel.config.training import TrainingConfig

__all__ = [
    "cast_inputs_to_param_dtype",
    "mixed_precision_policy",
    "reshard_policy",
    "set_gradient_reduction",
    "set_prefetch",
    "shard_module",
    "store_frozen_in_param_dtype",
    "sum_gradients",
    "tied_groups",
]


def mixed_precision_policy(training: TrainingConfig) -> MixedPrecisionPolicy:
    """FSDP2 mixed precision from ``--training.mixed_precision_param/_reduce``."""
    return MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
    )


def reshard_policy(mode: Literal["default", "always", "never"], *, pipeline: bool = False) -> bool | None:
    """``--parallelism.fsdp_reshard_after_forward`` -> ``fully_shard(reshard_after_forward=...)``.

    Under pipeline parallel ``default`` keeps the parameters unsharded between a stage's forwards and backwards
    (torchtitan's default): its micro-batches interleave, so resharding would all-gather every unit again for
    each; and the zero-bubble schedules compute weight gradients against the parameters the forward used."""
    if pipeline and mode == "default":
        return False
    return {"default": None, "always": True, "never": False}[mode]


def sum_gradients(module: FSDPModule) -> None:
    """Make ``module``'s gradient reduction a plain SUM over every parameter, used or not.

    Plain SUM (no averaging, no premultiplied sum) is also what gloo supports. Unused parameters are
    reduced as zeros: ranks legitimately skip parameters (a batch without images never touches
    an image projection), and otherwise their reduce-scatters would differ in size across ranks.
    """
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)
    if torch_features.has("fsdp_unused_params"):
        module.set_reduce_scatter_unused_params(True, recurse=False)
        return
    shard_ranks = module._get_fsdp_state()._fsdp_param_group.mesh_info.shard_mesh_size if _has_group(module) else 1
    if shard_ranks > 1:
        raise ConfigError(
            f"torch {torch.__version__} has no FSDPModule.set_reduce_scatter_unused_params, so a rank whose "
            f"micro-batch leaves a parameter unused would hang the gradient reduce-scatter of its {shard_ranks}-rank "
            "FSDP group; install torch >= 2.13 (pip install torch==2.13.0) or run one rank per FSDP group "
            "(--parallelism.data_parallel_shard_degree 1)"
        )


def _has_group(module: FSDPModule) -> bool:
    """Whether ``module`` manages parameters itself (a root without direct parameters has no group)."""
    return module._get_fsdp_state()._fsdp_param_group is not None


def shard_module(
    module: nn.Module | Sequence[nn.Module],
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
    shard_dim: int = 0,
    param_meshes: Mapping[nn.Parameter, tuple[DeviceMesh, int]] | None = None,
) -> FSDPModule | list[FSDPModule]:
    """``fully_shard`` with SUM gradient reduction; ``shard_dim`` != 0 shards every parameter on that dim.

    A list of modules becomes one FSDP unit (one all-gather and one reduce-scatter for all of them).

    A 2-D ``mesh`` (``dp_replicate x shard``) is HSDP: replicated over the first axis, sharded over the second.

    ``param_meshes``: parameters sharded over another mesh (and dim) than ``mesh`` inside this same unit (FSDP2's
    per-parameter mesh, ``torch_features.has("fsdp_per_param_mesh")``): each mesh becomes a param group of the
    unit with its own all-gather and reduce-scatter, but the unit has ONE set of hooks, so no FSDP hook runs
    inside a compiled block (routed experts on ``efsdp``, tp-reduced weights on a mesh including tp).
    """
    placement_fn = None
    if param_meshes:
        placement_fn = _per_param_placement(mesh, shard_dim, param_meshes)
    elif shard_dim != 0:

        def placement_fn(param: nn.Parameter) -> Shard:
            return Shard(shard_dim) if param.ndim > shard_dim else Shard(0)

    ignored = set(ignored_params) if ignored_params is not None else None
    fsdp_module = fully_shard(
        module,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=placement_fn,
        mp_policy=mp_policy,
        ignored_params=ignored,
    )
    # A list of modules forms one FSDP unit whose state the first module holds.
    sum_gradients(fsdp_module[0] if isinstance(fsdp_module, (list, tuple)) else fsdp_module)
    return fsdp_module


def _per_param_placement(
    mesh: DeviceMesh, shard_dim: int, param_meshes: Mapping[nn.Parameter, tuple[DeviceMesh, int]]
) -> Callable[[nn.Parameter], object]:
    """A ``shard_placement_fn`` giving each parameter its (mesh, dim): ``param_meshes``, else (``mesh``, ``shard_dim``).

    FSDP2 groups parameters by process group and wants ONE mesh-info object per group: every result, the
    default mesh's included, carries a mesh info made here once per mesh."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    infos: dict[int, object] = {}

    def info(m: DeviceMesh) -> object:
        if id(m) not in infos:
            infos[id(m)] = _get_mesh_info(m)
        return infos[id(m)]

    by_id = {id(p): where for p, where in param_meshes.items()}

    def placement_fn(param: nn.Parameter) -> ShardPlacementResult:
        m, dim = by_id.get(id(param), (mesh, shard_dim))
        return ShardPlacementResult(placement=Shard(dim) if param.ndim > dim else Shard(0), mesh_info=info(m))

    return placement_fn


def tied_groups(modules: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """``modules`` grouped so that modules sharing a parameter (tied embedding and LM head) are in one group.

    Each group becomes ONE FSDP unit: a parameter can belong to one unit only, and FSDP2 keeps a parameter
    that several modules of a unit hold as one sharded parameter (gathered once, gradients accumulated from
    every use before the reduce-scatter). Groups keep the order of their first module.
    """
    groups: list[tuple[set[int], list[nn.Module]]] = []  # (ids of the group's parameters, its modules)
    for module in modules:
        ids = {id(p) for p in module.parameters()}
        touching = [i for i, (group_ids, _) in enumerate(groups) if group_ids & ids]
        if not touching:
            groups.append((ids, [module]))
            continue
        first = touching[0]
        for i in touching[1:]:  # a module tying two earlier groups merges them
            groups[first][0].update(groups[i][0])
            groups[first][1].extend(groups[i][1])
        groups[first][0].update(ids)
        groups[first][1].append(module)
        groups = [g for i, g in enumerate(groups) if i not in touching[1:]]
    return [members for _, members in groups]


def store_frozen_in_param_dtype(
    model: nn.Module,
    policy: MixedPrecisionPolicy,
    *,
    keep: Iterable[nn.Module] = (),
    ignored: Iterable[nn.Parameter] = (),
) -> int:
    """Store every frozen parameter (``requires_grad=False``) of ``model`` in ``policy.param_dtype``; returns
    how many were cast.

    A frozen weight (a LoRA base, a frozen tower) is never updated, so the fp32 master copy mixed precision
    keeps for trainable weights would only double its memory: it is stored in the compute dtype, FSDP shards
    and gathers it as it is (no cast), and it has no gradient, no reduce-scatter and no optimizer state.
    FSDP2 allows frozen and trainable parameters of different dtypes in one unit (only the trainable ones must
    share a dtype). Call before ``fully_shard`` (on meta or materialised parameters, DTensors or plain).
    ``keep``: modules computing in fp32 whatever the policy (routers), ``ignored``: FSDP-ignored parameters
    (kept whole, in their own dtype). A parameter held by several modules (tied) stays one parameter.
    """
    dtype = policy.param_dtype
    if dtype is None or dtype == torch.float32:
        return 0
    skip = {id(p) for m in keep for p in m.parameters()} | {id(p) for p in ignored}
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.requires_grad or id(param) in skip or not param.is_floating_point() or param.dtype == dtype:
                continue
            new = done.get(id(param))
            if new is None:
                new = done[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
            module.register_parameter(name, new)
    return len(done)


def cast_inputs_to_param_dtype(module: nn.Module, policy: MixedPrecisionPolicy) -> None:
    """Cast ``module``'s floating-point inputs to ``policy.param_dtype``, as FSDP does for its own units.

    For a module inside a bigger FSDP unit whose input is computed from an FSDP-ignored parameter: that
    parameter keeps its full precision, while the module's weights are gathered in the compute dtype.
    """
    dtype = policy.param_dtype
    if dtype is None or dtype == torch.float32:
        return

    def cast(mod: nn.Module, args: tuple) -> tuple:
        return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    module.register_forward_pre_hook(cast)


def set_gradient_reduction(model: nn.Module, *, last: bool, defer: bool, replicated: bool) -> None:
    """FSDP gradient reduction for one micro-batch of a step (no-op for a model without FSDP).

    Default: reduce-scatter after every micro-batch, so gradients stay sharded between micro-batches
    (deferring keeps a full unsharded fp32 gradient on every rank: ~120 GB for a 30B model); with a
    replicate axis (HSDP, ``replicated``) only the all-reduce across replicas waits for the last one.
    ``defer`` (``--training.defer_grad_reduce``) holds both back until the last micro-batch: fewer
    collectives, full-size gradients (small models).
    """
    sync = getattr(model, "set_requires_gradient_sync", None)
    if not callable(sync):
        return
    if defer:
        sync(last)
        return
    sync(True)
    all_reduce = getattr(model, "set_requires_all_reduce", None)
    if replicated and callable(all_reduce):
        all_reduce(last)


def _units_of(module: nn.Module) -> list[FSDPModule]:
    """The FSDP units inside ``module`` (itself first, then nested ones), one module per unit."""
    out, seen = [], set()
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        if id(state) in seen or not _param_groups(state):
            continue  # a unit of several modules is listed once; a unit without parameters gathers nothing
        seen.add(id(state))
        out.append(m)
    return out


def _param_groups(state) -> list:
    """A unit's parameter groups (several with per-parameter meshes; torch < 2.13 has the one group only)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def set_prefetch(chain: Sequence[nn.Module]) -> int:
    """Explicit FSDP prefetch along ``chain``: modules whose units run in this order in every forward (the
    token embedding, the decoder layers, the LM head). Returns how many units got a prefetch.

    Forward: as soon as a unit's parameters are gathered it issues the all-gather of the next module's units
    (the module's own and any nested one, e.g. experts on their own mesh). FSDP's implicit overlap issues that
    all-gather only when the CPU reaches the next module; a host sync in between (expert parallel's split
    sizes) would leave the link idle until then. Backward: each unit gathers the previous module's units
    (what FSDP's reverse post-forward order does implicitly, named explicitly as torchtitan does, nested units
    included). One module ahead: at most one extra unit's parameters live at a time.

    Every module of ``chain`` must run in every forward, in this order (a prefetched unit that never runs
    would keep its gathered parameters until the step ends); modules that are not FSDP units are skipped.
    """
    units = [u for u in (_units_of(m) for m in chain) if u]
    for i, own in enumerate(units):
        if i + 1 < len(units):
            own[0].set_modules_to_forward_prefetch(units[i + 1])
        if i > 0:
            own[0].set_modules_to_backward_prefetch(units[i - 1])
    return len(units) if len(units) > 1 else 0
