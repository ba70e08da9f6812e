"""Peak memory per segment of a simulated step, and the full-depth peak from two shallow copies of a model.

A deep model is simulated at two depths one layer period apart (``step.LayerPlan``). Memory at a *given moment*
of the step is linear in the number of periods (every period adds its shards, optimizer state, saved activations
or gradients), but the moment of the peak is not the same at every depth: a shallow copy peaks at the loss (the
vocabulary-sized logits), the full model, with ten times the gradient shards, at the end of the backward or in the
optimizer step. Extrapolating the two shallow peaks would extrapolate two unrelated moments (and under-report:
expert parallel once showed a 55.8 GiB peak below its own 64.6 GiB of parameters, gradients and optimizer state).

So the tracker records the peak of every *segment* of the step: a stretch of operations with the same micro-batch,
phase (forward, backward, optimizer) and set of active modules; decoder layer ``i`` appears in it as an index, and
root-level operations between layers remember the last layer entered in the phase. A segment of the shallower copy
is matched with the same segment of the deeper one counted from the first layer (layer ``i`` -> ``i``) or from the
last one (``i`` -> ``i + period``): either keeps the segment's position relative to one end of the stack, so its
memory is linear in depth and extrapolates exactly, as long as its neighbours are alike in both copies (see
``extrapolate_segments``). Along the repeated periods memory is linear in the period index, so the full-depth
maximum over them lies at the first, second, second-to-last or last period, which the matchings cover. The
full-depth peak is the largest extrapolated segment peak.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker

__all__ = ["FSDPSegmentTracker", "SegmentKey", "SegmentPeak", "SegmentTracker", "extrapolate_segments"]

_TOTAL = "Total"
# ModTracker names a module "<RootClass>.<child path>": the decoder layers are the root's ``layers.<i>``
_LAYER = re.compile(r"^([^.]+\.layers\.)(\d+)(?=\.|$)")

SegmentKey = tuple[int, str, frozenset, tuple[int, ...], "int | None", int]
"""(micro-batch, phase, active modules with layer indices replaced by ``#``, layer indices, last layer entered
while none is active (``None``: none yet in this phase), occurrence of this state in its phase)."""


@dataclass(slots=True)
class SegmentPeak:
    """The largest memory seen in one segment, by tracker category (``Total`` included), in bytes."""

    total: float
    categories: dict[str, float] = field(default_factory=dict)


class _SegmentPeaks:
    """Mixin for torch's memory trackers: per-segment peaks (``segments``) next to the global one.

    ``micro_batch`` is set by the caller at each micro-batch. The per-module local peaks of the base trackers are
    not kept (the dry run reads only global and segment peaks): their update loops over every tracked module on
    every operation, a large share of the simulation's time on deep models.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.segments: dict[SegmentKey, SegmentPeak] = {}
        self.micro_batch = 0
        self._phase = ""
        self._after: int | None = None
        self._state: tuple | None = None
        self._segment: SegmentKey | None = None
        self._occurrences: dict[tuple, int] = {}
        self._names: dict[frozenset, tuple[frozenset, tuple[int, ...]]] = {}

    def _split_layers(self, names: frozenset) -> tuple[frozenset, tuple[int, ...]]:
        cached = self._names.get(names)
        if cached is None:
            template, layers = set(), set()
            for name in names:
                match = _LAYER.match(name)
                if match is None:
                    template.add(name)
                else:
                    layers.add(int(match.group(2)))
                    template.add(match.group(1) + "#" + name[match.end() :])
            cached = self._names[names] = (frozenset(template), tuple(sorted(layers)))
        return cached

    def _current_segment(self) -> SegmentKey:
        tracker = self._mod_tracker
        phase = "optimizer" if self._in_opt else ("backward" if tracker.is_bw else "forward")
        if phase != self._phase:
            self._phase, self._after = phase, None
        template, layers = self._split_layers(frozenset(tracker.parents))
        if len(layers) == 1:
            self._after = layers[0]
        state = (self.micro_batch, phase, template, layers, None if layers else self._after)
        if state != self._state:
            self._state = state
            occurrence = self._occurrences[state] = self._occurrences.get(state, -1) + 1
            self._segment = (*state, occurrence)
        return self._segment  # type: ignore[return-value]

    def _update_peak_stats(self, peak_state: Any) -> None:  # noqa: ARG002 - the base trackers' signature
        snap = self._curr_mem_snap
        for dev, dev_snap in snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL]:
                self._peak_mem[dev] = dev_snap[_TOTAL]
                self._peak_mem_snap[dev] = dict(dev_snap)
        total = sum(dev_snap[_TOTAL] for dev_snap in snap.values())
        key = self._current_segment()
        best = self.segments.get(key)
        if best is None or total > best.total:
            categories: dict[str, float] = {}
            for dev_snap in snap.values():
                for k, v in dev_snap.items():
                    name = str(getattr(k, "value", k))
                    categories[name] = categories.get(name, 0.0) + float(v)
            self.segments[key] = SegmentPeak(float(total), categories)


