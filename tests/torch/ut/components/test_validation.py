"""Validation during training and W&B (issue 34), on one process with the tiny GlmImageMoe.

- ``validation.split`` holds out the same samples (by sample id) on 1 and 4 DP ranks, the 4 ranks read the same
  validation micro-batches as one, and none of the held-out samples is in the training stream;
- a run validating every step on separate data (MoE bias update on, deterministic) trains bit-identically to
  one without validation, and ``val/loss`` is the exact token mean of the validation data (checked by hand);
- a mixture validates every source (``val/<name>/loss``; their token-weighted mean is ``val/loss``);
- a resumed run continues the validation schedule, the best-so-far and the early-stop count (the same records
  as an uninterrupted run); ``early_stop_patience`` stops both at the same step; ``checkpoint.keep_best`` keeps
  the step of the best ``val/loss`` beside the newest checkpoint;
- ``--metrics.wandb`` with ``WANDB_MODE=offline`` writes a run whose history (read back with wandb's own
  reader) has ``loss`` and ``val/loss`` at the logged steps; a missing package / failed start is an error at
  build time; the v1 key ``train.use_wandb`` maps to it.
"""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hyper_parallel.components import MetricsProcessor
from hyper_parallel.config.legacy import translate_legacy
from hyper_parallel.data import DataConfig, ToyCorpusSpec, write_toy_corpus
from hyper_parallel.data.holdout import Holdout
from tests.torch.helpers import run_trainer, trainer_config

FACTS = dict(lang_vocab_size=512, codebook_size=256, placeholder_token_id=511)
MODEL_FACTS = {"vocab_size": 512, "codebook_size": 256, "placeholder_token_id": 511}
BASE = ["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--debug.deterministic",
        "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1", "--data.max_tokens_per_microbatch", "256",
        "--data.global_batch_tokens", "512", "--checkpoint.no_export_hf"]  # fmt: skip


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("val_corpora")
    out = {}
    for name, n, seed, text in (("val", 12, 7, 0.1), ("textval", 8, 8, 1.0), ("train", 160, 3, 0.1)):
        write_toy_corpus(str(root / name), ToyCorpusSpec(**FACTS, num_samples=n, samples_per_shard=8, seed=seed,
                                                         text_only_fraction=text))  # fmt: skip
        out[name] = str(root / name)
    out["cache"] = str(root / "cache")
    return out


