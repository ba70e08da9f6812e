"""No process group outlives its job or its Trainer (issue 24).

A gloo group runs three threads (``gloo_tcp_loop`` and two ``pt_gloo_runloop``) until the last Python
reference to it goes, and a TCPStore runs ``pt_tcpstore_uv``; ``destroy_process_group()`` stops neither
(see ``hyper_parallel/distributed/teardown.py``). Before the fix every FSDP 2 x TP 2 job left ~28 threads
in each pool worker, forever. Here:

- jobs of several layouts (FSDP 2 x TP 2 with and without SP, CP 2 x EP 2) leave every worker with its
  baseline threads: the gloo/store threads exactly, all threads within ``SPARE_THREADS``;
- two Trainers (FSDP 2 x TP 2) built, trained and closed one after the other in one process leave no
  registered group behind (only the pool's default group) and no group thread once they are collected;
  a run through the command-line entry point (``hyper_parallel.train.main``) leaves none as it returns.
"""

from __future__ import annotations

import gc
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from hyper_parallel.data import ToyCorpusSpec, write_toy_corpus
from tests.torch.procfs import GROUP_THREADS, group_threads, thread_names
from tests.torch.st.glm_jobs import Layout, layout_job, trainer_job

pytestmark = pytest.mark.slow

SPARE_THREADS = 2
"""Allowed growth of a worker's total thread count over its baseline: room for a lazily started helper
thread, but less than one leaked gloo group (3 threads). The group threads themselves must match exactly."""
SETTLE_S = 10.0
"""How long a worker may take to join the threads of the groups it just freed (normally none)."""


def _group_threads(names: Counter[str]) -> dict[str, int]:
    return {name: names[name] for name in GROUP_THREADS}


def _assert_at_baseline(pids: list[int], baseline: dict[int, Counter[str]], after: str) -> None:
    """Every worker back at its baseline (polled for up to ``SETTLE_S``: freed threads are joined, not instant)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = {pid: thread_names(pid) for pid in pids}
        bad = {
            pid: (dict(baseline[pid]), dict(names))
            for pid, names in now.items()
            if _group_threads(names) != _group_threads(baseline[pid])
            or names.total() > baseline[pid].total() + SPARE_THREADS
        }
        if not bad or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not bad, f"after {after}, workers hold more threads than at baseline (baseline, now): {bad}"


def test_pool_workers_return_to_baseline_threads(pool):
    pids = pool.pids()
    pool.run(layout_job, 2, Layout(world=2), 1)  # warm-up: threads that start once per process (queue feeder ...)
    baseline = {pid: thread_names(pid) for pid in pids}
    assert all(_group_threads(names) == dict.fromkeys(GROUP_THREADS, 0) for names in baseline.values()), baseline
    layouts = [
        Layout(world=4, tp=2, sp=False, loss_parallel=False),  # FSDP 2 x TP 2 (the measured leak: +28 per job)
        Layout(world=4, cp=2, ep=2),  # CP 2 x EP 2: all-to-all groups, efsdp view
        Layout(world=4, tp=2),  # FSDP 2 x TP 2 with SP and loss parallel, again: nothing accumulates
    ]
    for layout in layouts:
        pool.run(layout_job, layout.world, layout, 1)
        _assert_at_baseline(pids, baseline, f"a {layout} job")


def two_trainers_job(parallelism: dict[str, Any], dump_folder: str, data_path: str) -> dict[str, Any]:
    """Build, train and close two Trainers in this process; report registered groups and group threads."""
    gc.collect()
    before = group_threads(os.getpid())  # the pool's default group and store
    runs = []
    for run in range(2):
        trainer_job(parallelism, 2, f"{dump_folder}/run{run}", data_path)  # ends with trainer.close()
        registered = len(dist.distributed_c10d._world.pg_map)  # no gc needed: close() destroyed its groups
        gc.collect()  # the dropped Trainer's FSDP reference cycles are what could still hold a group object
        runs.append({"registered_groups": registered, "group_threads": group_threads(os.getpid())})
    # The command-line entry point frees what its model held before it returns (no gc here): left to
    # interpreter exit, a live gloo group's threads once aborted a finished 2-rank run in CI.
    from hyper_parallel import train

    train.main(["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--training.steps", "1",
                "--checkpoint.no_enable", "--checkpoint.no_export_hf", "--metrics.no_plot_loss",
                "--data.path", data_path, "--data.max_tokens_per_microbatch", "256", "--data.global_batch_tokens",
                "0", "--data.pad_to_multiple_of", "2", "--dump_folder", f"{dump_folder}/cli",
                *[f"--parallelism.{k}={v}" for k, v in parallelism.items()]])  # fmt: skip
    runs.append({"registered_groups": len(dist.distributed_c10d._world.pg_map),
                 "group_threads": group_threads(os.getpid())})  # fmt: skip
    return {"before": before, "runs": runs}


@pytest.fixture(scope="module")
def toy_shards(tmp_path_factory) -> Path:
    from hyper_parallel.models.glm_image_moe_v2.config_registry import glm_image_moe_debug

    model = glm_image_moe_debug().model
    spec = ToyCorpusSpec(
        lang_vocab_size=model.vocab_size,
        codebook_size=model.codebook_size,
        placeholder_token_id=model.placeholder_token_id,
        num_samples=128,
        samples_per_shard=64,
    )
    path = tmp_path_factory.mktemp("teardown") / "shards"
    write_toy_corpus(str(path), spec)
    return path


def test_two_trainers_in_one_process_leave_no_groups(pool, toy_shards, tmp_path):
    pids = pool.pids()
    pool.run(layout_job, 2, Layout(world=2), 1)  # warm-up, as above
    baseline = {pid: thread_names(pid) for pid in pids}
    parallelism = dict(data_parallel_shard_degree=2, tensor_parallel_degree=2)
    results = pool.run(two_trainers_job, 4, parallelism, str(tmp_path), str(toy_shards))
    for rank, out in enumerate(results):
        for run, got in enumerate(out["runs"]):
            assert got["registered_groups"] == 1, f"rank {rank}, trainer {run}: groups left registered {got}"
            assert got["group_threads"] == out["before"], f"rank {rank}, trainer {run}: {got} vs {out['before']}"
    _assert_at_baseline(pids, baseline, "two trainers")
