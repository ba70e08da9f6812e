"""The HF checkpoint engine (floor 3: imports config, protocols, models.common; never a model family).

A family supplies its key mapping and config conversion (``ModelSpec.hf``, ``protocols.hf_spec.HFSpec``); this
package does the rest, once for every family:

- ``storage``: safetensors folders read lazily per rank (each rank reads its shards' boxes) and written per rank
  (``save_converted``; a pipeline-parallel export passes its stage group as ``stages``); ``shard_gather``;
- ``quant``: block-FP8 releases dequantized per box on load;
- ``convert``: the adapter contract (``CheckedStateDictAdapter`` and its hooks) and the key-mapping helpers;
  ``rope`` / ``tied_head``: the RoPE keys of config.json and tied heads, as every family reads them;
- ``load``: ``load_hf_weights`` (the one loader); ``save``: ``save_hf_state_dict`` / ``save_pretrained`` (the one
  export); ``pretrained``: ``from_pretrained``;
- ``folder``: an HF folder is a model (which family reads it, checked once at the run's entry point; the run's
  model config); ``serving``: the files a server needs beside an export; ``lora_export``: PEFT / vLLM adapters.
"""

from hyper_parallel.hf.convert import CheckedStateDictAdapter, CheckpointKeyError, HFLoadResult, read_hf_config
from hyper_parallel.hf.load import load_hf_weights, model_state_dict
from hyper_parallel.hf.pretrained import from_pretrained
from hyper_parallel.hf.quant import UnsupportedQuantizationError
from hyper_parallel.hf.save import save_hf_state_dict, save_pretrained
from hyper_parallel.hf.storage import HFCheckpointError, parse_size, read_safetensors, write_safetensors

__all__ = [
    "CheckedStateDictAdapter",
    "CheckpointKeyError",
    "HFCheckpointError",
    "HFLoadResult",
    "UnsupportedQuantizationError",
    "from_pretrained",
    "load_hf_weights",
    "model_state_dict",
    "parse_size",
    "read_hf_config",
    "read_safetensors",
    "save_hf_state_dict",
    "save_pretrained",
    "write_safetensors",
]
