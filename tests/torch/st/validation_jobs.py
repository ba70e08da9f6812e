"""Jobs of the validation layout test (gloo workers, see ``harness.py``): the real ``Trainer`` of the tiny
GlmImageMoe with its nextn (MTP) layer, validating a held-out split of the toy corpus, built and run once per
layout in ONE launch (each trainer releases its meshes on ``close``; the pool owns the default group).

Returns, from rank 0, every validation record of ``metrics.jsonl`` by step, and the training losses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hyper_parallel.config import ConfigManager


def records(dump: Path) -> tuple[dict[int, dict[str, float]], dict[int, float]]:
    """``(validation records by step, training loss by step)`` of a run's metrics.jsonl."""
    val: dict[int, dict[str, float]] = {}
    train: dict[int, float] = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "val/loss" in rec:
            val[rec["step"]] = rec
        else:
            train[rec["step"]] = rec["loss"]
    return val, train


def run_layouts(layouts: dict[str, list[str]], common: list[str], root: str) -> dict[str, Any]:
    """Train ``common`` + each layout's flags; rank 0 returns ``{layout: (val records, train losses)}``."""
    out: dict[str, Any] = {}
    for name, flags in layouts.items():
        dump = Path(root) / name
        trainer = ConfigManager().parse_args([*common, *flags, "--dump_folder", str(dump)]).build()
        try:
            trainer.train()
            pd = str(trainer.parallel_dims)
        finally:
            trainer.close()
        if dist.get_rank() == 0:
            out[name] = (*records(dump), pd)
    return out
