"""A simulated N-rank world in one process, and the run's model parallelized on it exactly as the Trainer does."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch import nn

from hyper_parallel.components.model_builder import ModelBuilder, validate_model_layout
from hyper_parallel.distributed.env import destroy_distributed
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.protocols.model_spec import ModelSpec
from hyper_parallel.trainer import Trainer

__all__ = ["MESH_DEVICE", "axis_labels", "build_parallel_model", "fake_world", "validate_layout"]

MESH_DEVICE = "cpu"
"""Device type of the simulated mesh: the fake backend moves nothing, so any device type would do."""


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """A default process group of ``world_size`` ranks on torch's ``fake`` backend, as ``rank``.

    On exit every group of the world is destroyed, those of the meshes built in it included.
    """
    # torch's fake process group (a test utility, but the supported way to simulate a world: torchtitan's
    # memory estimator uses it too); importing it registers the "fake" backend.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "the dry run needs its own (fake) default process group, but one is already initialized: "
            "run it in a process without torch.distributed set up (not under torchrun)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        destroy_distributed()


def validate_layout(spec: ModelSpec, config: Trainer.Config, parallel_dims: ParallelDims) -> None:
    """The Trainer's own model-layout check, so a dry run fails with the message a real run would print."""
    validate_model_layout(spec, config.model, parallel_dims)


def build_parallel_model(
    spec: ModelSpec, config: Trainer.Config, parallel_dims: ParallelDims, model_config: Any = None
) -> nn.Module:
    """``model_config`` (default: the run's) built and parallelized by the trainer's ``ModelBuilder`` (meta, LoRA base
    frozen, the run's parallelize path), as one whole model even under pipeline parallel (``pipeline.py`` builds the
    stages).

    ``torch.compile`` is left out: the simulated step runs eagerly (compiled kernels may use less memory). With LoRA
    on, the frozen base is stored in the compute dtype and the census counts no gradient or optimizer state for it.
    """
    return ModelBuilder(spec, config, parallel_dims).build(model_config, compile=False, stages=False).parts[0]


def axis_labels(parallel_dims: ParallelDims) -> dict[str, str]:
    """Process-group name -> the mesh axes it serves (``cp=ep`` when two axes share the same ranks)."""
    pd = parallel_dims
    names: dict[str, list[str]] = {}

    def add(mesh: Any) -> None:
        if mesh is None:
            return
        for i, name in enumerate(mesh.mesh_dim_names or ()):
            group = mesh.get_group(i).group_name
            if name not in names.setdefault(group, []):
                names[group].append(name)

    # The meshes the parallelize path uses name their groups; views that merely coincide with one of them
    # (dp_shard = dp_shard_cp without CP, dp = dp_shard without HSDP ...) only name groups nobody else named.
    add(pd.fsdp_mesh())
    add(pd.efsdp_mesh())
    if pd.tp == 1 or pd.ep == 1:
        add(pd.fsdp_mesh_with_tp())
    for axis in ("tp", "cp", "cp_inner", "cp_outer", "ep", "dp_replicate"):  # cp_inner/outer: hybrid CP only
        add(pd.mesh(axis))
    for axis in ("dp_shard", "dp_shard_cp", "efsdp", "dp", "dp_cp", "world"):
        mesh = pd.mesh(axis)
        if mesh is not None and mesh.get_group().group_name not in names:
            add(mesh)
    return {group: "=".join(axes) for group, axes in names.items()}
