"""kill -9 after (or during) a checkpoint, run the same command again: the loss sequence continues
exactly as in an uninterrupted run (fp32, deterministic mode). One process, and 4 gloo ranks with FSDP.

The kill takes the whole launch (``torchrun`` and every rank, each in a session of its own) and waits until
all of them have exited before the run is resumed (``launch.py``): no orphan writes into the folder meanwhile.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torch.st import launch
from tests.torch.helpers import read_losses

STEPS = 10
ARGS = ["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--debug.deterministic",
        "--metrics.log_freq", "1", "--training.steps", str(STEPS), "--checkpoint.interval", "3",
        "--checkpoint.keep_latest_k", "5", "--checkpoint.no_export_hf",
        "--lr_scheduler.warmup_steps", "2", "--data.max_tokens_per_microbatch", "256"]  # fmt: skip


def _command(dump: Path, nproc: int) -> list[str]:
    args = [*ARGS, "--dump_folder", str(dump), "--data.global_batch_tokens", str(256 * nproc * 2)]
    return launch.train_command(args, nproc)


def _run(dump: Path, nproc: int) -> str:
    return launch.run(_command(dump, nproc))


def _kill_when(dump: Path, nproc: int, ready) -> None:
    """Start the run; as soon as ``ready(checkpoint_folder)`` holds, SIGKILL the whole launch and wait until
    every process of it has exited."""
    folder = dump / "checkpoint"
    launch.kill_when(_command(dump, nproc), lambda: folder.is_dir() and ready(folder))


@pytest.mark.parametrize("nproc", [1, 4], ids=["1proc", "fsdp4"])
def test_kill9_after_checkpoint_resumes_exactly(tmp_path, nproc):
    _run(tmp_path / "whole", nproc)
    _kill_when(tmp_path / "split", nproc, lambda f: (f / "step-6" / ".metadata").is_file())
    _run(tmp_path / "split", nproc)  # the same command again resumes from step 6 (or later)
    a, b = read_losses(tmp_path / "whole"), read_losses(tmp_path / "split")
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    worst = max(abs(a[s] - b[s]) for s in a)
    assert worst <= 1e-6, (worst, a, b)
    assert a[STEPS] < a[1]


def test_kill9_during_checkpoint_write_keeps_previous_checkpoint(tmp_path):
    """Killed while step-6 is being written (its .tmp folder exists, no complete step-6): the next run resumes
    from step 3 and still matches. A kill that lands after the rename is retried, so the test proves the
    partial-write case every time."""
    _run(tmp_path / "whole", 1)
    for attempt in range(4):
        split = tmp_path / f"split{attempt}"
        folder = split / "checkpoint"
        _kill_when(split, 1, lambda f: (f / "step-6.tmp").exists())
        hit_partial = (folder / "step-6.tmp").exists() and not (folder / "step-6" / ".metadata").exists()
        if hit_partial:
            break
    assert hit_partial, "every kill landed after the step-6 write completed"
    complete = sorted(p.name for p in folder.iterdir() if (p / ".metadata").is_file())
    assert complete == ["step-3"], complete
    log = _run(split, 1)
    assert "resumed from" in log and "step-3 at step 3" in log, log[-2000:]
    a, b = read_losses(tmp_path / "whole"), read_losses(split)
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-6
    assert not any(p.name.endswith(".tmp") for p in folder.iterdir())
