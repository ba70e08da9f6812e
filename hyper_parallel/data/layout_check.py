"""Seeing the global batches of a layout: reproduce a step of a big run on one machine, or compare layouts.

``global_batches(config, model_facts=..., steps=3, first_step=10000, dp_world_size=8)`` builds the
loader of every DP rank of the layout, jumps to ``first_step`` without reading earlier data, and
returns each step's micro-batches concatenated over the ranks in rank order: by design the same
list for every DP degree and worker count (:mod:`hyper_parallel.data.base`).
:func:`first_difference` compares two such lists exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hyper_parallel.data.base import BaseDataLoader

__all__ = ["first_difference", "global_batches"]


def global_batches(
    config: BaseDataLoader.Config,
    *,
    model_facts: Mapping[str, Any],
    steps: int,
    dp_world_size: int = 1,
    first_step: int = 0,
    seq_multiple: int = 1,
) -> list[list[dict[str, Any]]]:
    """Steps ``first_step .. first_step + steps - 1`` of ``config``: per step, every DP rank's micro-batches."""
    loaders = [
        config.build(dp_rank=r, dp_world_size=dp_world_size, seq_multiple=seq_multiple, model_facts=dict(model_facts))
        for r in range(dp_world_size)
    ]
    try:
        for loader in loaders:
            loader.advance(first_step)
        return [[mb for loader in loaders for mb in loader.next_step()] for _ in range(steps)]
    finally:
        for loader in loaders:
            loader.close()


def first_difference(a: Sequence[Sequence[Mapping[str, Any]]], b: Sequence[Sequence[Mapping[str, Any]]]) -> str | None:
    """Where two per-step micro-batch lists first differ (keys, shapes or values), or None if identical."""
    if len(a) != len(b):
        return f"{len(a)} steps vs {len(b)}"
    for step, (sa, sb) in enumerate(zip(a, b)):
        if len(sa) != len(sb):
            return f"step {step}: {len(sa)} micro-batches vs {len(sb)}"
        for i, (ma, mb) in enumerate(zip(sa, sb)):
            if ma.keys() != mb.keys():
                return f"step {step} micro-batch {i}: keys {sorted(ma)} vs {sorted(mb)}"
            for k in ma:
                x, y = ma[k], mb[k]
                same = torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
                if not same:
                    return f"step {step} micro-batch {i}: {k!r} differs"
    return None
