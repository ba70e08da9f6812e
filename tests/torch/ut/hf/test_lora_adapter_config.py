"""The PEFT adapter_config.json names the base folder as an absolute path.
"""

from __future__ import annotations


def test_adapter_config_names_the_base_folder_absolute(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from hyper_parallel.hf.lora_export import _adapter_config

    (tmp_path / "Qwen3.5-tiny").mkdir()
    monkeypatch.chdir(tmp_path)
    target = SimpleNamespace(lora=SimpleNamespace(rank=4, alpha=8.0, rslora=False, dropout=0.0))
    meta = {"target_parameters": [], "target_modules": ["q_proj"], "modules_to_save": []}
    config = _adapter_config([target], meta, form="peft", base="Qwen3.5-tiny")
    assert config["base_model_name_or_path"] == str(tmp_path / "Qwen3.5-tiny")
