"""Qwen3-VL-MoE, Qwen3-VL (dense), Qwen3.5-MoE and Qwen3.5 (dense) vision-language models (v2 model package).

Registers the ``qwen3_vl_moe`` spec (alias ``qwen3_vl_moe_v2``; data source ``vision_language``) and offers
HF I/O: ``from_pretrained(path)`` reads a ``Qwen3VLMoeForConditionalGeneration``, ``Qwen3VLForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration`` or ``Qwen3_5ForConditionalGeneration`` folder (the text decoder is
picked by its ``model_type``; ``mtp=True``: the Qwen3.5(-MoE) MTP block on, its ``mtp.*`` keys
loaded into it; without it they are kept and written back); ``save_pretrained(model, path)`` writes it back
(the fused-expert layout it was read in; with MTP, ``text_config.mtp_num_hidden_layers``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hyper_parallel.models.qwen3_5_v2 import QWEN3_5_MTP
from hyper_parallel.models.qwen3_5_v2.model import mtp_reader
from hyper_parallel.models.qwen3_vl_moe_v2.model import (
    Qwen3VlMoeModel,
    qwen3_5_moe_vl_config,
    qwen3_5_vl_config,
    qwen3_vl_config,
    qwen3_vl_moe_config,
)
from hyper_parallel.models.qwen3_vl_moe_v2.state_dict import CheckpointKeyError, Qwen3VlMoeStateDictAdapter, config_from_hf
from hyper_parallel.hf.pretrained import pretrained_io
from hyper_parallel.protocols.hf_spec import HFSpec
from hyper_parallel.protocols.model_spec import ModelSpec, lazy_function, register_spec

__all__ = [
    "CheckpointKeyError",
    "Qwen3VlMoeModel",
    "Qwen3VlMoeStateDictAdapter",
    "from_pretrained",
    "qwen3_5_moe_vl_config",
    "qwen3_5_vl_config",
    "qwen3_vl_config",
    "qwen3_vl_moe_config",
    "save_pretrained",
]


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
    flavor="qwen3_vl_moe_debug",
    # the export writes the fused-expert layout the model was read in (Qwen3-VL-MoE), "memory" for a recipe's model
    hf=HFSpec(
        adapter=Qwen3VlMoeStateDictAdapter,
        config_from_hf=config_from_hf,
        # a Qwen3.5-MoE ConditionalGeneration folder's MTP block (Qwen3-VL-MoE folders have none)
        mtp=dataclasses.replace(QWEN3_5_MTP, config_from_hf=mtp_reader(config_from_hf)),
        load_options=("experts_layout",),
    ),
    validate_layout=lazy_function(f"{__name__}.parallelize", "validate_qwen3_vl_moe_layout"),
    data_sources=("vision_language", "preset_pt"),
    data_facts=_data_facts,
)
register_spec("qwen3_vl_moe", QWEN3_VL_MOE_SPEC, aliases=("qwen3_vl_moe_v2",))
from_pretrained, save_pretrained = pretrained_io(QWEN3_VL_MOE_SPEC)
"""``from_pretrained(path, *, dtype=torch.float32, device="cpu", mtp=False, experts_layout=None, **config_overrides)``:
a ``Qwen3VlMoeModel`` from an HF ConditionalGeneration folder (every key and shape checked). ``experts_layout``
(Qwen3-VL-MoE fused experts): default from the folder's ``config.json``. ``mtp=True``: the Qwen3.5-MoE MTP block
on (an error names ``text_config.mtp_num_hidden_layers`` when the folder has none, e.g. any Qwen3-VL-MoE one)."""
"""``save_pretrained(model, path, *, max_shard_size="5GB", dtype=None, state_dict=None, experts_layout=None)``."""
