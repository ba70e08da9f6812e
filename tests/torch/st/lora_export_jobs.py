"""Jobs of the sharded LoRA export test (gloo workers, ``harness.py``): the ``qwen3_5_moe_debug`` recipe through the
real ``Trainer`` with adapters on every linear projection and on the routed experts, the LM head trained in full,
started from a tiny HF folder written by our own export. Per layout the adapters (and the head) are set to the
same seeded values on every layout (each rank writes its own shard, as DTensor distributes the full value), then
``Trainer.export_hf`` writes the PEFT adapter folder and the merged export from every rank; rank 0 reads them back.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.torch.st.lora_jobs import write_hf_folder as write_base  # one tiny HF folder writer for both files

BASE = [
    "--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--checkpoint.export_dtype", "float32",
    "--lora.rank", "4", "--lora.alpha", "8", "--lora.targets", "all-linear", "experts",
    "--lora.modules_to_save", "lm_head", "--lora.export_merged", "True", "--metrics.no_plot_loss",
]  # fmt: skip

LAYOUTS = {
    "one_process": [],
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
    "ep2": ["--parallelism.expert_parallel_degree", "2"],
}


@torch.no_grad()
def _set_trained_(trainer: Any) -> None:
    """Every trained parameter (adapters, the head) to a value seeded by its name, the same on every layout."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from hyper_parallel.hf.convert import full_tensor

    for name, p in trainer.model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        if not p.requires_grad:
            continue
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        full = 0.05 * torch.randn(tuple(p.shape), generator=gen, dtype=torch.float32).to(p.dtype)
        if "lora_" not in name:  # a trained module: its loaded weight plus noise
            full = full + full_tensor(p).cpu()
        if isinstance(p, DTensor):
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
        else:
            p.copy_(full)


def export_job(labels: list[str], folder: str, out: str) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """For each layout: build the trainer, set the trained values, export; rank 0 returns every exported tensor."""
    from hyper_parallel.config.manager import ConfigManager
    from hyper_parallel.hf import read_safetensors

    results: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for label in labels:
        dump = Path(out) / label
        args = [*BASE, *LAYOUTS[label], "--dump_folder", str(dump), "--checkpoint.initial_load_path", folder]
        trainer = ConfigManager().parse_args(args).build()
        try:
            _set_trained_(trainer)
            trainer.export_hf(dump / "hf")
        finally:
            trainer.close()
        if not dist.is_initialized() or dist.get_rank() == 0:
            results[label] = {form: read_safetensors(dump / "hf" / form) for form in ("adapter", "merged")}
    return results
