"""Write a model (or a state dict) as an HF folder: the one generic export every family uses.

The family's adapter (``ModelSpec.hf.adapter``, built for the export's form by ``for_export``) maps the keys and
writes the config; this module keeps the loaded folder's passthrough tensors (under the names the adapter gives,
warning about those the form leaves out), casts to the export dtype, and writes one tensor at a time on every
rank (``hf.storage.save_converted``: each rank writes its own files; a pipeline-parallel model passes its
stage group as ``stages``). The server files beside an export are ``hf.serving``'s, the LoRA forms ``hf.lora_export``'s.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.hf.load import hf_spec_of
from hyper_parallel.hf.storage import parse_size, save_converted, writes_once
from hyper_parallel.protocols.hf_spec import HFSpec
from hyper_parallel.protocols.model_spec import ModelSpec
from hyper_parallel.rank_log import warn_on_rank0

__all__ = ["export_hf_config", "save_hf_state_dict", "save_pretrained", "warn_dropped", "write_hf_config"]

logger = logging.getLogger(__name__)


def warn_dropped(keys: Iterable[str], why: str) -> None:
    """Log (once per export) that the HF ``keys`` the folder had are not written, and ``why``."""
    keys = sorted(keys)
    if keys:
        shown = ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")
        warn_on_rank0(logger, "the HF export leaves out %d tensor(s) the loaded folder had (%s): %s", len(keys), shown, why)


def export_hf_config(hf_config: dict[str, Any], *, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` dict an export writes, from a family writer's ``hf_config`` (the folder's form).

    ``dtype`` says what was written: the top-level ``dtype`` always, and every ``dtype`` / legacy ``torch_dtype``
    key the folder had, at any level (``text_config``, ...). ``quantization_config`` is dropped at every level:
    an export holds dense tensors in ``dtype``, and a server must not read it as pre-quantized.
    """
    name = str(dtype).removeprefix("torch.")

    def clean(level: dict[str, Any], top: bool) -> dict[str, Any]:
        out = {}
        for key, value in level.items():
            if key == "quantization_config":
                continue
            if key in ("dtype", "torch_dtype"):
                value = name
            elif isinstance(value, dict):
                value = clean(value, False)
            out[key] = value
        if top:
            out["dtype"] = name
        return out

    return clean(hf_config, True)


def write_hf_config(
    path: str | os.PathLike, hf_config: dict[str, Any], *, dtype: torch.dtype, sources: dict[str, Any]
) -> str:
    """Write ``export_hf_config(hf_config, dtype=)`` as ``path/config.json`` from the one process that writes a
    folder's single files (``writes_once(sources)``); returns the file name."""
    if writes_once(sources):
        out = export_hf_config(hf_config, dtype=dtype)
        (Path(path) / "config.json").write_text(json.dumps(out, indent=2, sort_keys=True))
    return "config.json"


def save_hf_state_dict(
    config: Any,
    state_dict: dict[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    spec: ModelSpec | HFSpec,
    max_shard_size: int | str = "5GB",
    passthrough: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    stages: dist.ProcessGroup | None = None,
    **options: Any,
) -> list[str]:
    """Write ``state_dict`` (our keys; full tensors, or DTensors from every rank) + ``config.json`` as an HF folder
    of ``spec``'s family, in the form ``options`` choose (the adapter's ``for_export``: ``text_only``,
    ``experts_layout``), with the kept ``passthrough`` tensors the form has room for.

    Floating tensors are written in ``dtype`` (default: the adapter's ``export_dtype``, else as they are; integer
    tensors, e.g. ``hf.lora_export``'s row traces, as they are). ``stages``: the pipeline-parallel group when each
    rank hands in its own stages' tensors. Returns the written file names."""
    hf = spec if isinstance(spec, HFSpec) else hf_spec_of(None, spec)
    adapter = hf.adapter.for_export(config, **options)
    dtype = dtype if dtype is not None else adapter.export_dtype()
    names = adapter.export_names(passthrough or {})
    kept = {k: v for k, v in (passthrough or {}).items() if k in names}

    def convert(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # per tensor (save_converted)
        out = adapter.to_hf_export({k: v for k, v in sd.items() if k not in kept})
        out.update({names[k]: v for k, v in sd.items() if k in kept})
        if dtype is not None:  # one dtype for the whole folder (config.json states it): kept keys too
            out = {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}
        return out

    path = Path(path)
    sources = {**state_dict, **kept}
    files = save_converted(sources, convert, path, max_shard_size=parse_size(max_shard_size), stages=stages)
    written = dtype or next(iter(state_dict.values())).dtype
    return files + [write_hf_config(path, adapter.export_config(), dtype=written, sources=sources)]


def save_pretrained(
    model: Any,
    path: str | os.PathLike,
    *,
    spec: ModelSpec | HFSpec | None = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    stages: dist.ProcessGroup | None = None,
    **options: Any,
) -> list[str]:
    """Write ``model`` (or ``state_dict``, e.g. EMA weights; with sharded DTensors every rank calls it and writes
    its own files) as an HF folder with config.json, in the form it was loaded from (the adapter's
    ``export_defaults``; ``options`` given and not None replace them), kept passthrough tensors included.
    ``spec``: the family (default: the registered spec of ``model``'s class); the trainer's
    ``--checkpoint.export_hf``."""
    hf = hf_spec_of(model, spec)
    defaults = hf.adapter.export_defaults(model)
    options = {**defaults, **{k: v for k, v in options.items() if v is not None or k not in defaults}}
    return save_hf_state_dict(
        model.config, state_dict if state_dict is not None else model.state_dict(), path, spec=hf,
        max_shard_size=max_shard_size, passthrough=getattr(model, "hf_passthrough", None), dtype=dtype,
        stages=stages, **options,
    )  # fmt: skip
