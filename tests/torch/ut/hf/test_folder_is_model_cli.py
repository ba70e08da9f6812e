"""The folder is the model, on the command line (issue 31): the module comes from the folder, a folder of another
family is an error, an explicit model field that contradicts the folder is an error naming both values (the
training-only options apply on top), a folder that declares MTP must hold its tensors, the dry run sizes the
folder's model, and a resumed run keeps the model it started with after the folder's config.json changed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import hyper_parallel
from hyper_parallel.config import ConfigError, ConfigManager
from hyper_parallel.models import qwen3_5_moe_v2, qwen3_vl_moe_v2
from hyper_parallel.models.qwen3_5_moe_v2.config_registry import qwen3_5_moe_debug
from hyper_parallel.hf.convert import CheckpointKeyError
from hyper_parallel.hf.folder import folder_family, resolve_run_model
from hyper_parallel.protocols.model_spec import get_spec
from hyper_parallel.train import main as train_main
from tests.torch.ut.hf.test_released_configs import _shrink
from tests.torch.helpers import edit_config

RUN = ["--checkpoint.enable", "False", "--checkpoint.no_export_hf", "--training.steps", "1",
       "--data.global_batch_tokens", "256", "--data.max_tokens_per_microbatch", "256"]  # fmt: skip


def config_folder(path: Path, d: dict[str, Any]) -> Path:
    """A folder holding only a config.json (enough for everything decided before weights are read)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(d))
    return path


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> Path:
    """A Qwen3.5-MoE ConditionalGeneration-form folder with weights (our export of the debug model, MTP 1), its
    eps and theta then edited away from the recipe's."""
    from hyper_parallel.models.qwen3_vl_moe_v2.config_registry import qwen3_5_moe_vl_mtp_debug

    folder = tmp_path_factory.mktemp("moe") / "hf"
    torch.manual_seed(0)
    model = qwen3_5_moe_vl_mtp_debug().model.build()
    model.init_weights()
    qwen3_vl_moe_v2.save_pretrained(model, folder, dtype=torch.float32)
    edit_config(folder, rms_norm_eps=1e-2)
    return folder


def _parse(*args: str) -> tuple[Any, ConfigManager]:
    manager = ConfigManager(folder_family=folder_family)  # as hyper_parallel.train does
    return manager.parse_args(list(args)), manager


def _resolve(cfg: Any) -> Any:
    spec = get_spec(cfg.model_spec)
    return resolve_run_model(
        spec, cfg.model, folder=cfg.checkpoint.initial_load_path, explicit=cfg.explicit_model_fields
    ).config


