"""torchtitan users' command-line habits work: a short run of a recipe with a longer warmup, and boolean fields
that are flags and still take a value.
"""

from __future__ import annotations

import pytest

from hyper_parallel.config import ConfigManager
from tests.torch.helpers import run_trainer


def test_three_step_smoke_run_of_a_recipe_with_longer_warmup(tmp_path):
    """`--training.steps 3` on a recipe whose warmup is 10 steps: warmup is clamped, the run completes."""
    cfg = ConfigManager().parse_args(["--module", "glm_image_moe", "--config", "glm_image_moe_debug",
                                      "--dump_folder", str(tmp_path), "--training.steps", "3",
                                      "--lr_scheduler.warmup_steps", "10", "--checkpoint.no_enable",
                                      "--checkpoint.no_export_hf"])  # fmt: skip
    _, summary = run_trainer(cfg)
    assert summary["steps"] == 3


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--debug.deterministic"], True),
        (["--debug.no_deterministic"], False),
        (["--debug.deterministic", "True"], True),
        (["--debug.deterministic", "False"], False),
        (["--debug.deterministic=false"], False),
    ],
)
def test_boolean_fields_are_flags_and_still_take_a_value(args, expected):
    cfg = ConfigManager().parse_args(["--module", "glm_image_moe", "--config", "glm_image_moe_debug", *args])
    assert cfg.debug.deterministic is expected
