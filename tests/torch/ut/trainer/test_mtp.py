"""Multi-token prediction in the Trainer (one process): with the MTP loss weight at 0 a run equals the run
without MTP bit for bit (losses and every trunk weight after the steps), and an MTP run logs ``loss/mtp``
and ``mtp/top1``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hyper_parallel.config import ConfigManager
from hyper_parallel.trainer import Trainer
from tests.torch.helpers import full_tensor

BASE = ["--module", "qwen3_5", "--debug.deterministic", "True", "--metrics.log_freq", "1",
        "--training.steps", "2", "--data.global_batch_tokens", "512", "--checkpoint.enable", "False"]  # fmt: skip


def _run(tmp_path: Path, *args: str) -> tuple[dict, dict[str, torch.Tensor], list[dict]]:
    cfg: Trainer.Config = ConfigManager().parse_args([*BASE, "--dump_folder", str(tmp_path), *args])
    trainer = cfg.build()
    try:
        summary = trainer.train()
        weights = {k: full_tensor(v).detach().clone() for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, weights, records


def test_loss_weight_zero_equals_no_mtp_bit_for_bit(tmp_path):
    plain, plain_w, _ = _run(tmp_path / "plain", "--config", "qwen3_5_debug")
    zero, zero_w, records = _run(tmp_path / "zero", "--config", "qwen3_5_mtp_debug", "--model.mtp_loss_weight", "0")
    assert zero["losses"] == plain["losses"]
    assert set(zero_w) - set(plain_w) and all(k.startswith("mtp.") for k in set(zero_w) - set(plain_w))
    for key, value in plain_w.items():
        assert torch.equal(zero_w[key], value), key
    assert all("loss/mtp" in r and "mtp/top1" in r for r in records)
    assert records[0]["loss/mtp"] > 1.0  # the MTP head was evaluated (its loss is logged, not trained)


def test_dry_run_counts_the_mtp_block():
    """The dry run builds the MTP block (its parameters, gradients, optimizer state) and runs its forward,
    shared head and loss in the simulated step (its activations)."""
    from hyper_parallel.dry_run import main
    from hyper_parallel.models.qwen3_5_v2.config_registry import qwen3_5_mtp_debug

    plain = main(["--module", "qwen3_5", "--config", "qwen3_5_debug", "--world_size", "2"])
    mtp = main(["--module", "qwen3_5", "--config", "qwen3_5_mtp_debug", "--world_size", "2"])
    with torch.device("meta"):
        model = qwen3_5_mtp_debug().model.build()
    n_mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    assert mtp.model_numel - plain.model_numel == n_mtp > 0
    # the MTP layer and the second head pass: at least a T x vocab fp32 logits tensor more (T = 512, V = 512)
    assert mtp.peak["Activation"] - plain.peak["Activation"] >= 512 * 512 * 4
