"""GlmImageMoe / Glm4MoeLite HF ``config.json`` <-> our config tree: the one reader/writer of the family.

Two folder forms (docs/design.md section 4): ``glm_image_moe`` (``text_config`` = Glm4MoeLite fields +
``vq_config`` + the image-token ids) and a plain ``glm4_moe_lite`` (GLM-4.7-Flash) folder, whose image part
takes GlmImage's defaults. Read as transformers 5.x reads ``Glm4MoeLiteConfig``:

- RoPE in any accepted form (``models.common.hf_rope``): top-level ``rope_theta`` beside ``rope_scaling:
  null`` (GLM-4.7-Flash's released form), or ``rope_parameters``; default theta 1e4 (the class's).
  ``partial_rotary_factor`` must be 1.0 (HF rotates the whole ``qk_rope_head_dim``); RoPE scaling
  (yarn ...) is refused with the key named.
- Dense vs MoE layers: ``mlp_layer_types``, default ``["dense"] + ["sparse"] * (L - 1)``; transformers
  ignores ``first_k_dense_replace``. When a config gives only ``first_k_dense_replace`` and its value
  disagrees with that default, transformers would build a model that does not fit the checkpoint: refused,
  asking for an explicit ``mlp_layer_types``.
- ``tie_word_embeddings=True`` is refused: GlmImageMoe's head has ``vocab + codebook`` rows, the embedding
  ``vocab``. ``attention_dropout`` > 0 and a ``hidden_act`` other than silu are refused too.

A Glm4MoeLite folder is read as a model without image path (``image_path`` False: no codebook, projection or
image rows in the head); ``--model.image_path true`` or image data grows one.

The writer emits the folder's form: every key it had, at its level (the RoPE keys as the folder spelled them,
``models.common.hf_rope.rope_to_hf``; ``first_k_dense_replace`` restated from the layers), plus explicit
``mlp_layer_types``; without a folder one ``rope_parameters``. A model without image path is written exactly in
the Glm4MoeLite form; one that grew an image path from a Glm4MoeLite folder keeps the folder's keys in
``text_config`` of the GlmImageMoe form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.hf.rope import LEGACY_ROPE_KEYS, read_hf_rope, rope_to_hf
from hyper_parallel.models.common.moe import MoE
from hyper_parallel.models.glm_image_moe_v2.model import GlmImageMoeModel, glm_image_moe_config
from hyper_parallel.hf.quant import without_quantization

__all__ = ["config_from_hf", "config_to_hf"]

_LITE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "n_routed_experts", "num_experts_per_tok", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_shared_experts", "n_group", "topk_group",
    "routed_scaling_factor", "norm_topk_prob", "mlp_layer_types", "rms_norm_eps", "attention_bias",
    "initializer_range", "pad_token_id", "max_position_embeddings", "rope_interleave",
)  # fmt: skip
# transformers' Glm4MoeLiteConfig defaults (5.24) for fields a config.json may omit.
_LITE_DEFAULTS: dict[str, Any] = dict(
    vocab_size=154880, hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536, num_hidden_layers=47,
    num_attention_heads=20, n_routed_experts=64, num_experts_per_tok=4, q_lora_rank=768, kv_lora_rank=512,
    qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, n_shared_experts=1, n_group=1, topk_group=1,
    routed_scaling_factor=1.8, norm_topk_prob=True, rms_norm_eps=1e-5, attention_bias=False, initializer_range=0.02,
    max_position_embeddings=202752, rope_interleave=True,
)  # fmt: skip
_CONSUMED = set(_LITE_KEYS) | set(LEGACY_ROPE_KEYS) | {
    "model_type", "architectures", "hidden_act", "attention_dropout", "tie_word_embeddings", "first_k_dense_replace",
}  # fmt: skip


def _text_kwargs(text: Mapping[str, Any], where: str) -> dict[str, Any]:
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}.hidden_act={act!r}: the Glm4MoeLite blocks implement silu only")
    dropout = text.get("attention_dropout", 0.0) or 0.0
    if dropout:
        raise ValueError(f"{where}.attention_dropout={dropout}: attention dropout is not modelled; set it to 0.0")
    if text.get("tie_word_embeddings"):
        raise ValueError(
            f"{where}.tie_word_embeddings=true: GlmImageMoe's head has vocab + codebook rows and cannot share the "
            "embedding table; use an untied checkpoint"
        )
    kwargs = {k: text.get(k, _LITE_DEFAULTS.get(k)) for k in _LITE_KEYS}
    layers = kwargs["num_hidden_layers"]
    if kwargs["mlp_layer_types"] is None:
        first_k = text.get("first_k_dense_replace")
        if first_k is not None and first_k != 1:
            raise ValueError(
                f"{where}.first_k_dense_replace={first_k} without mlp_layer_types: transformers ignores "
                "first_k_dense_replace and builds layer 0 dense, the rest MoE; add an explicit mlp_layer_types to "
                "config.json that lists the layers the checkpoint holds"
            )
    rope = read_hf_rope(text, where=where, default_theta=10000.0, default_partial_rotary_factor=None)
    if rope.partial_rotary_factor != 1.0:
        raise NotImplementedError(
            f"{where}.partial_rotary_factor={rope.partial_rotary_factor}: MLA here rotates the whole "
            "qk_rope_head_dim; only 1.0 is modelled"
        )
    if rope.mrope_section is not None:
        raise NotImplementedError(f"{where} rope mrope_section={list(rope.mrope_section)}: Glm4MoeLite has 1-D RoPE")
    kwargs["rope_theta"] = rope.theta
    kwargs["_rope_form"] = rope.form
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads") if kwargs[k] is None]
    if missing or layers is None:
        raise ValueError(f"{where} has null {missing}")
    return kwargs


def _rest(d: Mapping[str, Any], keep: Sequence[str] = ()) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in _CONSUMED and k not in keep and not k.startswith("_")}


def _form(text: Mapping[str, Any], rope_form: dict[str, Any]) -> dict[str, Any]:
    """The export's form of a text level: its RoPE keys as written, its consumed keys as read (the writer
    states every fact it models again; a consumed key it does not write keeps its place and value)."""
    read = {k: v for k, v in text.items() if k in _CONSUMED and k not in LEGACY_ROPE_KEYS}
    return {"rope_form": rope_form, "read": read}


# GlmImageMoe top-level keys the reader consumes; the rest of the top level is kept and written back
_TOP_CONSUMED = {
    "model_type", "text_config", "vq_config", "lang_vocab_size", "placeholder_token_id", "image_start_token_id",
    "image_end_token_id", "vq_l2_normalize", "freeze_vq", "vq_to_llm_proj_bias", "tie_word_embeddings",
}  # fmt: skip


def config_from_hf(hf: Mapping[str, Any]) -> GlmImageMoeModel.Config:
    """From an HF ``config.json`` dict: GlmImageMoe (``text_config`` + ``vq_config``) or plain Glm4MoeLite.
    ``quantization_config`` is read by the loader (``hf.quant``) and not kept: the model is dense."""
    hf = without_quantization(hf)
    model_type = hf.get("model_type")
    if model_type == "glm_image_moe":
        text, vq = dict(hf["text_config"]), dict(hf["vq_config"])
        kwargs = _text_kwargs(text, "text_config")
        rope_form = kwargs.pop("_rope_form")
        kwargs["vocab_size"] = int(hf.get("lang_vocab_size", kwargs["vocab_size"]))
        extras = {
            "placeholder_token_id": hf["placeholder_token_id"],
            "image_start_token_id": hf.get("image_start_token_id"),
            "image_end_token_id": hf.get("image_end_token_id"),
            "codebook_size": vq["num_embeddings"],
            "vq_embed_dim": vq["embed_dim"],
            "vq_l2_normalize": hf.get("vq_l2_normalize", True),
            "freeze_vq": hf.get("freeze_vq", True),
            "vq_proj_bias": hf.get("vq_to_llm_proj_bias", False),
        }
        if hf.get("tie_word_embeddings"):
            raise ValueError("config.json tie_word_embeddings=true: GlmImageMoe's joint head cannot be tied")
        hf_extra = {"text_config": _rest(text), "vq_config": _rest(vq, keep=("num_embeddings", "embed_dim")),
                    "top": {k: v for k, v in hf.items() if k not in _TOP_CONSUMED and not k.startswith("_")},
                    "form": "glm_image_moe", **_form(text, rope_form)}  # fmt: skip
    elif model_type == "glm4_moe_lite":
        kwargs = _text_kwargs(hf, "config.json")
        rope_form = kwargs.pop("_rope_form")
        # A text-only checkpoint is a model without image path (a Glm4MoeLite model). The sizes an image path
        # would have (--model.image_path true, a DirectToken source) are GlmImage's defaults; a run takes the
        # recipe's (HFSpec.fields_not_in_hf).
        extras = {
            "placeholder_token_id": hf.get("placeholder_token_id", kwargs["vocab_size"] - 1),
            "codebook_size": 16384,
            "vq_embed_dim": 2048,
            "image_path": False,
        }
        hf_extra = {"text_config": _rest(hf), "form": "glm4_moe_lite", **_form(hf, rope_form)}
    else:
        raise ValueError(f"config.json model_type={model_type!r}: expected 'glm_image_moe' or 'glm4_moe_lite'")
    return glm_image_moe_config(**kwargs, **extras, hf_extra=hf_extra)


def config_to_hf(cfg: GlmImageMoeModel.Config, *, text_only: bool | None = None) -> dict[str, Any]:
    """The HF ``config.json`` dict: GlmImageMoe, or plain Glm4MoeLite with ``text_only`` (None: the model's form,
    Glm4MoeLite exactly when it has no image path)."""
    if text_only is None:
        text_only = not cfg.has_image_path
    if not text_only and not cfg.has_image_path:
        raise ValueError("a GlmImageMoe config without image path is a Glm4MoeLite model: write it with text_only=True")
    first = cfg.layers[0].self_attn
    moe = next((layer.mlp for layer in cfg.layers if isinstance(layer.mlp, MoE.Config)), None)
    dense = next((layer.mlp for layer in cfg.layers if isinstance(layer.mlp, FeedForward.Config)), None)
    shared = moe.shared_experts if moe is not None else None
    moe_hidden = moe.experts.hidden_dim if moe is not None else 0
    extra = cfg.hf_extra
    read = extra.get("read", {})
    layer_kinds = ["sparse" if isinstance(layer.mlp, MoE.Config) else "dense" for layer in cfg.layers]
    text = {
        **{k: v for k, v in read.items() if k != "architectures"},
        **extra.get("text_config", {}),
        "model_type": "glm4_moe_lite",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": dense.hidden_dim if dense is not None else 4 * cfg.dim,
        "moe_intermediate_size": moe_hidden,
        "num_hidden_layers": len(cfg.layers),
        "num_attention_heads": first.n_heads,
        "num_key_value_heads": first.n_heads,
        "q_lora_rank": first.q_lora_rank,
        "kv_lora_rank": first.kv_lora_rank,
        "qk_nope_head_dim": first.qk_nope_head_dim,
        "qk_rope_head_dim": first.qk_rope_head_dim,
        "v_head_dim": first.v_head_dim,
        "n_routed_experts": moe.num_experts if moe is not None else 0,
        "n_shared_experts": (shared.hidden_dim // moe_hidden) if shared is not None and moe_hidden else 0,
        "num_experts_per_tok": moe.gate.top_k if moe is not None else 0,
        "n_group": moe.gate.n_group if moe is not None else 1,
        "topk_group": moe.gate.topk_group if moe is not None else 1,
        "routed_scaling_factor": moe.gate.route_scale if moe is not None else 1.0,
        "norm_topk_prob": moe.gate.norm_topk_prob if moe is not None else True,
        "mlp_layer_types": layer_kinds,
        "rms_norm_eps": cfg.norm.eps,
        "attention_bias": bool(first.kv_a_proj_with_mqa.bias),
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        **rope_to_hf(theta=first.rope.theta, form=extra.get("rope_form")),
        "rope_interleave": first.rope.layout == "interleaved",
        "pad_token_id": cfg.embed_tokens.padding_idx,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False,
    }
    if "first_k_dense_replace" in read:  # vLLM's Glm4MoeLite builds its dense layers from it: restated
        text["first_k_dense_replace"] = next((i for i, kind in enumerate(layer_kinds) if kind != "dense"), len(layer_kinds))
    if text_only:
        return {**text, "architectures": read.get("architectures", ["Glm4MoeLiteForCausalLM"])}
    return {
        **extra.get("top", {}),
        "model_type": "glm_image_moe",
        "architectures": ["GlmImageMoeForConditionalGeneration"],
        "text_config": text,
        "vq_config": {
            **cfg.hf_extra.get("vq_config", {}),
            "model_type": "glm_image_vqmodel",
            "num_embeddings": cfg.codebook_size,
            "embed_dim": cfg.vq_embed_dim,
        },
        "lang_vocab_size": cfg.vocab_size,
        "placeholder_token_id": cfg.placeholder_token_id,
        "image_start_token_id": cfg.image_start_token_id,
        "image_end_token_id": cfg.image_end_token_id,
        "vq_l2_normalize": cfg.vq_l2_normalize,
        "freeze_vq": cfg.freeze_vq,
        "vq_to_llm_proj_bias": cfg.vq_to_llm_proj.bias if cfg.vq_to_llm_proj is not None else False,
        "tie_word_embeddings": False,
    }
