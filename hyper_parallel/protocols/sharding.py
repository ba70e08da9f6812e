"""Declarative placements: what each parameter and each forward input/output looks like on the mesh.

``sharding.py`` of a model package fills these from (model config, parallelism config) as a pure
function; ``parallelize.py`` reads them and applies DTensor placements. Placements are keyed by
mesh axis name, so one declaration serves every layout: axes of degree 1 are simply skipped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Partial, Placement

__all__ = ["LocalMapConfig", "MeshAxisName", "NamedPlacement", "ShardingConfig", "local_shard"]


class MeshAxisName(str, enum.Enum):
    """Names of the device-mesh axes (see ``hyper_parallel.distributed.parallel_dims``)."""

    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"
    EP = "ep"
    """Expert parallel: borrowed from dp_shard x cp."""
    EFSDP = "efsdp"
    """What is left of dp_shard x cp for FSDP of expert weights once EP took its part."""

    def __str__(self) -> str:
        return self.value


NamedPlacement = dict[MeshAxisName, Placement]
"""One placement per mesh axis; an axis that is absent is ``Replicate()``."""


@dataclass(kw_only=True, slots=True)
class LocalMapConfig:
    """Run a module's forward on local shards (``torch.distributed.tensor.experimental.local_map``)."""

    in_placements: tuple[NamedPlacement | None, ...] = ()
    """Placement of each positional input; ``None`` for non-tensor inputs."""
    out_placements: tuple[NamedPlacement, ...] = ()
    """Placement of each output."""
    in_grad_placements: tuple[NamedPlacement | None, ...] | None = None
    """Placement of each input's gradient (defaults to ``in_placements``)."""


@dataclass(kw_only=True, slots=True)
class ShardingConfig:
    """Placements a module declares; read by ``parallelize`` helpers, never mutated at run time."""

    params: dict[str, NamedPlacement] = field(default_factory=dict)
    """Direct parameter name -> placement (``"weight"``, ``"gate_up_proj"``)."""
    inputs: dict[str, NamedPlacement] = field(default_factory=dict)
    """Forward input name -> the placement the caller hands it in."""
    desired_inputs: dict[str, NamedPlacement] = field(default_factory=dict)
    """Forward input name -> the placement the module needs (redistributed on entry)."""
    outputs: NamedPlacement | None = None
    """The placement the forward output comes out in."""
    desired_outputs: NamedPlacement | None = None
    """The placement the caller wants the output in (redistributed on exit)."""
    use_local_output: bool = True
    """Hand the output on as a plain local tensor rather than a DTensor."""
    local_forward: bool = False
    """``forward`` computes on plain local tensors although the module declares parameters: its inputs are
    handed in local and it reads the local shards of its own parameters (a recurrence core over the rank's
    heads cannot run on DTensors). Default: a module with declared parameters computes on DTensors."""
    local_map: LocalMapConfig | None = None
    """Run the forward on local shards instead of DTensors."""

    def placement(self, name: str, axis: MeshAxisName) -> Placement | None:
        """The declared placement of parameter ``name`` on ``axis`` (None = replicated)."""
        return self.params.get(name, {}).get(axis)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter that parallelisation may have made a DTensor (plain tensors pass);
    for modules that compute on local tensors (``local_forward``, expert-parallel experts). The gradient
    flows back as that shard.

    A replicated placement's local copy serves this rank's share of the computation only (its heads, the
    tokens its experts received: a LoRA adapter shared by every expert under EP), so its gradient is this
    rank's contribution: it flows back ``Partial`` and the parameter's reduction (FSDP) sums it."""
    if not isinstance(t, DTensor):
        return t
    return t.to_local(grad_placements=[Partial() if p.is_replicate() else p for p in t.placements])
