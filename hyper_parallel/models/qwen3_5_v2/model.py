"""Qwen3.5 text decoder (HF ``Qwen3_5TextModel`` + ``lm_head``): hybrid Gated DeltaNet / gated attention.

    h      = embed_tokens(input_ids)                                   (no scaling)
    layer i: h = h + mixer_i(Qwen3_5RMSNorm(h));  h = h + mlp_i(Qwen3_5RMSNorm(h))
             mixer_i = GatedDeltaNet if layer_types[i] == "linear_attention" else GatedAttention
             mlp_i   = SwiGLU (dense family) or MoE with a sigmoid-gated shared expert (MoE family)
    logits = lm_head(Qwen3_5RMSNorm(h))

One parameterised builder, ``qwen3_5_config``, turns HF-style hyper-parameters into the config tree of
either family (``num_experts`` set = MoE); ``Config.from_hf`` / ``to_hf`` convert to and from the HF
``config.json`` (``Qwen3_5(Moe)ForCausalLM`` text configs and ``Qwen3_5(Moe)ForConditionalGeneration``
configs, whose non-text parts are kept in ``hf_extra`` and written back unchanged).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import tyro

from hyper_parallel.models.common.attention import VarlenAttention
from hyper_parallel.models.common.block import TransformerBlock
from hyper_parallel.models.common.decoder import Decoder
from hyper_parallel.models.common.embedding import Embedding
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.gated_attention import GatedAttention
from hyper_parallel.models.common.gated_delta_rule import GatedDeltaRule
from hyper_parallel.models.common.gated_deltanet import CausalConv1d, GatedDeltaNet
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.moe import GroupedExperts, MoE, Router
from hyper_parallel.models.common.qwen3_5_norm import GatedRMSNorm, Qwen3_5RMSNorm
from hyper_parallel.models.common.rope import RoPE
from hyper_parallel.protocols.param_init import NormalInit

__all__ = ["LayerType", "Qwen3_5Model", "Qwen3_5TransformerBlock", "layer_types_of", "qwen3_5_config"]

LayerType = Literal["linear_attention", "full_attention"]


class Qwen3_5TransformerBlock(TransformerBlock):
    """A Qwen3.5 decoder layer: Gated DeltaNet or gated attention, then a dense MLP or an MoE."""

    @dataclass(kw_only=True, slots=True)
    class Config(TransformerBlock.Config):
        pass

    @property
    def layer_type(self) -> LayerType:
        """HF ``layer_types[i]`` of this layer (HF names the mixer ``linear_attn`` or ``self_attn`` after it)."""
        return "linear_attention" if isinstance(self.self_attn, GatedDeltaNet) else "full_attention"


def layer_types_of(config: Decoder.Config) -> list[LayerType]:
    """HF ``layer_types`` of a config tree (from each layer's mixer)."""
    return [
        "linear_attention" if isinstance(layer.self_attn, GatedDeltaNet.Config) else "full_attention"
        for layer in config.layers
    ]


class Qwen3_5Model(Decoder):
    """Qwen3.5 text LM; ``model(input_ids)`` returns logits (``ModelOutput`` when an MoE aux loss is on)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        max_position_embeddings: int = 262144
        """Longest position the checkpoint was trained for (kept for the HF config)."""
        hf_extra: Annotated[dict[str, Any], tyro.conf.Suppress] = field(default_factory=dict)
        """HF config fields not modelled here (``text``: other text_config keys; ``top``: the non-text part
        of a ConditionalGeneration config, e.g. ``vision_config``), written back unchanged on export."""

        @classmethod
        def from_hf(cls, hf: dict[str, Any]) -> Qwen3_5Model.Config:
            """From an HF ``config.json`` dict (``qwen3_5_text``, or ``qwen3_5`` with ``text_config``)."""
            if "moe" in str(hf.get("model_type")):
                raise ValueError(
                    f"config.json model_type={hf.get('model_type')!r} is a Qwen3.5-MoE config: load it with the "
                    "qwen3_5_moe package (hyper_parallel.models.qwen3_5_moe_v2.from_pretrained)"
                )
            return config_from_hf(cls, hf)

        def to_hf(self, *, text_only: bool | None = None) -> dict[str, Any]:
            """The HF ``config.json`` dict; ``text_only`` (default: unless loaded from a VL folder) writes the
            ``Qwen3_5(Moe)ForCausalLM`` text config, else the ConditionalGeneration config."""
            return config_to_hf(self, text_only=text_only)

        @property
        def is_moe(self) -> bool:
            """Whether the layers' MLPs are MoEs (the ``qwen3_5_moe`` family)."""
            return any(isinstance(layer.mlp, MoE.Config) for layer in self.layers)

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.hf_passthrough: dict = {}
        """HF keys we do not model (``model.visual.*``, ``mtp.*``), written back unchanged by save_pretrained."""


C = TypeVar("C", bound=Qwen3_5Model.Config)


def qwen3_5_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    linear_num_key_heads: int,
    linear_num_value_heads: int,
    linear_key_head_dim: int,
    linear_value_head_dim: int,
    linear_conv_kernel_dim: int = 4,
    intermediate_size: int | None = None,
    num_experts: int | None = None,
    num_experts_per_tok: int = 8,
    moe_intermediate_size: int = 512,
    shared_expert_intermediate_size: int | None = 512,
    router_aux_loss_coef: float = 0.0,
    layer_types: Sequence[LayerType] | None = None,
    full_attention_interval: int = 4,
    rope_theta: float = 1e7,
    partial_rotary_factor: float = 0.25,
    mrope_section: Sequence[int] | None = (11, 11, 10),
    rms_norm_eps: float = 1e-6,
    attention_bias: bool = False,
    initializer_range: float = 0.02,
    pad_token_id: int | None = None,
    max_position_embeddings: int = 262144,
    grouped_mm_impl: str = "auto",
    attention_backend: Literal["auto", "sdpa", "flash"] = "auto",
    chunk_size: int = 64,
    hf_extra: dict[str, Any] | None = None,
    config_cls: type[C] = Qwen3_5Model.Config,
    block_cls: type[Qwen3_5TransformerBlock] = Qwen3_5TransformerBlock,
) -> C:
    """The one flavor builder of both families: HF Qwen3.5 (MoE) text hyper-parameters -> the config tree.

    ``num_experts`` None builds the dense family (SwiGLU of ``intermediate_size``), else every layer is an
    MoE (softmax top-k router, always renormalised; shared expert gated by ``sigmoid(shared_expert_gate)``;
    ``router_aux_loss_coef > 0`` adds the Switch load-balancing loss). ``layer_types`` default: full
    attention iff ``(i + 1) % full_attention_interval == 0`` (HF).
    """
    types = list(layer_types) if layer_types is not None else [
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
        for i in range(num_hidden_layers)
    ]  # fmt: skip
    if len(types) != num_hidden_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(
            f"layer_types must list 'linear_attention'/'full_attention' for each of the {num_hidden_layers} "
            f"layers, got {types}"
        )
    if num_experts is None and intermediate_size is None:
        raise ValueError("qwen3_5_config: give intermediate_size (dense family) or num_experts (MoE family)")

    def linear(bias: bool = False) -> Linear.Config:
        return Linear.Config(bias=bias, param_init=NormalInit.Config(std=initializer_range))

    def norm() -> Qwen3_5RMSNorm.Config:
        return Qwen3_5RMSNorm.Config(eps=rms_norm_eps)

    def ffn(hidden: int) -> FeedForward.Config:
        return FeedForward.Config(hidden_dim=hidden, gate_proj=linear(), up_proj=linear(), down_proj=linear())

    def mixer(kind: str) -> GatedDeltaNet.Config | GatedAttention.Config:
        if kind == "linear_attention":
            return GatedDeltaNet.Config(
                num_k_heads=linear_num_key_heads, num_v_heads=linear_num_value_heads,
                head_k_dim=linear_key_head_dim, head_v_dim=linear_value_head_dim,
                in_proj_qkv=linear(), in_proj_z=linear(), in_proj_b=linear(), in_proj_a=linear(),
                conv1d=CausalConv1d.Config(kernel_size=linear_conv_kernel_dim,
                                           param_init=NormalInit.Config(std=initializer_range)),
                norm=GatedRMSNorm.Config(eps=rms_norm_eps), out_proj=linear(),
                delta_rule=GatedDeltaRule.Config(chunk_size=chunk_size),
            )  # fmt: skip
        return GatedAttention.Config(
            n_heads=num_attention_heads, n_kv_heads=num_key_value_heads, head_dim=head_dim,
            q_proj=linear(attention_bias), k_proj=linear(attention_bias), v_proj=linear(attention_bias),
            o_proj=linear(attention_bias), q_norm=norm(), k_norm=norm(),
            rope=RoPE.Config(theta=rope_theta, layout="half", partial_rotary_factor=partial_rotary_factor,
                             mrope_section=tuple(mrope_section) if mrope_section is not None else None),
            inner_attention=VarlenAttention.Config(backend=attention_backend),
        )  # fmt: skip

    def mlp() -> FeedForward.Config | MoE.Config:
        if num_experts is None:
            return ffn(intermediate_size)
        shared = shared_expert_intermediate_size
        return MoE.Config(
            num_experts=num_experts,
            gate=Router.Config(top_k=num_experts_per_tok, score_func="softmax", norm_topk_prob=True,
                               use_bias_correction=False, param_init=NormalInit.Config(std=initializer_range)),
            experts=GroupedExperts.Config(hidden_dim=moe_intermediate_size, grouped_mm_impl=grouped_mm_impl,
                                          param_init=NormalInit.Config(std=initializer_range)),
            shared_experts=ffn(shared) if shared else None,
            shared_expert_gate=linear() if shared else None,
            router_aux_loss_coef=router_aux_loss_coef,
        )  # fmt: skip

    layers = [
        block_cls.Config(
            self_attn=mixer(kind), mlp=mlp(), input_layernorm=norm(), post_attention_layernorm=norm()
        )
        for kind in types
    ]
    return config_cls(
        vocab_size=vocab_size,
        dim=hidden_size,
        layers=layers,
        embed_tokens=Embedding.Config(padding_idx=pad_token_id, param_init=NormalInit.Config(std=initializer_range)),
        norm=norm(),
        lm_head=linear(),
        max_position_embeddings=max_position_embeddings,
        hf_extra=dict(hf_extra or {}),
    )


