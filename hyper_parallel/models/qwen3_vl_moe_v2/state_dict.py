"""Qwen3-VL(-MoE) / Qwen3.5-MoE VL / Qwen3.5 VL <-> HF ``*ForConditionalGeneration`` folders (reference doc 1.10, 3.5).

Ours (in memory)                          HF
  visual.*                                  model.visual.*   (``patch_embed.proj.weight``: ours [C, P], HF Conv3d)
  embed_tokens / layers.* / norm            model.language_model.*
  lm_head.weight                            lm_head.weight

Text layers, per family:
- ``qwen3_vl_moe``: names equal HF's. Fused experts: ours ``gate_up_proj [E, 2I, H]`` (gate rows first),
  ``down_proj [E, H, I]``. Hub checkpoints (made by transformers 4.x) store them TRANSPOSED (``[E, H, 2I]``,
  ``[E, I, H]``); transformers 5.x ``save_pretrained`` writes the in-memory layout. Which one a folder
  holds is decided by its ``config.json`` (``transformers_version`` < 5: ``hub``), or given explicitly
  (``experts_layout=``) - never by comparing shapes, which cannot tell them apart when ``H == 2I``.
  A folder is written back in the layout it was read in (``model.hf_experts_layout``), with a
  ``transformers_version`` that says so.
- ``qwen3_vl`` (dense, ``Qwen3VLForConditionalGeneration``): the same names, a dense
  ``mlp.gate_proj/up_proj/down_proj`` in every layer; a tied folder (2B / 4B) holds no ``lm_head.weight``.
- ``qwen3_5_moe`` / ``qwen3_5`` (dense, ``Qwen3_5ForConditionalGeneration``): the Qwen3.5 mapping
  (``qwen3_5_v2.state_dict``): ``linear_attn`` / ``shared_expert`` names, per-expert keys (fused ones also
  read), per-expert keys written; the dense MLPs are ``mlp.gate_proj/up_proj/down_proj``; a tied folder
  holds no ``lm_head.weight``.

MTP (``config.mtp``; vLLM ``qwen3_5_mtp.py`` reads ``mtp.*``, transformers ignores them): ``mtp.*`` at the top
level map to the block (Qwen3.5 names; a Qwen3-VL-MoE block, which no release has, keeps our names), and the
export writes ``text_config.mtp_num_hidden_layers``. Without ``config.mtp`` they are kept as passthrough.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal

import torch

from hyper_parallel.hf.rope import LEGACY_ROPE_KEYS, read_hf_rope, rope_to_hf
from hyper_parallel.hf.tied_head import HEAD_KEY, tied_head_from_hf, untied_head_hint
from hyper_parallel.models.qwen3_5_v2.state_dict import Qwen3_5StateDictAdapter

# the text families whose HF text part is the Qwen3.5 one (as model.QWEN3_5_FAMILIES; this module imports model lazily)
QWEN3_5_FAMILIES = ("qwen3_5_moe", "qwen3_5")
from hyper_parallel.hf import convert
from hyper_parallel.hf.convert import CheckedStateDictAdapter, CheckpointKeyError, HFLoadResult, read_hf_config
from hyper_parallel.hf.quant import without_quantization

if TYPE_CHECKING:
    from hyper_parallel.models.qwen3_vl_moe_v2.model import Qwen3VlMoeModel

__all__ = [
    "CheckpointKeyError",
    "ExpertsLayout",
    "Qwen3VlMoeStateDictAdapter",
    "config_from_hf",
    "config_to_hf",
    "experts_layout_of",
    "read_hf_config",
]

ExpertsLayout = Literal["hub", "memory"]
_LM, _VIS = "model.language_model.", "model.visual."
_MTP = "mtp."
_PASSTHROUGH = (_MTP,)
_FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def experts_layout_of(hf_config: dict[str, Any]) -> ExpertsLayout:
    """``hub`` (transposed fused experts) for a folder written by transformers 4.x (or with no version), else ``memory``."""
    version = str(hf_config.get("transformers_version") or "4")
    try:
        major = int(version.split(".")[0])
    except ValueError as e:
        raise ValueError(f"config.json transformers_version={version!r} is not a version: pass experts_layout=") from e
    return "hub" if major < 5 else "memory"


class Qwen3VlMoeStateDictAdapter(CheckedStateDictAdapter):
    """Our state dict <-> HF ``Qwen3VLMoeForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` keys.

    ``experts_layout`` (Qwen3-VL-MoE fused experts) on load: default from the folder's ``config.json``
    (:func:`experts_layout_of`), remembered on the model (``hf_experts_layout``) for the export, which writes the
    layout it was read in with a ``transformers_version`` that says so (4.x: hub)."""

    def __init__(self, model_config: Any, *, experts_layout: ExpertsLayout = "memory", **runtime_objects: Any) -> None:
        super().__init__(model_config, **runtime_objects)
        from hyper_parallel.models.qwen3_vl_moe_v2.vision import VisionTower

        self.family = model_config.text_family
        self.experts_layout = experts_layout
        # A meta tower only for the Conv3d <-> Linear reshape (it needs no weights).
        with torch.device("meta"):
            self._tower = VisionTower(model_config.visual, out_dim=model_config.dim)
        self._qwen3_5 = Qwen3_5StateDictAdapter(model_config) if self.family in QWEN3_5_FAMILIES else None

    # ---- ours -> HF -------------------------------------------------------------------------
    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        vis = {k[len("visual.") :]: v for k, v in state_dict.items() if k.startswith("visual.")}
        text = {k: v for k, v in state_dict.items() if not k.startswith("visual.")}
        out = {_VIS + k: v for k, v in self._tower.ours_to_hf_(vis).items()}
        if self._qwen3_5 is not None:
            out.update(self._qwen3_5.to_hf(text, text_only=False))
            return out
        for key, t in text.items():
            if key == HEAD_KEY:
                if not self.model_config.tie_word_embeddings:  # HF writes no head for a tied model
                    out[key] = t
                continue
            if key.endswith(_FUSED) and self.experts_layout == "hub":
                t = t.transpose(1, 2).contiguous()
            # an MTP block (Qwen3-VL-MoE ships none: project-defined) sits at the top level, like Qwen3.5's mtp.*
            out[key if key.startswith(_MTP) else _LM + key] = t
        return out

    # ---- HF -> ours -------------------------------------------------------------------------
    def load_result(
        self, hf_state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Size] | None = None
    ) -> HFLoadResult:
        ours, passthrough = self.from_hf_checked(hf_state_dict, expected=expected)
        return HFLoadResult(ours, self.family, passthrough)

    def from_hf_checked(
        self, hf_state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Size] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(ours, passthrough)``; with ``expected`` (our key -> shape) every key and shape is checked.

        Raises one ``CheckpointKeyError`` listing every missing, unexpected and mis-shaped key.
        """
        problems: list[str] = []
        # mtp.* load into the MTP block when the model has one (the Qwen3.5 adapter maps them), else pass through
        kept = () if getattr(self.model_config, "mtp", None) is not None else _PASSTHROUGH
        passthrough = {k: v for k, v in hf_state_dict.items() if kept and k.startswith(kept)}
        vis = {k[len(_VIS) :]: v for k, v in hf_state_dict.items() if k.startswith(_VIS)}
        rest = {k: v for k, v in hf_state_dict.items() if not k.startswith((_VIS, *kept))}
        try:
            ours = {"visual." + k: v for k, v in self._tower.hf_to_ours_(vis).items()}
        except ValueError as e:
            problems.append(f"shape: {_VIS}{e}")
            ours = {}
        if self._qwen3_5 is not None:
            try:
                text = self._qwen3_5.from_hf_checked(rest)
                ours.update(text.state_dict)
                passthrough.update(text.passthrough)  # e.g. an empty shared expert's keys
            except CheckpointKeyError as e:
                problems.append(str(e))
        else:
            for key, t in rest.items():
                if key == "lm_head.weight":
                    ours[key] = t
                elif key.startswith((_LM, _MTP)):  # mtp.* reach here only when the model has an MTP block
                    name = key[len(_LM) :] if key.startswith(_LM) else key
                    if name.endswith(_FUSED) and self.experts_layout == "hub":
                        t = t.transpose(1, 2)
                    ours[name] = t
                else:
                    problems.append(f"unexpected: {key}")
            if self.model_config.tie_word_embeddings:
                problems += tied_head_from_hf(ours, embed_hf_key=_LM + "embed_tokens.weight")
        if expected is not None:
            layout_hint = f" (experts read as the {self.experts_layout!r} layout: pass experts_layout=)"
            no_mtp = not any(k.startswith("mtp.") for k in hf_state_dict)  # the MTP block then keeps its init
            problems += convert.check_keys(
                ours, expected, shape_hint=lambda key: layout_hint if key.endswith(_FUSED) else "",
                optional=[k for k in expected if k.startswith("mtp.")] if no_mtp else (),
            )
        problems = untied_head_hint(problems, where="config.json (top level)")
        convert.raise_problems(problems, f"checkpoint ({self.family} VL)")
        return ours, passthrough

    # ---- the generic load / export's hooks ------------------------------------------------------
    @classmethod
    def for_folder(
        cls, model_config: Any, path: str | os.PathLike, *, experts_layout: ExpertsLayout | None = None
    ) -> Qwen3VlMoeStateDictAdapter:
        return cls(model_config, experts_layout=experts_layout or experts_layout_of(read_hf_config(path)))

    def after_load(self, model: Any, result: HFLoadResult) -> None:
        model.hf_experts_layout = self.experts_layout  # the export writes the layout the folder held

    @classmethod
    def export_defaults(cls, model: Any) -> dict[str, Any]:
        # the fused-expert layout the model was read in (Qwen3-VL-MoE), "memory" for a recipe's model
        return {"experts_layout": getattr(model, "hf_experts_layout", "memory")}

    @classmethod
    def for_export(cls, model_config: Any, *, experts_layout: ExpertsLayout = "memory") -> Qwen3VlMoeStateDictAdapter:
        return cls(model_config, experts_layout=experts_layout)

    def export_names(self, passthrough: Any) -> dict[str, str]:
        has_mtp = getattr(self.model_config, "mtp", None) is not None  # then the block's own weights are the mtp.* written
        return {k: k for k in passthrough if not (has_mtp and k.startswith(_MTP))}

    def export_config(self) -> dict[str, Any]:
        config, experts_layout = self.model_config, self.experts_layout
        hf_config = config_to_hf(config)
        if getattr(config, "mtp", None) is not None:  # vLLM's Qwen3_5MultiTokenPredictor reads this count (text_config)
            hf_config["text_config"]["mtp_num_hidden_layers"] = len(config.mtp.layers)
        hf_config["text_config"].setdefault("dtype", None)  # stated on both levels (hf.save fills it in)
        if config.text_family == "qwen3_vl_moe":
            version = hf_config.get("transformers_version")
            if experts_layout_of(hf_config) != experts_layout:  # make the folder's version state its layout
                hf_config["transformers_version"] = "4.57.0" if experts_layout == "hub" else "5.0.0"
            elif version is None:
                hf_config["transformers_version"] = "5.0.0"
        return hf_config


# ---- HF config.json <-> Config -----------------------------------------------------------------
#
# Read as transformers 5.x reads a ConditionalGeneration config: ``tie_word_embeddings`` from the TOP level
# (a text_config's own value is ignored by the ConditionalGeneration class), RoPE in any accepted form
# (``models.common.hf_rope``: 4.57's ``text_config.rope_scaling`` + ``text_config.rope_theta``, or
# ``rope_parameters``), absent keys with the class defaults, ``null`` where transformers' ``__post_init__``
# fills it (``num_key_value_heads`` -> heads, ``head_dim`` -> hidden / heads, ``mlp_only_layers`` -> []).
# The Qwen3.5-MoE text part is the Qwen3.5 family's reader (``qwen3_5_v2.hf_config``).

_VL_TEXT_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "rms_norm_eps", "attention_bias",
    "initializer_range", "pad_token_id", "max_position_embeddings",
)  # fmt: skip
# transformers' Qwen3VLMoeTextConfig defaults (5.24) for keys a config.json may omit.
_VL_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
    intermediate_size=5632, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
    decoder_sparse_step=1, rms_norm_eps=1e-6, attention_bias=False, initializer_range=0.02, pad_token_id=None,
    max_position_embeddings=128000,
)  # fmt: skip
# transformers' Qwen3VLTextConfig (dense) defaults (5.24): another size, head_dim 128 whatever the width.
_VL_DENSE_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    intermediate_size=22016, rms_norm_eps=1e-6, attention_bias=False, initializer_range=0.02, pad_token_id=None,
    max_position_embeddings=128000,
)  # fmt: skip
_MOE_TEXT_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")
_VL_CONSUMED = set(_VL_TEXT_KEYS) | set(LEGACY_ROPE_KEYS) | {
    "num_key_value_heads", "head_dim", "mlp_only_layers", "model_type", "hidden_act", "attention_dropout",
    "router_aux_loss_coef", "output_router_logits", "tie_word_embeddings", "num_local_experts",
}  # fmt: skip
# the vision_config classes' defaults
_DEEPSTACK_DEFAULT = {"qwen3_vl_moe": (8, 16, 24), "qwen3_vl": (8, 16, 24), "qwen3_5_moe": (), "qwen3_5": ()}
_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
_ID_DEFAULTS = {
    "qwen3_vl_moe": dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                         vision_end_token_id=151653),
    "qwen3_vl": dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                     vision_end_token_id=151653),  # Qwen3VLConfig's defaults (those of the MoE class)
    "qwen3_5_moe": dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                        vision_end_token_id=248054),
    "qwen3_5": dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                    vision_end_token_id=248054),  # Qwen3_5Config's defaults (those of the MoE class)
}  # fmt: skip


def _vision_kwargs(vision: dict[str, Any], family: str) -> tuple[dict[str, Any], int]:
    from hyper_parallel.models.qwen3_vl_moe_v2.vision import vision_tower_config_from_hf

    if "deepstack_visual_indexes" not in vision:  # absent: the family's vision class default
        vision = {**vision, "deepstack_visual_indexes": list(_DEEPSTACK_DEFAULT[family])}
    tower, out = vision_tower_config_from_hf(vision)
    kwargs = dict(
        depth=len(tower.blocks), dim=tower.dim, n_heads=tower.blocks[0].attn.n_heads,
        intermediate_size=tower.blocks[0].mlp.hidden_dim, patch_size=tower.patch_size,
        temporal_patch_size=tower.temporal_patch_size, in_channels=tower.in_channels,
        spatial_merge_size=tower.spatial_merge_size, num_position_embeddings=tower.num_position_embeddings,
        deepstack_visual_indexes=tuple(tower.deepstack_visual_indexes), hidden_act=tower.blocks[0].mlp.activation,
        rope_theta=tower.rotary_pos_emb.theta,
    )  # fmt: skip
    return kwargs, out


def _vl_text_kwargs(text: dict[str, Any], family: str = "qwen3_vl_moe") -> tuple[dict[str, Any], dict[str, Any]]:
    """Builder kwargs and ``hf_extra`` entries of a Qwen3-VL-MoE (``family`` ``qwen3_vl_moe``) or Qwen3-VL dense
    (``qwen3_vl``: no expert, every layer a dense SwiGLU MLP) ``text_config``."""
    where = "text_config"
    dense = family == "qwen3_vl"
    defaults = _VL_DENSE_TEXT_DEFAULTS if dense else _VL_TEXT_DEFAULTS
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}.hidden_act={act!r}: only silu is implemented")
    dropout = text.get("attention_dropout", 0.0) or 0.0
    if dropout:
        raise ValueError(f"{where}.attention_dropout={dropout}: attention dropout is not modelled; set it to 0.0")
    if "num_experts" not in text and "num_local_experts" in text:  # HF's attribute name in to_dict()
        text = {**text, "num_experts": text["num_local_experts"]}
    kwargs: dict[str, Any] = {}
    for key in _VL_TEXT_KEYS:
        if dense and key in _MOE_TEXT_KEYS:
            continue  # Qwen3VLTextConfig has no such field (a folder's value is kept as read)
        value = text.get(key, defaults[key])
        if value is None and defaults[key] is not None:
            raise ValueError(f"{where}.{key} is null: give a value (transformers' default is {defaults[key]!r})")
        kwargs[key] = value
    heads = kwargs["num_attention_heads"]
    kv = text.get("num_key_value_heads", defaults["num_key_value_heads"])
    kwargs["num_key_value_heads"] = heads if kv is None else kv  # HF __post_init__: null -> MHA
    if dense:  # Qwen3VLTextConfig: head_dim an int field, 128 when absent (never hidden / heads)
        if text.get("head_dim", 128) is None:
            raise ValueError(f"{where}.head_dim is null: give a value (transformers' Qwen3VLTextConfig refuses null)")
        kwargs.update(head_dim=text.get("head_dim", 128), num_experts=0, num_experts_per_tok=0,
                      moe_intermediate_size=0, mlp_only_layers=(), router_aux_loss_coef=0.0)  # fmt: skip
    else:
        kwargs["head_dim"] = text.get("head_dim") or kwargs["hidden_size"] // heads
        kwargs["mlp_only_layers"] = tuple(text.get("mlp_only_layers") or ())
        kwargs["router_aux_loss_coef"] = (
            float(text.get("router_aux_loss_coef", 0.001)) if text.get("output_router_logits") else 0.0
        )
    rope = read_hf_rope(text, where=where, default_theta=500000.0, default_partial_rotary_factor=None)
    kwargs.update(
        rope_theta=rope.theta, partial_rotary_factor=rope.partial_rotary_factor,
        mrope_section=rope.mrope_section if rope.mrope_section is not None else (24, 20, 20),
    )  # fmt: skip
    extra = {
        "text": {k: v for k, v in text.items() if k not in _VL_CONSUMED and not k.startswith("_")},
        "mrope_interleaved": rope.mrope_interleaved,
        "aux": {k: text[k] for k in ("router_aux_loss_coef", "output_router_logits") if k in text},
        # the export's form (as qwen3_5_v2.hf_config): the RoPE keys as written, the consumed keys as read
        "rope_form": rope.form,
        "read": {k: v for k, v in text.items() if k in _VL_CONSUMED and k not in LEGACY_ROPE_KEYS},
    }
    return kwargs, extra


def config_from_hf(hf: dict[str, Any]) -> Qwen3VlMoeModel.Config:
    """Our config from an HF ``config.json`` dict (``model_type`` ``qwen3_vl_moe``, ``qwen3_vl``, ``qwen3_5_moe`` or
    ``qwen3_5``)."""
    from hyper_parallel.models.qwen3_5_moe_v2.model import Qwen3_5MoeModel, Qwen3_5MoeTransformerBlock
    from hyper_parallel.models.qwen3_5_v2.hf_config import text_config_from_hf
    from hyper_parallel.models.qwen3_5_v2.model import Qwen3_5Model, Qwen3_5TransformerBlock
    from hyper_parallel.models.qwen3_vl_moe_v2.model import qwen3_vl_moe_config, vl_config_from_text
    from hyper_parallel.models.qwen3_vl_moe_v2.vision import vision_tower_config

    hf = without_quantization(hf)  # read by the loader (hf.quant), not kept: the model is dense
    family = hf.get("model_type")
    if family not in _ID_DEFAULTS or "vision_config" not in hf:
        raise ValueError(
            f"config.json model_type={family!r}: expected a Qwen3VLMoeForConditionalGeneration ('qwen3_vl_moe'), "
            "Qwen3VLForConditionalGeneration ('qwen3_vl'), Qwen3_5MoeForConditionalGeneration ('qwen3_5_moe') or "
            "Qwen3_5ForConditionalGeneration ('qwen3_5') folder with text_config and vision_config"
        )
    vision, out_dim = _vision_kwargs(dict(hf["vision_config"]), family)
    ids = {k: int(hf.get(k, _ID_DEFAULTS[family][k])) for k in _IDS}
    tie = bool(hf.get("tie_word_embeddings", False))  # transformers reads the top level for these classes
    top = {k: v for k, v in hf.items() if k not in ("text_config", "tie_word_embeddings", *_IDS)}
    text = dict(hf.get("text_config") or {})
    if family in QWEN3_5_FAMILIES:
        if vision["deepstack_visual_indexes"]:
            raise ValueError(f"a {family} vision_config has no deepstack_visual_indexes (Qwen3.5 has no deepstack)")
        moe = family == "qwen3_5_moe"
        t = text_config_from_hf(  # the text family's own reader: the decoder part, picked by model_type
            text, moe=moe, where="text_config", tie_word_embeddings=tie,
            config_cls=Qwen3_5MoeModel.Config if moe else Qwen3_5Model.Config,
            block_cls=Qwen3_5MoeTransformerBlock if moe else Qwen3_5TransformerBlock,
        )  # fmt: skip
        cfg = vl_config_from_text(t, vision=vision_tower_config(**vision), **ids, hf_extra={**t.hf_extra, "top": top})
    else:  # Qwen3-VL(-MoE): one builder, no expert for the dense family
        kwargs, extra = _vl_text_kwargs(text, family)
        cfg = qwen3_vl_moe_config(
            **kwargs, vision=vision, **ids, tie_word_embeddings=tie, hf_extra={**extra, "top": top}
        )  # fmt: skip
    if out_dim != cfg.dim:
        raise ValueError(f"vision_config.out_hidden_size={out_dim} must equal the text hidden_size={cfg.dim}")
    return cfg


def _sparse_layout(dense: list[int], layers: int, read: dict[str, Any]) -> dict[str, Any]:
    """``decoder_sparse_step`` + ``mlp_only_layers`` that build the ``dense`` layers: the folder's values when
    they still do (transformers: layer i is MoE iff i is not in mlp_only_layers and (i + 1) % step == 0),
    else step 1 and the explicit list."""
    step, only = read.get("decoder_sparse_step", 1), read.get("mlp_only_layers")
    if isinstance(step, int) and step >= 1:
        built = [i for i in range(layers) if i in set(only or ()) or (i + 1) % step]
        if built == dense:
            return {"decoder_sparse_step": step, "mlp_only_layers": only}
    return {"decoder_sparse_step": 1, "mlp_only_layers": dense}


def config_to_hf(cfg: Qwen3VlMoeModel.Config) -> dict[str, Any]:
    """The HF ``config.json`` dict of ``cfg`` (the inverse of :func:`config_from_hf`) in the form of the folder it
    was read from: every key at its level (the RoPE as the folder spelled it, the vision ``model_type``, the
    consumed keys as read, the dense/sparse layout keys restated), ``tie_word_embeddings`` on both levels; one
    ``rope_parameters`` without a folder."""
    from hyper_parallel.models.common.feed_forward import FeedForward
    from hyper_parallel.models.common.moe import MoE
    from hyper_parallel.models.qwen3_5_moe_v2.model import Qwen3_5MoeModel
    from hyper_parallel.models.qwen3_5_v2.hf_config import text_config_to_hf
    from hyper_parallel.models.qwen3_5_v2.model import Qwen3_5Model
    from hyper_parallel.models.qwen3_vl_moe_v2.vision import vision_tower_config_to_hf

    extra = cfg.hf_extra
    top = {k: v for k, v in extra.get("top", {}).items() if k not in LEGACY_ROPE_KEYS}
    vision = {**top.get("vision_config", {}), **vision_tower_config_to_hf(cfg.visual, cfg.dim)}
    ids = {k: getattr(cfg, k) for k in _IDS}
    tie = cfg.tie_word_embeddings
    if cfg.text_family in QWEN3_5_FAMILIES:
        family = cfg.text_family
        t = (Qwen3_5MoeModel if family == "qwen3_5_moe" else Qwen3_5Model).Config(
            vocab_size=cfg.vocab_size, dim=cfg.dim, layers=cfg.layers, embed_tokens=cfg.embed_tokens, norm=cfg.norm,
            lm_head=cfg.lm_head, max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=tie,
            hf_extra={k: v for k, v in extra.items() if k != "top"},
        )  # fmt: skip
        text = {"model_type": f"{family}_text", **text_config_to_hf(t)}
        arch = "Qwen3_5MoeForConditionalGeneration" if family == "qwen3_5_moe" else "Qwen3_5ForConditionalGeneration"
        top.setdefault("architectures", [arch])
        # the vision model_type as the folder spelled it (Qwen3.5 dense releases: "qwen3_5"), else the class's
        return {**top, **ids, "model_type": family, "text_config": text, "tie_word_embeddings": tie,
                "vision_config": {"model_type": f"{family}_vision", **vision}}  # fmt: skip
    family = cfg.text_family  # qwen3_vl_moe, or qwen3_vl (dense: no expert key, no sparse layout)
    attn = cfg.layers[0].self_attn
    moes = [layer.mlp for layer in cfg.layers if isinstance(layer.mlp, MoE.Config)]
    dense = [i for i, layer in enumerate(cfg.layers) if isinstance(layer.mlp, FeedForward.Config)]
    ffn = next((layer.mlp for layer in cfg.layers if isinstance(layer.mlp, FeedForward.Config)), None)
    read = extra.get("read", {})
    text: dict[str, Any] = {
        **read,
        **extra.get("text", {}),
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": len(cfg.layers),
        "num_attention_heads": attn.n_heads, "num_key_value_heads": attn.n_kv_heads, "head_dim": attn.head_dim,
        "attention_bias": attn.q_proj.bias, "rms_norm_eps": cfg.norm.eps, "hidden_act": "silu",
        "attention_dropout": 0.0,
        # all-MoE: no dense MLP holds the size; the folder's value (it sizes nothing) or the class default
        "intermediate_size": ffn.hidden_dim if ffn is not None else read.get("intermediate_size", 5632),
        **(_sparse_layout(dense if moes else [], len(cfg.layers), read) if family == "qwen3_vl_moe" else {}),
        "initializer_range": cfg.lm_head.param_init.std if hasattr(cfg.lm_head.param_init, "std") else 0.02,
        "pad_token_id": cfg.embed_tokens.padding_idx, "max_position_embeddings": cfg.max_position_embeddings,
        **rope_to_hf(  # a whole-head rotation is what an absent partial_rotary_factor means here
            theta=attn.rope.theta,
            partial_rotary_factor=attn.rope.partial_rotary_factor if attn.rope.partial_rotary_factor != 1.0 else None,
            mrope_section=attn.rope.mrope_section, mrope_interleaved=extra.get("mrope_interleaved", True),
            form=extra.get("rope_form"),
        ),
        "model_type": read.get("model_type", f"{family}_text"), "tie_word_embeddings": tie,
    }  # fmt: skip
    if family == "qwen3_vl":
        top.setdefault("architectures", ["Qwen3VLForConditionalGeneration"])
        # the vision model_type as the folder spelled it (the released files: "qwen3_vl"), else the class's
        return {**top, **ids, "model_type": "qwen3_vl", "text_config": text,
                "vision_config": {"model_type": "qwen3_vl_vision", **vision}, "tie_word_embeddings": tie}  # fmt: skip
    if "num_local_experts" in read:  # HF's attribute name, as the folder spelled it
        text["num_local_experts"] = moes[0].num_experts if moes else 0
    if moes:
        m = moes[0]
        text.update(num_experts=m.num_experts, num_experts_per_tok=m.gate.top_k, moe_intermediate_size=m.experts.hidden_dim)
        text.update(extra.get("aux", {}))
        if m.router_aux_loss_coef > 0 and "read" not in extra:  # a training option: a folder's keys as they were
            text.update(router_aux_loss_coef=m.router_aux_loss_coef, output_router_logits=True)
    else:
        text.update(num_experts=0, mlp_only_layers=list(range(len(cfg.layers))))
    top.setdefault("architectures", ["Qwen3VLMoeForConditionalGeneration"])
    return {**top, **ids, "model_type": "qwen3_vl_moe", "text_config": text,
            "vision_config": {"model_type": "qwen3_vl_moe_vision", **vision}, "tie_word_embeddings": tie}  # fmt: skip
