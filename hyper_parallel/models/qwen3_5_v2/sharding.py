"""Declared placements of Qwen3.5 (dense and MoE): a pure function (model config, TP/EP options) -> a new config.

Qwen3.5 is a ``Decoder`` whose mixers the shared builders of ``hyper_parallel.models.common.sharding``
already know, so this file only names the model:

- gated attention: the GQA placements (``q_proj`` column-wise over heads: its rows are per head
  ``[q_h | gate_h]``, so a rank keeps both halves of its heads together; ``k_proj``/``v_proj`` column-wise,
  ``o_proj`` row-wise back to the residual, per-head ``q_norm``/``k_norm`` replicated);
- Gated DeltaNet: by heads (``set_gated_deltanet_sharding``): the fused ``in_proj_qkv`` and ``conv1d``
  rows are stored grouped by key head, so one ``Shard(0)`` hands each rank whole Q, K and V heads;
  ``in_proj_z``/``in_proj_b``/``in_proj_a``, ``dt_bias``, ``A_log`` by value heads, ``out_proj`` row-wise,
  the gated ``norm`` replicated. The recurrence runs on the rank's heads as local tensors.
- dense MLP / MoE / embeddings / head: the shared placements.
"""

from __future__ import annotations

from hyper_parallel.models.common.sharding import set_decoder_sharding_config
from hyper_parallel.models.qwen3_5_v2.model import Qwen3_5Model

__all__ = ["set_qwen3_5_sharding_config"]


def set_qwen3_5_sharding_config(
    config: Qwen3_5Model.Config, *, loss_parallel: bool, enable_sp: bool, ep_degree: int
) -> Qwen3_5Model.Config:
    """A new config with every module's ``sharding_config`` declared (``config`` is untouched).

    Placements are keyed by mesh axis, so the result serves every layout (``parallelize`` skips axes of
    degree 1); ``ep_degree > 1`` declares the expert-parallel sharding of the routed experts.
    """
    return set_decoder_sharding_config(config, loss_parallel=loss_parallel, enable_sp=enable_sp, ep_degree=ep_degree)