# ---- HF config.json <-> Config ---------------------------------------------------------------

_TEXT_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "layer_types", "rms_norm_eps", "attention_bias", "initializer_range",
    "pad_token_id", "max_position_embeddings",
)  # fmt: skip
# HF Qwen3_5(Moe)TextConfig defaults for keys a config.json may omit.
_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=248320, num_attention_heads=16, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    attention_bias=False, initializer_range=0.02, max_position_embeddings=32768,
)  # fmt: skip
_VL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def config_from_hf(
    config_cls: type[C], hf: dict[str, Any], block_cls: type[Qwen3_5TransformerBlock] = Qwen3_5TransformerBlock
) -> C:
    model_type = hf.get("model_type")
    if model_type in _VL_TYPES:
        text = dict(hf.get("text_config") or {})
        top = {k: v for k, v in hf.items() if k != "text_config"}
    elif model_type in _VL_TYPES.values():
        text, top = dict(hf), None
    else:
        raise ValueError(
            f"config.json model_type={model_type!r}: expected one of {sorted(_VL_TYPES) + sorted(_VL_TYPES.values())}"
        )
    if text.get("tie_word_embeddings"):
        raise NotImplementedError("tie_word_embeddings=True checkpoints are not supported yet (lm_head is untied)")
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={text['hidden_act']!r}: Qwen3.5 blocks implement silu only")
    moe = "moe" in (model_type or "")
    kwargs = {**_TEXT_DEFAULTS, **{k: text[k] for k in _TEXT_KEYS if k in text}}
    if moe:
        kwargs.setdefault("num_experts", 256)
        kwargs.setdefault("num_experts_per_tok", 8)
        kwargs.setdefault("moe_intermediate_size", 512)
        kwargs.setdefault("shared_expert_intermediate_size", 512)
        kwargs.pop("intermediate_size", None)
        # HF adds the aux loss only with output_router_logits; we train with it iff the coefficient is > 0.
        kwargs["router_aux_loss_coef"] = float(text.get("router_aux_loss_coef", 0.001)) if text.get(
            "output_router_logits") else 0.0  # fmt: skip
    else:
        kwargs.setdefault("intermediate_size", 12288)
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
            kwargs.pop(key, None)
    if "hidden_size" not in kwargs or "num_hidden_layers" not in kwargs:
        raise ValueError("config.json is missing hidden_size / num_hidden_layers (in text_config for a VL folder)")
    rope = dict(text.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"rope_parameters.rope_type={rope['rope_type']!r}: only 'default' RoPE loads")
    section = rope.get("mrope_section", [11, 11, 10])
    skip = set(_TEXT_KEYS) | {"rope_parameters", "model_type", "architectures", "router_aux_loss_coef",
                              "output_router_logits", "tie_word_embeddings", "hidden_act"}  # fmt: skip
    extra = {"text": {k: v for k, v in text.items() if k not in skip and not k.startswith("_")},
             "rope": {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor", "mrope_section")},
             "aux": {k: text[k] for k in ("router_aux_loss_coef", "output_router_logits") if k in text}}  # fmt: skip
    if top is not None:
        extra["top"] = top
    return qwen3_5_config(
        **kwargs,
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.25)),
        mrope_section=section,
        hf_extra=extra,
        config_cls=config_cls,
        block_cls=block_cls,
    )