def test_module_comes_from_the_folder_and_another_family_is_an_error(tmp_path, moe_folder):
    cfg, manager = _parse("--config", "qwen3_5_moe_debug", "--checkpoint.initial_load_path", str(moe_folder))
    assert manager.module == "qwen3_5_moe" and cfg.model_spec == "qwen3_5_moe"
    # a ConditionalGeneration folder also fits the whole VL model: the package that has the recipe
    cfg, manager = _parse("--config", "qwen3_5_moe_vl_debug", "--checkpoint.initial_load_path", str(moe_folder))
    assert manager.module == "qwen3_vl_moe"
    text = hyper_parallel.from_pretrained(moe_folder)  # the default candidate: the text model, MTP as the folder says
    assert type(text) is qwen3_5_moe_v2.Qwen3_5MoeModel and text.config.mtp is not None
    assert type(hyper_parallel.from_pretrained(moe_folder, module="qwen3_vl_moe", mtp=False)) is qwen3_vl_moe_v2.Qwen3VlMoeModel
    glm = config_folder(tmp_path / "glm", _shrink("glm_4_7_flash.json"))
    cfg, manager = _parse("--config", "glm_image_moe_debug", "--checkpoint.initial_load_path", str(glm))
    assert manager.module == "glm_image_moe"
    with pytest.raises(ConfigError, match=r"glm4_moe_lite.*glm_image_moe.*not of 'qwen3_5'.*--module glm_image_moe"):
        _parse("--module", "qwen3_5", "--config", "qwen3_5_debug", "--checkpoint.initial_load_path", str(glm))
    with pytest.raises(ConfigError, match="recipe is in none of them"):
        _parse("--config", "qwen3_5_debug", "--checkpoint.initial_load_path", str(glm))
    with pytest.raises(ConfigError, match="not of 'qwen3_5'"):
        hyper_parallel.from_pretrained(glm, module="qwen3_5")
    odd = config_folder(tmp_path / "odd", {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ConfigError, match="model_type='llama'.*no model family"):
        _parse("--config", "qwen3_5_debug", "--checkpoint.initial_load_path", str(odd))


def test_explicit_fields_that_contradict_the_folder_are_errors_training_options_apply(tmp_path, moe_folder):
    base = ["--config", "qwen3_5_moe_debug", "--checkpoint.initial_load_path", str(moe_folder)]
    m = _resolve(_parse(*base)[0])
    assert m.option_values()["rms_norm_eps"] == 1e-2 and m.mtp is not None  # the folder's, its MTP block on
    with pytest.raises(ConfigError, match=r"--model.rms_norm_eps=1e-05 contradicts the folder: .* gives 0.01"):
        _resolve(_parse(*base, "--model.rms_norm_eps", "1e-5")[0])
    run_file = tmp_path / "run.toml"
    run_file.write_text("[model]\nrope_theta = 5.0\n")
    with pytest.raises(ConfigError, match=r"--model.rope_theta=5.0 contradicts the folder: .* gives 10000000.0"):
        _resolve(_parse(*base, "--config-file", str(run_file))[0])
    run_file.write_text("[model.layers.0.input_layernorm]\neps = 0.5\n")  # a per-layer field (run files only)
    with pytest.raises(ConfigError, match=r"--model.layers.0.input_layernorm.eps=0.5 contradicts .* gives 0.01"):
        _resolve(_parse(*base, "--config-file", str(run_file))[0])
    assert _resolve(_parse(*base, "--model.rms_norm_eps", "0.01")[0]).option_values()["rms_norm_eps"] == 1e-2
    # training-only options apply on top of the folder's config
    m = _resolve(_parse(*base, "--model.mtp_loss_weight", "0.5", "--model.router_aux_loss_coef", "0.02")[0])
    assert m.option_values()["mtp_loss_weight"] == 0.5 and m.option_values()["router_aux_loss_coef"] == 0.02
    assert _resolve(_parse(*base, "--model.use_mtp", "false")[0]).mtp is None  # then kept as passthrough
    cfg = _parse(*base, *RUN, "--model.rms_norm_eps", "1e-5", "--dump_folder", str(tmp_path / "run"))[0]
    with pytest.raises(ConfigError, match="contradicts the folder"):  # the trainer resolves the same way
        cfg.build()


def test_a_folder_that_declares_mtp_must_hold_its_tensors(tmp_path):
    folder = tmp_path / "hf"
    torch.manual_seed(0)
    model = qwen3_5_moe_debug().model.build()
    model.init_weights()
    qwen3_5_moe_v2.save_pretrained(model, folder, dtype=torch.float32)
    assert type(hyper_parallel.from_pretrained(folder)) is qwen3_5_moe_v2.Qwen3_5MoeModel  # the family from the folder
    edit_config(folder, mtp_num_hidden_layers=1)  # says MTP, holds no mtp.* tensors
    for load in (lambda: hyper_parallel.from_pretrained(folder), lambda: qwen3_5_moe_v2.from_pretrained(folder, mtp=True)):
        with pytest.raises(CheckpointKeyError, match=r"mtp_num_hidden_layers=1.*no MTP tensors.*mtp\.fc\.weight"):
            load()
    assert hyper_parallel.from_pretrained(folder, mtp=False).config.mtp is None
    cfg = _parse("--config", "qwen3_5_moe_debug", "--checkpoint.initial_load_path", str(folder), *RUN,
                 "--dump_folder", str(tmp_path / "run"))[0]  # fmt: skip
    with pytest.raises(CheckpointKeyError, match="no MTP tensors"):
        cfg.build()


def test_dry_run_sizes_the_folders_model(tmp_path):
    from hyper_parallel.dry_run import main

    d = _shrink("qwen3_5_35b_a3b.json")
    d["text_config"].update(hidden_size=96, num_hidden_layers=8, layer_types=d["text_config"]["layer_types"][:4] * 2)
    folder = config_folder(tmp_path / "hf", d)
    report = main(["--config", "qwen3_5_moe_debug", "--checkpoint.initial_load_path", str(folder), "--world_size", "1",
                   "--no_step"])  # fmt: skip
    with torch.device("meta"):
        want = sum(p.numel() for p in get_spec("qwen3_5_moe").hf.mtp.config_from_hf(d).build().parameters())
    assert report.num_layers == 8 and report.model_numel == want


def test_resume_uses_the_model_the_run_started_with(tmp_path, moe_folder, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    for f in moe_folder.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    args = ["--config", "qwen3_5_moe_debug", "--checkpoint.initial_load_path", str(folder), "--dump_folder",
            str(tmp_path / "run"), "--checkpoint.enable", "True", "--checkpoint.interval", "1",
            "--checkpoint.no_export_hf", "--data.global_batch_tokens", "256", "--data.max_tokens_per_microbatch", "256"]  # fmt: skip
    train_main([*args, "--training.steps", "1"])
    logged = capsys.readouterr().err  # once, on rank 0: what the folder sets that differs from the recipe
    assert logged.count("differs from the recipe in") == 1 and "rms_norm_eps 0.01 (recipe 1e-06)" in logged
    assert json.loads((tmp_path / "run" / "initial_model" / "config.json").read_text()) == json.loads(
        (moe_folder / "config.json").read_text()
    )
    edit_config(folder, rms_norm_eps=0.5, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    cfg = _parse(*args, "--training.steps", "2")[0]
    trainer = cfg.build()
    try:
        assert trainer.step == 1  # resumed
        m = trainer.config.model
        assert m.option_values()["rms_norm_eps"] == 1e-2 and len(m.layers) == 4  # the started model, not the edit
        trainer.train()
    finally:
        trainer.close()
