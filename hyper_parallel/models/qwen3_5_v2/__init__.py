"""Qwen3.5 dense (v2 model package): hybrid Gated DeltaNet / gated attention layers with SwiGLU MLPs.

Registers the ``qwen3_5`` spec (alias ``qwen3_5_v2``) and offers HF I/O: ``from_pretrained(path)`` reads a
``Qwen3_5ForCausalLM`` folder or the text part of a ``Qwen3_5ForConditionalGeneration`` folder (its
``model.visual.*`` / ``mtp.*`` keys are kept and written back); ``save_pretrained(model, path)`` writes the
format the model was loaded from (``Qwen3_5ForCausalLM`` for a model built from a recipe).
"""

from __future__ import annotations

from hyper_parallel.models.qwen3_5_v2.hf_config import config_to_hf
from hyper_parallel.models.qwen3_5_v2.hf_config import qwen3_5_config_from_hf as config_from_hf
from hyper_parallel.models.qwen3_5_v2.model import Qwen3_5Model, Qwen3_5TransformerBlock, mtp_reader, qwen3_5_config
from hyper_parallel.models.qwen3_5_v2.state_dict import CheckpointKeyError, Qwen3_5StateDictAdapter
from hyper_parallel.hf.pretrained import pretrained_io
from hyper_parallel.protocols.hf_spec import HFMtp, HFSpec
from hyper_parallel.protocols.model_spec import ModelSpec, lazy_function, register_spec

__all__ = [
    "CheckpointKeyError",
    "QWEN3_5_MTP",
    "Qwen3_5Model",
    "Qwen3_5StateDictAdapter",
    "Qwen3_5TransformerBlock",
    "config_from_hf",
    "config_to_hf",
    "from_pretrained",
    "qwen3_5_config",
    "save_pretrained",
]

QWEN3_5_MTP = HFMtp(
    count_key="mtp_num_hidden_layers",  # vLLM qwen3_5_mtp.py reads it (text_config of a ConditionalGeneration folder)
    config_from_hf=mtp_reader(config_from_hf),
    tensor_prefixes=lambda hf: ("mtp.",),
)
"""Qwen3.5 folders' MTP block: ``mtp.*`` tensors, counted by ``mtp_num_hidden_layers`` (shared by the MoE family)."""

QWEN3_5_SPEC = ModelSpec(
    name="qwen3_5",
    model=Qwen3_5Model,
    # parallelize.py imports the distributed stack; keep `import hyper_parallel.models.qwen3_5_v2` light.
    parallelize_fn=lazy_function(f"{__name__}.parallelize", "parallelize_qwen3_5"),
    flavor="qwen3_5_debug",
    # export: the ConditionalGeneration layout (with the kept visual/mtp keys) iff the model was loaded from one,
    # else Qwen3_5(Moe)ForCausalLM; experts are written per expert (what HF writes)
    hf=HFSpec(adapter=Qwen3_5StateDictAdapter, config_from_hf=config_from_hf, mtp=QWEN3_5_MTP),
    validate_layout=lazy_function(f"{__name__}.parallelize", "validate_qwen3_5_layout"),
    # data_sources / data_facts: the defaults (text, preset_pt, dummy; the vocabulary size)
)
register_spec("qwen3_5", QWEN3_5_SPEC, aliases=("qwen3_5_v2",))
from_pretrained, save_pretrained = pretrained_io(QWEN3_5_SPEC)
"""``from_pretrained(path, *, dtype=torch.float32, device="cpu", mtp=False, **config_overrides)``: a ``Qwen3_5Model``
from an HF ``Qwen3_5ForCausalLM`` or ``Qwen3_5ForConditionalGeneration`` folder (``mtp=True``: the MTP block on,
its ``mtp.*`` weights loaded; ``None``: on iff the folder ships one)."""
"""``save_pretrained(model, path, *, max_shard_size="5GB", text_only=None, dtype=None, state_dict=None)``."""
