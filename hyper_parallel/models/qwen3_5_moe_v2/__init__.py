"""Qwen3.5-MoE (v2 model package): hybrid Gated DeltaNet / gated attention layers, an MoE in every layer.

Registers the ``qwen3_5_moe`` spec (alias ``qwen3_5_moe_v2``) and offers HF I/O: ``from_pretrained(path)``
reads a ``Qwen3_5MoeForCausalLM`` folder or the text part of a ``Qwen3_5MoeForConditionalGeneration``
folder (``model.visual.*`` / ``mtp.*`` kept and written back); per-expert or fused expert keys in,
per-expert keys out.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hyper_parallel.models.qwen3_5_moe_v2.hf_config import config_from_hf, config_to_hf
from hyper_parallel.models.qwen3_5_moe_v2.model import Qwen3_5MoeModel, Qwen3_5MoeTransformerBlock, qwen3_5_moe_config
from hyper_parallel.models.qwen3_5_moe_v2.state_dict import CheckpointKeyError, Qwen3_5MoeStateDictAdapter, load_hf_weights
from hyper_parallel.models.qwen3_5_v2 import save_pretrained as _save_pretrained
from hyper_parallel.models.qwen3_5_v2.model import mtp_reader
from hyper_parallel.protocols.hf_io import build_from_hf
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


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    mtp: bool = False,
    **config_overrides: Any,
) -> Qwen3_5MoeModel:
    """A ``Qwen3_5MoeModel`` from an HF ``Qwen3_5MoeForCausalLM`` or ``Qwen3_5MoeForConditionalGeneration`` folder.

    ``mtp=True``: the MTP block on, with the checkpoint's ``mtp_num_hidden_layers``; its ``mtp.*`` weights load
    into it (without it they are kept as passthrough and written back unchanged).
    """
    return build_from_hf(
        Qwen3_5MoeModel, path, load_weights=load_hf_weights, dtype=dtype, device=device,
        config_overrides=config_overrides, config_from_hf=mtp_reader(config_from_hf) if mtp else config_from_hf,
    )  # fmt: skip


def save_pretrained(
    model: Qwen3_5MoeModel,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    text_only: bool | None = None,
    dtype: torch.dtype | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> list[str]:
    """Write ``model`` (or ``state_dict``) as an HF folder: the layout it was loaded from (``Qwen3_5MoeForCausalLM``
    for a model built from a recipe), per-expert keys."""
    return _save_pretrained(
        model, path, max_shard_size=max_shard_size, text_only=text_only, dtype=dtype, state_dict=state_dict
    )


QWEN3_5_MOE_SPEC = ModelSpec(
    name="qwen3_5_moe",
    model=Qwen3_5MoeModel,
    parallelize_fn=lazy_function(f"{__name__}.parallelize", "parallelize_qwen3_5_moe"),
    state_dict_adapter=Qwen3_5MoeStateDictAdapter,
    flavor="qwen3_5_moe_debug",
    from_pretrained=from_pretrained,
    save_pretrained=save_pretrained,
    load_hf_weights=load_hf_weights,
    validate_layout=lazy_function(f"{__name__}.parallelize", "validate_qwen3_5_moe_layout"),
    # data_sources / data_facts: the defaults (text, preset_pt, dummy; the vocabulary size)
)
register_spec("qwen3_5_moe", QWEN3_5_MOE_SPEC, aliases=("qwen3_5_moe_v2",))
