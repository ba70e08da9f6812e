"""GlmImageMoe (v2 model package): Glm4MoeLite layers + the DirectToken VQ image path.

Registers the ``glm_image_moe`` spec (alias ``glm_image_moe_v2``) and offers HF I/O:
``from_pretrained(path)`` reads a GlmImageMoe or a plain Glm4MoeLite HF folder (the latter as a model without
image path: GLM-4.7-Flash itself; ``image_path=True`` grows one); ``save_pretrained(model, path)`` writes the
folder form of the model: GlmImageMoe with an image path, else Glm4MoeLite (``text_only=True`` forces it).

A run is the model its data needs (``ModelSpec.fit_to_data``): text and chat sources train the model as it is;
a DirectToken source grows the image path of a model without one (logged), and the export is GlmImageMoe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hyper_parallel.config.errors import ConfigError
from hyper_parallel.models.glm_image_moe_v2.hf_config import config_from_hf, config_to_hf
from hyper_parallel.models.glm_image_moe_v2.model import GlmImageMoeModel, glm_image_moe_config, nextn_reader
from hyper_parallel.models.glm_image_moe_v2.state_dict import CheckpointKeyError, GlmImageMoeStateDictAdapter
from hyper_parallel.hf.pretrained import pretrained_io
from hyper_parallel.protocols.hf_spec import HFMtp, HFSpec
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


def _data_facts(config: GlmImageMoeModel.Config) -> dict[str, Any]:
    # What a DirectToken source checks samples against (docs/design.md section 5); a text source reads the
    # vocabulary size only. A model without image path has no image facts.
    if not config.has_image_path:
        return {"vocab_size": config.vocab_size}
    return {
        "vocab_size": config.vocab_size,
        "codebook_size": config.codebook_size,
        "placeholder_token_id": config.placeholder_token_id,
    }


IMAGE_SOURCES = ("direct_token",)
"""Data source types whose samples hold VQ image tokens: a run that reads one needs the image path."""


def _fit_to_data(
    config: GlmImageMoeModel.Config, source_types: tuple[str, ...]
) -> tuple[GlmImageMoeModel.Config, str | None]:
    """The model a run's data needs: image-token data on a model without image path (a Glm4MoeLite folder or
    recipe) grows the path from the config's image fields; text data leaves the model as it is."""
    images = [s for s in source_types if s in IMAGE_SOURCES]
    if not images or config.has_image_path:
        return config, None
    if config.image_path is False:
        raise ConfigError(
            f"the data holds image tokens (source {images[0]!r}) but --model.image_path is false: drop the flag "
            "(the image path is grown for such data) or train text sources only"
        )
    grown = dataclasses.replace(config, image_path=True)
    return grown, (
        f"image path grown for the {images[0]} data: a {'frozen ' if grown.freeze_vq else ''}VQ codebook "
        f"[{grown.codebook_size}, {grown.vq_embed_dim}], "
        f"vq_to_llm_proj [{grown.dim}, {grown.vq_embed_dim}] and {grown.codebook_size} image rows in the head "
        f"(placeholder id {grown.placeholder_token_id}); the export is the GlmImageMoe form"
    )


def _nextn_prefixes(hf: Mapping[str, Any]) -> tuple[str, ...]:
    # the nextn layer is layer L = num_hidden_layers, under either format's prefix (state_dict.py)
    n = (hf.get("text_config") or hf).get("num_hidden_layers")
    return (f"model.layers.{n}.", f"model.language_model.layers.{n}.")


def _fields_not_in_hf(hf: Mapping[str, Any]) -> tuple[str, ...]:
    # a text-only Glm4MoeLite folder (GLM-4.7-Flash) has no image path: the recipe's (hf_config.py's defaults else)
    if hf.get("model_type") == "glm4_moe_lite":
        return ("codebook_size", "vq_embed_dim", "placeholder_token_id", "image_start_token_id", "image_end_token_id",
                "image_path")  # fmt: skip
    return ()


GLM_IMAGE_MOE_SPEC = ModelSpec(
    name="glm_image_moe",
    model=GlmImageMoeModel,
    # parallelize.py imports the distributed stack; keep `import hyper_parallel.models.glm_image_moe_v2` light.
    parallelize_fn=lazy_function(f"{__name__}.parallelize", "parallelize_glm_image_moe"),
    flavor="glm_image_moe_debug",
    # the export form: a model without image path (a GLM-4.7-Flash run) is written as Glm4MoeLite, else GlmImageMoe
    hf=HFSpec(
        adapter=GlmImageMoeStateDictAdapter,
        config_from_hf=config_from_hf,
        # GLM-4.7-Flash's nextn layer (vLLM glm4_moe_lite_mtp.py), counted by num_nextn_predict_layers
        mtp=HFMtp(
            count_key="num_nextn_predict_layers", config_from_hf=nextn_reader(config_from_hf),
            tensor_prefixes=_nextn_prefixes,
        ),  # fmt: skip
        fields_not_in_hf=_fields_not_in_hf,
    ),
    validate_layout=lazy_function(f"{__name__}.parallelize", "validate_glm_image_moe_layout"),
    # image tokens, text and chat (assistant-only masks from the template), and mixtures of them
    data_sources=("direct_token", "text", "preset_pt", "dummy"),
    data_facts=_data_facts,
    fit_to_data=_fit_to_data,
)
register_spec("glm_image_moe", GLM_IMAGE_MOE_SPEC, aliases=("glm_image_moe_v2",))
from_pretrained, save_pretrained = pretrained_io(GLM_IMAGE_MOE_SPEC)
"""``from_pretrained(path, *, dtype=torch.float32, device="cpu", mtp=False, **config_overrides)``: a
GlmImageMoeModel from an HF folder (GlmImageMoe or plain Glm4MoeLite; sharded or single). ``config_overrides``
replace top-level fields (``image_path=True`` grows an image path on a Glm4MoeLite checkpoint, ``codebook_size``
... its sizes); parts a Glm4MoeLite checkpoint lacks (codebook, projection, image head rows) keep their seeded
initialisation. ``mtp=True``: the nextn layer
``model.layers.{num_hidden_layers}.*`` loads into the MTP block."""
"""``save_pretrained(model, path, *, max_shard_size="5GB", text_only=False, dtype=None, state_dict=None)``:
``text_only=True`` (the default for a model without image path) writes the backbone and head rows ``[0, V)`` as a
plain Glm4MoeLite checkpoint. ``dtype=None``: the dtype of the folder the model was read from."""
