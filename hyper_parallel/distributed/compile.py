"""``torch.compile`` per block (in place: ``nn.Module.compile`` keeps FQNs and hooks), as torchtitan does.

Each decoder block (and vision block) is compiled on its own: one graph per repeated block kind, compiled once
and reused by every layer of that kind. What makes a block ONE graph (``--compile.fullgraph``):

- hooks on the block itself (FSDP unshard/reshard: dynamo-disabled) run outside the graph: dynamo skips the
  ``_call_impl`` frame and captures ``forward``; so no FSDP unit may sit INSIDE a block (``parallelize`` gives
  each block one unit, with per-parameter meshes for experts and tp-reduced weights);
- activation checkpointing is ``torch.utils.checkpoint`` inside ``forward`` (``activation_checkpoint.py``),
  traced as one higher-order op;
- kernels dynamo cannot trace (SDPA over packed documents, the Gated DeltaNet core) are ``torch.library``
  custom ops that take their host metadata as CPU tensors;
- dynamic sizes: token counts, document counts and image geometries change every step and must not be
  specialised (a recompile per packing). A dynamo-disabled pre-hook marks them dynamic on every call
  (``mark_sizes_dynamic``: every size of index/mask/metadata tensors, every size but the feature dim of float
  ones, also inside dataclass arguments such as ``AttentionMeta``), so the first compile is already
  symbolic in them; other ints stay static until they change (``dynamic=True`` would make every int
  symbolic, the constants of TP placements included, which dynamo cannot build placements from). Host
  metadata enters graphs as CPU tensors, never as Python lists (a list's length and values would be guarded).

Order in ``parallelize_decoder``: ... -> activation checkpointing -> compile -> FSDP2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hyper_parallel.config.training import CompileConfig

__all__ = ["apply_compile", "configure_dynamo", "mark_sizes_dynamic"]


def configure_dynamo() -> None:
    """Process-wide dynamo settings the compiled blocks need (idempotent)."""
    cfg = torch._dynamo.config
    # An activation-checkpointed block stores Python-side results of its forward (the MoE's router
    # statistics, read right after the block by the decoder): apply them once, in forward, and not again
    # when the recompute runs in backward (the compiled recompute only rebuilds tensors). torchtitan sets
    # the same flag for the same reason.
    if hasattr(cfg, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        cfg.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    # data-dependent sizes (expert-parallel split sizes, a dropless MoE's per-expert counts) become unbacked
    # symbols instead of graph breaks
    cfg.capture_scalar_outputs = True


def _mark(x: Any, depth: int = 0) -> None:
    if isinstance(x, torch.Tensor):
        dims = range(x.ndim) if not x.is_floating_point() else range(x.ndim - 1)
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(x, d)
    elif depth < 3 and dataclasses.is_dataclass(x) and not isinstance(x, type):  # metadata (and its host plan)
        for f in dataclasses.fields(x):
            _mark(getattr(x, f.name), depth + 1)
    elif depth == 0 and isinstance(x, (tuple, list)):
        for item in x:
            _mark(item, depth + 1)


def mark_sizes_dynamic(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: the per-step sizes of a block's inputs are dynamic (see the module docstring). Registered
    dynamo-disabled (it runs before the compiled ``forward``, like FSDP's hooks)."""
    for x in (*args, *kwargs.values()):
        _mark(x)


def apply_compile(layers: Iterable[nn.Module], compile_config: CompileConfig) -> int:
    """Compile every layer's forward when ``compile_config.enable``; return how many were compiled.

    Per-layer compilation keeps graphs small and leaves FSDP's per-layer hooks outside the graph. The
    per-step sizes are marked dynamic (``mark_sizes_dynamic``), so a new packing (token count, documents,
    image grids) reuses the graph instead of recompiling it.
    """
    if not compile_config.enable:
        return 0
    configure_dynamo()
    hook = torch._dynamo.disable(mark_sizes_dynamic)  # imports dynamo only when something compiles
    count = 0
    for layer in layers:
        layer.register_forward_pre_hook(hook, with_kwargs=True)
        layer.compile(backend=compile_config.backend, fullgraph=compile_config.fullgraph)
        count += 1
    return count
