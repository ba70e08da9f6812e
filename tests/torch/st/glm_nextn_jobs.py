"""Job of the GLM nextn passthrough test (gloo workers, see ``harness.py``): a GlmImageMoe folder holding a
GLM-4.7-Flash nextn layer is loaded with MTP OFF into a parallel layout (every rank reading only its shards)
and exported from every rank; the nextn keys travel as lazy passthrough references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hyper_parallel.hf.convert import read_hf_config
from hyper_parallel.hf.storage import HFTensor
from tests.torch.st import glm_jobs
from tests.torch.st.glm_jobs import Layout
from tests.torch.st.hf_io_jobs import export_vs_reference


def nextn_passthrough_export_job(folder: str, reference_export: str, out_root: str, layout: Layout) -> dict[str, Any]:
    """The nextn keys this rank keeps (and whether all are lazy), and on rank 0 the exported files that differ
    from the one-process export."""
    from hyper_parallel.hf import load_hf_weights
    from hyper_parallel.models.glm_image_moe_v2 import config_from_hf, save_pretrained

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
    result.update(export_vs_reference(save_pretrained, model, Path(out_root) / str(layout), reference_export))
    return result
