"""Shared placement builders for decoder models: pure functions (config in, NEW config out).

A model's ``sharding.py`` composes these instead of writing placements by hand. Nothing here mutates a
config it is given: every ``set_*`` returns a new config made with ``dataclasses.replace``; every
``*_config`` returns a fresh ``ShardingConfig``. Placements are keyed by mesh axis, so one result serves
every layout (``parallelize`` skips axes of degree 1).

Tensor parallel (axis ``tp``; ``residual`` is ``Shard(1)`` with sequence parallel, else ``Replicate()``):

- TP region (an attention block, an MLP): whole tokens inside; the activation gradients inside are
  per-rank partial sums (``Partial``), reduced once at the region's entry. Replicated parameters inside a
  region (MLA's latent projections/norms, GQA's per-head q/k norms) therefore get partial gradients too;
  ``parallelize_decoder`` FSDP-shards them over a mesh that includes ``tp`` so the SUM completes them.
- ``colwise_config``: weight (and bias) ``Shard(0)``, input ``Replicate``, output ``Shard(-1)``
  (whole heads per rank when rows are head-major); ``rowwise_config``: weight ``Shard(1)``, input
  ``Shard(-1)``, output ``Partial`` reduced to ``residual`` (all-reduce, or reduce-scatter with SP).
- ``norm_config``: replicated weight on sequence shards (SP only; without SP a norm is left plain).
- Gated DeltaNet: a TP region over value heads; its fused ``in_proj_qkv`` and ``conv1d`` rows are stored
  grouped by key head (``GatedDeltaNet`` docstring), so one ``Shard(0)`` gives each rank whole heads of Q,
  K and V; the core runs on local tensors (``local_forward``).
- embedding: vocab-sharded, output all-reduced to ``Replicate`` (a multimodal ``embed`` scatters image
  features into whole sequences); with SP the first layer then keeps its sequence chunk.
- MoE: router and routed experts are not tensor-parallel: the MoE runs on the rank's sequence chunk
  (tokens split over ``tp`` like data); the shared expert is a TP MLP over the flattened local tokens.
- head: column-wise; with loss parallel its output stays a vocab-sharded DTensor for the loss.
- LoRA adapters (``Linear.Config.lora``: ``y = x W^T + s (x A^T) B^T``, ``A [r, in]``, ``B [out, r]``) follow
  their base: a column-wise base shards ``lora_B`` ``Shard(0)`` (its output rows) with ``lora_A`` replicated; a
  row-wise base shards ``lora_A`` ``Shard(1)`` (its input columns) with ``lora_B`` replicated, so ``x A^T`` is a
  partial sum reduced with the base's output. No adapter half is ever gathered. The replicated halves are
  DTensors of their Linear: DTensor autograd makes their gradients ``Partial`` over ``tp`` and FSDP completes
  them (``_fsdp_param._get_grad_inner_tensor`` redistributes to ``Replicate``); an adapter of a plain Linear
  inside a region (MLA's ``q_a_proj``) is a plain parameter of a ``tp``-reduced unit, like its base.

Expert parallel (axis ``ep``): routed experts ``Shard(0)`` (whole experts per rank); their adapter stacks
(``[E, r, D]`` ...) too, so each rank holds its experts' adapters. One adapter shared by every expert
(``LoRA.Config.share_experts``, ``E' = 1``) is replicated over ``ep``: each rank's gradient covers the tokens
its experts received, so it is read locally with a ``Partial`` gradient (``local_shard``) and FSDP sums it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from hyper_parallel.config.configurable import Configurable
from hyper_parallel.models.common.decoder import Decoder
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.gated_deltanet import GatedDeltaNet
from hyper_parallel.models.common.gqa import GQAttention
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.mixer import TokenMixer
from hyper_parallel.models.common.mla import MLAttention
from hyper_parallel.models.common.moe import MoE
from hyper_parallel.protocols.module import Module
from hyper_parallel.protocols.sharding import LocalMapConfig, MeshAxisName, NamedPlacement, ShardingConfig

__all__ = [
    "EXPERT_LORA_PARAMS",
    "colwise_config",
    "embedding_config",
    "expert_parallel_params",
    "lm_head_config",
    "norm_config",
    "region_config",
    "rowwise_config",
    "set_decoder_sharding_config",
    "set_dense_ffn_sharding",
    "set_gated_deltanet_sharding",
    "set_gqa_attention_sharding",
    "set_mla_attention_sharding",
    "set_moe_sharding",
    "set_qkv_linear_sharding",
    "without_sharding",
]

TP, EP = MeshAxisName.TP, MeshAxisName.EP

_C = TypeVar("_C", bound=Configurable.Config)

MixerSharding = Callable[[TokenMixer.Config, Placement], TokenMixer.Config]
"""``(mixer config, residual placement) -> new mixer config`` with its placements declared."""


def _partial_input_grad() -> LocalMapConfig:
    # The first positional input's gradient comes back as per-rank contributions (see the module docstring).
    return LocalMapConfig(in_grad_placements=({TP: Partial()},))


def _has_lora(config: Any) -> bool:
    """Whether a ``Linear``/``GroupedExperts`` config carries a LoRA adapter (``lora`` field set)."""
    return getattr(config, "lora", None) is not None


EXPERT_LORA_PARAMS = ("gate_up_proj_lora_A", "gate_up_proj_lora_B", "down_proj_lora_A", "down_proj_lora_B")
"""The adapter stacks of ``GroupedExperts`` (``[E', r, D]``, ``[E', 2F, r]``, ``[E', r, F]``, ``[E', D, r]``)."""


def expert_parallel_params(experts: Any) -> dict[str, NamedPlacement]:
    """Expert-parallel placements of a ``GroupedExperts`` config's parameters: the experts and their adapter
    stacks ``Shard(0)`` on ``ep``; adapters shared by every expert (``share_experts``) replicated."""
    params: dict[str, NamedPlacement] = {"gate_up_proj": {EP: Shard(0)}, "down_proj": {EP: Shard(0)}}
    if _has_lora(experts):
        per_expert = not experts.lora.share_experts
        params |= {name: {EP: Shard(0) if per_expert else Replicate()} for name in EXPERT_LORA_PARAMS}
    return params


# ---------------------------------------------------------------------------------------------------------
# ShardingConfig builders
# ---------------------------------------------------------------------------------------------------------


def colwise_config(
    linear: Linear.Config, *, input_placement: Placement | None = None, in_region: bool = True
) -> ShardingConfig:
    """Column-wise ``Linear``: weight (and bias) ``Shard(0)``, input made ``Replicate``, output ``Shard(-1)``.

    ``input_placement`` is how the caller hands the input in (default ``Replicate``; ``Shard(1)`` for a
    head reading sequence shards). ``in_region``: the linear sits inside a TP region, so its input
    gradient is handed back unreduced (``Partial``) for the region's entry to reduce once.
    """
    params = {"weight": {TP: Shard(0)}} | ({"bias": {TP: Shard(0)}} if linear.bias else {})
    if _has_lora(linear):  # the adapter's output rows follow the base's: B sharded, A whole
        params |= {"lora_A": {TP: Replicate()}, "lora_B": {TP: Shard(0)}}
    return ShardingConfig(
        params=params,
        inputs={"x": {TP: input_placement if input_placement is not None else Replicate()}},
        desired_inputs={"x": {TP: Replicate()}},
        outputs={TP: Shard(-1)},
        local_map=_partial_input_grad() if in_region else None,
    )


def rowwise_config(linear: Linear.Config, *, output_placement: Placement) -> ShardingConfig:
    """Row-wise ``Linear``: weight ``Shard(1)`` (bias replicated), input ``Shard(-1)``, partial output reduced
    to ``output_placement`` (``Replicate``: all-reduce; ``Shard(1)``/``Shard(0)``: reduce-scatter)."""
    params = {"weight": {TP: Shard(1)}} | ({"bias": {TP: Replicate()}} if linear.bias else {})
    if _has_lora(linear):  # the adapter reads the base's input columns: A sharded, x A^T partial like x W^T
        params |= {"lora_A": {TP: Shard(1)}, "lora_B": {TP: Replicate()}}
    return ShardingConfig(
        params=params,
        inputs={"x": {TP: Shard(-1)}},
        outputs={TP: Partial()},
        desired_outputs={TP: output_placement},
    )


def norm_config(*, input_name: str = "x", sequence_dim: int = 1) -> ShardingConfig:
    """Sequence-parallel norm: replicated weight applied to the rank's sequence shard (dim ``sequence_dim``)."""
    return ShardingConfig(params={"weight": {TP: Replicate()}}, inputs={input_name: {TP: Shard(sequence_dim)}})


