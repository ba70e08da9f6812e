"""Helpers shared by the unit and system tests: one definition each (they were re-declared per file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def trainer_config(base: list[str], dump: Path, *args: str) -> Any:
    """The Trainer.Config of the command line ``base`` + ``--dump_folder dump`` + ``args``."""
    from hyper_parallel.config.manager import ConfigManager  # here: st job modules import this file in every worker

    return ConfigManager().parse_args([*base, "--dump_folder", str(dump), *args])


def run_trainer(cfg: Any) -> tuple[Any, dict]:
    """Build, train and close a Trainer; returns it (closed) and its summary."""
    trainer = cfg.build()
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    return trainer, summary


def read_losses(dump: Path) -> dict[int, float]:
    """Loss per step from ``dump/metrics.jsonl`` (a resumed run appends: the last record of a step wins)."""
    out = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def canonical_fqn(name: str) -> str:
    """A parameter name without the activation-checkpoint and compile wrappers' prefixes."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def build_on_meta(config: Any) -> Any:
    """``config.build()`` on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        return config.build()


def next_token_ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``logits`` [B, T, V] on ``ids`` [B, T], in fp32."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def logits_of(out: Any) -> torch.Tensor:
    """The logits of an HF model output, or ``out`` itself when it is a tensor."""
    return out.logits if hasattr(out, "logits") else out


def write_jsonl(path: Path, rows: list) -> str:
    """Write ``rows`` as JSON lines to ``path``; returns the path as a string."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def edit_config(path: Path, **text: Any) -> None:
    """Update the text config (``text_config`` when present) of the HF folder ``path`` in place."""
    d = json.loads((path / "config.json").read_text())
    (d.get("text_config") or d).update(text)
    (path / "config.json").write_text(json.dumps(d))
