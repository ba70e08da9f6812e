"""Declared placements of GlmImageMoe: a pure function (model config, TP/EP options) -> a new config.

GlmImageMoe is a ``Decoder`` with MLA mixers, so the shared builders of
``hyper_parallel.models.common.sharding`` declare everything (see that module for the placements):

- embeddings vocab-sharded, output whole (the image scatter needs whole sequences); with SP layer 0
  then keeps its sequence chunk;
- MLA: ``q_proj``/``q_b_proj`` and ``kv_b_proj`` column-wise over heads, ``o_proj`` row-wise; latent
  projections/norms replicated;
- dense MLP and shared experts: ``gate_proj``/``up_proj`` column-wise, ``down_proj`` row-wise;
- MoE on the rank's sequence chunk (router/experts not tensor-parallel), experts ``Shard(0)`` on ``ep``;
- head column-wise, vocab-sharded logits with loss parallel.

The VQ codebook and ``vq_to_llm_proj`` declare nothing: they stay whole (the codebook is FSDP-ignored).
"""

from __future__ import annotations

from hyper_parallel.models.common.mla import MLAttention
from hyper_parallel.models.common.sharding import set_decoder_sharding_config
from hyper_parallel.models.glm_image_moe_v2.model import GlmImageMoeModel

__all__ = ["set_glm_image_moe_sharding_config"]


def set_glm_image_moe_sharding_config(
    config: GlmImageMoeModel.Config, *, loss_parallel: bool, enable_sp: bool, ep_degree: int
) -> GlmImageMoeModel.Config:
    """A new config with every module's ``sharding_config`` declared (``config`` is untouched).

    Placements are keyed by mesh axis, so the result serves every layout: ``parallelize`` skips axes of
    degree 1. ``ep_degree > 1`` declares the expert-parallel sharding of the routed experts.
    """
    for i, layer in enumerate(config.layers):
        if not isinstance(layer.self_attn, MLAttention.Config):
            raise TypeError(f"layers.{i}.self_attn is {type(layer.self_attn).__name__}; GlmImageMoe uses MLA")
    return set_decoder_sharding_config(config, loss_parallel=loss_parallel, enable_sp=enable_sp, ep_degree=ep_degree)
