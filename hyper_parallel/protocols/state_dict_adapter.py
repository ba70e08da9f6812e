"""``BaseStateDictAdapter``: the contract of a family's key mapping, our state dict <-> an HF checkpoint (the engine
that reads and writes folders with it is ``hyper_parallel.hf``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

__all__ = ["BaseStateDictAdapter"]


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
