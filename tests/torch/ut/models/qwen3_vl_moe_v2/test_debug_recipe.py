"""``python -m hyper_parallel.train --module qwen3_vl_moe --config qwen3_vl_moe_debug``: trains on the toy VL corpus
and its HF export loads in transformers with equal logits."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hyper_parallel.models.qwen3_vl_moe_v2 import from_pretrained  # noqa: E402
from hyper_parallel.train import main  # noqa: E402


def test_debug_recipe_trains_and_exports_hf(tmp_path):
    summary = main([
        "--module", "qwen3_vl_moe", "--config", "qwen3_vl_moe_debug", "--training.steps", "8",
        "--checkpoint.interval", "8", "--metrics.log_freq", "4", "--data.global_batch_tokens", "512", "--dump_folder", str(tmp_path),
    ])  # fmt: skip
    assert summary["steps"] == 8
    assert summary["last_loss"] < summary["first_loss"] - 0.3, summary
    folder = tmp_path / "hf"
    hf = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    ours = from_pretrained(folder)
    grid = torch.tensor([[1, 4, 4], [1, 6, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0))
    img, vs, ve = ours.config.image_token_id, ours.config.vision_start_token_id, ours.config.vision_end_token_id
    ids = torch.tensor([[5, vs] + [img] * 4 + [ve, 6, vs] + [img] * 6 + [ve, 7]])
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == img).int(),
                  use_cache=False).logits  # fmt: skip
        got = ours(ids, pixel_values=pixels, image_grid_thw=grid)
    got = got.logits if hasattr(got, "logits") else got
    assert (want - got).abs().max().item() <= 1e-5
