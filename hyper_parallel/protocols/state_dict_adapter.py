"""``BaseStateDictAdapter``: our state dict <-> an HF checkpoint, and sharded safetensors IO."""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hyper_parallel.protocols.hf_storage import SAFE_INDEX, SAFE_SINGLE, HFFolder, save_converted

__all__ = ["SAFE_INDEX", "SAFE_SINGLE", "BaseStateDictAdapter", "parse_size", "read_safetensors", "write_safetensors"]


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

    Returns the written file names. Tensors must be full (not sharded DTensors); to write a sharded model
    from every rank, see ``hf_storage.save_converted``.
    """
    for key, t in state_dict.items():
        if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
            raise TypeError(f"{key}: write_safetensors needs full plain tensors, got {type(t).__name__}")
    return save_converted(
        state_dict, lambda sd: sd, path, max_shard_size=parse_size(max_shard_size), metadata=metadata
    )


def read_safetensors(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read every tensor of an HF checkpoint folder (sharded with index, or single file) or one file.

    A broken folder raises ``HFCheckpointError`` naming the file (truncated, not safetensors, a shard the
    index names that is missing or lacks its tensors).
    """
    return {key: t.read().to(device) for key, t in HFFolder.open(path).tensors.items()}


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
