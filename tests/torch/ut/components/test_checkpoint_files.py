"""Checkpoint side files load weights-only, and the loss curve after a resume starts where the run started.
"""

from __future__ import annotations

import json

import pytest
import torch


class Payload:
    """A pickled object of a type no checkpoint holds."""


def test_checkpoint_side_files_are_weights_only(tmp_path):
    from hyper_parallel.components.checkpoint import (
        UnsafeCheckpointError,
        get_rng_state,
        load_side_file,
        save_side_file,
    )

    import random

    import numpy as np

    state = {"rng": get_rng_state(), "loader": {"order": np.arange(5, dtype=np.uint32), "n": np.int64(3)}}
    save_side_file(state, tmp_path / "rank0.pt")
    back = load_side_file(tmp_path / "rank0.pt")
    assert back["rng"]["python"] == random.getstate() and back["loader"]["n"] == 3
    np.testing.assert_array_equal(back["rng"]["numpy"][1], np.random.get_state()[1])
    assert back["loader"]["order"].dtype == np.uint32
    torch.save({"rng": Payload()}, tmp_path / "rank1.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"rank1.pt holds a pickled object of type .*Payload"):
        load_side_file(tmp_path / "rank1.pt")


def test_loss_curve_after_a_resume_starts_where_the_run_started(tmp_path):
    from hyper_parallel.components.metrics import MetricsProcessor

    lines = [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3)] + [{"step": 2, "loss": 9.0, "val/loss": 8.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 3, "lo')
    metrics = MetricsProcessor.Config(log_freq=1).build(dump_folder=tmp_path, total_steps=5)
    try:
        for step in (4, 5):
            metrics.log(step, loss=1.0, num_tokens=8)
        assert metrics._earlier_records(4) == ([(1, 4.0), (2, 9.0), (3, 2.0)], [(2, 8.0)])
        assert metrics.plot() is not None
    finally:
        metrics.close()
