"""The dry run with multi-token prediction on an image model: its simulated micro-batch holds image positions
(from the model's data facts: VQ codes for GlmImageMoe, pixel images for the Qwen3.5-MoE VL model), so the MTP
block's image path runs in the simulated step (GLM: the codebook vectors of the next image tokens; VL: the
merged visual features of the next image tokens) and its parameters and activations count, under context
parallel too (one image per CP piece)."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.dry_run import main
from hyper_parallel.models.glm_image_moe_v2.config_registry import glm_image_moe_mtp_debug
from hyper_parallel.models.glm_image_moe_v2.model import GlmImageMoeModel
from hyper_parallel.models.qwen3_vl_moe_v2.config_registry import qwen3_5_moe_vl_mtp_debug
from hyper_parallel.models.qwen3_vl_moe_v2.model import Qwen3VlMoeModel

CP2 = ["--world_size", "2", "--parallelism.context_parallel_degree", "2"]


def _mtp_numel(config) -> int:
    with torch.device("meta"):
        model = config.build()
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))


def _record(monkeypatch, cls, name: str, what) -> list:
    """Wrap ``cls.name``: each call appends ``what(*args, **kwargs)`` (the model's own code then runs)."""
    seen: list = []
    original = getattr(cls, name)

    def wrapped(*args, **kwargs):
        seen.append(what(*args, **kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(cls, name, wrapped)
    return seen


@pytest.mark.parametrize("args", [["--world_size", "2"], CP2], ids=["fsdp2", "cp2"])
def test_glm_dry_run_runs_the_mtp_block_on_image_codes(monkeypatch, args):
    cfg = glm_image_moe_mtp_debug().model
    # per MTP forward: how many next tokens are image codes (their projected codebook vectors feed the block)
    seen = _record(
        monkeypatch, GlmImageMoeModel, "embed_next_tokens_with_images",
        lambda self, mtp_input_ids, **kw: int((mtp_input_ids == cfg.placeholder_token_id).sum()),
    )  # fmt: skip
    images = _record(monkeypatch, GlmImageMoeModel, "image_embeddings", lambda self, codes: int(codes.numel()))
    report = main(["--module", "glm_image_moe", "--config", "glm_image_moe_mtp_debug", *args])
    assert seen and all(n > 0 for n in seen), seen
    assert len(images) >= 2 * len(seen) and all(n > 0 for n in images)  # the trunk's images and the MTP's
    with torch.device("meta"):
        total = sum(p.numel() for p in cfg.build().parameters())
    assert report.model_numel == total and _mtp_numel(cfg) > 0
    assert report.peak["Activation"] > 0


def test_vl_dry_run_runs_the_mtp_block_on_visual_features_under_cp(monkeypatch):
    cfg = qwen3_5_moe_vl_mtp_debug().model
    # per MTP forward: how many next tokens are image tokens, and whether the visual features reached the block
    seen = _record(
        monkeypatch, Qwen3VlMoeModel, "_embed_next_tokens_with_visuals",
        lambda self, mtp_input_ids, h, after: (int((mtp_input_ids == cfg.image_token_id).sum()), after is not None),
    )  # fmt: skip
    report = main(["--module", "qwen3_vl_moe", "--config", "qwen3_5_moe_vl_mtp_debug", *CP2])
    assert seen and all(n > 0 and visual for n, visual in seen), seen
    with torch.device("meta"):
        total = sum(p.numel() for p in cfg.build().parameters())
    assert report.model_numel == total and _mtp_numel(cfg) > 0
