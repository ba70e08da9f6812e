"""``HFSpec``: what a model family knows about its HF checkpoints (``ModelSpec.hf``).

A family supplies its key mapping (``adapter``: a ``BaseStateDictAdapter`` subclass; the hooks the generic engine
calls are those of ``hyper_parallel.hf.convert.CheckedStateDictAdapter``) and its config conversion
(``config_from_hf``); the engine in ``hyper_parallel.hf`` does the rest (per-rank reads, FP8, passthrough keys,
serving files, LoRA adapters). ``HF_MODEL_TYPES`` is the one table from an HF ``model_type`` to the families.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["HF_MODEL_TYPES", "HFMtp", "HFSpec"]


@dataclass(frozen=True, kw_only=True)
class HFMtp:
    """How a family's HF folders carry a multi-token-prediction block (Qwen3.5 ``mtp.*``, GLM's nextn layer)."""

    count_key: str
    """``config.json`` key (in ``text_config`` or at top level) holding the number of MTP layers."""
    config_from_hf: Callable[[Mapping[str, Any]], Any]
    """The family's HF config reader with the folder's MTP block on (raises, naming ``count_key``, without one)."""
    tensor_prefixes: Callable[[Mapping[str, Any]], tuple[str, ...]]
    """``tensor_prefixes(hf_config)``: HF key prefixes of the MTP block's tensors in such a folder."""


@dataclass(frozen=True, kw_only=True)
class HFSpec:
    """One family's HF checkpoint facts: its key mapping and its config conversion."""

    adapter: type
    """The family's state-dict adapter class (ours <-> HF keys): built per load with ``adapter.for_folder`` and per
    export with ``adapter.for_export``; its hooks carry the family's quirks (``hf.convert.CheckedStateDictAdapter``)."""
    config_from_hf: Callable[[Mapping[str, Any]], Any]
    """``config_from_hf(hf_config_dict) -> model.Config``: the family's HF config reader (MTP off), the one
    ``from_pretrained`` uses; with it an HF folder given as ``--checkpoint.initial_load_path`` is the run's model."""
    mtp: HFMtp | None = None
    """How the family's HF folders carry an MTP block (None: the family has none)."""
    fields_not_in_hf: Callable[[Mapping[str, Any]], tuple[str, ...]] | None = None
    """``fields_not_in_hf(hf_config_dict)``: top-level model fields such a folder does not set (a text-only GLM
    folder: the image path), which a run started from it takes from the recipe."""
    load_options: tuple[str, ...] = ()
    """Keywords of ``from_pretrained`` / ``load_hf_weights`` that go to the adapter (``experts_layout``), not to
    the model config."""


HF_MODEL_TYPES: dict[str, tuple[str, ...]] = {
    # Qwen3_5ForConditionalGeneration: its text part, or the whole VL model (Qwen3.5 dense VL, qwen3_vl_moe)
    "qwen3_5": ("qwen3_5", "qwen3_vl_moe"),
    "qwen3_5_text": ("qwen3_5",),  # Qwen3_5ForCausalLM
    # Qwen3_5MoeForConditionalGeneration: the text part, or the whole VL model (Qwen3.5-MoE VL, qwen3_vl_moe)
    "qwen3_5_moe": ("qwen3_5_moe", "qwen3_vl_moe"),
    "qwen3_5_moe_text": ("qwen3_5_moe",),  # Qwen3_5MoeForCausalLM
    "qwen3_vl_moe": ("qwen3_vl_moe",),  # Qwen3VLMoeForConditionalGeneration
    "qwen3_vl": ("qwen3_vl_moe",),  # Qwen3VLForConditionalGeneration (Qwen3-VL dense): the VL package's qwen3_vl family
    "glm4_moe_lite": ("glm_image_moe",),  # Glm4MoeLiteForCausalLM (GLM-4.7-Flash): the text part of GlmImageMoe
    "glm_image_moe": ("glm_image_moe",),
}
"""HF ``config.json`` ``model_type`` -> the registered specs that read such a folder, the default first (the
one table that maps a folder to a model package: ``--module`` and ``hyper_parallel.from_pretrained(path)``)."""
