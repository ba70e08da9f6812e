"""Job of the GLM nextn passthrough test (gloo workers, see ``harness.py``): a GlmImageMoe folder holding a
GLM-4.7-Flash nextn layer is loaded with MTP OFF into a parallel layout (every rank reading only its shards)
and exported from every rank; the nextn keys travel as lazy passthrough references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from hyper_parallel.protocols.hf_io import read_hf_config
from hyper_parallel.protocols.hf_storage import HFTensor
from tests.torch.st import glm_jobs
from tests.torch.st.glm_jobs import Layout


def nextn_passthrough_export_job(folder: str, reference_export: str, out_root: str, layout: Layout) -> dict[str, Any]:
    """The nextn keys this rank keeps (and whether all are lazy), and on rank 0 the exported files that differ
    from the one-process export."""
    from hyper_parallel.models.glm_image_moe_v2 import config_from_hf, load_hf_weights, save_pretrained

    config = config_from_hf(read_hf_config(folder))
    assert config.mtp is None
    with torch.device("meta"):
        model = config.build()
    glm_jobs.parallelize(model, layout)
    model.to_empty(device="cpu")
    load_hf_weights(model, folder)
    kept = sorted(k for k in model.hf_passthrough if ".layers." in k)
    result: dict[str, Any] = {
        "kept": kept,
        "lazy": all(isinstance(t, HFTensor) for t in model.hf_passthrough.values()),
    }
    export = Path(out_root) / str(layout)
    save_pretrained(model, export, state_dict=get_model_state_dict(model), max_shard_size="60KB")
    dist.barrier()
    if dist.get_rank() == 0:
        ref = Path(reference_export)
        names = sorted(p.name for p in ref.iterdir())
        result["files"] = sorted(p.name for p in export.iterdir()) == names and len(names) > 3
        result["files_differ"] = [
            n for n in names if not (export / n).is_file() or (export / n).read_bytes() != (ref / n).read_bytes()
        ]
    return result
