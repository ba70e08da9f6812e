"""Qwen3.5 (dense and MoE) <-> HF checkpoint keys (reference doc section 1.10).

Ours (in memory)                            HF ``Qwen3_5(Moe)ForCausalLM``  (``P = model.``)
  embed_tokens.weight, norm.weight            P embed_tokens.weight, P norm.weight
  layers.{i}.self_attn.*  (Gated DeltaNet)    P layers.{i}.linear_attn.*   (HF names the mixer by layer type)
  layers.{i}.self_attn.*  (gated attention)   P layers.{i}.self_attn.*
  layers.{i}.mlp.shared_experts.*             P layers.{i}.mlp.shared_expert.*
  layers.{i}.mlp.experts.gate_up_proj         P layers.{i}.mlp.experts.{e}.{gate,up}_proj.weight  (fused also read)
  layers.{i}.mlp.experts.down_proj            P layers.{i}.mlp.experts.{e}.down_proj.weight
  lm_head.weight                              lm_head.weight

A ``Qwen3_5(Moe)ForConditionalGeneration`` folder has ``P = model.language_model.``; its ``model.visual.*``
and ``mtp.*`` keys are not modelled here: they are kept (``hf_passthrough``) and written back unchanged.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hyper_parallel.models.common.gated_deltanet import GatedDeltaNet
from hyper_parallel.protocols.state_dict_adapter import BaseStateDictAdapter, read_safetensors, write_safetensors

__all__ = [
    "CheckpointKeyError",
    "HFLoadResult",
    "Qwen3_5StateDictAdapter",
    "load_hf_weights",
    "read_hf_config",
    "save_hf_state_dict",
]

_TEXT, _VL = "model.", "model.language_model."
_PASSTHROUGH = ("model.visual.", "mtp.")
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MIXER_RE = re.compile(r"^layers\.(\d+)\.(self_attn|linear_attn)\.")


class CheckpointKeyError(KeyError):
    """Missing, unexpected or wrongly shaped checkpoint keys; the message lists all of them."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


@dataclass
class HFLoadResult:
    """What ``from_hf_checked`` produced."""

    state_dict: dict[str, torch.Tensor]
    """Our keys -> tensors."""
    source_format: str
    """``causal_lm`` (``model.*``) or ``conditional_generation`` (``model.language_model.*``)."""
    passthrough: dict[str, torch.Tensor] = field(default_factory=dict)
    """HF keys we do not model (``model.visual.*``, ``mtp.*``), to write back unchanged."""


class Qwen3_5StateDictAdapter(BaseStateDictAdapter):
    """Converts a Qwen3.5 / Qwen3.5-MoE state dict to and from the HF formats above."""

    def __init__(self, model_config: Any, **runtime_objects: Any) -> None:
        super().__init__(model_config, **runtime_objects)
        self.linear_layers = {
            i for i, layer in enumerate(model_config.layers) if isinstance(layer.self_attn, GatedDeltaNet.Config)
        }

    # ---- ours -> HF -------------------------------------------------------------------------
    def to_hf(
        self,
        state_dict: dict[str, torch.Tensor],
        *,
        text_only: bool = True,
        passthrough: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Our keys -> HF keys (per-expert); ``text_only=False`` writes the ConditionalGeneration layout
        plus ``passthrough``."""
        prefix = _TEXT if text_only else _VL
        out: dict[str, torch.Tensor] = {}
        for key, t in state_dict.items():
            if key == "lm_head.weight":
                out[key] = t
                continue
            hf_key = self._mixer_to_hf(key).replace(".mlp.shared_experts.", ".mlp.shared_expert.")
            if hf_key.endswith("mlp.experts.gate_up_proj"):
                base = prefix + hf_key[: -len("gate_up_proj")]
                half = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{base}{e}.gate_proj.weight"] = t[e, :half]
                    out[f"{base}{e}.up_proj.weight"] = t[e, half:]
            elif hf_key.endswith("mlp.experts.down_proj"):
                base = prefix + hf_key[: -len("down_proj")]
                for e in range(t.shape[0]):
                    out[f"{base}{e}.down_proj.weight"] = t[e]
            else:
                out[prefix + hf_key] = t
        if not text_only:
            out.update(passthrough or {})
        return out

    def _mixer_to_hf(self, key: str) -> str:
        m = _MIXER_RE.match(key)
        if m and int(m.group(1)) in self.linear_layers:
            return f"layers.{m.group(1)}.linear_attn." + key[m.end() :]
        return key

    # ---- HF -> ours -------------------------------------------------------------------------
    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF keys (either format) -> our keys; see ``from_hf_checked``."""
        return self.from_hf_checked(hf_state_dict).state_dict

    def from_hf_checked(
        self, hf_state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Size] | None = None
    ) -> HFLoadResult:
        """Convert, and with ``expected`` (our key -> shape) check every key and shape.

        Raises one ``CheckpointKeyError`` listing every missing, unexpected and mis-shaped key.
        """
        vl = any(k.startswith(_VL) for k in hf_state_dict)
        prefix = _VL if vl else _TEXT
        result = HFLoadResult(state_dict={}, source_format="conditional_generation" if vl else "causal_lm")
        problems: list[str] = []
        experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        for key, t in hf_state_dict.items():
            if key.startswith(_PASSTHROUGH):
                result.passthrough[key] = t
            elif key == "lm_head.weight":
                result.state_dict[key] = t
            elif key.startswith(prefix):
                ours = key[len(prefix) :].replace(".mlp.shared_expert.", ".mlp.shared_experts.")
                m = _MIXER_RE.match(ours)
                if m:
                    want = "linear_attn" if int(m.group(1)) in self.linear_layers else "self_attn"
                    if m.group(2) != want:
                        problems.append(f"unexpected: {key} (layer {m.group(1)} is a {want} layer in the model)")
                        continue
                    ours = f"layers.{m.group(1)}.self_attn." + ours[m.end() :]
                em = _EXPERT_RE.match(ours)
                if em:
                    experts.setdefault((int(em.group(1)), em.group(3)), {})[int(em.group(2))] = t
                else:
                    result.state_dict[ours] = t
            else:
                problems.append(f"unexpected: {key}")
        problems += _fuse_experts(experts, result.state_dict, prefix)
        if expected is not None:
            for key in sorted(expected.keys() - result.state_dict.keys()):
                problems.append(f"missing: {key}")
            for key in sorted(result.state_dict.keys() - expected.keys()):
                problems.append(f"unexpected: {key}")
            for key in sorted(result.state_dict.keys() & expected.keys()):
                got, want = tuple(result.state_dict[key].shape), tuple(expected[key])
                if got != want:
                    problems.append(f"shape: {key} is {list(got)}, the model expects {list(want)}")
        if problems:
            raise CheckpointKeyError(
                f"checkpoint ({result.source_format} format) does not fit the model: {len(problems)} problem(s):\n  "
                + "\n  ".join(problems)
            )
        return result