class FSDPSegmentTracker(_SegmentPeaks, FSDPMemTracker):
    """``FSDPMemTracker`` that also records per-segment peaks."""


class SegmentTracker(_SegmentPeaks, MemTracker):
    """``MemTracker`` that also records per-segment peaks."""


def _shifted(key: SegmentKey, by: int) -> SegmentKey:
    """``key`` with every decoder-layer index moved by ``by``."""
    micro, phase, template, layers, after, occurrence = key
    return (
        micro, phase, template, tuple(i + by for i in layers), None if after is None else after + by, occurrence
    )  # fmt: skip


def _period(key: SegmentKey, head: int, period: int) -> int | None:
    """Index of the repeated period ``key`` belongs to (its layer, or the last layer entered before a root-level
    gap); None for a segment outside the repeated layers."""
    _, _, _, layers, after, _ = key
    indices = layers if layers else (() if after is None else (after,))
    if not indices or min(indices) < head:
        return None
    return (min(indices) - head) // period


def extrapolate_segments(
    low: dict[SegmentKey, SegmentPeak],
    high: dict[SegmentKey, SegmentPeak],
    *,
    head: int,
    period: int,
    depths: tuple[int, int],
    num_layers: int,
) -> SegmentPeak:
    """The full-depth peak from the segment peaks at ``depths`` (``head`` distinct layers, then layers repeating
    every ``period``; the shallower depth holds at least two periods).

    A segment's memory also depends on its neighbours (FSDP prefetches the next unit's parameters and keeps the
    previous unit's reduce-scatter buffer), so a segment is extrapolated only between copies where its neighbours
    are alike: the first period counted from the start (the periods after it are repeated ones in both copies), the
    last counted from the end, anything outside the repeated layers as it is. An interior period (neighbours
    repeated on both sides) exists in the deeper copy only when the shallower one has two periods: its full-depth
    value is its value in the deeper copy plus the growth of the first (or last) period's same segment, which sees
    the same added layers on the same side.
    """
    k1, k2 = depths
    periods = (k1 - head) // period
    if periods < 2 or k2 - k1 != period:
        raise ValueError(f"depths {depths} must be {head} + m*{period} and one period more, with m >= 2")
    scale = (num_layers - k1) / period  # from the shallower copy to full depth
    rest = (num_layers - k2) / period  # from the deeper copy to full depth
    best: SegmentPeak | None = None

    def offer(base: SegmentPeak, a: SegmentPeak, b: SegmentPeak, factor: float) -> None:
        """Candidate ``base + (b - a) * factor`` (totals and categories)."""
        nonlocal best
        total = base.total + (b.total - a.total) * factor
        if best is None or total > best.total:
            names = set(base.categories) | set(a.categories) | set(b.categories)
            best = SegmentPeak(total, {
                n: base.categories.get(n, 0.0) + (b.categories.get(n, 0.0) - a.categories.get(n, 0.0)) * factor
                for n in names
            })  # fmt: skip

    for key, a in low.items():
        q = _period(key, head, period)
        pairs = [key] if q is None or q < periods - 1 else []  # counted from the start
        if q is not None and q > 0:
            pairs.append(_shifted(key, period))  # counted from the end
        for match in pairs:
            b = high.get(match)
            if b is not None:
                offer(a, a, b, scale)
    for key, value in high.items():
        q = _period(key, head, period)
        if q is None or not 0 < q < periods:  # the deeper copy has periods + 1 periods: 1 .. periods - 1 interior
            continue
        first = _shifted(key, -q * period)  # the same segment in the first period, in both copies
        last = _shifted(key, (periods - q) * period)  # ... in the deeper copy's last period
        for a_key, b_key in ((first, first), (_shifted(last, -period), last)):
            a, b = low.get(a_key), high.get(b_key)
            if a is not None and b is not None:
                offer(value, a, b, rest)
    if best is None:
        raise RuntimeError(f"no step segment of the {k1}-layer copy matches one of the {k2}-layer copy")
    return best
