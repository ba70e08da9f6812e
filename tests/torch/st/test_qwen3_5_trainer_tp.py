"""Qwen3.5-MoE through the real trainer under tensor parallel (2 gloo ranks): an HF folder written by
transformers loads into the TP-sharded model (HF ``[Q | K | V]`` rows -> our grouped DeltaNet rows ->
per-rank head shards), the step losses equal the one-process run's, and the HF export (gathered shards
-> HF row order) equals the input folder bit for bit (learning rate 0, so the weights do not move).
Training numerics under TP (every first-step gradient, ten SGD steps) are in ``test_qwen3_5_layouts.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

STEPS = 3


def _write_hf_folder(path: Path) -> dict[str, torch.Tensor]:
    """A random ``Qwen3_5MoeForCausalLM`` with the debug recipe's dims, saved by transformers."""
    from safetensors.torch import load_file
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from hyper_parallel.models.qwen3_5_moe_v2 import config_to_hf
    from hyper_parallel.models.qwen3_5_moe_v2.config_registry import qwen3_5_moe_debug

    hf_config = Qwen3_5MoeTextConfig(**config_to_hf(qwen3_5_moe_debug().model))
    torch.manual_seed(11)
    model = Qwen3_5MoeForCausalLM(hf_config)
    with torch.no_grad():  # no symmetric rows: a row-order mistake must change the numbers
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path)
    return load_file(path / "model.safetensors")


def train_job(hf_dir: str, dump: str, extra: list[str]) -> list[float]:
    """Rank-local trainer from ``hf_dir`` with lr 0 and an fp32 HF export; the step losses."""
    import torch.distributed as dist

    from hyper_parallel.config import ConfigManager

    rank = dist.get_rank()  # the trainer's close() ends the process group
    cfg = ConfigManager().parse_args([
        "--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--dump_folder", dump,
        "--checkpoint.initial_load_path", hf_dir, "--checkpoint.no_enable", "--checkpoint.export_hf",
        "--checkpoint.export_dtype", "float32", "--optimizer.lr", "0", "--training.steps", str(STEPS),
        "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--debug.deterministic",
        "--data.global_batch_tokens", "512", "--data.max_tokens_per_microbatch", "256",
        "--data.cache_dir", f"{dump}/cache{rank}", *extra,
    ])  # fmt: skip
    trainer = cfg.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    if rank != 0:
        return []
    return [json.loads(line)["loss"] for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]


def _exported(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("sp", [True, False], ids=["tp2_sp", "tp2"])
def test_tp_trainer_loads_trains_and_exports_hf_exactly(pool, tmp_path, sp):
    weights = _write_hf_folder(tmp_path / "hf_in")
    ref = pool.run(train_job, 1, str(tmp_path / "hf_in"), str(tmp_path / "one"), [])[0]
    tp_args = ["--parallelism.tensor_parallel_degree", "2"]
    tp_args += [] if sp else ["--parallelism.no_enable_sequence_parallel", "--parallelism.no_enable_loss_parallel"]
    got = pool.run(train_job, 2, str(tmp_path / "hf_in"), str(tmp_path / "tp"), tp_args)[0]
    print(f"\nlosses one process {ref}\n       TP 2        {got}")
    assert len(got) == len(ref) == STEPS
    assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-5, (got, ref)
    exported = _exported(tmp_path / "tp" / "hf")
    assert exported.keys() == weights.keys(), sorted(exported.keys() ^ weights.keys())
    differ = [k for k in weights if not torch.equal(exported[k], weights[k])]
    assert not differ, differ[:5]
