"""What every rank holds: parameter, gradient and optimizer-state bytes from the parallelized model's shards.

The model is parallelized once, as one rank; every parameter is then a DTensor whose mesh and
placements define the local shard of *every* rank (``compute_local_shape``), so one process sizes all
N ranks exactly:

- **parameters**: FSDP2 stores each rank's shard padded to the largest shard of its unit
  (``padded_sharded_param_size``); non-FSDP parameters (a frozen codebook FSDP ignores) are whole.
- **gradients**: FSDP2 keeps each sharded gradient as a view of its padded reduce-scatter output, in
  the parameter's dtype: the padded shard again, for trainable parameters only.
- **optimizer state**: read from the real optimizer after one step on the fake model: a state tensor
  shaped like its parameter costs its element size per local element, any other (``step``) its bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

__all__ = [
    "OptimizerStateLayout", "ParamLayout", "RankMemory", "ShardCensus", "optimizer_state_layout", "param_layouts",
    "rank_memory",
]


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """How one parameter is spread over the ranks."""

    fqn: str
    shape: tuple[int, ...]
    """Global shape."""
    itemsize: int
    trainable: bool
    mesh: DeviceMesh | None
    """The DTensor's mesh; None for a plain parameter (whole on every rank)."""
    placements: tuple = ()
    padded_local_numel: int | None = None
    """Numel of the padded FSDP shard every rank of the unit allocates (None outside FSDP)."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class OptimizerStateLayout:
    """Optimizer state of one parameter: bytes per local element, plus fixed bytes (step counters)."""

    bytes_per_element: int = 0
    fixed_bytes: int = 0


@dataclass(slots=True)
class RankMemory:
    """Static memory of one rank, in bytes."""

    rank: int
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    local_numel: int = 0
    """Unpadded parameter elements this rank holds (its shards of every parameter)."""
    outside_fsdp: int = 0
    """Part of ``params`` FSDP does not manage (ignored parameters such as a frozen codebook)."""
    local_bytes: int = 0
    """Unpadded bytes of this rank's shards (what an HF load reads for it)."""
    largest_local: int = 0
    """Bytes of this rank's largest shard of one parameter."""
    frozen_params: int = 0
    """Part of ``params`` that trains nothing (a LoRA base, a frozen codebook): no gradient, no optimizer state."""

    @property
    def static(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(slots=True)
class ShardCensus:
    """Per-rank memory of all ranks and the check that the distinct shards tile the model."""

    ranks: list[RankMemory]
    model_numel: int
    distinct_shard_numel: int
    """Sum over parameters of the elements of every distinct shard (each counted once, whoever holds it)."""
    replicated_numel: int = field(default=0)
    """Sum over ranks of the local elements: ``distinct_shard_numel`` times the average replication."""
    largest_numel: int = field(default=0)
    """Elements of the largest parameter (an export gathers one whole parameter at a time)."""


def _fsdp_padded_numels(model: nn.Module) -> dict[int, int]:
    """id(sharded parameter) -> numel of the padded shard FSDP2 allocates for it on every rank."""
    out: dict[int, int] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        # a unit has several param groups with per-parameter meshes (experts on efsdp inside a layer's unit)
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # older torch: one group at most
            groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        for fsdp_param in (p for group in groups for p in group.fsdp_params):
            out[id(fsdp_param.sharded_param)] = fsdp_param.padded_sharded_param_size.numel()
    return out


def param_layouts(model: nn.Module) -> list[ParamLayout]:
    """Layouts of every parameter of a parallelized model (meta or fake tensors are fine)."""
    padded = _fsdp_padded_numels(model)
    out = []
    for fqn, p in model.named_parameters():
        is_dt = isinstance(p, DTensor)
        out.append(
            ParamLayout(
                fqn=fqn,
                shape=tuple(p.shape),
                itemsize=p.element_size(),
                trainable=p.requires_grad,
                mesh=p.device_mesh if is_dt else None,
                placements=tuple(p.placements) if is_dt else (),
                padded_local_numel=padded.get(id(p)),
            )
        )
    return out


def _coordinates(mesh: DeviceMesh, world_size: int) -> list[tuple[int, ...]]:
    """Coordinate of every global rank inside its own slice of ``mesh`` (all slices share the layout)."""
    # [slices, *mesh.shape] tensor of global ranks: every view of the world mesh, including the slices
    # this rank is not part of (DeviceMesh.mesh only shows this rank's slice).
    full = mesh._layout.remap_to_tensor(mesh._rank_map)
    coords: list[tuple[int, ...] | None] = [None] * world_size
    for flat, rank in enumerate(full.reshape(-1).tolist()):
        idx, rest = [], flat
        for size in reversed(full.shape[1:]):
            idx.append(rest % size)
            rest //= size
        coords[rank] = tuple(reversed(idx))
    missing = [r for r, c in enumerate(coords) if c is None]
    if missing:
        raise RuntimeError(f"mesh {mesh} does not cover ranks {missing[:8]} of the {world_size}-rank world")
    return coords  # type: ignore[return-value]


def _local_shards(
    layout: ParamLayout,
    coords: Sequence[tuple[int, ...]],
    cache: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]],
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(local shape, global offset) of every rank's shard of ``layout`` (``cache`` is shared across parameters)."""
    out = []
    for coord in coords:
        key = (layout.shape, tuple(layout.mesh.shape), layout.placements, coord)
        if key not in cache:
            shape, offset = _compute_local_shape_and_global_offset(
                layout.shape, tuple(layout.mesh.shape), list(coord), layout.placements
            )
            cache[key] = (tuple(shape), tuple(offset))
        out.append(cache[key])
    return out


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def rank_memory(
    layouts: Sequence[ParamLayout],
    world_size: int,
    optimizer: dict[str, OptimizerStateLayout] | None = None,
) -> ShardCensus:
    """Parameter/gradient/optimizer bytes of every rank, and the distinct-shard census."""
    optimizer = optimizer or {}
    ranks = [RankMemory(rank=r) for r in range(world_size)]
    coords_by_mesh: dict[DeviceMesh, list[tuple[int, ...]]] = {}
    shard_cache: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    distinct = 0
    for layout in layouts:
        if layout.mesh is None:
            local = [(layout.shape, (0,) * len(layout.shape))] * world_size
        else:
            if layout.mesh not in coords_by_mesh:
                coords_by_mesh[layout.mesh] = _coordinates(layout.mesh, world_size)
            local = _local_shards(layout, coords_by_mesh[layout.mesh], shard_cache)
        distinct += sum(_numel(shape) for shape, _ in set(local))
        state = optimizer.get(layout.fqn, OptimizerStateLayout())
        for mem, (shape, _) in zip(ranks, local):
            n = _numel(shape)
            stored = layout.padded_local_numel if layout.padded_local_numel is not None else n
            mem.local_numel += n
            mem.local_bytes += n * layout.itemsize
            mem.largest_local = max(mem.largest_local, n * layout.itemsize)
            mem.params += stored * layout.itemsize
            if layout.padded_local_numel is None:
                mem.outside_fsdp += n * layout.itemsize
            if layout.trainable:
                mem.grads += stored * layout.itemsize
            else:
                mem.frozen_params += stored * layout.itemsize
            mem.optimizer += n * state.bytes_per_element + state.fixed_bytes
    return ShardCensus(
        ranks=ranks,
        model_numel=sum(layout.numel for layout in layouts),
        distinct_shard_numel=distinct,
        replicated_numel=sum(m.local_numel for m in ranks),
        largest_numel=max((layout.numel for layout in layouts), default=0),
    )


def optimizer_state_layout(
    model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]
) -> dict[str, OptimizerStateLayout]:
    """FQN -> state layout, read from optimizers that have stepped once (their state exists)."""
    states: dict[int, dict] = {}
    for opt in optimizers:
        for p, st in opt.state.items():
            states[id(p)] = st
    out: dict[str, OptimizerStateLayout] = {}
    for fqn, p in model.named_parameters():
        st = states.get(id(p))
        if not st:
            continue
        per_element = fixed = 0
        for value in st.values():
            if not isinstance(value, torch.Tensor):
                continue
            if tuple(value.shape) == tuple(p.shape) and value.numel() > 1:
                per_element += value.element_size()
            else:
                local = value.to_local() if isinstance(value, DTensor) else value
                fixed += local.numel() * local.element_size()
        out[fqn] = OptimizerStateLayout(per_element, fixed)
    return out