def region_config(input_name: str, input_placement: Placement) -> ShardingConfig:
    """A TP region (attention block, MLP): input arrives as ``input_placement`` and is made whole
    (``Replicate``); activation gradients inside are partial and reduced once here, at the entry."""
    return ShardingConfig(
        inputs={input_name: {TP: input_placement}},
        desired_inputs={input_name: {TP: Replicate()}},
        local_map=_partial_input_grad(),
    )


def embedding_config() -> ShardingConfig:
    """Vocab-parallel embedding: table ``Shard(0)``, ids replicated, output all-reduced to ``Replicate``."""
    return ShardingConfig(
        params={"weight": {TP: Shard(0)}},
        inputs={"ids": {TP: Replicate()}},
        desired_outputs={TP: Replicate()},
    )


def lm_head_config(linear: Linear.Config, *, input_placement: Placement, loss_parallel: bool) -> ShardingConfig:
    """Column-wise LM head on ``input_placement`` hidden states; with ``loss_parallel`` the logits stay a
    vocab-sharded DTensor (for the parallel cross entropy), else they are gathered to ``Replicate``."""
    head = colwise_config(linear, input_placement=input_placement, in_region=False)
    if loss_parallel:
        return dataclasses.replace(head, use_local_output=False)
    return dataclasses.replace(head, desired_outputs={TP: Replicate()})


