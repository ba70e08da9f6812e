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
silently becomes a model with a different RoPE. An export writes the RoPE in the form the folder had
(:func:`rope_to_hf` with ``HFRope.form``: the same keys at the same level, each fact everywhere the folder
stated it, so the written ``config.json`` cannot contradict itself), or one ``rope_parameters`` dict without
a folder.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LEGACY_ROPE_KEYS", "HFRope", "read_hf_rope", "rope_parameters_to_hf", "rope_to_hf"]

LEGACY_ROPE_KEYS = ("rope_scaling", "rope_theta", "partial_rotary_factor", "rope_parameters")
"""Config keys that hold RoPE facts; a reader consumes them all, an export writes them in the folder's form."""
_DICTS = ("rope_scaling", "rope_parameters")  # the keys that hold a RoPE dict
_TOP_FACTS = ("rope_theta", "partial_rotary_factor")  # the facts transformers also reads beside the dict


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
    form: dict[str, Any] = field(default_factory=dict, compare=False)
    """The level's RoPE keys (``LEGACY_ROPE_KEYS``) exactly as the folder wrote them: ``rope_to_hf`` writes
    the export in this form."""


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
        form={k: copy.deepcopy(cfg[k]) for k in LEGACY_ROPE_KEYS if k in cfg},
    )


def rope_parameters_to_hf(
    *,
    theta: float,
    partial_rotary_factor: float | None = None,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool | None = None,
) -> dict[str, Any]:
    """The one ``rope_parameters`` dict of a config without a folder's form (default RoPE; see :func:`rope_to_hf`)."""
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if partial_rotary_factor is not None:
        out["partial_rotary_factor"] = partial_rotary_factor
    if mrope_section is not None:
        out["mrope_section"] = list(mrope_section)
    if mrope_interleaved is not None:
        out["mrope_interleaved"] = mrope_interleaved
    return out


def rope_to_hf(
    *,
    theta: float,
    partial_rotary_factor: float | None = None,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool | None = None,
    form: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The RoPE keys of one config level, in the folder's ``form`` (``HFRope.form``).

    Each fact is written everywhere the folder stated it (beside the dict for ``rope_theta`` /
    ``partial_rotary_factor``, inside its ``rope_scaling`` / ``rope_parameters`` dict, with its ``type`` or
    ``rope_type`` spelling); a fact the folder did not state goes into its dict (a new ``rope_parameters`` when
    it had none). The folder's other keys (``rope_scaling: null``, unknown entries of the dict) stay as they
    were. Without a form: ``{"rope_parameters": rope_parameters_to_hf(...)}``.
    """
    facts = rope_parameters_to_hf(theta=theta, partial_rotary_factor=partial_rotary_factor,
                                  mrope_section=mrope_section, mrope_interleaved=mrope_interleaved)  # fmt: skip
    if not form:
        return {"rope_parameters": facts}
    out = {k: copy.deepcopy(v) for k, v in form.items()}
    beside = {k for k in _TOP_FACTS if k in out and k in facts}
    out.update({k: facts[k] for k in beside})
    dicts = [k for k in _DICTS if isinstance(out.get(k), Mapping) and out[k]]
    for name in dicts:
        d = dict(out[name])
        type_key = "type" if "type" in d and "rope_type" not in d else "rope_type"
        for key, value in facts.items():
            if key == "rope_type":
                d[type_key] = value
            elif key in d or key not in beside:
                d[key] = value
        out[name] = d
    if not dicts:
        rest = {k: v for k, v in facts.items() if k not in beside and k != "rope_type"}
        if rest:
            out["rope_parameters"] = {"rope_type": "default", **rest}
    return out
