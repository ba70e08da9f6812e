"""Entry point: ``python -m hyper_parallel.train --module glm_image_moe --config glm_image_moe_debug [overrides]``.

Also under ``torchrun --nproc_per_node N -m hyper_parallel.train ...``; the device (CUDA or CPU) and
backend (NCCL or gloo) are picked at run time.
"""

from __future__ import annotations

import gc
import logging
import os
import warnings
from collections.abc import Sequence
from typing import Any

from hyper_parallel.config.manager import ConfigManager, run_cli
from hyper_parallel.distributed.env import intra_op_threads


def init_logging() -> None:
    """Console logging: INFO on rank 0 (metrics, progress, ETA), warnings only on the other ranks."""
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="[%(asctime)s rank%(process)d] %(message)s".replace("%(process)d", str(rank)),
        datefmt="%H:%M:%S",
        force=True,
    )
    # FSDP on a CPU mesh warns once about DTensor RNG; initialisation does not depend on it.
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse the run config, train, and return the run summary (intra-op threads: ``intra_op_threads``)."""
    init_logging()
    log = logging.getLogger("hyper_parallel")
    config = ConfigManager().parse_args(argv)
    with intra_op_threads(log):
        trainer = config.build()
        try:
            summary = trainer.train()
        finally:
            trainer.close()
        # close() destroyed every group, but the model still holds FSDP's and EP's gloo groups in reference
        # cycles, and a gloo group's threads end only when it is freed. Free them now: left to interpreter
        # exit, those threads can outlive the C++ state they use and abort a finished run ("terminate
        # called without an active exception", seen on one rank of a 2-rank FSDP run in CI).
        del trainer
        gc.collect()
    if summary["first_loss"] is not None:
        log.info("done: %d steps, loss %.4f -> %.4f", summary["steps"], summary["first_loss"], summary["last_loss"])
    return summary


if __name__ == "__main__":
    run_cli(main)
