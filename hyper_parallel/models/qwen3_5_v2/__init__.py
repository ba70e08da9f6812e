"""Qwen3.5 dense (v2 model package): hybrid Gated DeltaNet / gated attention layers with SwiGLU MLPs.

Registers the ``qwen3_5`` spec (alias ``qwen3_5_v2``) and offers HF I/O: ``from_pretrained(path)`` reads a
``Qwen3_5ForCausalLM`` folder or the text part of a ``Qwen3_5ForConditionalGeneration`` folder (its
``model.visual.*`` / ``mtp.*`` keys are kept and written back); ``save_pretrained(model, path)`` writes the
format the model was loaded from (``Qwen3_5ForCausalLM`` for a model built from a recipe).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hyper_parallel.models.qwen3_5_v2.hf_config import config_to_hf
from hyper_parallel.models.qwen3_5_v2.hf_config import qwen3_5_config_from_hf as config_from_hf
from hyper_parallel.models.qwen3_5_v2.model import Qwen3_5Model, Qwen3_5TransformerBlock, qwen3_5_config
from hyper_parallel.models.qwen3_5_v2.state_dict import (
    CheckpointKeyError,
    Qwen3_5StateDictAdapter,
    load_hf_weights,
    save_hf_state_dict,
)
from hyper_parallel.models.qwen3_5_v2.model import mtp_reader
from hyper_parallel.protocols.hf_io import build_from_hf, save_with_model
from hyper_parallel.protocols.model_spec import ModelSpec, lazy_function, register_spec

__all__ = [
    "CheckpointKeyError",
    "Qwen3_5Model",
    "Qwen3_5StateDictAdapter",
    "Qwen3_5TransformerBlock",
    "config_from_hf",
    "config_to_hf",
    "from_pretrained",
    "qwen3_5_config",
    "save_pretrained",
]


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    mtp: bool = False,
    **config_overrides: Any,
) -> Qwen3_5Model:
    """A ``Qwen3_5Model`` from an HF ``Qwen3_5ForCausalLM`` or ``Qwen3_5ForConditionalGeneration`` folder.

    ``mtp=True``: the MTP block on, with the checkpoint's ``mtp_num_hidden_layers``; its ``mtp.*`` weights load
    into it (without it they are kept as passthrough and written back unchanged).
    """
    return build_from_hf(
        Qwen3_5Model, path, load_weights=load_hf_weights, dtype=dtype, device=device,
        config_overrides=config_overrides, config_from_hf=mtp_reader(config_from_hf) if mtp else config_from_hf,
    )  # fmt: skip


def save_pretrained(
    model: Qwen3_5Model,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    text_only: bool | None = None,
    dtype: torch.dtype | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> list[str]:
    """Write ``model`` (or ``state_dict``, e.g. EMA weights) as an HF folder with ``config.json``.

    ``text_only`` default: the ConditionalGeneration layout (with the kept visual/mtp keys) iff the model was
    loaded from one, else ``Qwen3_5(Moe)ForCausalLM``. Experts are written per expert (what HF writes).
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


QWEN3_5_SPEC = ModelSpec(
    name="qwen3_5",
    model=Qwen3_5Model,
    # parallelize.py imports the distributed stack; keep `import hyper_parallel.models.qwen3_5_v2` light.
    parallelize_fn=lazy_function(f"{__name__}.parallelize", "parallelize_qwen3_5"),
    state_dict_adapter=Qwen3_5StateDictAdapter,
    flavor="qwen3_5_debug",
    from_pretrained=from_pretrained,
    save_pretrained=save_pretrained,
    load_hf_weights=load_hf_weights,
    validate_layout=lazy_function(f"{__name__}.parallelize", "validate_qwen3_5_layout"),
    # data_sources / data_facts: the defaults (text, preset_pt, dummy; the vocabulary size)
)
register_spec("qwen3_5", QWEN3_5_SPEC, aliases=("qwen3_5_v2",))
