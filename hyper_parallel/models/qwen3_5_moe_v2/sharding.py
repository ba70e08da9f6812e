"""Declared placements of Qwen3.5-MoE: the Qwen3.5 family's (``qwen3_5_v2.sharding``).

Gated attention by heads (per-head ``[q | gate]`` rows kept together), Gated DeltaNet without TP for now,
MoE on the rank's sequence chunk with a TP shared expert, routed experts ``Shard(0)`` on ``ep``.
"""

from __future__ import annotations

from hyper_parallel.models.qwen3_5_moe_v2.model import Qwen3_5MoeModel
from hyper_parallel.models.qwen3_5_v2.sharding import set_qwen3_5_sharding_config

__all__ = ["set_qwen3_5_moe_sharding_config"]


def set_qwen3_5_moe_sharding_config(
    config: Qwen3_5MoeModel.Config, *, loss_parallel: bool, enable_sp: bool, ep_degree: int
) -> Qwen3_5MoeModel.Config:
    """A new config with every module's ``sharding_config`` declared (``config`` is untouched)."""
    return set_qwen3_5_sharding_config(config, loss_parallel=loss_parallel, enable_sp=enable_sp, ep_degree=ep_degree)
