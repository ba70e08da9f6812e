"""Declared placements of Qwen3.5 (dense and MoE): a pure function (model config, TP/EP options) -> a new config.

Qwen3.5 is a ``Decoder``, so the shared builders of ``hyper_parallel.models.common.sharding`` declare
everything except the mixers, which this file supplies:

- gated attention: ``q_proj`` column-wise over heads (its rows are per head ``[q_h | gate_h]``, so a rank
  keeps both halves of its heads together), ``k_proj``/``v_proj`` column-wise, ``o_proj`` row-wise back to
  the residual, per-head ``q_norm``/``k_norm`` replicated (the GQA placements);
- Gated DeltaNet: by heads (``set_gated_deltanet_sharding``): the fused ``in_proj_qkv`` and ``conv1d``
  rows are stored grouped by key head, so one ``Shard(0)`` hands each rank whole Q, K and V heads;
  ``in_proj_z``/``in_proj_b``/``in_proj_a``, ``dt_bias``, ``A_log`` by value heads, ``out_proj`` row-wise,
  the gated ``norm`` replicated. The recurrence runs on the rank's heads as local tensors.
- dense MLP / MoE / embeddings / head: the shared placements.
"""

from __future__ import annotations

from torch.distributed.tensor import Placement

from hyper_parallel.models.common.gated_attention import GatedAttention
from hyper_parallel.models.common.gated_deltanet import GatedDeltaNet
from hyper_parallel.models.common.mixer import TokenMixer
from hyper_parallel.models.common.sharding import (
    set_decoder_sharding_config,
    set_gated_deltanet_sharding,
    set_gqa_attention_sharding,
)
from hyper_parallel.models.qwen3_5_v2.model import Qwen3_5Model

__all__ = ["qwen3_5_mixer_sharding", "set_qwen3_5_sharding_config"]


def qwen3_5_mixer_sharding(mixer: TokenMixer.Config, residual: Placement) -> TokenMixer.Config:
    """Tensor-parallel placements of a Qwen3.5 mixer (see the module docstring)."""
    if isinstance(mixer, GatedAttention.Config):
        # Same fields and head-major rows as GQA; q_proj's per-head [q | gate] rows stay together.
        return set_gqa_attention_sharding(mixer, residual=residual)
    if isinstance(mixer, GatedDeltaNet.Config):
        return set_gated_deltanet_sharding(mixer, residual=residual)
    raise TypeError(f"a Qwen3.5 layer's mixer is GatedAttention or GatedDeltaNet, not {type(mixer).__qualname__}")


def set_qwen3_5_sharding_config(
    config: Qwen3_5Model.Config, *, loss_parallel: bool, enable_sp: bool, ep_degree: int
) -> Qwen3_5Model.Config:
    """A new config with every module's ``sharding_config`` declared (``config`` is untouched).

    Placements are keyed by mesh axis, so the result serves every layout (``parallelize`` skips axes of
    degree 1); ``ep_degree > 1`` declares the expert-parallel sharding of the routed experts.
    """
    return set_decoder_sharding_config(
        config,
        loss_parallel=loss_parallel,
        enable_sp=enable_sp,
        ep_degree=ep_degree,
        mixer_sharding=qwen3_5_mixer_sharding,
    )
