"""GlmImageMoe <-> HF checkpoint keys (docs/design.md section 4).

Ours (in memory)                          HF GlmImageMoe (on disk)
  embed_tokens.weight                       model.language_model.embed_tokens.weight
  layers.{i}.<...>                          model.language_model.layers.{i}.<...>
  layers.{i}.mlp.experts.gate_up_proj       model.language_model.layers.{i}.mlp.experts.{e}.{gate,up}_proj.weight
  layers.{i}.mlp.experts.down_proj          model.language_model.layers.{i}.mlp.experts.{e}.down_proj.weight
  norm.weight                               model.language_model.norm.weight
  vq_codebook.weight                        model.vqmodel.quantize.embedding.weight
  vq_to_llm_proj.{weight,bias}              model.vq_to_llm_proj.{weight,bias}
  lm_head.weight [V + C, H]                 lm_head.weight [V + C, H]

A plain Glm4MoeLite checkpoint (``model.*``, ``lm_head.weight [V, H]``) maps to the backbone and head
rows ``[0, V)``; the image parts are then left to the caller's initialisation. Other ``model.vqmodel.*``
keys pass through.

The GLM-4.7-Flash nextn (MTP) layer, index ``L = num_hidden_layers`` (either prefix), with ``config.mtp``:
  mtp.pre_fc_norm_embedding / pre_fc_norm_hidden    layers.L.enorm / hnorm
  mtp.fc / mtp.norm                                  layers.L.eh_proj / layers.L.shared_head.norm
  mtp.layers.0.<...>                                 layers.L.<...> (experts per expert)
  (embed_tokens, lm_head: shared)                    layers.L.embed_tokens / shared_head.head: copies on export
Without ``config.mtp`` every key of a layer ``>= L`` is kept as passthrough (a lazy reference to the folder's
file) and written back unchanged, under the export format's prefix (a nextn layer read from a Glm4MoeLite
folder moves to ``model.language_model.`` in a GlmImageMoe export, and back in a ``text_only`` one), so a
later run with MTP on loads it into the block. With ``config.mtp`` the layers beyond L are ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hyper_parallel.hf import convert
from hyper_parallel.hf.convert import CheckedStateDictAdapter, CheckpointKeyError, read_hf_config
from hyper_parallel.hf.load import model_state_dict
from hyper_parallel.hf.save import warn_dropped
from hyper_parallel.hf.storage import load_tensor_
from hyper_parallel.models.glm_image_moe_v2.hf_config import config_to_hf

__all__ = [
    "CheckpointKeyError",
    "GlmImageMoeStateDictAdapter",
    "HFLoadResult",
    "folder_dtype",
    "read_hf_config",
]

_LM = "model.language_model."
_CODEBOOK_HF = "model.vqmodel.quantize.embedding.weight"
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.")
_NEXTN_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# GLM-4.7-Flash nextn layer (vLLM glm4_moe_lite_mtp.py / deepseek_mtp.py names) <-> our MTP block.
_NEXTN_TO_OURS = {
    "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "eh_proj.weight": "mtp.fc.weight",
    "shared_head.norm.weight": "mtp.norm.weight",
}
_OURS_TO_NEXTN = {v: k for k, v in _NEXTN_TO_OURS.items()}
# DeepSeek-V3-style copies of the shared embedding and head inside the nextn layer: the block uses the
# trunk's (one tensor each), so these are read as nothing and written as copies of the trained ones.
_NEXTN_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


@dataclass
class HFLoadResult(convert.HFLoadResult):
    """What ``from_hf_checked`` produced: ``source_format`` is ``glm_image_moe`` or ``glm4_moe_lite``
    (whose head rows [V, V+C) are absent); ``passthrough`` holds the other ``model.vqmodel.*`` keys and, with
    MTP off, the nextn layer's keys."""

    partial_head: torch.Tensor | None = None
    """For a plain Glm4MoeLite checkpoint: its ``lm_head [V, H]`` (head rows [0, V))."""
    ignored: list[str] = field(default_factory=list)
    """HF keys deliberately dropped, with MTP on: the nextn layer's copies of the shared embedding and head
    (written again from the trained ones), layers beyond the nextn layer."""


