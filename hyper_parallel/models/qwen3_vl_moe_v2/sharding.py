"""Declared placements of the VL models: a pure function (model config, TP/EP options) -> a new config.

- vision tower: FSDP only (no tensor parallel, RFC): its configs keep ``sharding_config=None``; every rank
  runs the whole tower on the micro-batch's images;
- text decoder: the full plan of ``hyper_parallel.models.common.sharding`` (GQA by heads, dense MLP
  column/row-wise, MoE routed experts ``Shard(0)`` on ``ep``, embeddings and head); Qwen3.5 text layers' gated
  attention and Gated DeltaNet placements come from the same shared builders.
"""

from __future__ import annotations

from hyper_parallel.models.common.sharding import set_decoder_sharding_config
from hyper_parallel.models.qwen3_vl_moe_v2.model import Qwen3VlMoeModel

__all__ = ["set_qwen3_vl_moe_sharding_config"]


def set_qwen3_vl_moe_sharding_config(
    config: Qwen3VlMoeModel.Config, *, loss_parallel: bool, enable_sp: bool, ep_degree: int
) -> Qwen3VlMoeModel.Config:
    """A new config with every text module's ``sharding_config`` declared (``config`` is untouched)."""
    return set_decoder_sharding_config(
        config,
        loss_parallel=loss_parallel,
        enable_sp=enable_sp,
        ep_degree=ep_degree,
    )
