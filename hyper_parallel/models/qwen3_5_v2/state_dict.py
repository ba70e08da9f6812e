"""Qwen3.5 (dense and MoE) <-> HF checkpoint keys (reference doc section 1.10).

Ours (in memory)                            HF ``Qwen3_5(Moe)ForCausalLM``  (``P = model.``)
  embed_tokens.weight, norm.weight            P embed_tokens.weight, P norm.weight
  layers.{i}.self_attn.*  (Gated DeltaNet)    P layers.{i}.linear_attn.*   (HF names the mixer by layer type)
  layers.{i}.self_attn.*  (gated attention)   P layers.{i}.self_attn.*
  layers.{i}.mlp.shared_experts.*             P layers.{i}.mlp.shared_expert.*
  layers.{i}.mlp.experts.gate_up_proj         P layers.{i}.mlp.experts.{e}.{gate,up}_proj.weight  (fused also read)
  layers.{i}.mlp.experts.down_proj            P layers.{i}.mlp.experts.{e}.down_proj.weight
  lm_head.weight                              lm_head.weight

Gated DeltaNet's fused ``in_proj_qkv.weight`` and ``conv1d.weight`` keep their keys but not their row order:
HF's ``[Q | K | V]`` becomes our grouped-by-key-head order (``GatedDeltaNet`` docstring), so that tensor
parallel is one ``Shard(0)``.

A ``Qwen3_5(Moe)ForConditionalGeneration`` folder has ``P = model.language_model.``; its ``model.visual.*``
and ``mtp.*`` keys are not modelled here: they are kept (``hf_passthrough``) and written back unchanged.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from hyper_parallel.models.common.gated_deltanet import GatedDeltaNet
from hyper_parallel.protocols import hf_io
from hyper_parallel.protocols.hf_io import CheckedStateDictAdapter, CheckpointKeyError, HFLoadResult, read_hf_config
from hyper_parallel.protocols.state_dict_adapter import write_safetensors

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
_QKV_ROWS_RE = re.compile(r"^layers\.(\d+)\.self_attn\.(in_proj_qkv|conv1d)\.weight$")


class Qwen3_5StateDictAdapter(CheckedStateDictAdapter):
    """Converts a Qwen3.5 / Qwen3.5-MoE state dict to and from the HF formats above."""

    def __init__(self, model_config: Any, **runtime_objects: Any) -> None:
        super().__init__(model_config, **runtime_objects)
        self.linear_layers = {
            i: layer.self_attn
            for i, layer in enumerate(model_config.layers)
            if isinstance(layer.self_attn, GatedDeltaNet.Config)
        }

    def _qkv_rows(self, key: str, t: torch.Tensor, *, to_hf: bool) -> torch.Tensor:
        """Reorder the rows of a DeltaNet ``in_proj_qkv``/``conv1d`` weight (our key); other tensors pass."""
        m = _QKV_ROWS_RE.match(key)
        gdn = self.linear_layers.get(int(m.group(1))) if m else None
        if gdn is None:
            return t
        if t.shape[0] != 2 * gdn.num_k_heads * gdn.head_k_dim + gdn.num_v_heads * gdn.head_v_dim:
            return t  # a wrong shape: left for the key/shape check to report with the file's key
        return GatedDeltaNet.qkv_rows_to_hf(gdn, t) if to_hf else GatedDeltaNet.qkv_rows_from_hf(gdn, t)

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
            t = self._qkv_rows(key, t, to_hf=True)
            hf_key = self._mixer_to_hf(key).replace(".mlp.shared_experts.", ".mlp.shared_expert.")
            out.update(hf_io.split_experts(hf_key, t, prefix) or {prefix + hf_key: t})
        if not text_only:
            out.update(passthrough or {})
        return out

    def _mixer_to_hf(self, key: str) -> str:
        m = _MIXER_RE.match(key)
        if m and int(m.group(1)) in self.linear_layers:
            return f"layers.{m.group(1)}.linear_attn." + key[m.end() :]
        return key

    # ---- HF -> ours -------------------------------------------------------------------------
    def from_hf_checked(
        self, hf_state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Size] | None = None
    ) -> HFLoadResult:
        """CausalLM (``model.*``) or ConditionalGeneration (``model.language_model.*``) keys; ``model.visual.*``
        and ``mtp.*`` go to ``passthrough``."""
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
                    result.state_dict[ours] = self._qkv_rows(ours, t, to_hf=False)
            else:
                problems.append(f"unexpected: {key}")
        problems += hf_io.fuse_experts(experts, result.state_dict, prefix)
        if expected is not None:
            problems += hf_io.check_keys(result.state_dict, expected)
        hf_io.raise_problems(problems, f"checkpoint ({result.source_format} format)")
        return result


# ---- HF folders ------------------------------------------------------------------------------


def load_hf_weights(model: Any, path: str | os.PathLike) -> HFLoadResult:
    """Load an HF folder (CausalLM or ConditionalGeneration; per-expert or fused experts) into a whole model in
    place. Every key and shape is checked first; ``model.visual.*``/``mtp.*`` are kept in ``model.hf_passthrough``."""
    return hf_io.load_checked(model, path, Qwen3_5StateDictAdapter(model.config).from_hf_checked)


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
    hf = adapter.to_hf({k: hf_io.full_tensor(v) for k, v in state_dict.items()}, text_only=True)
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
