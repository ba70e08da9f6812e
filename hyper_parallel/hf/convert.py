"""The adapter contract and the conversion helpers every family's key mapping shares.

A family keeps only its key mapping (an adapter: :class:`CheckedStateDictAdapter`) and its config conversion; the
generic load and export (``hf.load.load_hf_weights``, ``hf.save.save_hf_state_dict``) call the adapter's hooks,
which carry the family's quirks as data (a partial head, a text-only export form, the fused-expert layout a
folder holds). Helpers here: reading ``config.json``, checking converted keys and shapes against the model (one
error that lists every problem), fusing / splitting per-expert weights.

The adapters' HF -> ours mappings run on lazy tensors (``hf.storage.HFTensor``) as well as on real ones:
they combine tensors only with ``stack``, ``cat``, ``permute_rows`` (``hf.storage``) and ``.transpose`` /
``.reshape``, so a conversion is planned from the files' headers and each rank then reads its own slices.
"""

from __future__ import annotations

import json
import os
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hyper_parallel.hf.quant import quantization_of
from hyper_parallel.hf.storage import HFTensor, cat, stack
from hyper_parallel.protocols.state_dict_adapter import BaseStateDictAdapter

__all__ = [
    "CheckedStateDictAdapter",
    "CheckpointKeyError",
    "HFLoadResult",
    "check_keys",
    "full_tensor",
    "fuse_experts",
    "raise_problems",
    "read_hf_config",
    "split_experts",
]


class CheckpointKeyError(KeyError):
    """Missing, unexpected or wrongly shaped checkpoint keys; the message lists all of them."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


@dataclass
class HFLoadResult:
    """What an adapter's ``from_hf_checked`` produced."""

    state_dict: dict[str, torch.Tensor]
    """Our keys -> tensors."""
    source_format: str
    """Which HF layout the folder held (model specific, e.g. ``causal_lm``)."""
    passthrough: dict[str, torch.Tensor] = field(default_factory=dict)
    """HF keys the model does not represent, to write back unchanged."""


class CheckedStateDictAdapter(BaseStateDictAdapter):
    """The HF adapter contract: a family's key mapping, whose HF -> ours conversion reports what it found
    (:class:`HFLoadResult`) and can check every key and shape against the model, plus the hooks the generic load
    and export call (each default is what a family without that quirk needs)."""

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF keys -> our keys (any HF layout the adapter reads); see ``from_hf_checked``."""
        return self.load_result(hf_state_dict).state_dict

    @abstractmethod
    def from_hf_checked(self, hf_state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Size] | None = None) -> Any:
        """Convert, and with ``expected`` (our key -> shape) check every key and shape.

        Raises one ``CheckpointKeyError`` listing every missing, unexpected and mis-shaped key.
        """

    # ---- load hooks -------------------------------------------------------------------------------------
    @classmethod
    def for_folder(cls, model_config: Any, path: str | os.PathLike, **options: Any) -> CheckedStateDictAdapter:
        """The adapter that reads the HF folder ``path`` into a model of ``model_config`` (``options``: the
        family's ``HFSpec.load_options`` given to the loader)."""
        if options:
            raise TypeError(f"{cls.__name__} takes no load options, got {sorted(options)}")
        return cls(model_config)

    def load_result(
        self, hf_state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Size] | None = None
    ) -> HFLoadResult:
        """``from_hf_checked`` as an :class:`HFLoadResult` (what the generic load consumes)."""
        return self.from_hf_checked(hf_state_dict, expected)

    def after_load(self, model: Any, result: HFLoadResult) -> None:
        """What a load does beyond copying ``result.state_dict`` into the model (GlmImageMoe: a Glm4MoeLite head
        into rows ``[0, V)``; Qwen3-VL-MoE: the experts layout read, for the export). Default: nothing."""

    # ---- export hooks -----------------------------------------------------------------------------------
    @classmethod
    def export_defaults(cls, model: Any) -> dict[str, Any]:
        """``save_pretrained`` options a model implies (the form it was read in). Default: none."""
        return {}

    @classmethod
    def for_export(cls, model_config: Any, **options: Any) -> CheckedStateDictAdapter:
        """The adapter that writes ``model_config``'s folder in the form ``options`` choose (``text_only``,
        ``experts_layout``; an error names an option the model cannot be written with)."""
        if options:
            raise TypeError(f"{cls.__name__} takes no export options, got {sorted(options)}")
        return cls(model_config)

    def export_dtype(self) -> torch.dtype | None:
        """The dtype an export writes when the caller gives none (None: the tensors' own)."""
        return None

    def export_names(self, passthrough: Mapping[str, Any]) -> dict[str, str]:
        """Kept passthrough key -> the key the export writes it under, for those this export writes (it warns,
        ``hf.save.warn_dropped``, about those it leaves out). Default: every key, unchanged."""
        return {k: k for k in passthrough}

    def to_hf_export(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our keys -> the HF keys of the export's form (default ``to_hf``)."""
        return self.to_hf(state_dict)

    def export_config(self) -> dict[str, Any]:
        """The ``config.json`` dict the export writes (the family's config writer; ``hf.save`` then sets the dtype
        and drops ``quantization_config``)."""
        raise NotImplementedError(f"{type(self).__name__} has no HF config writer (export_config)")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain full tensor (a DTensor is gathered)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of an HF folder, with an error naming the file when it is absent or broken, or when its
    ``quantization_config`` is one the loader cannot read (``hf.quant.quantization_of``: refused before any
    model is built or tensor read; a block-FP8 release passes and is dequantized on load)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f} does not exist: an HF checkpoint folder needs its config.json")
    try:
        hf = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from e
    quantization_of(hf, where=str(f))
    return hf


