"""Qwen3.5-MoE (v2 model package): hybrid Gated DeltaNet / gated attention layers, an MoE in every layer.

Registers the ``qwen3_5_moe`` spec (alias ``qwen3_5_moe_v2``) and offers HF I/O: ``from_pretrained(path)``
reads a ``Qwen3_5MoeForCausalLM`` folder or the text part of a ``Qwen3_5MoeForConditionalGeneration``
folder (``model.visual.*`` / ``mtp.*`` kept and written back); per-expert or fused expert keys in,
per-expert keys out.
"""

from __future__ import annotations

import dataclasses

from hyper_parallel.models.qwen3_5_moe_v2.hf_config import config_from_hf, config_to_hf
from hyper_parallel.models.qwen3_5_moe_v2.model import Qwen3_5MoeModel, Qwen3_5MoeTransformerBlock, qwen3_5_moe_config
from hyper_parallel.models.qwen3_5_moe_v2.state_dict import CheckpointKeyError, Qwen3_5MoeStateDictAdapter
from hyper_parallel.models.qwen3_5_v2 import QWEN3_5_MTP
from hyper_parallel.models.qwen3_5_v2.model import mtp_reader
from hyper_parallel.hf.pretrained import pretrained_io
from hyper_parallel.protocols.hf_spec import HFSpec
from hyper_parallel.protocols.model_spec import ModelSpec, lazy_function, register_spec

__all__ = [
    "CheckpointKeyError",
    "Qwen3_5MoeModel",
    "Qwen3_5MoeStateDictAdapter",
    "Qwen3_5MoeTransformerBlock",
    "config_from_hf",
    "config_to_hf",
    "from_pretrained",
    "qwen3_5_moe_config",
    "save_pretrained",
]

QWEN3_5_MOE_SPEC = ModelSpec(
    name="qwen3_5_moe",
    model=Qwen3_5MoeModel,
    parallelize_fn=lazy_function(f"{__name__}.parallelize", "parallelize_qwen3_5_moe"),
    flavor="qwen3_5_moe_debug",
    # export: the layout it was loaded from (Qwen3_5MoeForCausalLM for a recipe's model)
    hf=HFSpec(
        adapter=Qwen3_5MoeStateDictAdapter, config_from_hf=config_from_hf,
        mtp=dataclasses.replace(QWEN3_5_MTP, config_from_hf=mtp_reader(config_from_hf)),
    ),  # fmt: skip
    validate_layout=lazy_function(f"{__name__}.parallelize", "validate_qwen3_5_moe_layout"),
    # data_sources / data_facts: the defaults (text, preset_pt, dummy; the vocabulary size)
)
register_spec("qwen3_5_moe", QWEN3_5_MOE_SPEC, aliases=("qwen3_5_moe_v2",))
from_pretrained, save_pretrained = pretrained_io(QWEN3_5_MOE_SPEC)
"""``from_pretrained(path, *, dtype=torch.float32, device="cpu", mtp=False, **config_overrides)``: a
``Qwen3_5MoeModel`` from an HF ``Qwen3_5MoeForCausalLM`` or ``Qwen3_5MoeForConditionalGeneration`` folder."""
"""``save_pretrained(model, path, *, max_shard_size="5GB", text_only=None, dtype=None, state_dict=None)``: per-expert
keys, the layout the model was loaded from."""
