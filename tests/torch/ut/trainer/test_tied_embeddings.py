"""Tied embeddings on one process: the trainer keeps ONE table through training, a DCP checkpoint, a resume
(AdamW + EMA state of the shared parameter) and the HF export (no ``lm_head.weight``, read back tied by
transformers with equal logits). Multi-process layouts: tests/torch/st/test_tied_layouts.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyper_parallel.config import ConfigManager
from hyper_parallel.models.glm_image_moe_v2.config_registry import glm_image_moe_debug
from hyper_parallel.hf import read_safetensors
from hyper_parallel.protocols.model import split_output
from tests.torch.helpers import read_losses

COMMON = ("--module", "qwen3_5", "--config", "qwen3_5_debug", "--model.tie_word_embeddings", "True",
          "--debug.deterministic", "True", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2",
          "--lr_scheduler.decay_steps", "4", "--data.global_batch_tokens", "256",
          "--data.max_tokens_per_microbatch", "256", "--checkpoint.interval", "2", "--ema.decay", "0.9")  # fmt: skip
IDS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))


def _run(folder: Path, steps: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Train to ``steps`` (resuming from ``folder``'s newest checkpoint); the final weights and the EMA model's
    logits on ``IDS`` (what the export holds)."""
    cfg = ConfigManager().parse_args([
        *COMMON, "--dump_folder", str(folder), "--data.cache_dir", str(folder.parent / "cache"),
        "--training.steps", str(steps),
    ])  # fmt: skip
    assert cfg.model.tie_word_embeddings
    trainer = cfg.build()
    try:
        assert trainer.model.lm_head.weight is trainer.model.embed_tokens.weight
        trainer.train()
        model = trainer.model
        assert model.lm_head.weight is model.embed_tokens.weight
        state = model.state_dict()
        weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in state.items()}
        with trainer.ema.swap(model), torch.no_grad():
            logits, _ = split_output(model.eval()(IDS))
    finally:
        trainer.close()
    return weights, logits


def test_tied_model_resumes_exactly_and_exports_without_a_head(tmp_path):
    import transformers

    whole, _ = _run(tmp_path / "whole", 4)
    _run(tmp_path / "split", 2)
    resumed, ours = _run(tmp_path / "split", 4)  # resumes from step-2: model, AdamW moments, EMA of the one table
    a, b = read_losses(tmp_path / "whole"), read_losses(tmp_path / "split")
    assert sorted(a) == sorted(b) == list(range(1, 5))
    for step in range(3, 5):
        assert abs(a[step] - b[step]) <= 1e-6, (step, a[step], b[step])
    for key, value in whole.items():
        assert torch.equal(value, resumed[key]), key

    export = tmp_path / "split" / "hf"  # written with the EMA weights: the EMA of the shared table, once
    assert "lm_head.weight" not in read_safetensors(export)
    assert json.loads((export / "config.json").read_text())["tie_word_embeddings"] is True
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    hf.config._attn_implementation = "sdpa"
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    with torch.no_grad():
        ref = hf(input_ids=IDS, use_cache=False).logits
    assert (ours - ref).abs().max().item() <= 1e-5


def test_a_head_of_another_shape_cannot_be_tied():
    import dataclasses

    cfg = dataclasses.replace(glm_image_moe_debug().model, tie_word_embeddings=True)  # head: vocab + codebook rows
    with pytest.raises(ValueError, match="tie_word_embeddings=True needs an LM head of the embedding's shape"):
        cfg.build()
