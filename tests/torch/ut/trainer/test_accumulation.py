"""Gradient accumulation in the trainer: dyn_bsz accumulation equals one big batch on gradients, labelled
tokens are counted on the host before the device copy, and the model's aux loss is added and logged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyper_parallel.config import ConfigManager
from hyper_parallel.trainer import Trainer
from tests.torch.helpers import full_tensor, run_trainer, trainer_config
from tests.torch.ut.trainer.test_export import BASE


def _records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _preset(path: Path, rows: list[dict]) -> Path:
    torch.save(rows, path)
    return path


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p.grad).clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def toy_micro_batches(cache: Path, n: int) -> list[dict]:
    """The first ``n`` packed 128-token micro-batches of the DirectToken toy corpus."""
    from hyper_parallel.data import TokenDataLoader

    cfg = trainer_config(BASE, cache)
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
        cfg = trainer_config(BASE, tmp_path / name, "--data.source", "preset_pt", "--data.path", str(_preset(tmp_path / f"{name}.pt", rows)),
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


def test_labelled_tokens_are_counted_on_the_host_before_the_copy(tmp_path):
    """The step's token count (its one all-reduce) comes from the host batches, before any tensor moves to
    the device, so counting never waits for the device."""
    trainer = trainer_config(BASE, tmp_path, "--training.steps", "1", "--checkpoint.no_enable", "--checkpoint.no_export_hf").build()
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
        run_trainer(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, layers=layers)))
        return _records(dump)

    plain, with_aux = run(0.0, tmp_path / "plain"), run(0.5, tmp_path / "aux")
    assert all("aux_loss" not in r for r in plain)
    assert all(r["aux_loss"] > 0 for r in with_aux)
    # step 1 starts from the same weights and batch: the logged loss is the token loss plus the aux loss
    assert with_aux[0]["loss"] == pytest.approx(plain[0]["loss"] + with_aux[0]["aux_loss"], rel=1e-5)
