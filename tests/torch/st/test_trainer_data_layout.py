"""The data order does not depend on the layout (issue 13), seen through the real entry point on the
embedded DirectToken toy corpus (no preset batches): 1 process, FSDP 2 and FSDP 4, with 0 or 2 data
workers, give the same losses; a checkpoint written on 2 ranks resumes on 4 ranks and on 1 process and
continues the uninterrupted run's losses. An HF folder's passthrough keys survive a 2-rank run."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
ARGS = ["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--debug.deterministic",
        "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_steps", "8",
        "--data.max_tokens_per_microbatch", "256", "--data.global_batch_tokens", "1024"]  # fmt: skip


def _run(dump: Path, nproc: int, *extra: str) -> dict[int, float]:
    export = () if "--checkpoint.export_hf" in extra else ("--checkpoint.no_export_hf",)
    args = [*ARGS, "--dump_folder", str(dump), *export, *extra]
    if nproc == 1:
        cmd = [sys.executable, "-m", "hyper_parallel.train", *args]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(port), "-m", "hyper_parallel.train", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    losses: dict[int, float] = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        losses[rec["step"]] = rec["loss"]  # a resumed run appends: the last record of a step wins
    return losses


def _close(a: dict[int, float], b: dict[int, float], steps) -> float:
    return max(abs(a[s] - b[s]) for s in steps)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """One process, no workers, 8 uninterrupted steps."""
    return _run(tmp_path_factory.mktemp("ref"), 1, "--training.steps", "8", "--checkpoint.no_enable")


def test_same_losses_on_one_two_and_four_ranks_with_and_without_workers(reference, tmp_path):
    fsdp4 = _run(tmp_path / "fsdp4", 4, "--training.steps", "8", "--checkpoint.no_enable",
                 "--data.num_workers", "2")  # fmt: skip
    assert sorted(fsdp4) == sorted(reference) == list(range(1, 9))
    assert _close(fsdp4, reference, range(1, 9)) <= 1e-5, (fsdp4, reference)
    assert reference[8] < reference[1]


def test_checkpoint_from_two_ranks_resumes_on_four_ranks_and_on_one_process(reference, tmp_path):
    first = _run(tmp_path / "two", 2, "--training.steps", "4", "--checkpoint.interval", "4",
                 "--data.num_workers", "2")  # fmt: skip
    assert _close(first, reference, range(1, 5)) <= 1e-5, (first, reference)
    shutil.copytree(tmp_path / "two", tmp_path / "one")
    on_four = _run(tmp_path / "two", 4, "--training.steps", "8", "--checkpoint.interval", "4")
    on_one = _run(tmp_path / "one", 1, "--training.steps", "8", "--checkpoint.interval", "4",
                  "--data.num_workers", "2")  # fmt: skip
    for resumed in (on_four, on_one):
        assert sorted(resumed) == list(range(1, 9))
        assert _close(resumed, reference, range(5, 9)) <= 1e-5, (resumed, reference)


def test_hf_passthrough_keys_survive_a_two_rank_run(tmp_path):
    from safetensors.torch import load_file

    from tests.torch.ut.trainer.test_export import PASSTHROUGH_KEY, write_hf_folder_with_passthrough

    extra = write_hf_folder_with_passthrough(tmp_path / "src", tmp_path / "hf_in")
    _run(tmp_path / "run", 2, "--training.steps", "2", "--checkpoint.no_enable",
         "--checkpoint.initial_load_path", str(tmp_path / "hf_in"), "--checkpoint.export_hf",
         "--checkpoint.export_dtype", "float32", "--parallelism.tensor_parallel_degree", "2")  # fmt: skip
    exported = {}
    for f in sorted((tmp_path / "run" / "hf").glob("*.safetensors")):
        exported.update(load_file(f))
    assert torch.equal(exported[PASSTHROUGH_KEY], extra)
