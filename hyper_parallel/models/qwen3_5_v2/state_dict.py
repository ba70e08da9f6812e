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
keys are not modelled here: they are kept (``hf_passthrough``) and written back unchanged.

MTP (vLLM ``qwen3_5_mtp.py`` reads these; HF ignores ``^mtp.*``): with ``config.mtp`` set, ``mtp.*`` maps to
the ``mtp`` block one to one (``mtp.fc``, ``mtp.pre_fc_norm_{embedding,hidden}``, ``mtp.norm``,
``mtp.layers.0.*`` with HF's ``shared_expert`` and per-expert names), in either layout; a folder without
them leaves the block at its initialisation. Without ``config.mtp`` they are kept as passthrough.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from hyper_parallel.hf import convert
from hyper_parallel.hf.convert import CheckedStateDictAdapter, CheckpointKeyError, HFLoadResult, read_hf_config
from hyper_parallel.hf.save import warn_dropped
from hyper_parallel.hf.storage import permute_rows
from hyper_parallel.hf.tied_head import HEAD_KEY, tied_head_from_hf, untied_head_hint
from hyper_parallel.models.common.gated_deltanet import GatedDeltaNet
from hyper_parallel.models.qwen3_5_v2.hf_config import config_to_hf

__all__ = [
    "CheckpointKeyError",
    "HFLoadResult",
    "Qwen3_5StateDictAdapter",
    "read_hf_config",
]

_TEXT, _VL = "model.", "model.language_model."
_PASSTHROUGH = ("model.visual.", "mtp.")
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MTP = "mtp."
# HF builds a shared expert (and its gate) even at shared_expert_intermediate_size=0; it adds exactly 0 and ours
# has none: such a layer's shared-expert keys are kept aside and written back.
_EMPTY_SHARED_RE = re.compile(r"^layers\.(\d+)\.mlp\.shared_expert(_gate)?\.")
_MIXER_RE = re.compile(r"^layers\.(\d+)\.(self_attn|linear_attn)\.")
_QKV_ROWS_RE = re.compile(r"^layers\.(\d+)\.self_attn\.(in_proj_qkv|conv1d)\.weight$")


class Qwen3_5StateDictAdapter(CheckedStateDictAdapter):
    """Converts a Qwen3.5 / Qwen3.5-MoE state dict to and from the HF formats above.

    Export (``text_only``, default: the ConditionalGeneration layout iff the config came from such a folder): the
    kept keys exactly as they were read (a live MTP block writes its own ``mtp.*``); a CausalLM layout has no
    vision tower, but keeps the MTP head (vLLM reads ``mtp.*`` in both layouts)."""

    def __init__(self, model_config: Any, *, text_only: bool | None = None, **runtime_objects: Any) -> None:
        super().__init__(model_config, **runtime_objects)
        self.export_text_only = "top" not in (getattr(model_config, "hf_extra", None) or {}) if text_only is None else text_only
        """The export's layout: CausalLM (True) or ConditionalGeneration."""
        self.has_mtp = getattr(model_config, "mtp", None) is not None
        self.tied = bool(getattr(model_config, "tie_word_embeddings", False))
        # a folder that stores its experts fused (the Qwen3.5-MoE releases) is written back fused
        self.fused_experts = (getattr(model_config, "hf_extra", None) or {}).get("experts_form") == "fused"
        self.no_shared_expert = {
            i
            for i, layer in enumerate(model_config.layers)
            if hasattr(layer.mlp, "shared_experts") and layer.mlp.shared_experts is None
        }
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
        if to_hf:
            return GatedDeltaNet.qkv_rows_to_hf(gdn, t)
        # a row permutation: on the lazy tensors of a sharded load each rank still reads only its rows
        return permute_rows(t, lambda rows: GatedDeltaNet.qkv_rows_from_hf(gdn, rows))

    # ---- ours -> HF -------------------------------------------------------------------------
    def to_hf(
        self,
        state_dict: dict[str, torch.Tensor],
        *,
        text_only: bool = True,
        passthrough: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Our keys -> HF keys (experts per expert, or fused as the folder stored them: ``hf_extra["experts_form"]``);
        ``text_only=False`` writes the ConditionalGeneration layout
        plus ``passthrough``."""
        prefix = _TEXT if text_only else _VL
        out: dict[str, torch.Tensor] = {}
        for key, t in state_dict.items():
            if key == HEAD_KEY:
                if not self.tied:  # HF writes no head for a tied model: it is the embedding
                    out[key] = t
                continue
            if key.startswith(_MTP):  # top-level in both layouts
                hf_key = key.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
                out.update(self._experts_to_hf(hf_key, t, "") or {hf_key: t})
                continue
            t = self._qkv_rows(key, t, to_hf=True)
            hf_key = self._mixer_to_hf(key).replace(".mlp.shared_experts.", ".mlp.shared_expert.")
            out.update(self._experts_to_hf(hf_key, t, prefix) or {prefix + hf_key: t})
        if not text_only:
            out.update(passthrough or {})
        return out

    def _experts_to_hf(self, hf_key: str, t: torch.Tensor, prefix: str) -> dict[str, torch.Tensor] | None:
        """Per-expert HF keys of a fused experts tensor; None (the key as it is: fused ``[E, 2I, H]`` /
        ``[E, H, I]``, HF's own layout) for other keys and for a folder that stores its experts fused."""
        return None if self.fused_experts else convert.split_experts(hf_key, t, prefix)

    def _empty_shared(self, hf_key: str) -> bool:
        """An HF shared-expert key (prefix removed) of a layer built without one (``shared_expert_intermediate_size=0``)."""
        m = _EMPTY_SHARED_RE.match(hf_key)
        return m is not None and int(m.group(1)) in self.no_shared_expert

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
        mtp_experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        for key, t in hf_state_dict.items():
            if self.has_mtp and key.startswith(_MTP):
                ours = key.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
                em = _EXPERT_RE.match(ours[len(_MTP) :])
                if em:
                    mtp_experts.setdefault((int(em.group(1)), em.group(3)), {})[int(em.group(2))] = t
                else:
                    result.state_dict[ours] = t
            elif key.startswith(_PASSTHROUGH):
                result.passthrough[key] = t
            elif key == "lm_head.weight":
                result.state_dict[key] = t
            elif key.startswith(prefix) and self._empty_shared(key[len(prefix) :]):
                result.passthrough[key] = t
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
        problems += convert.fuse_experts(experts, result.state_dict, prefix)
        fused_mtp: dict[str, torch.Tensor] = {}
        problems += convert.fuse_experts(mtp_experts, fused_mtp, _MTP)
        result.state_dict.update({_MTP + k: v for k, v in fused_mtp.items()})
        if self.tied:
            problems += tied_head_from_hf(result.state_dict, embed_hf_key=prefix + "embed_tokens.weight")
        if expected is not None:
            # a folder without MTP weights leaves the block at its (seeded) initialisation
            optional = [k for k in expected if k.startswith(_MTP)] if not any(k.startswith(_MTP) for k in hf_state_dict) else []
            problems += convert.check_keys(result.state_dict, expected, optional=optional)
        where = "config.json (top level)" if vl else "config.json"
        problems = untied_head_hint(problems, where=where)
        convert.raise_problems(problems, f"checkpoint ({result.source_format} format)")
        return result

    # ---- the generic export's hooks ---------------------------------------------------------------
    @classmethod
    def for_export(cls, model_config: Any, *, text_only: bool | None = None) -> Qwen3_5StateDictAdapter:
        return cls(model_config, text_only=text_only)

    def export_names(self, passthrough: Mapping[str, Any]) -> dict[str, str]:
        kept = [k for k in passthrough if not (self.has_mtp and k.startswith(_MTP))]
        if self.export_text_only:
            warn_dropped([k for k in kept if not k.startswith(_MTP)], "a text-only (CausalLM) export has no "
                         "vision tower; export with text_only=False to keep them")  # fmt: skip
            kept = [k for k in kept if k.startswith(_MTP)]
        return {k: k for k in kept}

    def to_hf_export(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hf = self.to_hf(state_dict, text_only=True)
        if not self.export_text_only:
            hf = {_VL + k[len(_TEXT) :] if k.startswith(_TEXT) else k: v for k, v in hf.items()}
        return hf

    def export_config(self) -> dict[str, Any]:
        config = self.model_config
        hf_config = config_to_hf(config, text_only=self.export_text_only)
        text = hf_config if self.export_text_only else hf_config["text_config"]
        if getattr(config, "mtp", None) is not None:  # vLLM's Qwen3_5MultiTokenPredictor reads this count
            text["mtp_num_hidden_layers"] = len(config.mtp.layers)
        text.setdefault("dtype", None)  # the text level states it too, as transformers 5 writes (hf.save fills it in)
        return hf_config
