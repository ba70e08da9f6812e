"""Jobs of the sharded HF load/export test (gloo workers, see ``harness.py``): a Qwen3.5-MoE
ConditionalGeneration folder (written by transformers, plus ``mtp.*`` keys) is loaded into each parallel
layout of one launch, every rank reading only its shards, then exported from every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from hyper_parallel.config import ActivationCheckpointConfig, CompileConfig, TrainingConfig
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.hf import model_state_dict, read_hf_config
from hyper_parallel.hf.storage import HFTensor, StoredTensor
from tests.torch.st.glm_jobs import Layout


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def export_vs_reference(save_pretrained: Any, model: Any, export: Path, reference_export: str) -> dict[str, Any]:
    """Export ``model`` from every rank (small shards: several files); on rank 0, whether the file names
    equal the one-process export's (``files``) and which files differ from it byte for byte (``files_differ``)."""
    save_pretrained(model, export, state_dict=get_model_state_dict(model), max_shard_size="60KB")
    dist.barrier()
    if dist.get_rank() != 0:
        return {}
    ref = Path(reference_export)
    names = sorted(p.name for p in ref.iterdir())
    return {
        "files": sorted(p.name for p in export.iterdir()) == names and len(names) > 3,
        "files_differ": [n for n in names if not (export / n).is_file() or (export / n).read_bytes() != (ref / n).read_bytes()],
    }


def sharded_load_export_job(folder: str, reference_export: str, out_root: str, layouts: list[Layout]) -> dict[str, Any]:
    """Per layout: the keys whose loaded full tensor differs from the one-process load, the bytes this rank
    read from the folder, whether the kept passthrough keys are lazy, and (rank 0) the exported files
    that differ from the one-process export."""
    from hyper_parallel.hf import load_hf_weights
    from hyper_parallel.models.qwen3_5_moe_v2 import config_from_hf, from_pretrained, save_pretrained
    from hyper_parallel.models.qwen3_5_moe_v2.parallelize import parallelize_qwen3_5_moe

    reference = model_state_dict(from_pretrained(folder))  # the one-process load (tiny, on every rank)
    config = config_from_hf(read_hf_config(folder))
    read = {"bytes": 0}
    original = StoredTensor.read_into

    def counting(self: StoredTensor, out: torch.Tensor, box: Any) -> None:
        read["bytes"] += out.numel() * self.dtype.itemsize
        original(self, out, box)

    out: dict[str, Any] = {}
    StoredTensor.read_into = counting  # type: ignore[method-assign]
    try:
        for layout in layouts:
            with torch.device("meta"):
                model = config.build()
            pd = ParallelDims.from_config(layout.parallelism(), dist.get_world_size())
            pd.build_mesh("cpu")
            parallelize_qwen3_5_moe(
                model, parallel_dims=pd, training=TrainingConfig(), parallelism=layout.parallelism(),
                ac_config=ActivationCheckpointConfig(), compile_config=CompileConfig(),
            )  # fmt: skip
            model.to_empty(device="cpu")
            read["bytes"] = 0
            load_hf_weights(model, folder)
            ours = model_state_dict(model)
            result: dict[str, Any] = {
                "read_bytes": read["bytes"],
                "differ": sorted(k for k in reference if not torch.equal(_full(ours[k]), reference[k])),
                "sharded": sorted(k for k, v in ours.items() if isinstance(v, DTensor) and v.to_local().numel() < v.numel()),
                "passthrough_lazy": bool(model.hf_passthrough)
                and all(isinstance(t, HFTensor) for t in model.hf_passthrough.values()),
            }
            result.update(export_vs_reference(save_pretrained, model, Path(out_root) / str(layout), reference_export))
            out[str(layout)] = result
    finally:
        StoredTensor.read_into = original  # type: ignore[method-assign]
    return out
