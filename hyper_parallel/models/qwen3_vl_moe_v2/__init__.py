"""Qwen3-VL-MoE and Qwen3.5-MoE vision-language models (v2 model package).

Registers the ``qwen3_vl_moe`` spec (alias ``qwen3_vl_moe_v2``; data source ``vision_language``) and offers
HF I/O: ``from_pretrained(path)`` reads a ``Qwen3VLMoeForConditionalGeneration`` or
``Qwen3_5MoeForConditionalGeneration`` folder (``mtp=True``: the Qwen3.5-MoE MTP block on, its ``mtp.*`` keys
loaded into it; without it they are kept and written back); ``save_pretrained(model, path)`` writes it back
(the fused-expert layout it was read in; with MTP, ``text_config.mtp_num_hidden_layers``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hyper_parallel.models.qwen3_5_v2.model import mtp_reader
from hyper_parallel.models.qwen3_vl_moe_v2.model import (
    Qwen3VlMoeModel,
    qwen3_5_moe_vl_config,
    qwen3_vl_moe_config,
)
from hyper_parallel.models.qwen3_vl_moe_v2.state_dict import (
    CheckpointKeyError,
    ExpertsLayout,
    Qwen3VlMoeStateDictAdapter,
    config_from_hf,
    load_hf_weights,
    save_hf_state_dict,
)
from hyper_parallel.protocols.hf_io import build_from_hf, save_with_model
from hyper_parallel.protocols.model_spec import ModelSpec, lazy_function, register_spec

__all__ = [
    "CheckpointKeyError",
    "Qwen3VlMoeModel",
    "Qwen3VlMoeStateDictAdapter",
    "from_pretrained",
    "qwen3_5_moe_vl_config",
    "qwen3_vl_moe_config",
    "save_pretrained",
]


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    experts_layout: ExpertsLayout | None = None,
    mtp: bool | None = False,
    **config_overrides: Any,
) -> Qwen3VlMoeModel:
    """A ``Qwen3VlMoeModel`` from an HF ConditionalGeneration folder (every key and shape checked).

    ``experts_layout`` (Qwen3-VL-MoE fused experts): default from the folder's ``config.json``.
    ``mtp=True``: the MTP block on, with the checkpoint's ``text_config.mtp_num_hidden_layers`` (an error names
    the key when the folder has none, e.g. any Qwen3-VL-MoE one); its ``mtp.*`` weights load into it. Off
    (``False`` / ``None``): they are kept as passthrough and written back unchanged.
    """
    return build_from_hf(
        Qwen3VlMoeModel,
        path,
        load_weights=load_hf_weights,
        dtype=dtype,
        device=device,
        config_overrides=config_overrides,
        config_from_hf=mtp_reader(config_from_hf) if mtp else config_from_hf,
        experts_layout=experts_layout,
    )


def save_pretrained(
    model: Qwen3VlMoeModel,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    experts_layout: ExpertsLayout | None = None,
) -> list[str]:
    """Write ``model`` (or ``state_dict``, e.g. EMA weights) as an HF folder with ``config.json``."""
    return save_with_model(
        save_hf_state_dict,
        model,
        path,
        state_dict=state_dict,
        max_shard_size=max_shard_size,
        experts_layout=experts_layout or getattr(model, "hf_experts_layout", "memory"),
        dtype=dtype,
    )


def _data_facts(config: Qwen3VlMoeModel.Config) -> dict[str, Any]:
    # What the vision_language source needs to expand images and check samples.
    v = config.visual
    return {
        "vocab_size": config.vocab_size,
        "image_token_id": config.image_token_id,
        "vision_start_token_id": config.vision_start_token_id,
        "vision_end_token_id": config.vision_end_token_id,
        "video_token_id": config.video_token_id,  # -1: no video path (the source then refuses videos)
        "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size,
        "merge_size": v.spatial_merge_size,
    }


QWEN3_VL_MOE_SPEC = ModelSpec(
    name="qwen3_vl_moe",
    model=Qwen3VlMoeModel,
    parallelize_fn=lazy_function(f"{__name__}.parallelize", "parallelize_qwen3_vl_moe"),
    state_dict_adapter=Qwen3VlMoeStateDictAdapter,
    flavor="qwen3_vl_moe_debug",
    from_pretrained=from_pretrained,
    save_pretrained=save_pretrained,
    load_hf_weights=load_hf_weights,
    validate_layout=lazy_function(f"{__name__}.parallelize", "validate_qwen3_vl_moe_layout"),
    data_sources=("vision_language", "preset_pt"),
    data_facts=_data_facts,
)
register_spec("qwen3_vl_moe", QWEN3_VL_MOE_SPEC, aliases=("qwen3_vl_moe_v2",))
