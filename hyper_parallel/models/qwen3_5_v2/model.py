"""Qwen3.5 text decoder (HF ``Qwen3_5TextModel`` + ``lm_head``): hybrid Gated DeltaNet / gated attention.

    h      = embed_tokens(input_ids)                                   (no scaling)
    layer i: h = h + mixer_i(Qwen3_5RMSNorm(h));  h = h + mlp_i(Qwen3_5RMSNorm(h))
             mixer_i = GatedDeltaNet if layer_types[i] == "linear_attention" else GatedAttention
             mlp_i   = SwiGLU (dense family) or MoE with a sigmoid-gated shared expert (MoE family)
    logits = lm_head(Qwen3_5RMSNorm(h))

One parameterised builder, ``qwen3_5_config``, turns HF-style hyper-parameters into the config tree of
either family (``num_experts`` set = MoE); ``hf_config.py`` converts to and from the HF ``config.json``
(``Qwen3_5(Moe)ForCausalLM`` text configs and ``Qwen3_5(Moe)ForConditionalGeneration`` configs, whose
non-text parts are kept in ``hf_extra`` and written back unchanged).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
from hyper_parallel.models.common.mtp import MTP, mtp_config_like, with_mtp
from hyper_parallel.models.common.qwen3_5_norm import GatedRMSNorm, Qwen3_5RMSNorm
from hyper_parallel.models.common.rope import RoPE
from hyper_parallel.protocols.param_init import NormalInit

__all__ = [
    "MTP_LOSS_WEIGHT",
    "LayerType",
    "Qwen3_5Model",
    "Qwen3_5TransformerBlock",
    "layer_types_of",
    "qwen3_5_config",
    "qwen3_5_with_mtp",
]

LayerType = Literal["linear_attention", "full_attention"]

MTP_LOSS_WEIGHT = 0.1
"""Default weight of the MTP loss, for Qwen3.5 dense and MoE (and the Qwen3.5-MoE VL model): Megatron-Bridge's
value, ``config.mtp_loss_scaling_factor = 0.1`` in ``apply_qwen35_common_config``
(``src/megatron/bridge/models/qwen/qwen35_common.py``, used by the Qwen3.5 text bridges) and
``provider.mtp_loss_scaling_factor = 0.1`` in ``src/megatron/bridge/models/qwen_vl/qwen35_vl_bridge.py``."""


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

        @property
        def is_moe(self) -> bool:
            """Whether the layers' MLPs are MoEs (the ``qwen3_5_moe`` family)."""
            return any(isinstance(layer.mlp, MoE.Config) for layer in self.layers)

        def mtp_block(self) -> MTP.Config:
            """``use_mtp=True``: the Qwen3.5 MTP block (``qwen3_5_with_mtp``, its default loss weight)."""
            return qwen3_5_with_mtp(self.without_options()).mtp

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.hf_passthrough: dict = {}
        """HF keys we do not model (``model.visual.*``, ``mtp.*``), written back unchanged by save_pretrained."""


C = TypeVar("C", bound=Qwen3_5Model.Config)


def qwen3_5_with_mtp(config: C, *, loss_weight: float = MTP_LOSS_WEIGHT) -> C:
    """``config`` (e.g. read from an HF folder whose ``mtp_num_hidden_layers`` is 1) with the MTP block on: one
    gated-attention layer like the trunk's full-attention layers (vLLM ``qwen3_5_mtp.py``)."""
    full = [i for i, t in enumerate(layer_types_of(config)) if t == "full_attention"]
    if not full:
        raise ValueError("the Qwen3.5 MTP layer is a full-attention layer, but the config has none to copy")
    return with_mtp(config, layer_index=full[0], loss_weight=loss_weight)


def mtp_reader(read: Callable[[Mapping[str, Any]], C]) -> Callable[[Mapping[str, Any]], C]:
    """An HF config reader that also turns the MTP block on, with the checkpoint's ``mtp_num_hidden_layers``
    (``from_pretrained(path, mtp=True)``)."""

    def reader(hf: Mapping[str, Any]) -> C:
        count = (hf.get("text_config") or hf).get("mtp_num_hidden_layers", 0)
        if not count:
            raise ValueError(
                "mtp=True but config.json has no mtp_num_hidden_layers (the checkpoint ships no MTP block): load "
                "without mtp, or start a fresh block with qwen3_5_with_mtp(config)"
            )
        if count != 1:
            raise NotImplementedError(f"config.json mtp_num_hidden_layers={count}: only 1 MTP layer is implemented")
        return qwen3_5_with_mtp(read(hf))

    return reader


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
    tie_word_embeddings: bool = False,
    grouped_mm_impl: str = "auto",
    attention_backend: Literal["auto", "sdpa", "flash"] = "auto",
    chunk_size: int = 64,
    hf_extra: dict[str, Any] | None = None,
    mtp_num_hidden_layers: int = 0,
    mtp_loss_weight: float = MTP_LOSS_WEIGHT,
    config_cls: type[C] = Qwen3_5Model.Config,
    block_cls: type[Qwen3_5TransformerBlock] = Qwen3_5TransformerBlock,
) -> C:
    """The one flavor builder of both families: HF Qwen3.5 (MoE) text hyper-parameters -> the config tree.

    ``num_experts`` None builds the dense family (SwiGLU of ``intermediate_size``), else every layer is an
    MoE (softmax top-k router, always renormalised; shared expert gated by ``sigmoid(shared_expert_gate)``;
    ``router_aux_loss_coef > 0`` adds the Switch load-balancing loss). ``layer_types`` default: full
    attention iff ``(i + 1) % full_attention_interval == 0`` (HF). ``mtp_num_hidden_layers`` (HF's field;
    0 = off, released checkpoints have 1) adds the MTP block (``mtp.*``: a gated-attention layer with the
    family's MLP, vLLM ``qwen3_5_mtp.py``) trained with weight ``mtp_loss_weight``. ``tie_word_embeddings``
    makes the LM head the embedding table (Qwen3.5-0.8B/2B/4B).
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
    mtp = None
    if mtp_num_hidden_layers:
        if mtp_num_hidden_layers != 1:
            raise NotImplementedError(f"mtp_num_hidden_layers={mtp_num_hidden_layers}: only 1 MTP layer is implemented")
        mtp_layer = block_cls.Config(
            self_attn=mixer("full_attention"), mlp=mlp(), input_layernorm=norm(), post_attention_layernorm=norm()
        )
        mtp = mtp_config_like(mtp_layer, norm=norm(), fc=linear(), loss_weight=mtp_loss_weight)
    return config_cls(
        vocab_size=vocab_size,
        dim=hidden_size,
        layers=layers,
        mtp=mtp,
        embed_tokens=Embedding.Config(padding_idx=pad_token_id, param_init=NormalInit.Config(std=initializer_range)),
        norm=norm(),
        lm_head=linear(),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        hf_extra=dict(hf_extra or {}),
    )
