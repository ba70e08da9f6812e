"""Qwen3.5 (dense and MoE) HF ``config.json`` <-> our config tree: the one reader/writer of the family.

Read by ``from_pretrained`` of ``qwen3_5`` / ``qwen3_5_moe`` and, for the text part, by the Qwen3.5-MoE
VL model (``qwen3_vl_moe_v2.state_dict``). It builds the model transformers builds from the same dict
(``Qwen3_5(Moe)TextConfig`` / ``Qwen3_5(Moe)Config``, 5.x):

- RoPE in any form transformers folds into ``rope_parameters`` (``models.common.hf_rope``): 5.x
  ``rope_parameters``, 4.x ``rope_scaling`` + ``rope_theta``, top-level ``partial_rotary_factor`` beside an
  M-RoPE-only dict (Qwen3.6). Defaults: theta 1e4 (the class's, not a release's), rotary 0.25,
  ``mrope_section`` [11, 11, 10] (the rotary class's fallback).
- Layer pattern: ``layer_types``, else ``full_attention_interval`` (default 4).
- Absent keys take the class defaults (dense and MoE classes differ: hidden 4096 vs 2048, ...).
- ``tie_word_embeddings`` where transformers reads it: top level of a ``Qwen3_5(Moe)ForConditionalGeneration``
  config, the text config of a ``*ForCausalLM`` one.
- Keys HF stores but ignores (``norm_topk_prob``: the router always renormalises; ``mtp_*``; ``mlp_only_layers``,
  which the Qwen3.5 classes do not have) are kept and written back; values this project does not model
  (``hidden_act`` other than silu, ``attention_dropout > 0``, RoPE scaling) are refused with an error naming
  the key. ``shared_expert_intermediate_size = 0`` (HF: an empty shared expert adding exactly 0) builds no
  shared expert.

The writer emits the folder's form: every key the folder had, at its level (the RoPE keys as the folder spelled
them, ``models.common.hf_rope.rope_to_hf``; ``full_attention_interval`` beside the explicit ``layer_types``),
with what the config models restated, ``tie_word_embeddings`` on both levels of a ConditionalGeneration config.
Without a folder: one ``rope_parameters`` dict and explicit ``layer_types``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from hyper_parallel.models.common.gated_attention import GatedAttention
from hyper_parallel.models.common.gated_deltanet import GatedDeltaNet
from hyper_parallel.hf.rope import LEGACY_ROPE_KEYS, read_hf_rope, rope_to_hf
from hyper_parallel.models.common.moe import MoE
from hyper_parallel.models.qwen3_5_v2.model import (
    Qwen3_5Model,
    Qwen3_5TransformerBlock,
    layer_types_of,
    qwen3_5_config,
)
from hyper_parallel.hf.quant import without_quantization
from hyper_parallel.protocols.param_init import NormalInit

__all__ = ["config_from_hf", "config_to_hf", "qwen3_5_config_from_hf", "text_config_from_hf", "text_config_to_hf"]

C = TypeVar("C", bound=Qwen3_5Model.Config)

# Keys of a text config that become builder arguments.
_TEXT_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "rms_norm_eps", "attention_bias", "initializer_range", "pad_token_id",
    "max_position_embeddings",
)  # fmt: skip
_DENSE_KEYS = ("intermediate_size",)
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
# transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults (5.24) for keys a config.json may omit.
_COMMON_DEFAULTS: dict[str, Any] = dict(
    vocab_size=248320, num_attention_heads=16, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    attention_bias=False, initializer_range=0.02, pad_token_id=None, max_position_embeddings=32768,
)  # fmt: skip
_DENSE_DEFAULTS: dict[str, Any] = dict(
    hidden_size=4096, num_hidden_layers=32, num_key_value_heads=4, intermediate_size=12288
)
_MOE_DEFAULTS: dict[str, Any] = dict(
    hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512,
)  # fmt: skip
# Keys the reader consumes (everything else of the text config is kept in hf_extra["text"] and written back).
_CONSUMED = (
    set(_TEXT_KEYS) | set(_DENSE_KEYS) | set(_MOE_KEYS) | set(LEGACY_ROPE_KEYS)
    | {"layer_types", "full_attention_interval", "model_type", "architectures", "hidden_act", "attention_dropout",
       "tie_word_embeddings", "router_aux_loss_coef", "output_router_logits"}
)  # fmt: skip
_FAMILIES = {"qwen3_5": False, "qwen3_5_moe": True}  # model_type -> MoE


def _value(text: Mapping[str, Any], key: str, defaults: Mapping[str, Any], where: str) -> Any:
    if key not in text:
        return defaults[key]
    value = text[key]
    if value is None and defaults.get(key) is not None:
        raise ValueError(f"{where}.{key} is null: give a value (transformers' default is {defaults[key]!r})")
    return value


def text_config_from_hf(
    text: Mapping[str, Any],
    *,
    moe: bool,
    where: str,
    tie_word_embeddings: bool,
    config_cls: type[C],
    block_cls: type[Qwen3_5TransformerBlock],
    top: Mapping[str, Any] | None = None,
) -> C:
    """Our config from one Qwen3.5(-MoE) TEXT config dict (``where`` names it in errors).

    ``tie_word_embeddings`` is passed in: the caller knows which level transformers reads it from. ``top``
    (the rest of a ConditionalGeneration config) is kept in ``hf_extra["top"]`` and written back.
    """
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}.hidden_act={act!r}: the Qwen3.5 blocks implement silu only")
    dropout = text.get("attention_dropout", 0.0) or 0.0
    if dropout:
        raise ValueError(f"{where}.attention_dropout={dropout}: attention dropout is not modelled; set it to 0.0")
    defaults = {**_COMMON_DEFAULTS, **(_MOE_DEFAULTS if moe else _DENSE_DEFAULTS)}
    kwargs = {k: _value(text, k, defaults, where) for k in (*_TEXT_KEYS, *(_MOE_KEYS if moe else _DENSE_KEYS))}
    if moe:
        # shared_expert_intermediate_size=0: HF builds an empty shared expert whose output is exactly 0 (and a gate
        # that multiplies it); ours has none. The folder's shared_expert(_gate) keys are kept and written back.
        # HF adds the load-balancing loss only with output_router_logits; we train with it iff the coefficient > 0.
        aux = float(text.get("router_aux_loss_coef", 0.001)) if text.get("output_router_logits") else 0.0
        kwargs["router_aux_loss_coef"] = aux
    layers = kwargs["num_hidden_layers"]
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = text.get("full_attention_interval", 4)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    elif len(layer_types) != layers:
        raise ValueError(f"{where}.layer_types lists {len(layer_types)} layers but num_hidden_layers={layers}")
    rope = read_hf_rope(text, where=where, default_theta=10000.0, default_partial_rotary_factor=0.25,
                        layer_types=layer_types)  # fmt: skip
    extra: dict[str, Any] = {
        "text": {k: v for k, v in text.items() if k not in _CONSUMED and not k.startswith("_")},
        "aux": {k: text[k] for k in ("router_aux_loss_coef", "output_router_logits") if k in text},
        "mrope_interleaved": rope.mrope_interleaved,
        # the export's form: the RoPE keys as written, and the consumed keys as read (the writer states every
        # fact it models again; a consumed key it does not write keeps its place and value)
        "rope_form": rope.form,
        "read": {k: v for k, v in text.items() if k in _CONSUMED and k not in LEGACY_ROPE_KEYS},
    }
    if top is not None:
        extra["top"] = dict(top)
    return qwen3_5_config(
        **kwargs,
        layer_types=layer_types,
        rope_theta=rope.theta,
        partial_rotary_factor=rope.partial_rotary_factor,
        mrope_section=rope.mrope_section if rope.mrope_section is not None else (11, 11, 10),
        tie_word_embeddings=bool(tie_word_embeddings),
        hf_extra=extra,
        config_cls=config_cls,
        block_cls=block_cls,
    )


def config_from_hf(
    hf: Mapping[str, Any],
    *,
    moe: bool,
    config_cls: type[C],
    block_cls: type[Qwen3_5TransformerBlock],
) -> C:
    """Our config from an HF ``config.json`` dict of the dense (``moe=False``) or MoE family.

    ``qwen3_5(_moe)_text`` (``*ForCausalLM``) or ``qwen3_5(_moe)`` with a ``text_config``
    (``*ForConditionalGeneration``; the non-text part is kept and written back). ``quantization_config`` is
    read by the loader (``hf.quant``) and not kept: the model is dense.
    """
    hf = without_quantization(hf)
    family = "qwen3_5_moe" if moe else "qwen3_5"
    model_type = hf.get("model_type")
    if model_type in _FAMILIES or str(model_type).removesuffix("_text") in _FAMILIES:
        if _FAMILIES[str(model_type).removesuffix("_text")] != moe:
            other = "qwen3_5_moe" if not moe else "qwen3_5"
            raise ValueError(
                f"config.json model_type={model_type!r} is a {other} config: load it with the {other} package "
                f"(hyper_parallel.models.{other}_v2.from_pretrained), not {family}"
            )
    else:
        raise ValueError(
            f"config.json model_type={model_type!r}: expected {family!r} (with text_config) or {family + '_text'!r}"
        )
    if model_type == family:
        text = hf.get("text_config") or {}
        top = {k: v for k, v in hf.items() if k != "text_config"}
        return text_config_from_hf(
            text, moe=moe, where="text_config", tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            config_cls=config_cls, block_cls=block_cls, top=top,
        )  # fmt: skip
    return text_config_from_hf(
        hf, moe=moe, where="config.json", tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        config_cls=config_cls, block_cls=block_cls,
    )  # fmt: skip


def qwen3_5_config_from_hf(hf: Mapping[str, Any]) -> Qwen3_5Model.Config:
    """Our dense-family config from an HF ``config.json`` dict (``qwen3_5_text``, or ``qwen3_5`` with
    ``text_config``)."""
    return config_from_hf(hf, moe=False, config_cls=Qwen3_5Model.Config, block_cls=Qwen3_5TransformerBlock)


def _interval_of(types: list[str], read: Any) -> Any:
    """``full_attention_interval`` of ``types`` when they are 'full every n-th layer', else the value as read
    (transformers builds from the explicit ``layer_types``, which the export always writes)."""
    if "full_attention" in types:
        n = types.index("full_attention") + 1
        if types == ["linear_attention" if (i + 1) % n else "full_attention" for i in range(len(types))]:
            return n
    return read


def text_config_to_hf(cfg: Qwen3_5Model.Config) -> dict[str, Any]:
    """The HF text config dict of ``cfg`` (without ``model_type``; :func:`config_to_hf` adds it)."""
    extra = cfg.hf_extra
    gdn = next((layer.self_attn for layer in cfg.layers if isinstance(layer.self_attn, GatedDeltaNet.Config)), None)
    attn = next((layer.self_attn for layer in cfg.layers if isinstance(layer.self_attn, GatedAttention.Config)), None)
    mlp = cfg.layers[0].mlp
    init = cfg.lm_head.param_init
    types = layer_types_of(cfg)
    text: dict[str, Any] = {
        **extra.get("read", {}),
        **extra.get("text", {}),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": len(cfg.layers),
        "layer_types": types,
        "rms_norm_eps": cfg.norm.eps,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": init.std if isinstance(init, NormalInit.Config) else 0.02,
        "pad_token_id": cfg.embed_tokens.padding_idx,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }
    if "full_attention_interval" in text:  # as read; restated when the layer types still follow one interval
        text["full_attention_interval"] = _interval_of(types, text["full_attention_interval"])
    if gdn is not None:
        text.update(
            linear_num_key_heads=gdn.num_k_heads, linear_num_value_heads=gdn.num_v_heads,
            linear_key_head_dim=gdn.head_k_dim, linear_value_head_dim=gdn.head_v_dim,
            linear_conv_kernel_dim=gdn.conv1d.kernel_size,
        )  # fmt: skip
    if attn is not None:
        rope = attn.rope
        text.update(
            num_attention_heads=attn.n_heads, num_key_value_heads=attn.n_kv_heads, head_dim=attn.head_dim,
            attention_bias=attn.q_proj.bias,
        )  # fmt: skip
        text.update(rope_to_hf(
            theta=rope.theta, partial_rotary_factor=rope.partial_rotary_factor, mrope_section=rope.mrope_section,
            mrope_interleaved=extra.get("mrope_interleaved"), form=extra.get("rope_form"),
        ))  # fmt: skip
    if isinstance(mlp, MoE.Config):
        shared = mlp.shared_experts
        text.update(
            num_experts=mlp.num_experts, num_experts_per_tok=mlp.gate.top_k,
            moe_intermediate_size=mlp.experts.hidden_dim,
            shared_expert_intermediate_size=shared.hidden_dim if shared is not None else 0,
        )  # fmt: skip
        aux = dict(extra.get("aux", {}))
        # The aux-loss coefficient is a training option (--model.router_aux_loss_coef): a config read from a folder
        # writes the folder's keys back as they were; a recipe's model states its own.
        if mlp.router_aux_loss_coef > 0 and "read" not in extra:
            aux = {"router_aux_loss_coef": mlp.router_aux_loss_coef, "output_router_logits": True}
        text.update(aux)
    else:
        text["intermediate_size"] = mlp.hidden_dim
    return text


def config_to_hf(cfg: Qwen3_5Model.Config, *, text_only: bool | None = None) -> dict[str, Any]:
    """The HF ``config.json`` dict of ``cfg``: ``Qwen3_5(Moe)ForCausalLM`` with ``text_only`` (default: unless
    ``cfg`` was read from a ConditionalGeneration folder), else ``Qwen3_5(Moe)ForConditionalGeneration``."""
    extra = cfg.hf_extra
    if text_only is None:
        text_only = "top" not in extra
    text = text_config_to_hf(cfg)
    family = "qwen3_5_moe" if cfg.is_moe else "qwen3_5"
    arch = "Qwen3_5MoeFor" if cfg.is_moe else "Qwen3_5For"
    if text_only:
        return {**text, "model_type": f"{family}_text", "architectures": [arch + "CausalLM"]}
    top = {k: v for k, v in extra.get("top", {}).items() if k not in LEGACY_ROPE_KEYS}
    top.setdefault("architectures", [arch + "ConditionalGeneration"])
    return {**top, "model_type": family, "tie_word_embeddings": cfg.tie_word_embeddings,
            "text_config": {**text, "model_type": f"{family}_text"}}  # fmt: skip
