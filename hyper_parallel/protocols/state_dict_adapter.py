"""``BaseStateDictAdapter``: our state dict <-> an HF checkpoint, and sharded safetensors IO."""

from __future__ import annotations

import json
import os
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

__all__ = ["BaseStateDictAdapter", "parse_size", "read_safetensors", "write_safetensors"]

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"


def parse_size(size: int | str) -> int:
    """``"5GB"`` / ``"500MB"`` / ``"100KiB"`` / ``1024`` -> bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", size, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={size!r}: use bytes or a size like '5GB' / '500MB'")
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(float(m.group(1)) * base**power)


def write_safetensors(
    state_dict: dict[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Write ``state_dict`` as HF safetensors: one file, or shards plus ``model.safetensors.index.json``.

    Returns the written file names. Tensors must be full (not sharded DTensors).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(state_dict):
        t = state_dict[key]
        if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
            raise TypeError(f"{key}: write_safetensors needs full plain tensors, got {type(t).__name__}")
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        # clone: safetensors refuses tensors that share storage or are non-contiguous views
        shards[-1][key] = t.detach().to("cpu").contiguous().clone()
        size += nbytes
    meta = {"format": "pt", **(metadata or {})}
    for stale in list(path.glob("model*.safetensors")) + [path / SAFE_INDEX]:
        if stale.exists():
            stale.unlink()
    if len(shards) == 1:
        save_file(shards[0], str(path / SAFE_SINGLE), metadata=meta)
        return [SAFE_SINGLE]
    names, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata=meta)
        names.append(name)
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    return names + [SAFE_INDEX]


def read_safetensors(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read every tensor of an HF checkpoint folder (sharded with index, or single file) or one file."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif (path / SAFE_INDEX).is_file():
        index = json.loads((path / SAFE_INDEX).read_text())
        if "weight_map" not in index:
            raise ValueError(f"{path / SAFE_INDEX}: no 'weight_map' in the index")
        files = sorted({path / f for f in index["weight_map"].values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{path / SAFE_INDEX} names shard files that do not exist: {missing}")
    elif (path / SAFE_SINGLE).is_file():
        files = [path / SAFE_SINGLE]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no {SAFE_INDEX}, {SAFE_SINGLE} or *.safetensors file")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as reader:
            for key in reader.keys():
                if key in out:
                    raise ValueError(f"{f}: tensor {key!r} appears in more than one shard")
                out[key] = reader.get_tensor(key)
    return out


class BaseStateDictAdapter(ABC):
    """Converts between our state dict and the HF checkpoint format of one model.

    Both directions preserve shapes; placements of DTensors are preserved by converting local
    views only where a key maps one-to-one, and the caller gathers full tensors before writing.
    """

    def __init__(self, model_config: Any, **runtime_objects: Any) -> None:
        del runtime_objects
        self.model_config = model_config

    @abstractmethod
    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our keys/tensors -> HF keys/tensors."""

    @abstractmethod
    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF keys/tensors -> our keys/tensors; raise one error listing every bad key."""

    def save_hf(self, state_dict: dict[str, torch.Tensor], path: str | os.PathLike, *, max_shard_size: int | str = "5GB") -> list[str]:
        """Convert and write as (sharded) safetensors."""
        return write_safetensors(self.to_hf(state_dict), path, max_shard_size=max_shard_size)

    def load_hf(self, path: str | os.PathLike) -> dict[str, torch.Tensor]:
        """Read (sharded) safetensors and convert to our keys."""
        return self.from_hf(read_safetensors(path))
