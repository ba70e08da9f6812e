"""Declared placements of GlmImageMoe: a pure function (model config, TP/EP options) -> a new config.

Tensor parallel (axis ``tp``), with the residual stream sharded along the sequence when SP is on:

- embeddings: vocab-sharded (``Shard(0)``), output all-reduced to ``Replicate`` (the image scatter
  needs whole sequences); layer 0 then keeps its sequence shard (``Replicate -> Shard(1)``).
- norms: replicated weights on sequence shards (SP), else untouched.
- MLA: ``q_b_proj``/``q_proj`` and ``kv_b_proj`` column-wise (whole heads per rank, rows are
  head-major), ``o_proj`` row-wise; the latent projections/norms stay replicated. Inside the block
  activation gradients are per-rank partial sums (the shared rope key feeds heads of every rank),
  reduced once at the block's entry; ``parallelize`` reduces the replicated latent weights over a
  mesh that includes ``tp``.
- dense MLP and shared experts: ``gate_proj``/``up_proj`` column-wise, ``down_proj`` row-wise.
- MoE: router and routed experts are not tensor-parallel: the MoE runs on the rank's sequence shard
  (tokens split across ``tp`` like data), and ``parallelize`` shards router/experts with FSDP over
  ``efsdp`` (which includes ``tp``) so their gradients sum over those ranks.
- head: column-wise; with loss parallel its output stays a vocab-sharded DTensor for the loss.

Expert parallel (axis ``ep``): ``experts.gate_up_proj``/``down_proj`` ``Shard(0)`` (whole experts per rank).
"""

from __future__ import annotations

import copy

from torch.distributed.tensor import Partial, Replicate, Shard

from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.mla import MLAttention
from hyper_parallel.models.common.moe import MoE
from hyper_parallel.models.glm_image_moe_v2.model import GlmImageMoeModel
from hyper_parallel.protocols.sharding import LocalMapConfig, MeshAxisName, ShardingConfig

__all__ = ["set_glm_image_moe_sharding_config"]

TP, EP = MeshAxisName.TP, MeshAxisName.EP


# Inside an attention block or an MLP, activation gradients are per-rank contributions (``Partial``):
# column-wise projections hand their input gradient back unreduced and the block's entry reduces once.
_PARTIAL_INPUT_GRAD = LocalMapConfig(in_grad_placements=({TP: Partial()},))


def _colwise(linear: Linear.Config, *, input_placement=None, in_region: bool = True) -> ShardingConfig:
    params = {"weight": {TP: Shard(0)}} | ({"bias": {TP: Shard(0)}} if linear.bias else {})
    return ShardingConfig(
        params=params,
        inputs={"x": {TP: input_placement or Replicate()}},
        desired_inputs={"x": {TP: Replicate()}},
        outputs={TP: Shard(-1)},
        local_map=_PARTIAL_INPUT_GRAD if in_region else None,
    )


def _rowwise(linear: Linear.Config, *, output_placement) -> ShardingConfig:
    params = {"weight": {TP: Shard(1)}} | ({"bias": {TP: Replicate()}} if linear.bias else {})
    return ShardingConfig(
        params=params,
        inputs={"x": {TP: Shard(-1)}},
        outputs={TP: Partial()},
        desired_outputs={TP: output_placement},
    )


def _region(input_name: str, input_placement) -> ShardingConfig:
    """A TP block (attention, MLP): whole tokens inside, partial activation gradients reduced at the entry."""
    return ShardingConfig(
        inputs={input_name: {TP: input_placement}},
        desired_inputs={input_name: {TP: Replicate()}},
        local_map=_PARTIAL_INPUT_GRAD,
    )


def _sequence_parallel_norm() -> ShardingConfig:
    return ShardingConfig(params={"weight": {TP: Replicate()}}, inputs={"x": {TP: Shard(1)}})


def _feed_forward(ffn: FeedForward.Config, *, token_placement) -> None:
    """SwiGLU MLP whose input arrives as ``token_placement`` (``Replicate`` or a sequence/token shard)."""
    ffn.sharding_config = _region("x", token_placement)
    ffn.gate_proj.sharding_config = _colwise(ffn.gate_proj)
    ffn.up_proj.sharding_config = _colwise(ffn.up_proj)
    ffn.down_proj.sharding_config = _rowwise(ffn.down_proj, output_placement=token_placement)


