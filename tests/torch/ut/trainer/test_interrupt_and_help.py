"""Ctrl-C names the last complete checkpoint; ``--help`` without ``--module`` says a folder replaces the model.
"""

from __future__ import annotations

import pytest

from hyper_parallel.train import _cli as train_cli
from tests.torch.ut.hf.test_release_folders import TINY


def test_ctrl_c_names_the_last_complete_checkpoint(tmp_path, monkeypatch, capsys):
    from hyper_parallel.trainer import Trainer

    real = Trainer.train_step

    def step(self, *args, **kwargs):
        if self.step == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", step)
    with pytest.raises(SystemExit) as e:
        train_cli(["--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--dump_folder", str(tmp_path / "run"),
                   "--checkpoint.interval", "1", "--checkpoint.no_export_hf", "--training.steps", "3", *TINY])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 130
    assert "interrupted during step 2" in err and str(tmp_path / "run" / "checkpoint" / "step-1") in err and "resume" in err


def test_help_without_module_says_a_folder_replaces_the_model(capsys):
    from hyper_parallel.config.manager import main

    with pytest.raises(SystemExit) as e:
        main(["--config", "qwen3_5_moe_a3b", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--module qwen3_5_moe --config qwen3_5_moe_a3b" in out
    assert "the model is DIR's config.json" in " ".join(out.split())
