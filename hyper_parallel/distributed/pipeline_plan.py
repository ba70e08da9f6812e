"""Pipeline stages: which decoder layers each stage holds and which stages each pipeline rank runs.

Pure arithmetic over model facts (no process group), shared by the trainer and the dry run.

A model of ``L`` decoder layers is cut into ``S = pp x stages_per_rank`` contiguous stages. Stage 0 also holds
the input side (the token embedding and whatever else the model feeds its first layer: an image path), the last
stage the output side (final norm, LM head, an MTP block): their costs come with the model's facts (``StageCosts``,
``protocols/pipeline_stage.py``), so the automatic split balances ``first + layers`` against ``layers + last``. A manual split
(``--parallelism.pipeline_split``) gives the first layer of every stage after the first.

Stages map to ranks the way torch.distributed.pipelining's schedules expect: one stage per rank (1F1B, GPipe),
a loop (Interleaved1F1B: stage ``s`` on rank ``s % pp``) or a V (ZBVZeroBubble, DualPipeV: rank ``r`` holds ``r``
and ``2 pp - 1 - r``, so the first and the last stage share rank 0).

Every rule a schedule imposes is one row of ``SCHEDULES`` (``ScheduleRules``): the layout check
(``ParallelDims``), the stage placement here, the micro-batch check (``pipeline_parallel.check_microbatches``) and
the dry run read it, so a schedule is added in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args, get_type_hints

from hyper_parallel.config.errors import ConfigError
from hyper_parallel.config.parallelism import ParallelismConfig
from hyper_parallel.protocols.pipeline_stage import StageCosts, StageSpan

__all__ = [
    "SCHEDULES", "ScheduleRules", "min_microbatches", "plan_stages", "schedule_rules", "stage_ranks", "stages_of_rank",
]  # fmt: skip

_P = "--parallelism."


@dataclass(frozen=True)
class ScheduleRules:
    """What one ``torch.distributed.pipelining`` schedule requires of a layout and a step."""

    torch_class: str
    """The schedule's class in ``torch.distributed.pipelining.schedules``."""
    stages_per_rank: tuple[int, int | None]
    """Allowed ``--parallelism.pipeline_stages_per_rank``: (least, most; None: no bound)."""
    placement: Literal["loop", "v"]
    """Stage ``s`` on pp rank ``s % pp`` (loop), or rank ``r`` holding ``r`` and ``2 pp - 1 - r`` (V)."""
    min_microbatches: Literal["one", "pp", "stages"]
    """The fewest micro-batches per step: 1, ``pp``, or one per stage (``pp x stages_per_rank``)."""
    multiple_of_pp: bool = False
    """Micro-batches per step must be a multiple of ``pp``."""
    splits_weight_grad: bool = False
    """Weight gradients run apart from (after) input gradients, against the parameters the forward used: FSDP
    must keep them unsharded between the two (no ``fsdp_reshard_after_forward always``)."""


SCHEDULES: dict[str, ScheduleRules] = {
    "1F1B": ScheduleRules("Schedule1F1B", (1, 1), "loop", "pp"),
    "GPipe": ScheduleRules("ScheduleGPipe", (1, 1), "loop", "one"),
    "Interleaved1F1B": ScheduleRules("ScheduleInterleaved1F1B", (2, None), "loop", "pp", multiple_of_pp=True),
    "ZBVZeroBubble": ScheduleRules("ScheduleZBVZeroBubble", (2, 2), "v", "pp", splits_weight_grad=True),
    "DualPipeV": ScheduleRules("ScheduleDualPipeV", (2, 2), "v", "stages", splits_weight_grad=True),
}
"""The schedules ``--parallelism.pipeline_schedule`` names, and their rules."""
_NAMES = get_args(get_type_hints(ParallelismConfig)["pipeline_schedule"])
assert set(_NAMES) == set(SCHEDULES), f"ParallelismConfig.pipeline_schedule {_NAMES} vs SCHEDULES {list(SCHEDULES)}"


