"""Single-process tests leave no process group behind: a test that initialises one destroys it.

A leftover default group changes what the next test sees (a Trainer then joins it instead of creating,
and later destroying, its own) and keeps gloo threads running for the rest of the session.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hyper_parallel.distributed.env import destroy_distributed


@pytest.fixture(autouse=True)
def _no_process_group_left(request):
    assert not (dist.is_available() and dist.is_initialized()), "a process group was already initialised"
    yield
    if dist.is_available() and dist.is_initialized():
        destroy_distributed()  # so the tests after this one start clean
        pytest.fail(f"{request.node.nodeid} left the default process group initialised: destroy it (Trainer.close())")
