"""Parallelise a GlmImageMoe model: CP -> AC -> TP/SP -> EP -> compile -> FSDP2 (see
``hyper_parallel.distributed.parallelize``). This file supplies only the model's facts: its declared
placements (``sharding.py``), its FSDP units and the frozen codebook FSDP must ignore.
"""

from __future__ import annotations

from hyper_parallel.config.parallelism import ParallelismConfig
from hyper_parallel.config.training import ActivationCheckpointConfig, CompileConfig, TrainingConfig
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.parallelize import declared_shardings, parallelize_decoder
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.moe import MoE
from hyper_parallel.models.glm_image_moe_v2.model import GlmImageMoeModel
from hyper_parallel.models.glm_image_moe_v2.sharding import set_glm_image_moe_sharding_config

__all__ = ["parallelize_glm_image_moe", "validate_glm_image_moe_layout"]


def validate_glm_image_moe_layout(config: GlmImageMoeModel.Config, parallel_dims: ParallelDims) -> None:
    """Check the layout against the model (heads, experts, sharded dimensions); ``ConfigError`` names the fix."""
    attn = config.layers[0].self_attn
    moes = [layer.mlp for layer in config.layers if isinstance(layer.mlp, MoE.Config)]
    tp_dims: dict[str, int] = {}
    for i, layer in enumerate(config.layers):
        mlp = layer.mlp
        ffn = mlp if isinstance(mlp, FeedForward.Config) else getattr(mlp, "shared_experts", None)
        if ffn is not None:
            name = f"layers.{i}.mlp hidden size" if ffn is mlp else f"layers.{i}.mlp.shared_experts hidden size"
            tp_dims.setdefault(name, ffn.hidden_dim)
    efsdp_dims = {}
    if moes:
        efsdp_dims = {"2 x moe_intermediate_size": 2 * moes[0].experts.hidden_dim, "hidden_size": config.dim}
    parallel_dims.validate_model(
        n_heads=attn.n_heads,
        n_routed_experts=moes[0].num_experts if moes else None,
        tp_dims=tp_dims,
        efsdp_dims=efsdp_dims,
    )


def parallelize_glm_image_moe(
    model: GlmImageMoeModel,
    *,
    parallel_dims: ParallelDims,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    ac_config: ActivationCheckpointConfig,
    compile_config: CompileConfig,
) -> GlmImageMoeModel:
    """Apply the layout of ``parallel_dims`` to ``model`` in place (meta or materialised) and return it.

    With ``freeze_vq`` the codebook is an FSDP-ignored parameter: whole on every rank, no gradient, no
    communication. Gradients are SUMMED over data-parallel ranks: normalise the loss by the global token
    count (``CrossEntropyLoss(num_tokens=...)``).
    """
    validate_glm_image_moe_layout(model.config, parallel_dims)
    declared = declared_shardings(
        set_glm_image_moe_sharding_config(
            model.config,
            loss_parallel=parallel_dims.loss_parallel_enabled,
            enable_sp=parallel_dims.sp_enabled,
            ep_degree=parallel_dims.ep,
        )
    )
    # A model built from an already-sharded config carries its placements in module.config; they must be
    # the ones this layout needs (a config sharded for another layout would silently mis-shard).
    carried = declared_shardings(model.config)
    if carried and carried != declared:
        differ = sorted(k for k in carried.keys() | declared.keys() if carried.get(k) != declared.get(k))
        raise ValueError(
            f"the model was built from a config sharded for another layout (first differences: {differ[:3]}): "
            "build it from set_glm_image_moe_sharding_config(config, ...) with this run's parallelism, or unsharded"
        )
    ignored = [model.vq_codebook.weight] if model.config.freeze_vq else []
    return parallelize_decoder(
        model,
        declared=declared,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        ac_config=ac_config,
        compile_config=compile_config,
        layers=model.layers,
        embeddings=[model.embed_tokens],
        head=[model.lm_head],
        ignored_params=ignored,
        # vq_to_llm_proj stays in the root unit: a rank whose batch has no image never calls it, so as an FSDP
        # unit (alone or grouped) its collectives would differ across ranks. Its input comes from the FSDP-ignored
        # full-precision codebook, so it gets the input cast FSDP gives its own units.
        cast_input_modules=[model.vq_to_llm_proj] if ignored else [],
    )
