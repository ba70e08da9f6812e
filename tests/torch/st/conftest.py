"""Shared fixtures of the multi-process system tests: one pool of 8 gloo workers per session."""

from __future__ import annotations

import pytest

from tests.torch.st.harness import WorkerPool


@pytest.fixture(scope="session")
def pool():
    workers = WorkerPool(max_world=8)
    yield workers
    workers.close()
