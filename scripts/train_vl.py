"""Train a vision-language model (default: spec ``qwen3_vl_moe``, recipe ``qwen3_vl_moe_debug`` on the toy VL corpus).

    python scripts/train_vl.py [--config qwen3_5_moe_vl_debug] [--training.steps 20 ...]
"""

from __future__ import annotations

import sys

from hyper_parallel.config import ConfigManager
from hyper_parallel.train import init_logging

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--module" not in args:
        args = ["--module", "qwen3_vl_moe", *args]
    if not any(a in args for a in ("--config", "--config-file")):
        args += ["--config", "qwen3_vl_moe_debug"]
    init_logging()
    trainer = ConfigManager().parse_args(args).build()
    try:
        trainer.train()
    finally:
        trainer.close()