def _records(dump: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """``(validation records, training records)`` by step; a resumed run appends (the last record wins)."""
    val, train = {}, {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        (val if "val/loss" in rec else train)[rec["step"]] = rec
    return val, train


def _val_args(corpora, *extra: str) -> list[str]:
    return ["--validation.freq", "1", "--validation.data.path", corpora["val"], "--validation.data.cache_dir",
            corpora["cache"], "--validation.data.max_tokens_per_microbatch", "256", *extra]  # fmt: skip


# -- the held-out split ------------------------------------------------------------------------------
def _loader(corpora, side: str, rank: int = 0, world: int = 1, **kw):
    cfg = DataConfig(path=corpora["train"], cache_dir=corpora["cache"], max_tokens_per_microbatch=256,
                     shuffle_buffer=32)  # fmt: skip
    return cfg.build(dp_rank=rank, dp_world_size=world, model_facts=MODEL_FACTS, holdout=Holdout(0.2, side), **kw)


def test_split_is_the_same_on_1_and_4_ranks_and_leaves_the_training_stream(corpora):
    one = _loader(corpora, "validation", single_pass=True)
    total = one.pass_micro_batches
    held = [one.record_ids(g) for g in range(total)]
    one.load_state_dict(one.state_dict())  # back to the start (record_ids planned ahead; nothing was read)
    held_ids = {i for ids in held for i in ids}
    assert 0.1 < len(held_ids) / 160 < 0.3 and sum(map(len, held)) == len(held_ids)  # each sample once
    one_batches = [mb for _ in range(total) for mb in one.next_step()]
    # 4 ranks: rank r reads global micro-batches r, r + 4, ...: the same micro-batches as one process
    ranks = [_loader(corpora, "validation", r, 4, single_pass=True) for r in range(4)]
    assert {r.pass_micro_batches for r in ranks} == {total}
    for k in range(math.ceil(total / 4)):
        for r, loader in enumerate(ranks):
            g = k * 4 + r
            ids = loader.record_ids(g)
            (mb,) = loader.next_step()
            if g < total:
                assert ids == held[g]
                assert torch.equal(mb["input_ids"], one_batches[g]["input_ids"]), g
    # the training side on 4 ranks, two epochs: every other sample, none of the held-out ones
    seen = set()
    train = [_loader(corpora, "train", r, 4) for r in range(4)]
    for _ in range(12):
        for r, loader in enumerate(train):
            for g in loader.my_micro_batches(loader.next_micro_batch):
                seen.update(loader.record_ids(g))
            loader.next_step()
    assert seen and not seen & held_ids
    assert len(seen) + len(held_ids) == 160
    # a checkpointed training stream with a split refuses to resume without it
    assert train[0].state_dict()["order"]["holdout"] == [0.2, "train"]


# -- no change to training; the exact token mean -------------------------------------------------------
def test_validation_leaves_training_bit_identical_and_is_the_token_mean(corpora, tmp_path):
    common = ["--training.steps", "2", "--checkpoint.no_enable", "--training.moe_bias_update_rate", "0.01"]
    _, plain = run_trainer(trainer_config(BASE, tmp_path / "plain", *common))
    trainer, summary = run_trainer(trainer_config(BASE, tmp_path / "val", *common, *_val_args(corpora)))
    assert summary["losses"] == plain["losses"]  # bit-equal: counters, RNG, data untouched
    a, b = _records(tmp_path / "plain")[1], _records(tmp_path / "val")[1]
    assert [a[s]["grad_norm"] for s in a] == [b[s]["grad_norm"] for s in b]
    val = _records(tmp_path / "val")[0]
    assert sorted(val) == [0, 1, 2]
    # val/loss by hand: every micro-batch of one pass of the validation data, the summed CE over labelled
    # tokens divided by their count (the validator's loader is rewound; the trainer's weights after step 2)
    loader = trainer.validator.loader
    loader.load_state_dict(trainer.validator.streams[0].start)
    total, count = 0.0, 0
    with torch.no_grad():
        for _ in range(loader.pass_micro_batches):
            (mb,) = loader.next_step()
            logits = trainer.model(mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"],
                                   max_seqlen=mb["max_seqlen"], visual_indices=mb.get("visual_indices"),
                                   vq_codes=mb.get("vq_codes"))  # fmt: skip
            logits = getattr(logits, "logits", logits)
            total += F.cross_entropy(logits.float().flatten(0, 1), mb["labels"].flatten(), reduction="sum").item()
            count += int((mb["labels"] != -100).sum())
    assert val[2]["val/tokens"] == count
    assert abs(val[2]["val/loss"] - total / count) <= 1e-5, (val[2]["val/loss"], total / count)
    assert val[2]["val/ppl"] == pytest.approx(math.exp(val[2]["val/loss"]))
    assert (tmp_path / "val" / "loss_curve.png").stat().st_size > 1000


def test_mixture_validates_every_source(corpora, tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text(
        f"""
[validation.data]
max_tokens_per_microbatch = 256
cache_dir = "{corpora['cache']}"

[[validation.data.sources]]
name = "images"
path = "{corpora['val']}"
direct_token = {{ loss_on = "image" }}

[[validation.data.sources]]
name = "text"
path = "{corpora['textval']}"
"""
    )
    run_trainer(trainer_config(BASE, tmp_path, "--config-file", str(run_file), "--training.steps", "1", "--checkpoint.no_enable",
                 "--validation.freq", "1", "--validation.no_at_start"))  # fmt: skip
    rec = _records(tmp_path)[0][1]
    losses = {k: v for k, v in rec.items() if k.endswith("/loss") and k.count("/") == 2}
    assert set(losses) == {"val/images/loss", "val/text/loss"}
    assert losses["val/images/loss"] != losses["val/text/loss"]
    assert min(losses.values()) < rec["val/loss"] < max(losses.values())  # the token-weighted mean


# -- resume, keep_best, early stop -----------------------------------------------------------------------
# a high LR: the validation loss goes up and down, so the best step is not the newest one
RESUME = ["--optimizer.lr", "0.03", "--lr_scheduler.decay_steps", "6", "--checkpoint.interval", "2",
          "--checkpoint.keep_latest_k", "1", "--checkpoint.keep_best", "--validation.steps", "2"]  # fmt: skip


def test_resume_continues_the_schedule_best_and_early_stop_and_keeps_the_best_step(corpora, tmp_path):
    # early stop after 2 evaluations without a new best; the second launch resumes with one of them counted
    args = [*RESUME, *_val_args(corpora, "--validation.early_stop_patience", "2")]
    whole, summary = run_trainer(trainer_config(BASE, tmp_path / "whole", "--training.steps", "6", *args))
    run_trainer(trainer_config(BASE, tmp_path / "split", "--training.steps", "2", *args))
    resumed, resumed_summary = run_trainer(trainer_config(BASE, tmp_path / "split", "--training.steps", "6", *args))
    (va, ta), (vb, tb) = _records(tmp_path / "whole"), _records(tmp_path / "split")
    best = whole.validator.best_step
    stop = best + 2
    assert summary["stopped_early"] and resumed_summary["stopped_early"]
    assert summary["steps"] == resumed_summary["steps"] == stop < 6
    assert stop > 2, "the test needs the stop after the resume"
    assert all(va[s]["val/loss"] >= va[best]["val/loss"] for s in range(1, stop + 1))
    assert sorted(va) == sorted(vb) == list(range(stop + 1))
    steps = [json.loads(line)["step"] for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
             if "val/loss" in line]  # fmt: skip
    assert steps == list(range(stop + 1))  # the resumed launch did not validate step 0 or 2 again
    for s in range(1, stop + 1):
        assert vb[s]["val/loss"] == va[s]["val/loss"] and tb[s]["loss"] == ta[s]["loss"], s
    assert resumed.validator.best_step == best and vb[stop]["val/best_loss"] == va[best]["val/loss"]
    for dump in ("whole", "split"):  # keep_latest_k 1: the newest (the stop step, saved) and the best
        folder = tmp_path / dump / "checkpoint"
        assert (folder / "best").read_text().strip() == f"step-{best}"
        assert sorted(p.name for p in folder.glob("step-*")) == sorted({f"step-{best}", f"step-{stop}"})


def test_validation_config_errors_name_the_fix(corpora, tmp_path):
    with pytest.raises(ValueError, match="no validation data"):
        trainer_config(BASE, tmp_path, "--validation.freq", "2").validate()
    with pytest.raises(ValueError, match="keep_best"):
        trainer_config(BASE, tmp_path, "--checkpoint.keep_best").validate()
    with pytest.raises(ValueError, match="both"):
        trainer_config(BASE, tmp_path, *_val_args(corpora, "--validation.split", "0.1")).validate()
    with pytest.raises(ValueError, match="shard-backed"):
        DataConfig(source="dummy").build(model_facts=MODEL_FACTS, holdout=Holdout(0.1, "train"))


# -- W&B ------------------------------------------------------------------------------------------------
def _wandb_history(run_file: Path) -> dict[int, dict]:
    """The history of an offline W&B run by step (wandb's own transaction-log reader), rows of a step merged."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    store = datastore.DataStore()
    store.open_for_scan(str(run_file))
    by_step: dict[int, dict] = {}
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            by_step.setdefault(record.history.step.num, {}).update(row)
    return by_step


def test_wandb_offline_run_has_loss_and_val_loss(corpora, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_trainer(trainer_config(BASE, tmp_path, "--training.steps", "1", "--checkpoint.no_enable", "--metrics.wandb",
                 "--metrics.wandb_project", "p", *_val_args(corpora, "--validation.steps", "2")))  # fmt: skip
    import wandb

    wandb.teardown()  # the wandb service writes the run file asynchronously: let it finish and exit
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # WANDB_DIR unset: in the dump folder
    by_step = _wandb_history(run)
    val, train = _records(tmp_path)
    assert {s for s, r in by_step.items() if "loss" in r} == set(train) == {1}, by_step
    assert {s for s, r in by_step.items() if "val/loss" in r} == set(val) == {0, 1}
    for s in train:
        assert by_step[s]["loss"] == pytest.approx(train[s]["loss"], abs=1e-12)
    for s in val:
        assert by_step[s]["val/loss"] == pytest.approx(val[s]["val/loss"], abs=1e-12)


def test_wandb_missing_package_or_failed_start_is_an_error_at_build(tmp_path, monkeypatch):
    cfg = MetricsProcessor.Config(wandb=True)
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import of it raises ImportError
    with pytest.raises(ImportError, match=r"hyper-parallel\[wandb\]"):
        cfg.build(dump_folder=tmp_path)

    def fail(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=fail))
    with pytest.raises(RuntimeError, match="W&B could not start the run .*WANDB_MODE=offline"):
        cfg.build(dump_folder=tmp_path)


def test_legacy_use_wandb_maps_to_metrics_wandb():
    with pytest.warns(DeprecationWarning):
        assert translate_legacy({"train": {"use_wandb": True}}, source="old.yaml") == {"metrics": {"wandb": True}}
