"""Parallelise a Qwen3.5-MoE model: the Qwen3.5 family's layout checks and ``parallelize_decoder`` call
(``qwen3_5_v2.parallelize``) with this package's declared placements."""

from __future__ import annotations

from typing import Any

from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.models.qwen3_5_moe_v2.model import Qwen3_5MoeModel
from hyper_parallel.models.qwen3_5_moe_v2.sharding import set_qwen3_5_moe_sharding_config
from hyper_parallel.models.qwen3_5_v2.parallelize import parallelize_qwen3_5, validate_qwen3_5_layout

__all__ = ["parallelize_qwen3_5_moe", "validate_qwen3_5_moe_layout"]


def validate_qwen3_5_moe_layout(config: Qwen3_5MoeModel.Config, parallel_dims: ParallelDims) -> None:
    """Heads, experts and sharded dimensions against the layout; ``ConfigError`` names the degree to change."""
    validate_qwen3_5_layout(config, parallel_dims)


def parallelize_qwen3_5_moe(model: Qwen3_5MoeModel, **kwargs: Any) -> Qwen3_5MoeModel:
    """Apply the layout to ``model`` in place and return it (see ``parallelize_qwen3_5``)."""
    return parallelize_qwen3_5(model, set_sharding=set_qwen3_5_moe_sharding_config, **kwargs)
