"""Parallelise a GlmImageMoe model: CP -> AC -> TP/SP -> EP -> compile -> FSDP2 (see
``hyper_parallel.distributed.parallelize``). This file supplies only the model's facts: its declared
placements (``sharding.py``), its FSDP units and the frozen codebook FSDP must ignore.
"""

from __future__ import annotations

from hyper_parallel.config.parallelism import ParallelismConfig
from hyper_parallel.config.training import ActivationCheckpointConfig, CompileConfig, TrainingConfig
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.parallelize import layout_shardings, parallelize_decoder
from hyper_parallel.models.common.layout import mlp_layout_facts
from hyper_parallel.models.glm_image_moe_v2.model import GlmImageMoeModel
from hyper_parallel.models.glm_image_moe_v2.sharding import set_glm_image_moe_sharding_config

__all__ = ["parallelize_glm_image_moe", "validate_glm_image_moe_layout"]


def validate_glm_image_moe_layout(config: GlmImageMoeModel.Config, parallel_dims: ParallelDims) -> None:
    """Check the layout against the model (heads, experts, sharded dimensions); ``ConfigError`` names the fix."""
    parallel_dims.validate_model(
        n_heads=config.layers[0].self_attn.n_heads,
        **mlp_layout_facts(
            config, ffn_name=lambda i, shared: f"layers.{i}.mlp{'.shared_experts' if shared else ''} hidden size"
        ),
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
    declared = layout_shardings(model.config, set_glm_image_moe_sharding_config, parallel_dims)
    # (no VQ path on a pipeline stage after the first)
    ignored = [model.vq_codebook.weight] if model.config.freeze_vq and model.vq_codebook is not None else []
    return parallelize_decoder(
        model,
        declared=declared,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        ac_config=ac_config,
        compile_config=compile_config,
        layers=model.all_layers(),  # the decoder layers and the MTP block's
        embeddings=[model.embed_tokens],
        head=[model.lm_head],
        ignored_params=ignored,
        # vq_to_llm_proj stays in the root unit: a rank whose batch has no image never calls it, so as an FSDP
        # unit (alone or grouped) its collectives would differ across ranks. Its input comes from the FSDP-ignored
        # full-precision codebook, so it gets the input cast FSDP gives its own units.
        cast_input_modules=[model.vq_to_llm_proj] if ignored else [],
    )
