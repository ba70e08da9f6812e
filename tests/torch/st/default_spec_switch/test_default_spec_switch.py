"""The RFC's default-spec switch for Qwen3.5: the base names are the v2 packages.

- ``--module qwen3_5`` / ``qwen3_5_v2`` (and ``qwen3_5_moe`` / ``qwen3_5_moe_v2``) resolve to the same
  ``ModelSpec`` and train to bit-identical losses;
- a v1 three-section YAML (``model:`` / ``data:`` / ``train:``) for a Qwen3.5-MoE run still works through
  ``--config-file``: it trains to the same losses as the equivalent v2 command line.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from hyper_parallel.config import ConfigManager
from hyper_parallel.config.legacy import LegacyConfigWarning
from hyper_parallel.protocols.model_spec import discover_model_spec

STEPS = 2
SMALL = ["--training.steps", str(STEPS), "--data.global_batch_tokens", "256", "--data.max_tokens_per_microbatch",
         "256", "--checkpoint.enable", "False", "--checkpoint.export_hf", "False", "--metrics.log_freq", "1",
         "--metrics.plot_loss", "False", "--debug.deterministic", "True"]  # fmt: skip


def _losses(args: list[str], dump: Path) -> list[float]:
    paths = ["--dump_folder", str(dump), "--data.cache_dir", str(dump.parent / "cache")]
    cfg = ConfigManager().parse_args([*args, *paths])
    trainer = cfg.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    return [json.loads(line)["loss"] for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("base", "recipe"), [("qwen3_5", "qwen3_5_debug"), ("qwen3_5_moe", "qwen3_5_moe_debug")])
def test_base_name_and_v2_alias_are_one_spec_with_equal_losses(tmp_path, base, recipe):
    spec, alias = discover_model_spec(base), discover_model_spec(f"{base}_v2")
    assert spec is alias and spec.name == base and spec.flavor == recipe
    assert "text" in spec.data_sources
    a = _losses(["--module", base, "--config", recipe, *SMALL], tmp_path / "base")
    b = _losses(["--module", f"{base}_v2", "--config", recipe, *SMALL], tmp_path / "alias")
    print(f"{base}: {a} == {base}_v2: {b}")
    assert len(a) == STEPS and a == b


V1_YAML = """\
model:
  name: qwen3_5_moe
data:
  max_seq_len: 256
  global_batch_size_tokens: 256
  seed: 3
train:
  max_steps: 2
  lr: 0.002
  lr_warmup_steps: 1
  max_grad_norm: 1.0
  seed: 7
  deterministic: true
  log_steps: 1
  checkpoint:
    enable: false
    save_hf_weights: false
"""


def test_v1_three_section_yaml_trains_a_qwen3_5_moe_run(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text(V1_YAML)
    recipe = ["--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--metrics.plot_loss", "False"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        v1 = _losses([*recipe, "--config-file", str(old)], tmp_path / "v1")
    (warning,) = [w for w in record if issubclass(w.category, LegacyConfigWarning)]
    assert "--model_spec qwen3_5_moe" in str(warning.message) and "--training.steps 2" in str(warning.message)
    v2 = _losses([*recipe, "--model_spec", "qwen3_5_moe", "--data.max_tokens_per_microbatch", "256",
                  "--data.global_batch_tokens", "256", "--data.seed", "3", "--training.steps", "2",
                  "--optimizer.lr", "0.002", "--lr_scheduler.warmup_steps", "1", "--training.max_norm", "1.0",
                  "--debug.seed", "7", "--debug.deterministic", "True", "--metrics.log_freq", "1",
                  "--checkpoint.enable", "False", "--checkpoint.export_hf", "False"], tmp_path / "v2")  # fmt: skip
    print(f"v1 yaml: {v1}, v2 cli: {v2}")
    assert len(v1) == 2 and v1 == v2
