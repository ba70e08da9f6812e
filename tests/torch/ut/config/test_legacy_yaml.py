"""v1 run files (``model:`` / ``data:`` / ``train:``): translated with a DeprecationWarning that prints the new
CLI, equal to that CLI, and every key without an equivalent named in one error."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from hyper_parallel.config import ConfigError, ConfigManager, legacy
from hyper_parallel.config.legacy import (
    LEGACY_KEYS,
    LegacyConfigWarning,
    cli_args,
    is_legacy_layout,
    translate_legacy,
)

REPO = Path(__file__).resolve().parents[4]
MIGRATION_DOC = REPO / "docs/migrations/v2_migration.md"
RECIPE = ["--module", "glm_image_moe", "--config", "glm_image_moe_debug"]

V1_YAML = """\
model:
  name: glm_image_moe
  model_path: /ckpt/glm
  config_path: /ckpt/glm
data:
  train_path: /data/shards/train-{000000..000003}.tar
  data_type: webdataset
  max_seq_len: 256
  global_batch_size_tokens: 512
  dyn_bsz: true
  num_workers: 1
  seed: 7
  shuffle_buffer_size: 64
  skip_bad_samples: true
train:
  max_steps: 100
  lr: 1.0e-3
  lr_warmup_ratio: 0.29
  lr_decay_style: linear
  lr_min: 1.0e-4
  weight_decay: 0.05
  max_grad_norm: 0.5
  seed: 3
  output_dir: runs/old run
  bf16: true
  enable_gradient_checkpointing: true
  enable_full_shard: false
  ema_decay: 0.99
  log_steps: 5
  optimizer:
    name: muon
    betas: [0.9, 0.99]
    eps: 1.0e-6
    momentum: 0.9
  accelerator:
    fsdp_size: -1
    tp_size: 1
    ep_size: 2
    backend: gloo
  checkpoint:
    save_steps: 20
    keep_last: 2
    async_save: false
    save_hf_weights: true
    hf_dtype: bf16
