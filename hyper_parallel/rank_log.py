"""Log a message every rank would print alike (a config-level warning) once, from rank 0.

Ranks other than 0 show warnings (``train.init_logging``), which is right for what differs per rank (a skipped
sample, a missing per-rank file) but repeats a run-wide message once per rank: 64 copies on 64 ranks.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

__all__ = ["warn_on_rank0"]


def warn_on_rank0(logger: logging.Logger, msg: str, *args: Any) -> None:
    """``logger.warning(msg, *args)`` on rank 0 (or without a process group); nothing on the other ranks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        logger.warning(msg, *args, stacklevel=2)
