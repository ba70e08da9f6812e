"""What the trainer promises, each checked through the trainer itself (review findings of issue 10):
HF passthrough keys survive training, the NaN guard fires inside ``train()``, dyn_bsz accumulation is
exact on gradients, the EMA reaches the HF export, skipped samples reach metrics.jsonl, the short-run
and boolean-flag habits of torchtitan users work, and a checkpoint made with other data says what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyper_parallel.config import ConfigManager
from hyper_parallel.trainer import NonFiniteError, Trainer
from tests.torch.ut.test_trainer import _run  # build, train, close: one helper for the trainer tests

BASE = ["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--debug.deterministic",
        "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1", "--data.global_batch_tokens", "512"]  # fmt: skip
PASSTHROUGH_KEY = "model.vqmodel.decoder.conv_in.weight"


def _config(dump: Path, *args: str) -> Trainer.Config:
    return ConfigManager().parse_args([*BASE, "--dump_folder", str(dump), *args])


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def write_hf_folder_with_passthrough(dump: Path, path: Path) -> torch.Tensor:
    """An HF GlmImageMoe folder of the debug model plus one VQ-decoder key we do not model."""
    from hyper_parallel.models.glm_image_moe_v2 import save_pretrained

    torch.manual_seed(7)
    model = _config(dump).model.build()
    model.init_weights()
    extra = torch.randn(4, 3, 3, 3)
    model.hf_passthrough = {PASSTHROUGH_KEY: extra}
    save_pretrained(model, path, dtype=torch.float32)
    return extra


def test_hf_passthrough_keys_survive_training_and_export(tmp_path):
    extra = write_hf_folder_with_passthrough(tmp_path / "src", tmp_path / "hf_in")
    cfg = _config(tmp_path / "run", "--training.steps", "2", "--checkpoint.initial_load_path", str(tmp_path / "hf_in"),
                  "--checkpoint.export_hf", "--checkpoint.export_dtype", "float32", "--checkpoint.no_enable")  # fmt: skip
    _run(cfg)
    from safetensors.torch import load_file

    exported = {}
    for f in sorted((tmp_path / "run" / "hf").glob("*.safetensors")):
        exported.update(load_file(f))
    assert PASSTHROUGH_KEY in exported
    assert torch.equal(exported[PASSTHROUGH_KEY], extra)


def test_nonfinite_guard_fires_inside_train_before_a_due_checkpoint(tmp_path):
    """Step 2 is poisoned and a checkpoint is due at step 2: the run stops naming step 2, nothing is saved."""
    trainer = _config(tmp_path, "--training.steps", "4", "--checkpoint.interval", "2").build()
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


def _preset(path: Path, rows: list[dict]) -> Path:
    torch.save(rows, path)
    return path


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: _full(p.grad).clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def toy_micro_batches(cache: Path, n: int) -> list[dict]:
    """The first ``n`` packed 128-token micro-batches of the DirectToken toy corpus."""
    from hyper_parallel.data import TokenDataLoader

    cfg = _config(cache)
    loader = TokenDataLoader.Config(max_tokens_per_microbatch=128, global_batch_tokens=128 * n,
                                    cache_dir=str(cache)).build(model_facts=_facts(cfg))  # fmt: skip
    batches = loader.next_step()
    loader.close()
    assert len(batches) == n
    return batches


def accumulation_batches(cache: Path) -> tuple[list[dict], dict]:
    """4 packed micro-batches of the toy corpus, and the same documents packed as one row."""
    small = toy_micro_batches(cache, 4)
    return small, concat_rows(small)


def _facts(cfg: Trainer.Config) -> dict:
    from hyper_parallel.protocols.model_spec import discover_model_spec

    return discover_model_spec(cfg.model_spec).data_facts(cfg.model)


def concat_rows(batches: list[dict]) -> dict:
    """One ``[1, sum T]`` row holding every document of ``batches`` (padding runs become their own segments)."""
    out = {k: torch.cat([b[k] for b in batches], dim=1) for k in ("input_ids", "labels", "position_ids")}
    offsets = [0]
    for b in batches:
        offsets.append(offsets[-1] + b["input_ids"].shape[1])
    out["cu_seqlens"] = torch.cat(
        [batches[0]["cu_seqlens"][:1]] + [b["cu_seqlens"][1:] + off for b, off in zip(batches, offsets)]
    ).to(torch.int32)
    out["max_seqlen"] = max(int(b["max_seqlen"]) for b in batches)
    out["visual_indices"] = torch.cat([b["visual_indices"] + off for b, off in zip(batches, offsets)])
    out["vq_codes"] = torch.cat([b["vq_codes"] for b in batches])
    return out


def test_dyn_bsz_accumulation_equals_one_big_batch_on_gradients(tmp_path):
    small, big = accumulation_batches(tmp_path / "cache")
    runs = {}
    for name, rows, budget in (("four", small, 128), ("one", [big], 512)):
        cfg = _config(tmp_path / name, "--data.source", "preset_pt", "--data.path", str(_preset(tmp_path / f"{name}.pt", rows)),
                      "--data.max_tokens_per_microbatch", str(budget), "--training.max_norm", "0",
                      "--checkpoint.no_enable", "--checkpoint.no_export_hf", "--training.steps", "1")  # fmt: skip
        trainer = cfg.build()
        try:
            stats = trainer.train_step()
            runs[name] = (stats["loss"], _grads(trainer))
        finally:
            trainer.close()
    (loss4, g4), (loss1, g1) = runs["four"], runs["one"]
    assert abs(loss4 - loss1) <= 1e-6
    assert g4.keys() == g1.keys() and len(g4) > 10
    worst = max((g4[k] - g1[k]).abs().max().item() for k in g4)
    assert worst <= 1e-6, worst


def test_ema_weights_reach_the_trainer_export(tmp_path):
    cfg = _config(tmp_path, "--training.steps", "3", "--ema.decay", "0.5", "--checkpoint.no_enable",
                  "--checkpoint.export_hf", "--checkpoint.export_dtype", "float32")  # fmt: skip
    trainer, _ = _run(cfg)
    from hyper_parallel.models.glm_image_moe_v2 import from_pretrained

    exported = from_pretrained(tmp_path / "hf").state_dict()
    live = {k: _full(v) for k, v in trainer.model.state_dict().items()}
    shadow = {k: _full(v) for k, v in trainer.ema.shadow.items()}
    assert shadow
    for key, value in shadow.items():
        assert torch.equal(exported[key], value), key
    assert any(not torch.equal(exported[k], live[k]) for k in shadow)  # EMA != live weights after 3 steps


def test_skipped_samples_reach_metrics_jsonl(tmp_path):
    """A corpus with bad samples, `--data.on_bad_sample skip`: the count is in every metrics record."""
    from hyper_parallel.data import DirectTokenWriter

    cfg = _config(tmp_path)
    facts = _facts(cfg)
    shards = tmp_path / "shards"
    rng = torch.Generator().manual_seed(0)
    with DirectTokenWriter(str(shards), placeholder_token_id=facts["placeholder_token_id"]) as w:
        for i in range(40):
            tokens = torch.randint(0, 100, (30,), generator=rng).numpy().astype("int32")
            if i % 10 == 3:
                tokens[5] = facts["vocab_size"] + 7  # a token outside the vocabulary: a bad sample
            w.write(tokens)
    cfg = _config(tmp_path / "run", "--data.path", str(shards), "--data.on_bad_sample", "skip",
                  "--data.max_tokens_per_microbatch", "128", "--training.steps", "2",
                  "--checkpoint.no_enable", "--checkpoint.no_export_hf")  # fmt: skip
    _run(cfg)
    records = _records(tmp_path / "run")
    assert all("bad_samples_skipped" in r for r in records), records[0]
    assert records[-1]["bad_samples_skipped"] >= 1


def test_three_step_smoke_run_of_a_recipe_with_longer_warmup(tmp_path):
    """`--training.steps 3` on a recipe whose warmup is 10 steps: warmup is clamped, the run completes."""
    cfg = ConfigManager().parse_args(["--module", "glm_image_moe", "--config", "glm_image_moe_debug",
                                      "--dump_folder", str(tmp_path), "--training.steps", "3",
                                      "--lr_scheduler.warmup_steps", "10", "--checkpoint.no_enable",
                                      "--checkpoint.no_export_hf"])  # fmt: skip
    _, summary = _run(cfg)
    assert summary["steps"] == 3


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--debug.deterministic"], True),
        (["--debug.no_deterministic"], False),
        (["--debug.deterministic", "True"], True),
        (["--debug.deterministic", "False"], False),
        (["--debug.deterministic=false"], False),
    ],
)
def test_boolean_fields_are_flags_and_still_take_a_value(args, expected):
    cfg = ConfigManager().parse_args(["--module", "glm_image_moe", "--config", "glm_image_moe_debug", *args])
    assert cfg.debug.deterministic is expected


def test_resuming_with_other_data_says_what_to_do_and_the_flag_restarts_the_stream(tmp_path):
    common = ("--training.steps", "2", "--checkpoint.interval", "2", "--checkpoint.no_export_hf")
    _run(_config(tmp_path, *common))
    with pytest.raises(ValueError, match="restart_data_stream"):
        _run(_config(tmp_path, "--training.steps", "4", "--data.seed", "5", *common[2:]))
    trainer, summary = _run(_config(tmp_path, "--training.steps", "4", "--data.seed", "5",
                                    "--checkpoint.restart_data_stream", *common[2:]))  # fmt: skip
    assert summary["steps"] == 4 and len(summary["losses"]) == 2  # resumed at step 2 with a fresh stream


def test_profiler_writes_a_trace_after_a_three_step_run(tmp_path):
    cfg = _config(tmp_path, "--training.steps", "3", "--checkpoint.no_enable", "--checkpoint.no_export_hf",
                  "--profiling.enable_profiling", "--profiling.profile_freq", "3", "--profiling.profiler_warmup", "1",
                  "--profiling.profiler_active", "1")  # fmt: skip
    _run(cfg)
    traces = list((tmp_path / "profile_traces").rglob("rank0_trace.json"))
    assert traces and traces[0].stat().st_size > 1000, traces


def test_labelled_tokens_are_counted_on_the_host_before_the_copy(tmp_path):
    """The step's token count (its one all-reduce) comes from the host batches, before any tensor moves to
    the device, so counting never waits for the device."""
    trainer = _config(tmp_path, "--training.steps", "1", "--checkpoint.no_enable", "--checkpoint.no_export_hf").build()
    order: list[str] = []
    to_device, count = trainer.runner.to_device, trainer.runner.sum_over_token_ranks

    def recording_to_device(mb):
        assert all(v.device.type == "cpu" for v in mb.values() if torch.is_tensor(v))  # still host batches
        order.append("to_device")
        return to_device(mb)

    def recording_count(value):
        order.append("count")
        return count(value)

    trainer.runner.to_device, trainer.runner.sum_over_token_ranks = recording_to_device, recording_count
    try:
        trainer.train_step()
    finally:
        trainer.close()
    assert order[0] == "count" and "to_device" in order, order


def test_the_model_aux_loss_is_added_and_logged(tmp_path):
    """A model that returns ModelOutput(logits, aux_loss) (Qwen3.5-MoE with router_aux_loss_coef > 0): the
    trainer adds the aux loss to the step's loss and logs it; without one, no aux_loss is logged."""
    import dataclasses

    from hyper_parallel.models.common.moe import MoE

    def run(coef: float, dump: Path) -> list[dict]:
        cfg = ConfigManager().parse_args([
            "--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--training.steps", "2",
            "--metrics.log_freq", "1", "--checkpoint.no_enable", "--checkpoint.no_export_hf",
            "--dump_folder", str(dump), "--debug.deterministic",
        ])  # fmt: skip
        layers = [
            dataclasses.replace(layer, mlp=dataclasses.replace(layer.mlp, router_aux_loss_coef=coef))
            if isinstance(layer.mlp, MoE.Config) else layer
            for layer in cfg.model.layers
        ]  # fmt: skip
        _run(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, layers=layers)))
        return _records(dump)

    plain, with_aux = run(0.0, tmp_path / "plain"), run(0.5, tmp_path / "aux")
    assert all("aux_loss" not in r for r in plain)
    assert all(r["aux_loss"] > 0 for r in with_aux)
    # step 1 starts from the same weights and batch: the logged loss is the token loss plus the aux loss
    assert with_aux[0]["loss"] == pytest.approx(plain[0]["loss"] + with_aux[0]["aux_loss"], rel=1e-5)
