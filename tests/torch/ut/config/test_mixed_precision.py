"""float16 compute without loss scaling is refused, with the reason (a hazard a GPU run would hit).
"""

from __future__ import annotations

import pytest

from hyper_parallel.config import ConfigError, ConfigManager
from hyper_parallel.config.training import TrainingConfig


# DCP announces that it runs without a process group in these single-process tests
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_float16_compute_is_refused_with_the_reason() -> None:
    assert TrainingConfig(mixed_precision_param="bfloat16").mixed_precision_param == "bfloat16"
    with pytest.raises(ConfigError, match="loss scaling.*use 'bfloat16'"):
        TrainingConfig(mixed_precision_param="float16")  # type: ignore[arg-type]
    with pytest.raises(SystemExit):  # the CLI does not offer it
        ConfigManager().parse_args(
            ["--module", "tests.torch.ut.recipes.toy_registry", "--config", "toy_small",
             "--training.mixed_precision_param", "float16"]
        )  # fmt: skip