def check_keys(
    got: dict[str, torch.Tensor],
    expected: dict[str, torch.Size],
    *,
    optional: Iterable[str] = (),
    shape_hint: Callable[[str], str] | None = None,
) -> list[str]:
    """Problems of converted keys ``got`` against the model's ``expected`` key -> shape: missing keys
    (except ``optional``), unexpected keys and shape mismatches (``shape_hint(key)`` appended)."""
    problems = [f"missing: {k}" for k in sorted(expected.keys() - got.keys() - set(optional))]
    problems += [f"unexpected: {k}" for k in sorted(got.keys() - expected.keys())]
    for key in sorted(got.keys() & expected.keys()):
        have, want = tuple(got[key].shape), tuple(expected[key])
        if have != want:
            hint = shape_hint(key) if shape_hint is not None else ""
            problems.append(f"shape: {key} is {list(have)}{_where(got[key])}, the model expects {list(want)}{hint}")
    return problems


def _where(t: Any) -> str:
    return f" (in {t.location})" if isinstance(t, HFTensor) else ""


def raise_problems(problems: list[str], what: str) -> None:
    """Raise one ``CheckpointKeyError`` listing ``problems`` (if any); ``what`` names the checkpoint."""
    if problems:
        raise CheckpointKeyError(
            f"{what} does not fit the model: {len(problems)} problem(s):\n  " + "\n  ".join(problems)
        )


def split_experts(key: str, t: torch.Tensor, prefix: str) -> dict[str, torch.Tensor] | None:
    """Fused ``...mlp.experts.gate_up_proj [E, 2I, H]`` / ``...down_proj [E, H, I]`` -> HF per-expert keys
    ``<prefix>...mlp.experts.{e}.{gate,up,down}_proj.weight``; ``None`` for any other key."""
    base = prefix + key.rsplit(".", 1)[0] + "."
    if key.endswith("mlp.experts.gate_up_proj"):
        half = t.shape[1] // 2
        out = {}
        for e in range(t.shape[0]):
            out[f"{base}{e}.gate_proj.weight"] = t[e, :half]
            out[f"{base}{e}.up_proj.weight"] = t[e, half:]
        return out
    if key.endswith("mlp.experts.down_proj"):
        return {f"{base}{e}.down_proj.weight": t[e] for e in range(t.shape[0])}
    return None


def fuse_experts(
    experts: dict[tuple[int, str], dict[int, torch.Tensor]], out: dict[str, torch.Tensor], prefix: str
) -> list[str]:
    """Stack per-expert weights (``experts[(layer, proj)][e]``) into ``layers.{i}.mlp.experts.gate_up_proj
    [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]`` in ``out``; returns the missing HF keys."""
    missing: list[str] = []
    for layer in sorted({layer for layer, _ in experts}):
        parts = {proj: experts.get((layer, proj), {}) for proj in ("gate_proj", "up_proj", "down_proj")}
        n = max(max(p) + 1 if p else 0 for p in parts.values())
        gaps = [
            f"missing: {prefix}layers.{layer}.mlp.experts.{e}.{proj}.weight"
            for proj, per in parts.items()
            for e in range(n)
            if e not in per
        ]
        if gaps:
            missing += gaps
            continue
        # stack / cat: lazy when the parts are (an expert-parallel rank then reads only its experts)
        gate = stack([parts["gate_proj"][e] for e in range(n)])
        up = stack([parts["up_proj"][e] for e in range(n)])
        out[f"layers.{layer}.mlp.experts.gate_up_proj"] = cat([gate, up], dim=1)
        out[f"layers.{layer}.mlp.experts.down_proj"] = stack([parts["down_proj"][e] for e in range(n)])
    return missing


