"""The Trainer on one process: the debug recipe trains, writes its artifacts, resumes exactly,
handles non-finite steps, and trains with Muon as well as AdamW."""

from __future__ import annotations


import pytest
import torch

from hyper_parallel.trainer import NonFiniteError, Trainer
from tests.torch.helpers import full_tensor, read_losses, run_trainer, trainer_config

BASE = ["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--debug.deterministic", "True",
        "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2", "--data.global_batch_tokens", "512"]  # fmt: skip


def test_debug_recipe_trains_and_writes_artifacts(tmp_path):
    cfg = trainer_config(BASE, tmp_path, "--training.steps", "16", "--checkpoint.interval", "8")
    trainer, summary = run_trainer(cfg)
    assert summary["steps"] == 16
    assert summary["last_loss"] < summary["first_loss"] - 0.5, summary
    assert (tmp_path / "checkpoint" / "step-16" / ".metadata").is_file()
    assert (tmp_path / "checkpoint" / "step-8").is_dir()
    assert len(read_losses(tmp_path)) == 16
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000
    # the HF export loads back into an equal model
    from hyper_parallel.models.glm_image_moe_v2 import from_pretrained

    exported = from_pretrained(tmp_path / "hf")
    ours = {k: full_tensor(v) for k, v in trainer.model.state_dict().items()}
    for key, value in exported.state_dict().items():
        assert torch.equal(value, ours[key]), key


def test_resume_continues_the_loss_sequence_and_ema_exactly(tmp_path):
    common = ("--checkpoint.interval", "4", "--lr_scheduler.decay_steps", "8", "--ema.decay", "0.9",
              "--checkpoint.export_hf", "False")  # fmt: skip
    run_trainer(trainer_config(BASE, tmp_path / "whole", "--training.steps", "8", *common))
    run_trainer(trainer_config(BASE, tmp_path / "split", "--training.steps", "4", *common))
    resumed, _ = run_trainer(trainer_config(BASE, tmp_path / "split", "--training.steps", "8", *common))
    assert resumed.checkpointer.last_saved_step == 8
    a, b = read_losses(tmp_path / "whole"), read_losses(tmp_path / "split")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in range(5, 9):
        assert abs(a[step] - b[step]) <= 1e-6, (step, a[step], b[step])


def test_ema_after_resume_equals_uninterrupted_ema(tmp_path):
    common = ("--checkpoint.interval", "3", "--lr_scheduler.decay_steps", "6", "--ema.decay", "0.8",
              "--checkpoint.export_hf", "False")  # fmt: skip
    whole, _ = run_trainer(trainer_config(BASE, tmp_path / "whole", "--training.steps", "6", *common))
    run_trainer(trainer_config(BASE, tmp_path / "split", "--training.steps", "3", *common))
    resumed, _ = run_trainer(trainer_config(BASE, tmp_path / "split", "--training.steps", "6", *common))
    assert whole.ema.shadow.keys() == resumed.ema.shadow.keys() and whole.ema.shadow
    for name, value in whole.ema.shadow.items():
        assert torch.allclose(full_tensor(value), full_tensor(resumed.ema.shadow[name]), atol=1e-6, rtol=0), name


def test_nonfinite_loss_stops_naming_the_step_and_writes_no_checkpoint(tmp_path):
    cfg = trainer_config(BASE, tmp_path, "--training.steps", "4", "--checkpoint.interval", "1")
    trainer = cfg.build()
    try:
        trainer.train_step()  # step 1 is fine
        with torch.no_grad():
            trainer.model.norm.weight[0] = float("nan")  # poison the weights: the next loss is NaN
        trainer.step = 1
        with pytest.raises(NonFiniteError, match="step 2: loss=nan"):
            trainer.step = 2
            trainer.train_step()
    finally:
        trainer.close()
    assert not (tmp_path / "checkpoint").exists() or not any((tmp_path / "checkpoint").glob("step-*"))


def test_nonfinite_step_is_skipped_when_configured(tmp_path):
    cfg = trainer_config(BASE, tmp_path, "--training.steps", "4", "--training.on_nonfinite", "skip",
                  "--checkpoint.enable", "False")  # fmt: skip
    trainer = cfg.build()
    try:
        with torch.no_grad():
            trainer.model.norm.weight[0] = float("nan")
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.step = 1
        stats = trainer.train_step()
        assert stats["extra"]["skipped"] == 1.0
        after = trainer.model.state_dict()
        for key, value in before.items():
            assert torch.equal(value.nan_to_num(7.0), after[key].nan_to_num(7.0)), key
    finally:
        trainer.close()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_both_optimizers_train_the_debug_model(tmp_path, optimizer):
    cfg = trainer_config(BASE, tmp_path, "--training.steps", "12", "--optimizer.name", optimizer, "--checkpoint.enable", "False",
                  "--checkpoint.export_hf", "False")  # fmt: skip
    _, summary = run_trainer(cfg)
    assert summary["last_loss"] < summary["first_loss"] - 0.3, summary


@pytest.mark.parametrize("path", ["full_copy", "broadcast_shards"])
def test_initial_load_path_starts_from_the_hf_checkpoint(tmp_path, monkeypatch, path):
    from hyper_parallel.components import model_builder as trainer_module
    from hyper_parallel.models.glm_image_moe_v2 import save_pretrained

    if path == "broadcast_shards":  # the path of models too big for a full copy per rank
        monkeypatch.setattr(trainer_module, "_FULL_INIT_MAX_BYTES", 0)

    torch.manual_seed(123)
    source = trainer_config(BASE, tmp_path).model.build()
    source.init_weights()
    save_pretrained(source, tmp_path / "hf_in")
    trainer = trainer_config(BASE, tmp_path / "run", "--checkpoint.initial_load_path", str(tmp_path / "hf_in")).build()
    try:
        ours = {k: full_tensor(v) for k, v in trainer.model.state_dict().items()}
        for key, value in source.state_dict().items():
            assert torch.equal(ours[key], value), key
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--parallelism.tensor_parallel_degree", "2"], "does not divide the world size 1"),
        (["--parallelism.data_parallel_shard_degree", "3"], "world size is 1"),
        (["--data.global_batch_tokens", "700"], "global_batch_tokens=700"),
    ],
)
def test_invalid_layout_fails_before_the_model_is_built(tmp_path, monkeypatch, flags, message):
    built = []
    monkeypatch.setattr(type(trainer_config(BASE, tmp_path).model), "build", lambda self, **kw: built.append(1))
    with pytest.raises(ValueError, match=message):  # ConfigError is a ValueError
        trainer_config(BASE, tmp_path, *flags).build()
    assert not built
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
