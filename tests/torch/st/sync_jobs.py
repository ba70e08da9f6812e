"""Jobs of the sync-count layout tests (gloo workers, see ``harness.py``): each layout builds the real ``Trainer``
for a debug recipe in bf16, runs a warm step, then counts one step that does not log
(``tests.torch.ut.models.test_syncs.measure``). Every rank returns its counts (ranks route different tokens)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["sync_layouts_job"]


def sync_layouts_job(layouts: dict[str, tuple[str, str, list[str]]]) -> dict[str, dict[str, Any]]:
    """``{name: counts}`` of each layout ``name: (module, recipe, flags)`` in turn, on this rank."""
    from tests.torch.ut.models.test_syncs import measure

    out = {}
    for name, (module, recipe, flags) in layouts.items():
        got = measure(module, recipe, *flags)
        got["rank"] = dist.get_rank()
        out[name] = got
    return out