def _fuse_experts(
    experts: dict[tuple[int, str], dict[int, torch.Tensor]], out: dict[str, torch.Tensor], prefix: str
) -> list[str]:
    """Stack per-expert keys into ``gate_up_proj [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]``."""
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
        gate = torch.stack([parts["gate_proj"][e] for e in range(n)])
        up = torch.stack([parts["up_proj"][e] for e in range(n)])
        out[f"layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"layers.{layer}.mlp.experts.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(n)])
    return missing


# ---- HF folders ------------------------------------------------------------------------------


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of an HF folder, with an error naming the file when it is absent or broken."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f} does not exist: an HF checkpoint folder needs its config.json")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from e


def load_hf_weights(model: Any, path: str | os.PathLike) -> HFLoadResult:
    """Load an HF folder (CausalLM or ConditionalGeneration; per-expert or fused experts) into a whole model in
    place. Every key and shape is checked first; ``model.visual.*``/``mtp.*`` are kept in ``model.hf_passthrough``."""
    adapter = Qwen3_5StateDictAdapter(model.config)
    ours = model.state_dict()
    result = adapter.from_hf_checked(read_safetensors(path), expected={k: v.shape for k, v in ours.items()})
    with torch.no_grad():
        for key, t in result.state_dict.items():
            ours[key].copy_(t)
    model.hf_passthrough = dict(result.passthrough)
    return result


def save_hf_state_dict(
    config: Any,
    state_dict: dict[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    text_only: bool | None = None,
    passthrough: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write ``state_dict`` (our keys, full tensors) + ``config.json`` as an HF folder.

    ``text_only`` default: the ConditionalGeneration layout iff the config came from such a folder.
    """
    if text_only is None:
        text_only = "top" not in config.hf_extra
    adapter = Qwen3_5StateDictAdapter(config)
    hf = adapter.to_hf({k: _full(v) for k, v in state_dict.items()}, text_only=True)
    if dtype is not None:
        hf = {k: v.to(dtype) if v.is_floating_point() else v for k, v in hf.items()}
    if not text_only:  # the ConditionalGeneration layout, with the kept keys exactly as they were read
        hf = {_VL + k[len(_TEXT) :] if k.startswith(_TEXT) else k: v for k, v in hf.items()} | dict(passthrough or {})
    path = Path(path)
    dtype_name = str(dtype or next(iter(state_dict.values())).dtype).removeprefix("torch.")
    files = write_safetensors(hf, path, max_shard_size=max_shard_size)
    hf_config = config.to_hf(text_only=text_only)
    (hf_config if text_only else hf_config["text_config"])["dtype"] = dtype_name
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
    return files + ["config.json"]
