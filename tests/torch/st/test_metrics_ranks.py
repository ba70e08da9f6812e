"""The console's and ``metrics.jsonl``'s ``memory_gib`` is the fullest rank's peak, not rank 0's: pipeline stages
(the head and loss on the last) and expert shards hold different amounts, and the rank that runs out is the one
a user must see. Each rank here reports a different peak; every rank's record holds the largest."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.slow


def metrics_job(folder: str) -> dict[str, Any]:
    import torch.distributed as dist

    from hyper_parallel.components import metrics

    rank = dist.get_rank()
    real = metrics.peak_memory_gib
    metrics.peak_memory_gib = lambda device=None: 1.0 + 0.5 * ((rank + 1) % dist.get_world_size())  # rank 2 of 4 peaks
    try:
        proc = metrics.MetricsProcessor.Config(log_freq=1, plot_loss=False).build(dump_folder=f"{folder}/r{rank}")
        record = proc.log(1, loss=1.0, num_tokens=8)
        proc.close()
    finally:
        metrics.peak_memory_gib = real
    return {"memory_gib": record["memory_gib"]}


def test_memory_is_the_fullest_ranks_peak(pool, tmp_path):
    results = pool.run(metrics_job, 4, str(tmp_path))
    assert [r["memory_gib"] for r in results] == [2.5] * 4