"""


def _parse(*args: str):
    return ConfigManager().parse_args([*RECIPE, *args])


def _translate(data: dict, source: str = "old.yaml") -> tuple[dict, str]:
    with pytest.warns(DeprecationWarning) as record:
        out = translate_legacy(data, source=source)
    (warning,) = [w for w in record if issubclass(w.category, LegacyConfigWarning)]
    return out, str(warning.message)


def _cli_from_warning(message: str) -> list[str]:
    (line,) = [ln for ln in message.splitlines() if ln.startswith("  --")]
    return shlex.split(line)


def _flat(nested: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _pairs(cli: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for arg in cli:
        if arg.startswith("--"):
            assert arg not in out, f"{arg} given twice"
            out[arg] = current = []
        else:
            current.append(arg)
    return out


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


# ---- translation ----------------------------------------------------------------------------------------


def test_v1_yaml_translates_to_the_printed_cli(tmp_path):
    folder = tmp_path / "ckpt" / "glm"  # the model folder must exist (a mistyped path is refused at parse time)
    folder.mkdir(parents=True)
    v1_yaml = V1_YAML.replace("/ckpt/glm", str(folder))
    out, message = _translate(yaml.safe_load(v1_yaml))
    assert "deprecated v1 layout" in message and "docs/migrations/v2_migration.md" in message
    flat = _flat(out)
    assert flat["training.steps"] == 100
    assert flat["lr_scheduler.warmup_steps"] == 29  # round(0.29 * 100), not int(28.999999999999996)
    assert flat["lr_scheduler.min_lr_ratio"] == 0.1
    assert flat["optimizer.betas"] == (0.9, 0.99)
    assert flat["checkpoint.enable"] is True and flat["checkpoint.interval"] == 20
    assert flat["training.mixed_precision_param"] == "bfloat16"
    assert flat["parallelism.fsdp_reshard_after_forward"] == "never"
    assert flat["data.source"] == "direct_token" and flat["data.on_bad_sample"] == "skip"
    assert "model.config_path" not in message  # repeats model_path: ignored
    cli = _cli_from_warning(message)
    assert _pairs(cli) == _pairs(cli_args(flat))
    assert "--training.steps" in cli and cli[cli.index("--optimizer.lr") + 1] == "0.001"
    assert cli[cli.index("--dump_folder") + 1] == "runs/old run"  # shell-quoted in the message

    old = tmp_path / "old.yaml"
    old.write_text(v1_yaml)
    with pytest.warns(LegacyConfigWarning):
        from_file = _parse("--config-file", str(old))
    from_cli = _parse(*cli)
    assert from_file.to_dict() == from_cli.to_dict()
    assert from_file.optimizer.betas == (0.9, 0.99)  # a tuple, as the field's type says
    assert (from_file.training.steps, from_file.optimizer.name, from_file.ema.decay) == (100, "muon", 0.99)
    assert from_file.checkpoint.initial_load_path == str(folder)
    # the rest of the recipe is untouched, and the command line still wins over the file
    assert from_file.model == _parse().model
    with pytest.warns(LegacyConfigWarning):
        assert _parse("--config-file", str(old), "--training.steps", "9").training.steps == 9


def test_unmappable_keys_are_listed_in_one_error():
    data = yaml.safe_load(V1_YAML)
    data["train"]["foo_bar"] = 1
    data["train"]["max_stesp"] = 3
    data["train"]["accelerator"]["tp_size"] = "two"
    data["model"]["tokenizer_path"] = "/tok"
    data["data"]["dyn_bsz"] = False
    data["train"]["optimizer"]["name"] = "adam"
    data["train"]["checkpoint"]["load_path"] = "/ckpt/step-100"
    with pytest.raises(ConfigError) as err:
        translate_legacy(data, source="--config-file old.yaml")
    msg = str(err.value)
    assert "--config-file old.yaml" in msg and "7 of its keys" in msg
    for key in ("train.foo_bar", "train.max_stesp", "train.accelerator.tp_size", "model.tokenizer_path",
                "data.dyn_bsz", "train.optimizer.name", "train.checkpoint.load_path"):  # fmt: skip
        assert f"\n  {key}: " in msg, key
    assert "did you mean 'train.max_steps'" in msg
    assert "expected an integer, got 'two'" in msg
    assert "'adam' has no equivalent; use one of 'adamw', 'muon'" in msg


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"train": {"lr_warmup_ratio": 0.1}}, r"train.lr_warmup_ratio: .*needs train.max_steps"),
        ({"train": {"lr_warmup_ratio": 1.5, "max_steps": 10}}, r"train.lr_warmup_ratio: 1.5 must lie in \[0, 1\]"),
        ({"train": {"lr_min": 1e-5}}, r"train.lr_min: .*give train.lr"),
        ({"data": {"max_seq_len": 10, "max_tokens": 20}},
         r"data.max_tokens: sets data.max_tokens_per_microbatch=20, but data.max_seq_len already set it to 10"),
        ({"train": {"save_steps": 100, "checkpoint": {"enable": False}}}, r"train.checkpoint.enable: sets checkpoint.enable"),
        ({"model": {"model_path": "/a", "config_path": "/b"}}, r"model.config_path: no equivalent: the architecture"),
        ({"train": {"max_steps": 3}, "training": {"steps": 3}}, r"training: not a v1 section.*do not mix layouts"),
        ({"train": ["max_steps"]}, r"train: a v1 section must be a mapping"),
    ],
)  # fmt: skip
def test_values_that_cannot_convert(data, match):
    with pytest.raises(ConfigError, match=match):
        translate_legacy(data, source="old.yaml")


def test_null_means_unset():
    out, message = _translate({"model": None, "train": {"max_steps": 5, "lr": None, "lr_decay_steps": None}})
    assert out == {"training": {"steps": 5}} and message.count("  --") == 1


def test_lr_min_reads_the_optimizer_section_lr():
    out, _ = _translate({"train": {"optimizer": {"lr": 4e-4}, "lr_min": 1e-4}})
    assert out["lr_scheduler"]["min_lr_ratio"] == 0.25


def test_layout_detection():
    assert is_legacy_layout({"train": {}})
    assert is_legacy_layout({"data": {"train_path": "x"}})
    assert is_legacy_layout({"model": {"model_path": "x"}})
    # the new layout, including keys both layouts share, is not v1
    assert not is_legacy_layout({"training": {"steps": 3}, "data": {"num_workers": 2, "path": "x"}})
    assert not is_legacy_layout({"model": {"dim": 8}})
    assert not is_legacy_layout({})


def test_new_layout_file_is_not_translated(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("training:\n  steps: 11\ndata:\n  num_workers: 1\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        cfg = _parse("--config-file", str(f))
    assert (cfg.training.steps, cfg.data.num_workers) == (11, 1)


def test_every_target_is_a_field_of_the_run_config():
    # Renaming a config field must update the mapping table: walk every target through Trainer.Config.
    cfg = _parse()
    assert set(legacy._NEW_SECTIONS) == {f.name for f in dataclasses.fields(cfg)}
    for key, entry in LEGACY_KEYS.items():
        for target in entry.targets:
            node = cfg
            for part in target.split("."):
                assert dataclasses.is_dataclass(node) and part in {f.name for f in dataclasses.fields(node)}, (
                    f"{key} -> {target}: {part!r} is not a field"
                )
                node = getattr(node, part)


# ---- the migration guide's examples are what the code does --------------------------------------------------


def test_migration_guide_examples():
    text = MIGRATION_DOC.read_text()
    (old_yaml,) = [b for b in _code_blocks(text, "yaml") if b.startswith("# old.yaml")]
    out, message = _translate(yaml.safe_load(old_yaml))
    # the printed command line in the guide is the one the warning prints
    (command,) = [b for b in _code_blocks(text, "bash") if "--model_spec" in b]
    args = shlex.split(command.replace("\\\n", " "))
    assert args[:7] == ["python", "-m", "hyper_parallel.train", "--module", "glm_image_moe", "--config",
                        "glm_image_moe_a3b"]  # fmt: skip
    assert args[7:] == _cli_from_warning(message)
    # the new-layout run file in the guide is the same run
    (toml,) = [b for b in _code_blocks(text, "toml") if b.startswith("# run.toml")]
    import tomllib

    assert _flat(tomllib.loads(toml)) == {k: list(v) if isinstance(v, tuple) else v for k, v in _flat(out).items()}
    # the error shown in the guide is the error the code raises
    (shown,) = [b for b in _code_blocks(text, "text") if b.startswith("error:")]
    bad = {"model": {"tokenizer_path": "/tok"}, "train": {"foo_bar": 1, "num_train_epochs": 3}}
    with pytest.raises(ConfigError) as err:
        translate_legacy(bad, source="--config-file old.yaml")
    assert shown.strip() == f"error: {err.value}"


# ---- end to end --------------------------------------------------------------------------------------------


def test_manager_cli_end_to_end(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text(V1_YAML)
    cmd = [sys.executable, "-m", "hyper_parallel.config.manager", *RECIPE, "--config-file", str(old)]
    ok = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert ok.returncode == 0, ok.stderr
    resolved = json.loads(ok.stdout)
    assert resolved["training"]["steps"] == 100 and resolved["lr_scheduler"]["warmup_steps"] == 29
    assert resolved["parallelism"]["expert_parallel_degree"] == 2 and resolved["dump_folder"] == "runs/old run"
    # a DeprecationWarning outside __main__ is hidden by default; this one is shown, with the new CLI
    assert "LegacyConfigWarning" in ok.stderr and "--training.steps 100" in ok.stderr

    old.write_text(V1_YAML.replace("  max_steps: 100\n", "  max_steps: 100\n  foo_bar: 1\n"))
    bad = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 2, bad.stderr  # a clean `error:` line, not a traceback
    assert bad.stderr.startswith("error: --config-file") and "train.foo_bar: unknown v1 key" in bad.stderr
    assert "Traceback" not in bad.stderr
