"""Read the RoPE of an HF ``config.json`` in every form transformers accepts, and write one form back.

transformers (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`` / ``standardize_rope_params``)
folds three generations of keys into one ``rope_parameters`` dict, in this priority:

1. ``rope_scaling`` (the 4.x name; transformers reads it first when it is non-empty), else
   ``rope_parameters`` (5.x);
2. inside that dict: ``rope_theta``, ``partial_rotary_factor``, ``rope_type`` (or the older ``type``),
   ``mrope_section``, ``mrope_interleaved``;
3. missing entries come from the same config level: top-level ``rope_theta`` / ``partial_rotary_factor``
   (e.g. Qwen3-VL's 4.57 form ``rope_scaling={mrope_section, ...}`` + ``rope_theta: 5000000``, or the
   Qwen3.6 form with ``partial_rotary_factor`` beside an M-RoPE-only ``rope_parameters``);
4. then the model class's defaults (Qwen3.5: theta 1e4, rotary 0.25; Qwen3-VL-MoE: theta 5e5; GLM: 1e4).

Only ``rope_type == "default"`` is modelled. Any other type (yarn, dynamic, linear, llama3, longrope ...)
and per-layer-type RoPE dicts are refused with an error naming the key and its value: a config never
silently becomes a model with a different RoPE. Exports write one ``rope_parameters`` dict and none of the
legacy keys, so the written ``config.json`` cannot contradict itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["LEGACY_ROPE_KEYS", "HFRope", "read_hf_rope", "rope_parameters_to_hf"]

LEGACY_ROPE_KEYS = ("rope_scaling", "rope_theta", "partial_rotary_factor", "rope_parameters")
"""Config keys that hold RoPE facts; a reader consumes them all, an export writes ``rope_parameters`` only."""


@dataclass(frozen=True)
class HFRope:
    """The RoPE an HF config describes, after transformers' standardisation."""

    theta: float
    """``rope_theta``."""
    partial_rotary_factor: float
    """Fraction of the head dimension that rotates."""
    mrope_section: tuple[int, ...] | None
    """M-RoPE ``[t, h, w]`` frequency slots (None: plain 1-D RoPE / the model's fallback)."""
    mrope_interleaved: bool | None
    """``mrope_interleaved`` as written (None: absent)."""


def read_hf_rope(
    cfg: Mapping[str, Any],
    *,
    where: str,
    default_theta: float,
    default_partial_rotary_factor: float | None,
    layer_types: Sequence[str] = (),
) -> HFRope:
    """The RoPE of one config level ``cfg`` (a text config, or a flat CausalLM config).

    ``where`` names that level in errors (``"text_config"``, ``"config.json"``). ``default_partial_rotary_factor``
    None means the class has no default (transformers then uses 1.0). ``layer_types`` are the config's
    layer types: a ``rope_parameters`` dict keyed by them (per-layer RoPE) is refused.
    """
    scaling, params = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    key = "rope_scaling" if scaling else "rope_parameters"
    rope = scaling or params or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"{where}.{key}={rope!r}: expected a dict (or null)")
    nested = sorted(k for k in rope if k in set(layer_types))
    if nested:
        raise NotImplementedError(
            f"{where}.{key} holds a RoPE per layer type ({nested}): this project models one RoPE for every layer"
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(
            f"{where}.{key}.rope_type={rope_type!r}: only 'default' RoPE is modelled here (no "
            "yarn/dynamic/linear/llama3/longrope scaling); use a checkpoint without RoPE scaling, or drop the "
            "scaling from config.json if you mean to train at the original context length"
        )
    theta = rope.get("rope_theta", cfg.get("rope_theta", default_theta))
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default_partial_rotary_factor))
    section = rope.get("mrope_section")
    if section is not None and (
        not isinstance(section, Sequence) or not all(isinstance(s, int) and s >= 0 for s in section)
    ):
        raise ValueError(f"{where}.{key}.mrope_section={section!r}: expected a list of non-negative ints")
    return HFRope(
        theta=float(theta),
        partial_rotary_factor=float(partial if partial is not None else 1.0),
        mrope_section=tuple(section) if section is not None else None,
        mrope_interleaved=rope.get("mrope_interleaved"),
    )


def rope_parameters_to_hf(
    *,
    theta: float,
    partial_rotary_factor: float | None = None,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool | None = None,
) -> dict[str, Any]:
    """The one ``rope_parameters`` dict an export writes (default RoPE; no legacy keys beside it)."""
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if partial_rotary_factor is not None:
        out["partial_rotary_factor"] = partial_rotary_factor
    if mrope_section is not None:
        out["mrope_section"] = list(mrope_section)
    if mrope_interleaved is not None:
        out["mrope_interleaved"] = mrope_interleaved
    return out
