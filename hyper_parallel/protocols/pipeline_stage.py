"""What a model and the pipeline planner tell each other: a model's cost facts (``StageCosts``, from
``Decoder.stage_costs``) and the stage a model is cut to (``StageSpan``, ``Decoder.restrict_to_stage``).

Plain data on the interface floor, so the building blocks (``models/common``) need nothing from the planner
(``distributed/pipeline_plan.py``) that splits the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageCosts", "StageSpan"]


@dataclass(frozen=True)
class StageCosts:
    """A model's cost facts for the split (any unit, e.g. training FLOPs per token)."""

    layers: tuple[float, ...]
    """One cost per decoder layer (a DeltaNet layer and an attention layer differ, an MoE layer counts its active
    experts)."""
    first: float = 0.0
    """The input side on stage 0: embedding, VQ projection, vision tower."""
    last: float = 0.0
    """The output side on the last stage: final norm, LM head, MTP block."""
    first_stage_min_layers: int = 0
    """Layers that must sit on stage 0 (the input side feeds them directly, e.g. a vision tower's intermediate
    features added after the first layers)."""


@dataclass(frozen=True)
class StageSpan:
    """One pipeline stage: its index and the decoder layers it holds."""

    index: int
    num_stages: int
    layers: range

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1
