"""Parallelise a Qwen3.5 model (dense or MoE): CP -> AC -> TP/SP -> EP -> compile -> FSDP2 (see
``hyper_parallel.distributed.parallelize``). This file supplies only the model's facts: its layout
checks, its declared placements (``sharding.py``) and its FSDP units.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyper_parallel.config.errors import ConfigError
from hyper_parallel.config.parallelism import ParallelismConfig
from hyper_parallel.config.training import ActivationCheckpointConfig, CompileConfig, TrainingConfig
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.parallelize import layout_shardings, parallelize_decoder
from hyper_parallel.models.common.gated_attention import GatedAttention
from hyper_parallel.models.common.gated_deltanet import GatedDeltaNet
from hyper_parallel.models.common.layout import mlp_layout_facts
from hyper_parallel.models.qwen3_5_v2.model import Qwen3_5Model
from hyper_parallel.models.qwen3_5_v2.sharding import set_qwen3_5_sharding_config

__all__ = ["parallelize_qwen3_5", "validate_qwen3_5_layout"]

_P = "--parallelism."


def validate_qwen3_5_layout(config: Qwen3_5Model.Config, parallel_dims: ParallelDims) -> None:
    """Check the layout against the model; ``ConfigError`` names the degree (or field) to change.

    TP splits heads: it must divide the gated attention's query and key/value heads and Gated DeltaNet's key
    (Hk) and value (Hv) heads (TP shards the DeltaNet projections by heads). Context parallel takes any degree
    that divides the world: Ulysses splits the rank's heads again where they divide; beyond that, attention
    gathers K/V and Gated DeltaNet passes its recurrent state between sequence pieces
    (``context_parallel.apply_context_parallel``).
    """
    attn = next((layer.self_attn for layer in config.layers if isinstance(layer.self_attn, GatedAttention.Config)), None)
    gdn = next((layer.self_attn for layer in config.layers if isinstance(layer.self_attn, GatedDeltaNet.Config)), None)
    if gdn is not None:
        for name, value in (("linear_num_key_heads", gdn.num_k_heads), ("linear_num_value_heads", gdn.num_v_heads)):
            if value % parallel_dims.tp:
                raise ConfigError(
                    f"tensor_parallel_degree ({parallel_dims.tp}) does not divide the Gated DeltaNet {name} "
                    f"({value}): set {_P}tensor_parallel_degree to a divisor of {value}"
                )
        parallel_dims.check_cp_heads("Gated DeltaNet linear_num_key_heads", gdn.num_k_heads)
    parallel_dims.validate_model(
        n_heads=attn.n_heads if attn is not None else 1,
        n_kv_heads=attn.n_kv_heads if attn is not None else None,
        **mlp_layout_facts(config, ffn_name=qwen_ffn_name),
    )


def qwen_ffn_name(layer: int, shared: bool) -> str:
    """The HF Qwen field that sets a dense MLP's / shared expert's hidden size (named by layout errors)."""
    return "shared_expert_intermediate_size" if shared else "intermediate_size"


def parallelize_qwen3_5(
    model: Qwen3_5Model,
    *,
    parallel_dims: ParallelDims,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    ac_config: ActivationCheckpointConfig,
    compile_config: CompileConfig,
    set_sharding: Callable[..., Any] = set_qwen3_5_sharding_config,
) -> Qwen3_5Model:
    """Apply the layout of ``parallel_dims`` to ``model`` in place (meta or materialised) and return it.

    Gradients are SUMMED over data-parallel ranks: normalise the loss by the global token count.
    """
    validate_qwen3_5_layout(model.config, parallel_dims)
    declared = layout_shardings(model.config, set_sharding, parallel_dims)
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
    )
