"""Intra-op threads: a plain run picks a thread count per local rank (OMP_NUM_THREADS kept when set), logs it
and restores the caller's count.
"""

from __future__ import annotations

import torch


def test_default_intra_op_threads():
    from hyper_parallel.distributed.env import MAX_INTRA_OP_THREADS, default_intra_op_threads

    assert default_intra_op_threads(cpus=2, local_world_size=1) == 1  # the busy 2-core box of the issue
    assert default_intra_op_threads(cpus=1, local_world_size=4) == 1
    assert default_intra_op_threads(cpus=16, local_world_size=2) == 7
    assert default_intra_op_threads(cpus=192, local_world_size=8) == MAX_INTRA_OP_THREADS == 8


def test_intra_op_threads_keeps_the_users_setting(monkeypatch, caplog):
    import logging

    from hyper_parallel.distributed.env import intra_op_threads

    before = torch.get_num_threads()
    log = logging.getLogger("test_intra_op_threads")
    monkeypatch.setenv("OMP_NUM_THREADS", str(before))
    with caplog.at_level(logging.INFO, logger=log.name), intra_op_threads(log) as n:
        assert n == torch.get_num_threads() == before
    assert f"intra-op threads: {before} per rank (OMP_NUM_THREADS={before})" in caplog.text
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr("hyper_parallel.distributed.env.available_cpus", lambda: 9)
    with intra_op_threads(log) as n:
        assert n == torch.get_num_threads() == 4  # (9 - 1) // 2
    assert torch.get_num_threads() == before  # the caller's count is back


def test_plain_run_picks_and_logs_its_threads(tmp_path, monkeypatch, capfd):
    """``python -m hyper_parallel.train`` without OMP_NUM_THREADS (what torch would run: every core)."""
    from hyper_parallel.distributed.env import available_cpus, default_intra_op_threads
    from hyper_parallel.train import main
    from hyper_parallel.trainer import Trainer

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    want = default_intra_op_threads(cpus=available_cpus(), local_world_size=1)
    during = []
    train = Trainer.train

    def recording(self):
        during.append(torch.get_num_threads())
        return train(self)

    monkeypatch.setattr(Trainer, "train", recording)
    before = torch.get_num_threads()
    main(["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--training.steps", "1",
          "--checkpoint.enable", "False", "--dump_folder", str(tmp_path)])  # fmt: skip
    assert during == [want]
    assert torch.get_num_threads() == before
    assert f"intra-op threads: {want} per rank" in capfd.readouterr().err
