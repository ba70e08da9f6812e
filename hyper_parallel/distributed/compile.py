"""``torch.compile`` per decoder layer (in place: ``nn.Module.compile`` keeps FQNs and hooks)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from hyper_parallel.config.training import CompileConfig

__all__ = ["apply_compile"]


def apply_compile(layers: Iterable[nn.Module], compile_config: CompileConfig) -> int:
    """Compile every layer's forward when ``compile_config.enable``; return how many were compiled.

    Per-layer compilation keeps graphs small (one graph per repeated block, compiled once and reused)
    and leaves FSDP's per-layer hooks outside the graph boundaries.
    """
    if not compile_config.enable:
        return 0
    count = 0
    for layer in layers:
        layer.compile(backend=compile_config.backend, fullgraph=compile_config.fullgraph)
        count += 1
    return count