def _attention(attn: MLAttention.Config, *, residual) -> None:
    # The latent projections/norms (q_a_*, kv_a_*) stay replicated inside the region; the shared rope
    # key k_rot feeds every head, so its gradient is a per-rank partial sum like everything else here.
    attn.sharding_config = _region("x_BTD", residual)
    for name in ("q_proj", "q_b_proj", "kv_b_proj"):
        linear = getattr(attn, name)
        if linear is not None:
            linear.sharding_config = _colwise(linear)
    attn.o_proj.sharding_config = _rowwise(attn.o_proj, output_placement=residual)


def set_glm_image_moe_sharding_config(
    config: GlmImageMoeModel.Config, *, loss_parallel: bool, enable_sp: bool, ep_degree: int
) -> GlmImageMoeModel.Config:
    """A deep copy of ``config`` with every module's ``sharding_config`` declared (``config`` is untouched).

    Placements are keyed by mesh axis, so the result serves every layout: ``parallelize`` skips axes of
    degree 1. ``ep_degree > 1`` declares the expert-parallel sharding of the routed experts.
    """
    cfg = copy.deepcopy(config)
    for _, module_cfg, _, _ in cfg.traverse():  # start clean: the result depends on the arguments only
        if hasattr(module_cfg, "sharding_config"):
            module_cfg.sharding_config = None
    residual = Shard(1) if enable_sp else Replicate()

    cfg.embed_tokens.sharding_config = ShardingConfig(
        params={"weight": {TP: Shard(0)}},
        inputs={"ids": {TP: Replicate()}},
        desired_outputs={TP: Replicate()},
    )
    for i, layer in enumerate(cfg.layers):
        if enable_sp and i == 0:
            # The embedding output is whole (the image scatter indexes whole sequences): keep this rank's chunk.
            layer.sharding_config = ShardingConfig(
                inputs={"x_BTD": {TP: Replicate()}}, desired_inputs={"x_BTD": {TP: Shard(1)}}
            )
        if enable_sp:
            layer.input_layernorm.sharding_config = _sequence_parallel_norm()
            layer.post_attention_layernorm.sharding_config = _sequence_parallel_norm()
        if not isinstance(layer.self_attn, MLAttention.Config):
            raise TypeError(f"layers.{i}.self_attn is {type(layer.self_attn).__name__}; GlmImageMoe uses MLA")
        _attention(layer.self_attn, residual=residual)
        mlp = layer.mlp
        if isinstance(mlp, MoE.Config):
            if not enable_sp:
                # Route this rank's sequence chunk only (SP already hands the MoE a chunk).
                mlp.sharding_config = ShardingConfig(
                    inputs={"x": {TP: Replicate()}},
                    desired_inputs={"x": {TP: Shard(1)}},
                    outputs={TP: Shard(1)},
                    desired_outputs={TP: Replicate()},
                )
            if mlp.shared_experts is not None:
                # MoE.forward hands the shared expert the flattened local tokens [T_local, D].
                _feed_forward(mlp.shared_experts, token_placement=Shard(0))
            if ep_degree > 1:
                mlp.experts.sharding_config = ShardingConfig(
                    params={"gate_up_proj": {EP: Shard(0)}, "down_proj": {EP: Shard(0)}}
                )
        elif isinstance(mlp, FeedForward.Config):
            _feed_forward(mlp, token_placement=residual)
        else:
            raise TypeError(f"layers.{i}.mlp is {type(mlp).__name__}; expected FeedForward or MoE")
    if enable_sp:
        cfg.norm.sharding_config = _sequence_parallel_norm()
    head = _colwise(cfg.lm_head, input_placement=residual, in_region=False)
    if loss_parallel:
        head.use_local_output = False  # vocab-sharded DTensor logits for the parallel cross entropy
    else:
        head.desired_outputs = {TP: Replicate()}
    cfg.lm_head.sharding_config = head
    return cfg
