"""GlmImageMoe (v2 model package): Glm4MoeLite layers + the DirectToken VQ image path.

Registers the ``glm_image_moe`` spec (alias ``glm_image_moe_v2``) and offers HF I/O:
``from_pretrained(path)`` reads a GlmImageMoe or a plain Glm4MoeLite HF folder;
``save_pretrained(model, path)`` writes the GlmImageMoe HF format (``text_only=True``: Glm4MoeLite).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hyper_parallel.models.glm_image_moe_v2.hf_config import config_from_hf, config_to_hf
from hyper_parallel.models.glm_image_moe_v2.model import GlmImageMoeModel, glm_image_moe_config, nextn_reader
from hyper_parallel.models.glm_image_moe_v2.state_dict import (
    CheckpointKeyError,
    GlmImageMoeStateDictAdapter,
    load_hf_weights,
    save_hf_state_dict,
)
from hyper_parallel.protocols.hf_io import build_from_hf, save_with_model
from hyper_parallel.protocols.model_spec import ModelSpec, lazy_function, register_spec

__all__ = [
    "CheckpointKeyError",
    "GlmImageMoeModel",
    "GlmImageMoeStateDictAdapter",
    "config_from_hf",
    "config_to_hf",
    "from_pretrained",
    "glm_image_moe_config",
    "save_pretrained",
]


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    mtp: bool = False,
    **config_overrides: Any,
) -> GlmImageMoeModel:
    """Build a GlmImageMoeModel from an HF folder (GlmImageMoe or plain Glm4MoeLite; sharded or single).

    ``config_overrides`` replace top-level fields of the model config (e.g. ``codebook_size`` for a
    text-only checkpoint). Parts a Glm4MoeLite checkpoint lacks (codebook, projection, image head
    rows) keep their seeded initialisation. ``mtp=True``: the MTP block on with the checkpoint's
    ``num_nextn_predict_layers`` (the nextn layer ``model.layers.{num_hidden_layers}.*`` loads into it).
    """
    return build_from_hf(
        GlmImageMoeModel,
        path,
        load_weights=load_hf_weights,
        dtype=dtype,
        device=device,
        config_overrides=config_overrides,
        config_from_hf=nextn_reader(config_from_hf) if mtp else config_from_hf,
    )


def save_pretrained(
    model: GlmImageMoeModel,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    text_only: bool = False,
    dtype: torch.dtype | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> list[str]:
    """Write ``model`` (or ``state_dict``, e.g. EMA weights) as an HF folder with ``config.json``.

    ``text_only=True`` writes the backbone and head rows ``[0, V)`` as a plain Glm4MoeLite checkpoint
    that ``transformers.Glm4MoeLiteForCausalLM.from_pretrained`` loads.
    """
    return save_with_model(
        save_hf_state_dict,
        model,
        path,
        state_dict=state_dict,
        max_shard_size=max_shard_size,
        text_only=text_only,
        dtype=dtype,
    )


def _data_facts(config: GlmImageMoeModel.Config) -> dict[str, Any]:
    # What a DirectToken source checks samples against (docs/design.md section 5).
    return {
        "vocab_size": config.vocab_size,
        "codebook_size": config.codebook_size,
        "placeholder_token_id": config.placeholder_token_id,
    }


GLM_IMAGE_MOE_SPEC = ModelSpec(
    name="glm_image_moe",
    model=GlmImageMoeModel,
    # parallelize.py imports the distributed stack; keep `import hyper_parallel.models.glm_image_moe_v2` light.
    parallelize_fn=lazy_function(f"{__name__}.parallelize", "parallelize_glm_image_moe"),
    state_dict_adapter=GlmImageMoeStateDictAdapter,
    flavor="glm_image_moe_debug",
    from_pretrained=from_pretrained,
    save_pretrained=save_pretrained,
    load_hf_weights=load_hf_weights,
    validate_layout=lazy_function(f"{__name__}.parallelize", "validate_glm_image_moe_layout"),
    data_sources=("direct_token", "preset_pt", "dummy"),
    data_facts=_data_facts,
)
register_spec("glm_image_moe", GLM_IMAGE_MOE_SPEC, aliases=("glm_image_moe_v2",))
