"""Entry point: ``python -m hyper_parallel.train --module glm_image_moe --config glm_image_moe_debug [overrides]``.

Also under ``torchrun --nproc_per_node N -m hyper_parallel.train ...``; the device (CUDA or CPU) and
backend (NCCL or gloo) are picked at run time.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from hyper_parallel.config.manager import ConfigError, ConfigManager


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse the run config, train, and return the run summary."""
    config = ConfigManager().parse_args(argv)
    trainer = config.build()
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    if trainer.rank == 0 and summary["first_loss"] is not None:
        print(
            f"[hyper_parallel] done: {summary['steps']} steps, loss {summary['first_loss']:.4f} -> "
            f"{summary['last_loss']:.4f}",
            flush=True,
        )
    return summary


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
