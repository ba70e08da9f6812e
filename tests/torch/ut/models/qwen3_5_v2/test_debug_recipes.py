"""The Qwen3.5 debug recipes end to end on one process: they train on the embedded toy TEXT corpus (no
download) with a falling loss, and their ``--checkpoint.export_hf`` folder loads in transformers
(``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``) with logits equal to the trained model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyper_parallel.config import ConfigManager
from hyper_parallel.protocols.model import split_output
from tests.torch.helpers import full_tensor

STEPS = 6

# family -> (module, recipe, HF class name)
FAMILIES = {
    "dense": ("qwen3_5", "qwen3_5_debug", "Qwen3_5ForCausalLM"),
    "moe": ("qwen3_5_moe", "qwen3_5_moe_debug", "Qwen3_5MoeForCausalLM"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_debug_recipe_trains_on_toy_text_and_exports_hf(tmp_path: Path, family: str):
    import transformers

    module, recipe, hf_cls = FAMILIES[family]
    cfg = ConfigManager().parse_args([
        "--module", module, "--config", recipe, "--dump_folder", str(tmp_path),
        "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
        "--data.global_batch_tokens", "512", "--data.max_tokens_per_microbatch", "256",
        "--data.cache_dir", str(tmp_path / "cache"), "--checkpoint.interval", str(STEPS),
    ])  # fmt: skip
    assert cfg.data.source == "text" and cfg.data.path == "", "the debug recipe must train on the toy text corpus"
    trainer = cfg.build()
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    assert summary["steps"] == STEPS
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    print(f"{family}: losses {[round(x, 4) for x in losses]}")
    assert summary["last_loss"] < summary["first_loss"] - 0.3, summary

    model = trainer.model.eval()
    hf = getattr(transformers, hf_cls).from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    hf.config._attn_implementation = "sdpa"
    # every exported tensor is the trained weight (the export is not a stale or re-initialised model)
    ours = {k: full_tensor(v) for k, v in model.state_dict().items()}
    assert hf.lm_head.weight.shape == ours["lm_head.weight"].shape
    assert torch.equal(hf.lm_head.weight, ours["lm_head.weight"])
    ids = torch.randint(0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _ = split_output(model(ids))
        ref = hf(input_ids=ids, use_cache=False).logits
    diff = (logits - ref).abs().max().item()
    print(f"{family}: exported-HF vs trained logits max |diff| {diff:.2e}")
    assert diff <= 1e-5, diff
