"""The trainer's HF export: passthrough keys of the initial folder survive training and reach the export, and
the export holds the EMA weights when EMA is on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.torch.helpers import full_tensor, run_trainer, trainer_config


BASE = ["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--debug.deterministic",
        "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1", "--data.global_batch_tokens", "512"]  # fmt: skip
PASSTHROUGH_KEY = "model.vqmodel.decoder.conv_in.weight"


def write_hf_folder_with_passthrough(dump: Path, path: Path) -> torch.Tensor:
    """An HF GlmImageMoe folder of the debug model plus one VQ-decoder key we do not model."""
    from hyper_parallel.models.glm_image_moe_v2 import save_pretrained

    torch.manual_seed(7)
    model = trainer_config(BASE, dump).model.build()
    model.init_weights()
    extra = torch.randn(4, 3, 3, 3)
    model.hf_passthrough = {PASSTHROUGH_KEY: extra}
    save_pretrained(model, path, dtype=torch.float32)
    return extra


def test_hf_passthrough_keys_survive_training_and_export(tmp_path):
    extra = write_hf_folder_with_passthrough(tmp_path / "src", tmp_path / "hf_in")
    cfg = trainer_config(BASE, tmp_path / "run", "--training.steps", "2", "--checkpoint.initial_load_path", str(tmp_path / "hf_in"),
                  "--checkpoint.export_hf", "--checkpoint.export_dtype", "float32", "--checkpoint.no_enable")  # fmt: skip
    run_trainer(cfg)
    from safetensors.torch import load_file

    exported = {}
    for f in sorted((tmp_path / "run" / "hf").glob("*.safetensors")):
        exported.update(load_file(f))
    assert PASSTHROUGH_KEY in exported
    assert torch.equal(exported[PASSTHROUGH_KEY], extra)


def test_ema_weights_reach_the_trainer_export(tmp_path):
    cfg = trainer_config(BASE, tmp_path, "--training.steps", "3", "--ema.decay", "0.5", "--checkpoint.no_enable",
                  "--checkpoint.export_hf", "--checkpoint.export_dtype", "float32")  # fmt: skip
    trainer, _ = run_trainer(cfg)
    from hyper_parallel.models.glm_image_moe_v2 import from_pretrained

    exported = from_pretrained(tmp_path / "hf").state_dict()
    live = {k: full_tensor(v) for k, v in trainer.model.state_dict().items()}
    shadow = {k: full_tensor(v) for k, v in trainer.ema.shadow.items()}
    assert shadow
    for key, value in shadow.items():
        assert torch.equal(exported[key], value), key
    assert any(not torch.equal(exported[k], live[k]) for k in shadow)  # EMA != live weights after 3 steps
