"""What this torch build offers of the newer APIs the project uses, and the fallback each absence takes.

The project is tested on torch 2.13 (CPU) and admits 2.11, the torch of the lent GPU image. Each entry is
probed once, from the installed torch itself (no version arithmetic), and the users of an API ask here:

- ``varlen_attn``: torch's flash varlen kernel (``torch.nn.attention.varlen``); absent -> flash-attn or the
  per-document SDPA path (``VarlenAttention``'s "auto" backend picks). Its ``enable_gqa`` argument (not in
  2.11) -> grouped K/V heads are expanded to the query heads before the call.
- ``grouped_mm``: ``torch.nn.functional.grouped_mm`` or ``torch._grouped_mm``; absent -> the per-expert loop
  (``models/common/grouped_mm.py``, with its one warning).
- ``fsdp_unused_params``: ``FSDPModule.set_reduce_scatter_unused_params`` (not in 2.11): without it a rank
  whose micro-batch leaves a parameter unused (no image in it) would reduce-scatter fewer gradients than
  its peers and hang, so a multi-rank FSDP group is refused at start (``fsdp.sum_gradients``); one rank
  per group needs nothing.
- ``fsdp_per_param_mesh``: ``fully_shard(shard_placement_fn=...)`` returning ``ShardPlacementResult`` (a parameter
  on another mesh inside the same unit); absent -> routed experts and tp-reduced weights get nested FSDP units,
  whose hooks break a compiled block's graph (``--compile.fullgraph`` fails on those blocks).

``describe()`` is the one line the trainer logs at start.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["Feature", "describe", "features", "has"]


@dataclass(frozen=True, slots=True)
class Feature:
    name: str
    available: bool
    fallback: str
    """What the project does without it."""


def _varlen_params() -> set[str] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return set(inspect.signature(varlen_attn).parameters)


def _has_per_param_mesh() -> bool:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult  # noqa: F401
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def features() -> dict[str, Feature]:
    """Every probed API of the installed torch, by name."""
    from torch.distributed.fsdp import FSDPModule

    varlen = _varlen_params()
    found = [
        Feature("varlen_attn", varlen is not None, "flash-attn varlen, else per-document SDPA"),
        Feature("varlen_attn.enable_gqa", bool(varlen) and "enable_gqa" in varlen, "K/V heads expanded to the query heads"),
        Feature("grouped_mm", hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm"), "per-expert matmul loop"),
        Feature(
            "fsdp_unused_params",
            hasattr(FSDPModule, "set_reduce_scatter_unused_params"),
            "multi-rank FSDP groups refused (a rank without a parameter's gradient would hang the reduce-scatter)",
        ),
        Feature(
            "fsdp_per_param_mesh",
            _has_per_param_mesh(),
            "routed experts / tp-reduced weights in nested FSDP units (their hooks break a compiled block's graph)",
        ),
    ]
    return {f.name: f for f in found}


def has(name: str) -> bool:
    """Whether the installed torch has the probed API ``name`` (a key of ``features()``)."""
    return features()[name].available


def describe() -> str:
    """``torch 2.11.0+cu130: varlen_attn ok, varlen_attn.enable_gqa missing (K/V heads expanded ...), ...``."""
    parts = [f"{f.name} ok" if f.available else f"{f.name} missing ({f.fallback})" for f in features().values()]
    return f"torch {torch.__version__}: " + ", ".join(parts)
