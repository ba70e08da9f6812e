"""What a run promises around the loop: the NaN guard fires inside ``train()`` before a due checkpoint, skipped
samples reach metrics.jsonl, a checkpoint made with other data says what to do, the profiler writes a trace.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyper_parallel.trainer import NonFiniteError, Trainer
from tests.torch.helpers import run_trainer, trainer_config
from tests.torch.ut.trainer.test_accumulation import _facts, _records
from tests.torch.ut.trainer.test_export import BASE


def test_nonfinite_guard_fires_inside_train_before_a_due_checkpoint(tmp_path):
    """Step 2 is poisoned and a checkpoint is due at step 2: the run stops naming step 2, nothing is saved."""
    trainer = trainer_config(BASE, tmp_path, "--training.steps", "4", "--checkpoint.interval", "2").build()
    step = trainer.train_step

    def poisoned_step():
        if trainer.step == 2:
            with torch.no_grad():
                trainer.model.norm.weight.fill_(float("nan"))
        return step()

    trainer.train_step = poisoned_step
    try:
        with pytest.raises(NonFiniteError, match="step 2: loss=nan"):
            trainer.train()
    finally:
        trainer.close()
    assert not list((tmp_path / "checkpoint").glob("step-*"))


def test_skipped_samples_reach_metrics_jsonl(tmp_path):
    """A corpus with bad samples, `--data.on_bad_sample skip`: the count is in every metrics record."""
    from hyper_parallel.data import DirectTokenWriter

    cfg = trainer_config(BASE, tmp_path)
    facts = _facts(cfg)
    shards = tmp_path / "shards"
    rng = torch.Generator().manual_seed(0)
    with DirectTokenWriter(str(shards), placeholder_token_id=facts["placeholder_token_id"]) as w:
        for i in range(40):
            tokens = torch.randint(0, 100, (30,), generator=rng).numpy().astype("int32")
            if i % 10 == 3:
                tokens[5] = facts["vocab_size"] + 7  # a token outside the vocabulary: a bad sample
            w.write(tokens)
    cfg = trainer_config(BASE, tmp_path / "run", "--data.path", str(shards), "--data.on_bad_sample", "skip",
                  "--data.max_tokens_per_microbatch", "128", "--training.steps", "2",
                  "--checkpoint.no_enable", "--checkpoint.no_export_hf")  # fmt: skip
    run_trainer(cfg)
    records = _records(tmp_path / "run")
    assert all("bad_samples_skipped" in r for r in records), records[0]
    assert records[-1]["bad_samples_skipped"] >= 1


def test_resuming_with_other_data_says_what_to_do_and_the_flag_restarts_the_stream(tmp_path):
    common = ("--training.steps", "2", "--checkpoint.interval", "2", "--checkpoint.no_export_hf")
    run_trainer(trainer_config(BASE, tmp_path, *common))
    with pytest.raises(ValueError, match="restart_data_stream"):
        run_trainer(trainer_config(BASE, tmp_path, "--training.steps", "4", "--data.seed", "5", *common[2:]))
    trainer, summary = run_trainer(trainer_config(BASE, tmp_path, "--training.steps", "4", "--data.seed", "5",
                                    "--checkpoint.restart_data_stream", *common[2:]))  # fmt: skip
    assert summary["steps"] == 4 and len(summary["losses"]) == 2  # resumed at step 2 with a fresh stream


def test_profiler_writes_a_trace_after_a_three_step_run(tmp_path):
    cfg = trainer_config(BASE, tmp_path, "--training.steps", "3", "--checkpoint.no_enable", "--checkpoint.no_export_hf",
                  "--profiling.enable_profiling", "--profiling.profile_freq", "3", "--profiling.profiler_warmup", "1",
                  "--profiling.profiler_active", "1")  # fmt: skip
    run_trainer(cfg)
    traces = list((tmp_path / "profile_traces").rglob("rank0_trace.json"))
    assert traces and traces[0].stat().st_size > 1000, traces
