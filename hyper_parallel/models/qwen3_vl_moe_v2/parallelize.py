"""Parallelise a VL model: CP -> AC -> TP/SP -> EP -> compile -> FSDP2 (``hyper_parallel.distributed.parallelize``).

This file supplies only the model's facts: layout checks, declared placements (``sharding.py``; the
vision tower has none: FSDP only) and the FSDP units. Vision blocks are ``layers`` of the shared
``parallelize_decoder`` (AC + FSDP units; they declare no TP/EP placements, so TP/EP leave them whole);
the mergers are FSDP units of their own. The model runs the tower in every forward (a dummy grid when
a micro-batch has no image), so every rank calls every unit. With ``freeze_vision`` the whole tower is
FSDP-ignored: whole on every rank, no gradient, no communication. Under Ulysses context parallel the
tower is not split (its attention core is not named ``inner_attention``); see ``Qwen3VlMoeModel.cp_shard``.
"""

from __future__ import annotations

from hyper_parallel.config.errors import ConfigError
from hyper_parallel.config.parallelism import ParallelismConfig
from hyper_parallel.config.training import ActivationCheckpointConfig, CompileConfig, TrainingConfig
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.parallelize import layout_shardings, parallelize_decoder
from hyper_parallel.models.common.layout import mlp_layout_facts
from hyper_parallel.models.qwen3_5_v2.parallelize import qwen_ffn_name, validate_qwen3_5_layout
from hyper_parallel.models.qwen3_vl_moe_v2.model import QWEN3_5_FAMILIES, Qwen3VlMoeModel
from hyper_parallel.models.qwen3_vl_moe_v2.sharding import set_qwen3_vl_moe_sharding_config

__all__ = ["parallelize_qwen3_vl_moe", "validate_qwen3_vl_moe_layout"]

_P = "--parallelism."


def validate_qwen3_vl_moe_layout(config: Qwen3VlMoeModel.Config, parallel_dims: ParallelDims) -> None:
    """Check the layout against the model; ``ConfigError`` names the degree (or field) to change."""
    if config.visual.deepstack_visual_indexes and parallel_dims.sp_enabled:
        raise ConfigError(
            "sequence parallel splits the residual stream between layers, where deepstack adds visual features "
            f"at whole-sequence positions: set {_P}enable_sequence_parallel false (or use no TP)"
        )
    if config.text_family in QWEN3_5_FAMILIES:  # Qwen3.5 hybrid text stack, dense or MoE
        validate_qwen3_5_layout(config, parallel_dims)
        return
    attn = config.layers[0].self_attn
    parallel_dims.validate_model(
        n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads, **mlp_layout_facts(config, ffn_name=qwen_ffn_name)
    )


def parallelize_qwen3_vl_moe(
    model: Qwen3VlMoeModel,
    *,
    parallel_dims: ParallelDims,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    ac_config: ActivationCheckpointConfig,
    compile_config: CompileConfig,
) -> Qwen3VlMoeModel:
    """Apply the layout of ``parallel_dims`` to ``model`` in place (meta or materialised) and return it.

    Gradients are SUMMED over data-parallel ranks: normalise the loss by the global token count.
    """
    validate_qwen3_vl_moe_layout(model.config, parallel_dims)
    declared = layout_shardings(model.config, set_qwen3_vl_moe_sharding_config, parallel_dims)
    # Context parallel: the tower runs on all images on every CP rank (pixels are replicated); the model
    # keeps the features of its own pieces' image tokens (``model.cp_shard``, set by apply_context_parallel).
    visual = model.visual  # None on a pipeline stage after the first
    frozen = model.config.freeze_vision
    vision_layers = [] if frozen or visual is None else list(visual.blocks)
    vision_units = [] if frozen or visual is None else [visual.merger, *visual.deepstack_merger_list]
    return parallelize_decoder(
        model,
        declared=declared,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        ac_config=ac_config,
        compile_config=compile_config,
        layers=[*vision_layers, *model.all_layers()],  # with the MTP block's layers
        embeddings=[model.embed_tokens, *vision_units],
        head=[model.lm_head],
        ignored_params=list(visual.parameters()) if frozen and visual is not None else [],
        # The frozen tower runs in full precision outside FSDP; its output is cast to the text dtype in embed.
        cast_input_modules=[],
    )
