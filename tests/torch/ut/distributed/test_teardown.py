"""Two Trainers built one after the other in one process leave no process group and no group thread.

One process, no torchrun: each Trainer creates the default (gloo) group itself, so its ``close()`` must
destroy it, and every mesh group it made. A gloo group's threads stop only when its last reference is
dropped (``hyper_parallel/distributed/teardown.py``); before the fix DTensor's mesh caches kept the
first trainer's mesh, and with it its group, for the life of the process.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch.distributed as dist

from hyper_parallel.config import ConfigManager
from hyper_parallel.distributed.teardown import clear_dtensor_mesh_caches
from tests.torch.procfs import group_threads

ARGS = ["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--training.steps", "2",
        "--metrics.log_freq", "1", "--metrics.no_plot_loss", "--checkpoint.no_enable", "--checkpoint.no_export_hf",
        "--data.global_batch_tokens", "512"]  # fmt: skip


def test_two_trainers_one_after_the_other_leave_no_groups_or_threads(tmp_path: Path):
    assert not dist.is_initialized()
    clear_dtensor_mesh_caches()  # what earlier tests in this process may have left, so the baseline is stable
    gc.collect()
    before = group_threads(os.getpid())
    for run in range(2):
        trainer = ConfigManager().parse_args([*ARGS, "--dump_folder", str(tmp_path / f"run{run}")]).build()
        try:
            summary = trainer.train()
        finally:
            trainer.close()
        assert summary["steps"] == 2
        assert not dist.is_initialized(), "close() must destroy the default group the trainer created"
        del trainer
        gc.collect()  # the Trainer's FSDP reference cycles: a cycle is freed by a collection, not by `del`
        assert group_threads(os.getpid()) == before, f"trainer {run} left group threads running"