def config_to_hf(cfg: Qwen3_5Model.Config, *, text_only: bool | None = None) -> dict[str, Any]:
    extra = cfg.hf_extra
    if text_only is None:
        text_only = "top" not in extra
    layer_types = layer_types_of(cfg)
    gdn = next((layer.self_attn for layer in cfg.layers if isinstance(layer.self_attn, GatedDeltaNet.Config)), None)
    attn = next((layer.self_attn for layer in cfg.layers if isinstance(layer.self_attn, GatedAttention.Config)), None)
    mlp = cfg.layers[0].mlp
    text: dict[str, Any] = {
        **extra.get("text", {}),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": len(cfg.layers),
        "layer_types": layer_types,
        "rms_norm_eps": cfg.norm.eps,
        "hidden_act": "silu",
        "initializer_range": cfg.lm_head.param_init.std if isinstance(cfg.lm_head.param_init, NormalInit.Config) else 0.02,
        "pad_token_id": cfg.embed_tokens.padding_idx,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False,
    }
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
            rope_parameters={**extra.get("rope", {"rope_type": "default"}), "rope_theta": rope.theta,
                             "partial_rotary_factor": rope.partial_rotary_factor,
                             **({"mrope_section": list(rope.mrope_section)} if rope.mrope_section else {})},
        )  # fmt: skip
    if isinstance(mlp, MoE.Config):
        shared = mlp.shared_experts
        text.update(
            num_experts=mlp.num_experts, num_experts_per_tok=mlp.gate.top_k, moe_intermediate_size=mlp.experts.hidden_dim,
            shared_expert_intermediate_size=shared.hidden_dim if shared is not None else 0,
        )  # fmt: skip
        aux = dict(extra.get("aux", {}))
        if mlp.router_aux_loss_coef > 0:
            aux = {"router_aux_loss_coef": mlp.router_aux_loss_coef, "output_router_logits": True}
        text.update(aux)
    else:
        text["intermediate_size"] = mlp.hidden_dim
    family = "qwen3_5_moe" if cfg.is_moe else "qwen3_5"
    arch = "Qwen3_5MoeFor" if cfg.is_moe else "Qwen3_5For"
    if text_only:
        return {**text, "model_type": f"{family}_text", "architectures": [arch + "CausalLM"]}
    top = dict(extra.get("top", {}))
    top.setdefault("architectures", [arch + "ConditionalGeneration"])
    return {**top, "model_type": family, "text_config": {**text, "model_type": f"{family}_text"}}
