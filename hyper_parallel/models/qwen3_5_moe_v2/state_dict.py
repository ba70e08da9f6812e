"""Qwen3.5-MoE <-> HF checkpoint keys: the Qwen3.5 family's mapping (``qwen3_5_v2.state_dict``), under the
MoE package's names. Experts: per-expert or fused keys in; out in the folder's form (fused when the folder stored
them fused, ``hf_extra["experts_form"]``; per expert otherwise)."""

from __future__ import annotations

from hyper_parallel.models.qwen3_5_v2.state_dict import (
    CheckpointKeyError,
    HFLoadResult,
    Qwen3_5StateDictAdapter,
    read_hf_config,
)

__all__ = [
    "CheckpointKeyError",
    "HFLoadResult",
    "Qwen3_5MoeStateDictAdapter",
    "read_hf_config",
]


class Qwen3_5MoeStateDictAdapter(Qwen3_5StateDictAdapter):
    """Qwen3.5-MoE state dict <-> HF ``Qwen3_5MoeForCausalLM`` / ``Qwen3_5MoeForConditionalGeneration`` keys."""