def schedule_rules(schedule: str) -> ScheduleRules:
    """The rules of ``schedule``; a ``ConfigError`` lists the names when it is none of them."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"{_P}pipeline_schedule is {schedule!r}; use one of {', '.join(SCHEDULES)}")
    return SCHEDULES[schedule]


def min_microbatches(schedule: str, pp: int, stages_per_rank: int) -> int:
    """The fewest micro-batches per step ``schedule`` runs over ``pp`` ranks of ``stages_per_rank`` stages."""
    need = schedule_rules(schedule).min_microbatches
    return {"one": 1, "pp": pp, "stages": pp * stages_per_rank}[need]


def _spans(bounds: Sequence[int], num_layers: int) -> list[StageSpan]:
    edges = [0, *bounds, num_layers]
    n = len(edges) - 1
    return [StageSpan(i, n, range(edges[i], edges[i + 1])) for i in range(n)]


def _balanced_bounds(costs: StageCosts, num_stages: int) -> list[int]:
    """The contiguous split minimising the most expensive stage (exact dynamic programme over cut points;
    ties go to the earliest cut)."""
    c = costs.layers
    n = len(c)
    prefix = [0.0]
    for x in c:
        prefix.append(prefix[-1] + x)

    def stage_cost(lo: int, hi: int, s: int) -> float:
        cost = prefix[hi] - prefix[lo]
        return cost + (costs.first if s == 0 else 0.0) + (costs.last if s == num_stages - 1 else 0.0)

    inf = float("inf")
    # best[s][i]: the smallest maximum over stages 0..s-1 covering layers [0, i); cut[s][i] its last cut
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            if s == 1 and i < costs.first_stage_min_layers:
                continue  # stage 0 must hold the layers the input side feeds
            for j in range(0, 1) if s == 1 else range(s - 1, i):
                value = max(best[s - 1][j], stage_cost(j, i, s - 1))
                if value < best[s][i] - 1e-12 * max(1.0, abs(value)):
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n
    for s in range(num_stages, 1, -1):
        i = cut[s][i]
        bounds.append(i)
    return bounds[::-1]


def plan_stages(costs: StageCosts, num_stages: int, split: Sequence[int] = ()) -> list[StageSpan]:
    """The ``num_stages`` stages: ``split`` (first layer of every stage after the first) or balanced by cost.

    Raises ``ConfigError`` naming the flag when the model has fewer layers than stages or the split is not a
    strictly increasing list of ``num_stages - 1`` layer numbers inside the model.
    """
    n = len(costs.layers)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if n < num_stages:
        raise ConfigError(
            f"the model has {n} decoder layers, fewer than the {num_stages} pipeline stages "
            f"({_P}pipeline_parallel_degree x {_P}pipeline_stages_per_rank): every stage needs a layer; lower them"
        )
    if split:
        split = [int(b) for b in split]
        if len(split) != num_stages - 1 or any(b <= a for a, b in zip([0, *split], [*split, n + 1])) or split[-1] >= n:
            raise ConfigError(
                f"{_P}pipeline_split {' '.join(map(str, split))}: give the first layer of each of the "
                f"{num_stages - 1} stages after the first, strictly increasing in 1..{n - 1} (the model has {n} "
                "layers), or leave it empty for a split balanced by layer cost"
            )
        if split[0] < costs.first_stage_min_layers:
            raise ConfigError(
                f"{_P}pipeline_split starts stage 1 at layer {split[0]}, but the first "
                f"{costs.first_stage_min_layers} layers take the input side's features directly and must sit on "
                f"stage 0: start stage 1 at layer {costs.first_stage_min_layers} or later"
            )
        return _spans(split, n)
    if n - costs.first_stage_min_layers < num_stages - 1:
        raise ConfigError(
            f"the first {costs.first_stage_min_layers} of the model's {n} layers sit on stage 0, which leaves too "
            f"few for the other {num_stages - 1} pipeline stages: lower {_P}pipeline_parallel_degree"
        )
    return _spans(_balanced_bounds(costs, num_stages), n)


def stage_ranks(num_stages: int, pp: int, schedule: str) -> list[int]:
    """The pp rank of every stage: stage ``s`` on ``s % pp`` (one stage per rank, or Interleaved1F1B's loop);
    a V schedule's (ZBVZeroBubble, DualPipeV): rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``."""
    if schedule_rules(schedule).placement == "v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]
    return [s % pp for s in range(num_stages)]


def stages_of_rank(pp_rank: int, num_stages: int, pp: int, schedule: str) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` runs, in increasing order."""
    return [s for s, r in enumerate(stage_ranks(num_stages, pp, schedule)) if r == pp_rank]
