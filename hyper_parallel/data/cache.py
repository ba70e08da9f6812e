"""Content-addressed cache folders, built once and safely by many processes at a time."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any

__all__ = ["cached_build", "spec_digest"]


def spec_digest(spec: Any, version: int, *, length: int = 12) -> str:
    """Hash of a frozen spec dataclass and its generator ``version`` (bump it to leave stale caches)."""
    d = dataclasses.asdict(spec)
    d["version"] = version
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:length]


def cached_build(
    root: str, name: str, build: Callable[[str], Any], *, ready: Callable[[str], bool] = os.path.isdir
) -> str:
    """``root/name``, written by ``build(folder)`` unless ``ready(root/name)`` already holds.

    Safe when several ranks call it at once: each builds into its own temporary folder and the first
    atomic rename wins; the others discard theirs and use the winner's, so every rank reads the same files.
    """
    root = os.path.expanduser(root)
    final = os.path.join(root, name)
    if ready(final):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".tmp-{name}-{uuid.uuid4().hex}")
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not ready(final):  # a real failure, not "another process won"
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
