"""Qwen3.5-MoE text decoder (HF ``Qwen3_5MoeTextModel`` + ``lm_head``): the Qwen3.5 hybrid stack with an MoE
in every layer (softmax top-k router, always renormalised; shared expert scaled by
``sigmoid(shared_expert_gate(x))``; optional Switch aux loss, ``router_aux_loss_coef``).

The math, the config builder and the HF config conversion are the Qwen3.5 family's
(``qwen3_5_v2.model`` / ``qwen3_5_v2.hf_config``); this module fixes the MoE flavour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyper_parallel.models.qwen3_5_v2.model import (
    MTP_LOSS_WEIGHT,
    Qwen3_5Model,
    Qwen3_5TransformerBlock,
    qwen3_5_config,
)

__all__ = ["MTP_LOSS_WEIGHT", "Qwen3_5MoeModel", "Qwen3_5MoeTransformerBlock", "qwen3_5_moe_config"]

# MTP_LOSS_WEIGHT (0.1): the Qwen3.5 family's, re-exported beside this family's builder. Megatron-Bridge gives the
# MoE models the same value (qwen35_common.py: apply_qwen35_moe_config calls apply_qwen35_common_config).


class Qwen3_5MoeTransformerBlock(Qwen3_5TransformerBlock):
    """A Qwen3.5-MoE decoder layer: Gated DeltaNet or gated attention, then the MoE."""

    @dataclass(kw_only=True, slots=True)
    class Config(Qwen3_5TransformerBlock.Config):
        pass


class Qwen3_5MoeModel(Qwen3_5Model):
    """Qwen3.5-MoE text LM; ``model(input_ids)`` returns logits (``ModelOutput`` when the aux loss is on)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Qwen3_5Model.Config):
        pass


def qwen3_5_moe_config(
    *,
    num_experts: int,
    num_experts_per_tok: int,
    moe_intermediate_size: int,
    shared_expert_intermediate_size: int | None,
    **kwargs: Any,
) -> Qwen3_5MoeModel.Config:
    """``qwen3_5_config`` for the MoE family (every layer an MoE); other keywords as there."""
    return qwen3_5_config(
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        shared_expert_intermediate_size=shared_expert_intermediate_size,
        config_cls=Qwen3_5MoeModel.Config,
        block_cls=Qwen3_5MoeTransformerBlock,
        **kwargs,
    )