class GlmImageMoeStateDictAdapter(CheckedStateDictAdapter):
    """Converts a GlmImageMoe state dict to and from the HF formats of docs/design.md section 4.

    Load: a plain Glm4MoeLite checkpoint fills the backbone and head rows ``[0, V)`` (``after_load``) and leaves the
    image parts as they are. Export: the GlmImageMoe form, or with ``text_only`` the Glm4MoeLite form (default:
    the model's, Glm4MoeLite exactly without image path); floating tensors by default in the dtype the folder the
    model was read from declares (``folder_dtype``); routers included (a release stores them like the rest)."""

    def __init__(self, model_config: Any, *, text_only: bool | None = None, **runtime_objects: Any) -> None:
        super().__init__(model_config, **runtime_objects)
        self.text_only = not model_config.has_image_path if text_only is None else text_only
        """The export's form: Glm4MoeLite (True) or GlmImageMoe."""
        self.num_layers = len(model_config.layers)
        self.lang_vocab_size = model_config.vocab_size
        self.has_mtp = getattr(model_config, "mtp", None) is not None
        """The nextn layer (index ``num_layers`` on disk) maps to the ``mtp`` block; else it passes through."""

    def _mtp_to_hf(self, key: str, t: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
        """An ``mtp.*`` key -> the nextn layer's HF key(s) under ``prefix`` (experts per expert)."""
        base = f"{prefix}layers.{self.num_layers}."
        if key in _OURS_TO_NEXTN:
            return {base + _OURS_TO_NEXTN[key]: t}
        rest = key[len("mtp.layers.0.") :]
        return convert.split_experts(rest, t, base) or {base + rest: t}

    def _shared_copies(self, key: str, t: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
        """With MTP: the nextn layer's copies of the shared embedding / head (vLLM's drafter loads its own)."""
        if not self.has_mtp or key not in ("embed_tokens.weight", "lm_head.weight"):
            return {}
        name = "embed_tokens.weight" if key == "embed_tokens.weight" else "shared_head.head.weight"
        return {f"{prefix}layers.{self.num_layers}.{name}": t}

    # ---- ours -> HF -------------------------------------------------------------------------
    def to_hf(
        self, state_dict: dict[str, torch.Tensor], *, passthrough: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Our keys -> GlmImageMoe HF keys (experts split per expert)."""
        out: dict[str, torch.Tensor] = {}
        for key, t in state_dict.items():
            if key == "vq_codebook.weight":
                out[_CODEBOOK_HF] = t
            elif key.startswith("vq_to_llm_proj."):
                out["model." + key] = t
            elif key == "lm_head.weight":
                out[key] = t
                out.update(self._shared_copies(key, t, _LM))
            elif key.startswith("mtp."):
                out.update(self._mtp_to_hf(key, t, _LM))
            else:
                out.update(self._backbone_to_hf(key, t, _LM))
                out.update(self._shared_copies(key, t, _LM))
        out.update(passthrough or {})
        return out

    def to_hf_text_only(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Backbone + head rows [0, V) as a plain Glm4MoeLite checkpoint."""
        out: dict[str, torch.Tensor] = {}
        for key, t in state_dict.items():
            if key.startswith(("vq_codebook.", "vq_to_llm_proj.")):
                continue
            if key == "lm_head.weight":
                out[key] = t[: self.lang_vocab_size]
                out.update(self._shared_copies(key, t[: self.lang_vocab_size], "model."))
            elif key.startswith("mtp."):
                out.update(self._mtp_to_hf(key, t, "model."))
            else:
                out.update(self._backbone_to_hf(key, t, "model."))
                out.update(self._shared_copies(key, t, "model."))
        return out

    def kept_to_hf(self, key: str, *, text_only: bool) -> str | None:
        """The export name of a passthrough key (None: not written): a layer key (the nextn layer kept with MTP
        off) under the export format's prefix, whichever format it was read from; ``text_only`` drops the
        image-path keys (``model.vqmodel.*``)."""
        prefix = "model." if text_only else _LM
        for read_prefix in (_LM, "model."):
            if key.startswith(read_prefix + "layers."):
                return prefix + key[len(read_prefix) :]
        return None if text_only else key

    @staticmethod
    def _backbone_to_hf(key: str, t: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
        split = convert.split_experts(key, t, prefix)
        return split if split is not None else {prefix + key: t}

    # ---- HF -> ours -------------------------------------------------------------------------
    def from_hf_checked(
        self, hf_state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Size] | None = None
    ) -> HFLoadResult:
        """Either HF format; a plain Glm4MoeLite head goes to ``partial_head``; the nextn layer to the MTP block
        (with ``config.mtp``) or to ``passthrough``."""
        is_image = any(k.startswith(_LM) for k in hf_state_dict)
        prefix = _LM if is_image else "model."
        result = HFLoadResult(state_dict={}, source_format="glm_image_moe" if is_image else "glm4_moe_lite")
        unexpected: list[str] = []
        experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        mtp_experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        for key, t in hf_state_dict.items():
            if key == _CODEBOOK_HF:
                result.state_dict["vq_codebook.weight"] = t
            elif key.startswith("model.vqmodel."):
                result.passthrough[key] = t
            elif key.startswith("model.vq_to_llm_proj."):
                result.state_dict[key[len("model.") :]] = t
            elif key == "lm_head.weight":
                if is_image:
                    result.state_dict[key] = t
                else:
                    result.partial_head = t
            elif key.startswith(prefix):
                ours = key[len(prefix) :]
                m = _LAYER_RE.match(ours)
                if m and int(m.group(1)) >= self.num_layers:
                    rest = ours[m.end() :]
                    if not self.has_mtp:  # kept (lazy) and written back, for a later run with MTP on
                        result.passthrough[key] = t
                    elif int(m.group(1)) > self.num_layers or rest in _NEXTN_SHARED:
                        result.ignored.append(key)  # the nextn layer's copies of shared tensors
                    elif rest in _NEXTN_TO_OURS:
                        result.state_dict[_NEXTN_TO_OURS[rest]] = t
                    elif em := _NEXTN_EXPERT_RE.match(rest):
                        mtp_experts.setdefault((0, em.group(2)), {})[int(em.group(1))] = t
                    else:
                        result.state_dict["mtp.layers.0." + rest] = t
                    continue
                em = _EXPERT_RE.match(ours)
                if em:
                    layer, e, proj = int(em.group(1)), int(em.group(2)), em.group(3)
                    experts.setdefault((layer, proj), {})[e] = t
                else:
                    result.state_dict[ours] = t
            else:
                unexpected.append(key)
        missing_experts = convert.fuse_experts(experts, result.state_dict, prefix)
        fused_mtp: dict[str, torch.Tensor] = {}
        missing_experts += convert.fuse_experts(mtp_experts, fused_mtp, f"{prefix}[nextn]")
        result.state_dict.update({"mtp." + k: v for k, v in fused_mtp.items()})
        if expected is not None or unexpected or missing_experts:
            self._check(result, expected or {}, unexpected, missing_experts, check_keys=expected is not None)
        return result

    def _check(
        self,
        result: HFLoadResult,
        expected: dict[str, torch.Size],
        unexpected: list[str],
        missing_experts: list[str],
        *,
        check_keys: bool,
    ) -> None:
        problems: list[str] = list(missing_experts)
        problems += [f"unexpected: {k}" for k in unexpected]
        if check_keys:
            optional = set() if result.source_format == "glm_image_moe" else {
                "vq_codebook.weight", "vq_to_llm_proj.weight", "vq_to_llm_proj.bias", "lm_head.weight"
            }
            if not any(k.startswith("mtp.") for k in result.state_dict):  # no nextn layer: the block keeps its init
                optional |= {k for k in expected if k.startswith("mtp.")}
            problems += convert.check_keys(result.state_dict, expected, optional=optional)
            if result.partial_head is None and result.source_format == "glm4_moe_lite":
                problems.append("missing: lm_head.weight")
            elif result.partial_head is not None and "lm_head.weight" in expected:
                want = (self.lang_vocab_size, expected["lm_head.weight"][1])
                if tuple(result.partial_head.shape) != want:
                    problems.append(
                        f"shape: lm_head.weight is {list(result.partial_head.shape)}, "
                        f"a Glm4MoeLite head for this model must be {list(want)}"
                    )
        convert.raise_problems(problems, f"checkpoint ({result.source_format} format)")


    # ---- the generic load / export's hooks ---------------------------------------------------------
    def after_load(self, model: Any, result: HFLoadResult) -> None:
        """A plain Glm4MoeLite head fills rows ``[0, V)``: the block at offset 0 of our head."""
        if result.partial_head is not None:
            load_tensor_(model_state_dict(model)["lm_head.weight"], result.partial_head, offset=(0, 0))

    @classmethod
    def export_defaults(cls, model: Any) -> dict[str, Any]:
        # a model without image path (a GLM-4.7-Flash run) is written in the Glm4MoeLite form, else GlmImageMoe's
        return {"text_only": not model.config.has_image_path}

    @classmethod
    def for_export(cls, model_config: Any, *, text_only: bool | None = None) -> GlmImageMoeStateDictAdapter:
        if text_only is False and not model_config.has_image_path:
            raise ValueError(
                "this GlmImageMoe model has no image path (a Glm4MoeLite model): it is written in the Glm4MoeLite "
                "form, text_only=True"
            )
        return cls(model_config, text_only=text_only)

    def export_dtype(self) -> torch.dtype | None:
        return folder_dtype(self.model_config)

    def export_names(self, passthrough: Mapping[str, Any]) -> dict[str, str]:
        names = {k: self.kept_to_hf(k, text_only=self.text_only) for k in passthrough}
        warn_dropped([k for k, n in names.items() if n is None], "a text-only (Glm4MoeLite) export has no image "
                     "path; export with text_only=False to keep them")  # fmt: skip
        return {k: n for k, n in names.items() if n is not None}

    def to_hf_export(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.to_hf_text_only(state_dict) if self.text_only else self.to_hf(state_dict)

    def export_config(self) -> dict[str, Any]:
        config = self.model_config
        hf_config = config_to_hf(config, text_only=self.text_only)
        if getattr(config, "mtp", None) is not None:  # the nextn layer count vLLM's Glm4MoeLiteMTP reads
            (hf_config if self.text_only else hf_config["text_config"])["num_nextn_predict_layers"] = len(config.mtp.layers)
        return hf_config


# ---- the dtype of the folder a model was read from ---------------------------------------------


def folder_dtype(config: Any) -> torch.dtype | None:
    """The dtype the HF folder a config was read from declares (``dtype`` / legacy ``torch_dtype``, top level or
    ``text_config``); None for a config not read from a folder."""
    extra = getattr(config, "hf_extra", None) or {}
    for level in (extra.get("top", {}), extra.get("text_config", {})):
        name = level.get("dtype", level.get("torch_dtype"))
        if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
    return None
