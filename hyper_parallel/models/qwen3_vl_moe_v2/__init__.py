"""Qwen3-VL-MoE and Qwen3.5-MoE vision-language models (v2 model package).

Registers the ``qwen3_vl_moe`` spec (alias ``qwen3_vl_moe_v2``; data source ``vision_language``) and offers
HF I/O: ``from_pretrained(path)`` reads a ``Qwen3VLMoeForConditionalGeneration`` or
``Qwen3_5MoeForConditionalGeneration`` folder; ``save_pretrained(model, path)`` writes it back (the
fused-expert layout it was read in).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from hyper_parallel.models.qwen3_vl_moe_v2.model import (
    Qwen3VlMoeModel,
    qwen3_5_moe_vl_config,
    qwen3_vl_moe_config,
)
from hyper_parallel.models.qwen3_vl_moe_v2.state_dict import (
    CheckpointKeyError,
    ExpertsLayout,
    Qwen3VlMoeStateDictAdapter,
    load_hf_weights,
    read_hf_config,
    save_hf_state_dict,
)
from hyper_parallel.protocols.model_spec import ModelSpec, register_spec

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
    **config_overrides: Any,
) -> Qwen3VlMoeModel:
    """A ``Qwen3VlMoeModel`` from an HF ConditionalGeneration folder (every key and shape checked).

    ``experts_layout`` (Qwen3-VL-MoE fused experts): default from the folder's ``config.json``.
    """
    config = Qwen3VlMoeModel.Config.from_hf(read_hf_config(path))
    if config_overrides:
        config = dataclasses.replace(config, **config_overrides)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    model.init_weights()
    load_hf_weights(model, path, experts_layout=experts_layout)
    return model.to(dtype=dtype)


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
    return save_hf_state_dict(
        model.config,
        state_dict if state_dict is not None else model.state_dict(),
        path,
        max_shard_size=max_shard_size,
        experts_layout=experts_layout or getattr(model, "hf_experts_layout", "memory"),
        passthrough=getattr(model, "hf_passthrough", None),
        dtype=dtype,
    )


def _parallelize(model: Qwen3VlMoeModel, **kwargs: Any) -> Qwen3VlMoeModel:
    from hyper_parallel.models.qwen3_vl_moe_v2.parallelize import parallelize_qwen3_vl_moe

    return parallelize_qwen3_vl_moe(model, **kwargs)


def _validate_layout(config: Any, parallel_dims: Any) -> None:
    from hyper_parallel.models.qwen3_vl_moe_v2.parallelize import validate_qwen3_vl_moe_layout

    validate_qwen3_vl_moe_layout(config, parallel_dims)


def _data_facts(config: Qwen3VlMoeModel.Config) -> dict[str, Any]:
    # What the vision_language source needs to expand images and check samples.
    v = config.visual
    return {
        "vocab_size": config.vocab_size,
        "image_token_id": config.image_token_id,
        "vision_start_token_id": config.vision_start_token_id,
        "vision_end_token_id": config.vision_end_token_id,
        "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size,
        "merge_size": v.spatial_merge_size,
    }


def _load_hf_weights(model: Qwen3VlMoeModel, path: str) -> None:
    load_hf_weights(model, path)


QWEN3_VL_MOE_SPEC = ModelSpec(
    name="qwen3_vl_moe",
    model=Qwen3VlMoeModel,
    parallelize_fn=_parallelize,
    state_dict_adapter=Qwen3VlMoeStateDictAdapter,
    flavor="qwen3_vl_moe_debug",
    from_pretrained=from_pretrained,
    save_pretrained=save_pretrained,
    load_hf_weights=_load_hf_weights,
    validate_layout=_validate_layout,
    data_sources=("vision_language", "preset_pt"),
    data_facts=_data_facts,
)
register_spec("qwen3_vl_moe", QWEN3_VL_MOE_SPEC, aliases=("qwen3_vl_moe_v2",))
