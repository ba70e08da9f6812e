"""MetricsProcessor: jsonl records on log steps, derived numbers (tps, MFU, expert load), the PNG."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch

from hyper_parallel.components import MetricsProcessor, measure_peak_flops


def test_jsonl_console_and_loss_curve(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    metrics = MetricsProcessor.Config(log_freq=2).build(
        dump_folder=tmp_path, total_steps=5, flops_per_token=1e6, peak_flops=1e12
    )
    load = {"layers.1.mlp": torch.tensor([4.0, 2.0, 2.0, 0.0]), "layers.2.mlp": torch.tensor([1, 1, 1, 1])}
    emitted = []
    with caplog.at_level(logging.INFO, logger="hyper_parallel.components.metrics"):
        for step in range(1, 6):
            record = metrics.log(
                step, loss=torch.tensor(5.0 - step), grad_norm=1.5, lr=1e-3, num_tokens=1000, expert_load=load
            )
            emitted.append(record is not None)
    metrics.close()
    assert emitted == [True, True, False, True, True]  # step 1, every 2nd step, the last step

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 4, 5]
    r = lines[2]
    assert r["loss"] == 1.0 and r["grad_norm"] == 1.5 and r["lr"] == 1e-3
    assert r["tps"] > 0 and r["memory_gib"] > 0
    assert r["mfu"] == pytest.approx(100 * r["tps"] * 1e6 / 1e12)
    assert r["expert_load/layers.1.mlp"] == pytest.approx(2.0)  # max 4 / mean 2
    assert r["expert_load/layers.2.mlp"] == pytest.approx(1.0)

    console = [m for m in caplog.messages if m.startswith("step")]
    assert len(console) == 4 and "5/5" in console[-1] and "eta" in console[-1] and "mfu" in console[-1]

    png = (tmp_path / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert metrics.loss_history == [(s, 5.0 - s) for s in range(1, 6)]


def test_measure_peak_flops_on_cpu() -> None:
    flops = measure_peak_flops("cpu", torch.float32)
    assert 1e8 < flops < 1e14


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_missing_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ImportError, match="enable_tensorboard"):
        MetricsProcessor.Config(enable_tensorboard=True).build(dump_folder=tmp_path)
