"""Entry point: ``python -m hyper_parallel.train --module glm_image_moe --config glm_image_moe_debug [overrides]``.

Also under ``torchrun --nproc_per_node N -m hyper_parallel.train ...``; the device (CUDA or CPU) and
backend (NCCL or gloo) are picked at run time.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from hyper_parallel.components.checkpoint import UnsafeCheckpointError
from hyper_parallel.config.manager import ConfigManager, run_cli
from hyper_parallel.distributed.env import intra_op_threads
from hyper_parallel.hf import CheckpointKeyError, HFCheckpointError, UnsupportedQuantizationError
from hyper_parallel.hf.folder import folder_family


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
    config = ConfigManager(folder_family=folder_family).parse_args(argv)  # the HF folder opened here, once
    with intra_op_threads(log):
        trainer = config.build()
        try:
            summary = trainer.train()
        except KeyboardInterrupt:
            raise Interrupted(_interrupted_message(trainer)) from None
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


class Interrupted(Exception):
    """Ctrl-C during training; the message names the last complete checkpoint (a rerun resumes from it)."""


def _interrupted_message(trainer: Any) -> str:
    """What a Ctrl-C leaves: the last complete checkpoint, which the same command resumes from."""
    ck = getattr(trainer, "checkpointer", None)
    steps = ck.complete_steps() if ck is not None and ck.config.enable else []
    at = f"interrupted during step {trainer.step}"
    if steps:
        return (f"{at}: the last complete checkpoint is {ck.step_dir(steps[-1])} (step {steps[-1]}); run the same "
                "command again to resume from it")  # fmt: skip
    return f"{at}: no complete checkpoint in {ck.folder if ck is not None else 'the dump folder'}; a rerun starts afresh"


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors of the user's input (data, HF folders, checkpoints, layout, config): their message says what to
    change, so the command line prints it as one line (exit code 2) instead of a traceback."""
    from hyper_parallel.data import DataStateMismatch
    from hyper_parallel.data.bad_samples import BadSampleError
    from hyper_parallel.data.chat import ChatTemplateError
    from hyper_parallel.data.vision_language.preprocess import MediaError

    return (
        BadSampleError, DataStateMismatch, ChatTemplateError, MediaError, CheckpointKeyError,
        UnsupportedQuantizationError, HFCheckpointError, FileNotFoundError, UnsafeCheckpointError,
    )  # fmt: skip


def _cli(argv: Sequence[str] | None = None) -> None:
    """``python -m hyper_parallel.train``: user errors are one line (exit code 2), Ctrl-C one line (130)."""
    try:
        run_cli(lambda: main(argv), user_errors=user_errors())
    except Interrupted as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    _cli()