# ---------------------------------------------------------------------------------------------------------
# Config transformers: config in, new config out
# ---------------------------------------------------------------------------------------------------------


def _rebuilt(value: Any) -> Any:
    if isinstance(value, Configurable.Config):
        changes = {f.name: _rebuilt(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        if isinstance(value, Module.Config):
            changes["sharding_config"] = None
        return dataclasses.replace(value, **changes)
    if isinstance(value, list):
        return [_rebuilt(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_rebuilt(v) for v in value)
    if isinstance(value, dict):
        return {k: _rebuilt(v) for k, v in value.items()}
    return value


def without_sharding(config: _C) -> _C:
    """A new config tree equal to ``config`` with every ``sharding_config`` cleared (no config object shared)."""
    return _rebuilt(config)


def _with(config: _C, sharding_config: ShardingConfig | None) -> _C:
    return dataclasses.replace(config, sharding_config=sharding_config)


def set_qkv_linear_sharding(config: _C, names: Sequence[str]) -> _C:
    """``config`` with its ``Linear`` children ``names`` column-wise (whole heads per rank); children that
    are None (an unused branch, e.g. MLA's ``q_proj`` under ``q_lora_rank``) are skipped."""
    changes = {}
    for name in names:
        if not hasattr(config, name):
            raise AttributeError(f"{type(config).__qualname__} has no field {name!r}: fix the projection names")
        linear = getattr(config, name)
        if linear is not None:
            changes[name] = _with(linear, colwise_config(linear))
    return dataclasses.replace(config, **changes)


def set_gqa_attention_sharding(attn: _C, *, residual: Placement) -> _C:
    """GQA over tensor parallel: ``q_proj``/``k_proj``/``v_proj`` column-wise over heads, ``o_proj`` row-wise
    back to ``residual``; per-head ``q_norm``/``k_norm`` stay replicated (plain parameters in the region).

    Takes ``GQAttention.Config`` or any mixer config with the same projection fields whose rows are
    head-major (e.g. gated attention, whose ``q_proj`` rows are ``[q_h | gate_h]`` per head). The layout
    must give every rank whole key/value heads: tp divides ``n_kv_heads`` (check it in the model's
    ``validate_layout``).
    """
    attn = set_qkv_linear_sharding(attn, ("q_proj", "k_proj", "v_proj"))
    norms = {
        name: _with(norm, None)
        for name in ("q_norm", "k_norm")
        if (norm := getattr(attn, name, None)) is not None
    }
    return dataclasses.replace(
        attn,
        sharding_config=region_config("x_BTD", residual),
        o_proj=_with(attn.o_proj, rowwise_config(attn.o_proj, output_placement=residual)),
        **norms,
    )


def set_mla_attention_sharding(attn: MLAttention.Config, *, residual: Placement) -> MLAttention.Config:
    """MLA over tensor parallel: ``q_proj``/``q_b_proj`` and ``kv_b_proj`` column-wise (rows are head-major),
    ``o_proj`` row-wise back to ``residual``. The latent projections/norms (``q_a_*``, ``kv_a_*``) stay
    replicated; the shared rope key feeds heads of every rank, so its gradient is partial like the rest."""
    attn = set_qkv_linear_sharding(attn, ("q_proj", "q_b_proj", "kv_b_proj"))
    return dataclasses.replace(
        attn,
        sharding_config=region_config("x_BTD", residual),
        o_proj=_with(attn.o_proj, rowwise_config(attn.o_proj, output_placement=residual)),
    )


def set_gated_deltanet_sharding(gdn: GatedDeltaNet.Config, *, residual: Placement) -> GatedDeltaNet.Config:
    """Gated DeltaNet over tensor parallel, by heads: ``in_proj_qkv`` (rows grouped by key head),
    ``in_proj_z``/``in_proj_b``/``in_proj_a`` column-wise, ``conv1d.weight``, ``dt_bias`` and ``A_log``
    ``Shard(0)``, ``out_proj`` row-wise back to ``residual``; the gated ``norm`` (one weight over Dv, shared
    by all heads) stays replicated. The mixer's forward runs on local tensors (``local_forward``): the
    recurrence sees the rank's heads only. tp must divide ``num_k_heads`` (so also ``num_v_heads``).
    """
    gdn = set_qkv_linear_sharding(gdn, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    per_head = {"dt_bias": {TP: Shard(0)}, "A_log": {TP: Shard(0)}}
    region = dataclasses.replace(region_config("x_BTD", residual), params=per_head, local_forward=True)
    return dataclasses.replace(
        gdn,
        sharding_config=region,
        conv1d=_with(gdn.conv1d, ShardingConfig(params={"weight": {TP: Shard(0)}}, local_forward=True)),
        norm=_with(gdn.norm, None),
        out_proj=_with(gdn.out_proj, rowwise_config(gdn.out_proj, output_placement=residual)),
    )


def set_dense_ffn_sharding(ffn: FeedForward.Config, *, token_placement: Placement) -> FeedForward.Config:
    """SwiGLU MLP as a TP region whose input arrives as ``token_placement`` (``Replicate``, a sequence shard
    ``Shard(1)``, or a token shard ``Shard(0)``): ``gate_proj``/``up_proj`` column-wise, ``down_proj``
    row-wise back to ``token_placement``."""
    return dataclasses.replace(
        ffn,
        sharding_config=region_config("x", token_placement),
        gate_proj=_with(ffn.gate_proj, colwise_config(ffn.gate_proj)),
        up_proj=_with(ffn.up_proj, colwise_config(ffn.up_proj)),
        down_proj=_with(ffn.down_proj, rowwise_config(ffn.down_proj, output_placement=token_placement)),
    )


def set_moe_sharding(moe: MoE.Config, *, enable_sp: bool, ep_degree: int) -> MoE.Config:
    """MoE on the rank's sequence chunk (not tensor-parallel; without SP it slices its input and gathers its
    output), shared expert a TP MLP over the flattened local tokens, routed experts ``Shard(0)`` on ``ep``
    when ``ep_degree > 1``. The ``token_mask`` (the decoder hands it whole, ``[B, T]``) is cut to the same
    sequence chunk."""
    changes: dict[str, Any] = {}
    # the padding mask of this rank's chunk: the router statistics leave padding out
    mask_in, mask_want = {"token_mask": {TP: Replicate()}}, {"token_mask": {TP: Shard(1)}}
    if not enable_sp:
        # Route this rank's sequence chunk only (SP already hands the MoE a chunk).
        changes["sharding_config"] = ShardingConfig(
            inputs={"x": {TP: Replicate()}, **mask_in},
            desired_inputs={"x": {TP: Shard(1)}, **mask_want},
            outputs={TP: Shard(1)},
            desired_outputs={TP: Replicate()},
        )
    else:
        changes["sharding_config"] = ShardingConfig(inputs=mask_in, desired_inputs=mask_want)
    if moe.shared_experts is not None:
        # MoE.forward hands the shared expert the flattened local tokens [T_local, D].
        changes["shared_experts"] = set_dense_ffn_sharding(moe.shared_experts, token_placement=Shard(0))
    if ep_degree > 1:
        changes["experts"] = _with(moe.experts, ShardingConfig(params=expert_parallel_params(moe.experts)))
    return dataclasses.replace(moe, **changes)


_GQA_FIELDS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})


def _default_mixer_sharding(mixer: TokenMixer.Config, residual: Placement) -> TokenMixer.Config:
    if isinstance(mixer, MLAttention.Config):
        return set_mla_attention_sharding(mixer, residual=residual)
    if isinstance(mixer, GatedDeltaNet.Config):
        return set_gated_deltanet_sharding(mixer, residual=residual)
    if isinstance(mixer, GQAttention.Config) or _GQA_FIELDS <= {f.name for f in dataclasses.fields(mixer)}:
        return set_gqa_attention_sharding(mixer, residual=residual)
    raise TypeError(
        f"no default tensor-parallel placements for a {type(mixer).__qualname__} mixer: pass "
        "mixer_sharding=(mixer_config, residual) -> new mixer config to set_decoder_sharding_config"
    )


def set_decoder_sharding_config(
    config: Decoder.Config,
    *,
    loss_parallel: bool,
    enable_sp: bool,
    ep_degree: int,
    mixer_sharding: MixerSharding | None = None,
) -> Decoder.Config:
    """A new ``Decoder`` config tree with every module's placements declared; ``config`` is untouched.

    The result depends on the arguments only: placements already in ``config`` are dropped first. Mixers
    are MLA, or GQA-style (``q_proj``/``k_proj``/``v_proj``/``o_proj`` fields) by default; ``mixer_sharding``
    handles others (a linear-attention mixer). MLPs are ``FeedForward`` or ``MoE``.
    Modules a subclass adds (e.g. GlmImageMoe's codebook) are left without placements.
    """
    cfg = without_sharding(config)
    residual: Placement = Shard(1) if enable_sp else Replicate()
    shard_mixer = mixer_sharding or _default_mixer_sharding

    def norm() -> ShardingConfig | None:  # a fresh config per module: no object is shared in the tree
        return norm_config() if enable_sp else None

    def shard_layer(name: str, layer: Any, *, first: bool) -> Any:
        mlp = layer.mlp
        if isinstance(mlp, MoE.Config):
            mlp = set_moe_sharding(mlp, enable_sp=enable_sp, ep_degree=ep_degree)
        elif isinstance(mlp, FeedForward.Config):
            mlp = set_dense_ffn_sharding(mlp, token_placement=residual)
        else:
            raise TypeError(f"{name}.mlp is {type(mlp).__qualname__}; expected FeedForward or MoE")
        layer_sc = None
        if enable_sp and first:
            # The embedding output is whole (a multimodal embed indexes whole sequences): keep this rank's chunk.
            layer_sc = ShardingConfig(inputs={"x_BTD": {TP: Replicate()}}, desired_inputs={"x_BTD": {TP: Shard(1)}})
        return dataclasses.replace(
            layer,
            sharding_config=layer_sc,
            self_attn=shard_mixer(layer.self_attn, residual),
            mlp=mlp,
            input_layernorm=_with(layer.input_layernorm, norm()),
            post_attention_layernorm=_with(layer.post_attention_layernorm, norm()),
        )

    layers = [shard_layer(f"layers.{i}", layer, first=i == 0) for i, layer in enumerate(cfg.layers)]
    changes: dict[str, Any] = {}
    if getattr(cfg, "mtp", None) is not None:
        changes["mtp"] = _mtp_sharding(cfg.mtp, shard_layer, enable_sp=enable_sp, norm=norm)
    return dataclasses.replace(
        cfg,
        embed_tokens=_with(cfg.embed_tokens, embedding_config()),
        layers=layers,
        norm=_with(cfg.norm, norm()),
        lm_head=_with(cfg.lm_head, lm_head_config(cfg.lm_head, input_placement=residual, loss_parallel=loss_parallel)),
        **changes,
    )


def _mtp_sharding(mtp: Any, shard_layer: Callable[..., Any], *, enable_sp: bool, norm: Callable[[], Any]) -> Any:
    """The MTP block (``models/common/mtp.py``) under TP. Its decoder layer is placed like a trunk layer. The
    trunk's final-normed hidden state reaches it as the residual stream is (sequence-sharded with SP); the
    next-token embedding arrives whole (the vocab-parallel embedding's output) and is cut to the rank's
    sequence chunk on entry, as layer 0 does. With SP the pre-norms and ``fc`` then run on the rank's tokens
    with replicated weights (DTensor sums their partial weight gradients over tp); without SP every tp rank
    computes them whole and identically (plain modules)."""
    fc_sc = ShardingConfig(params={"weight": {TP: Replicate()}}, inputs={"x": {TP: Shard(1)}}) if enable_sp else None
    block_sc = None
    if enable_sp:
        block_sc = ShardingConfig(inputs={"e_BTD": {TP: Replicate()}}, desired_inputs={"e_BTD": {TP: Shard(1)}})
    return dataclasses.replace(
        mtp,
        sharding_config=block_sc,
        pre_fc_norm_embedding=_with(mtp.pre_fc_norm_embedding, norm()),
        pre_fc_norm_hidden=_with(mtp.pre_fc_norm_hidden, norm()),
        fc=_with(mtp.fc, fc_sc),
        layers=[shard_layer(f"mtp.layers.{i}", layer, first=False) for i, layer in enumerate(mtp.layers)],
        norm=_with(mtp.norm, norm()),
    )
