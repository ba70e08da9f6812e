"""A seeded shuffle buffer whose contents and RNG are part of the checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hyper_parallel.data.sample import Sample

__all__ = ["ShuffleBuffer"]


class ShuffleBuffer:
    """Keeps ``size`` samples; each ``next()`` tops it up from ``source`` and draws one at random.

    ``size <= 1`` passes samples through in order. The draw uses a numpy PCG64 generator seeded by
    ``seed`` (e.g. ``(data.seed, dp_rank)``); its bit-generator state is saved with the buffer, so a resumed buffer draws the same.
    """

    def __init__(self, source: Callable[[], Sample], size: int, seed: Sequence[int]) -> None:
        self.source, self.size = source, size
        self.rng = np.random.Generator(np.random.PCG64([*seed, 0x5A1F]))
        self.buffer: list[Sample] = []

    def next(self) -> Sample:
        if self.size <= 1:
            return self.source()
        while len(self.buffer) < self.size:
            self.buffer.append(self.source())
        j = int(self.rng.integers(len(self.buffer)))
        # swap-remove: O(1), and the layout stays a pure function of the draws
        self.buffer[j], self.buffer[-1] = self.buffer[-1], self.buffer[j]
        return self.buffer.pop()

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": [s.to_dict() for s in self.buffer], "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer = [Sample.from_dict(s) for s in state["buffer"]]
        self.rng.bit_generator.state = state["rng"]
