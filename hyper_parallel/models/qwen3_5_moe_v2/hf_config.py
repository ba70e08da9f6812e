"""Qwen3.5-MoE HF ``config.json`` <-> our config tree: the Qwen3.5 family's reader/writer
(``qwen3_5_v2.hf_config``) bound to this package's classes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hyper_parallel.models.qwen3_5_moe_v2.model import Qwen3_5MoeModel, Qwen3_5MoeTransformerBlock
from hyper_parallel.models.qwen3_5_v2 import hf_config as _family
from hyper_parallel.models.qwen3_5_v2.hf_config import config_to_hf

__all__ = ["config_from_hf", "config_to_hf"]


def config_from_hf(hf: Mapping[str, Any]) -> Qwen3_5MoeModel.Config:
    """Our config from an HF ``config.json`` dict (``qwen3_5_moe_text``, or ``qwen3_5_moe`` with ``text_config``)."""
    return _family.config_from_hf(hf, moe=True, config_cls=Qwen3_5MoeModel.Config, block_cls=Qwen3_5MoeTransformerBlock)
