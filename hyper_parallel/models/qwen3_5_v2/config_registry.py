"""Recipes of Qwen3.5 (dense) runs: plain functions returning ``Trainer.Config``.

    python -m hyper_parallel.train --module qwen3_5 --config qwen3_5_debug
"""

from __future__ import annotations

from hyper_parallel.models.qwen3_5_v2.model import qwen3_5_config
from hyper_parallel.models.qwen3_5_v2.trainer_config import qwen3_5_text_trainer
from hyper_parallel.trainer import Trainer

__all__ = ["qwen3_5_4b", "qwen3_5_debug"]


def qwen3_5_debug() -> Trainer.Config:
    """Tiny dense Qwen3.5 (3 DeltaNet + 1 gated-attention layer) that trains on a laptop CPU."""
    model = qwen3_5_config(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, intermediate_size=128, rope_theta=1e7, partial_rotary_factor=0.25,
        mrope_section=(2, 1, 1), max_position_embeddings=4096,
    )  # fmt: skip
    return qwen3_5_text_trainer("qwen3_5", model, debug=True)


def qwen3_5_4b() -> Trainer.Config:
    """Qwen3.5-4B text dimensions, bf16 FSDP.

    Given by the issue (published): hidden 2560, 32 layers, 16 q / 4 kv heads of 256, vocab 248320.
    NOT confirmed here (no network; the values are the Qwen3.5 family's HF defaults and the 35B-A3B's
    DeltaNet shape): intermediate_size 9216, DeltaNet Hk 16 / Hv 32 of 128 with conv 4, rotary 0.25 with
    mrope (11, 11, 10), rope_theta 1e7, rms_norm_eps 1e-6, 3:1 layer pattern. Qwen3.5-4B may tie its
    embeddings; this model keeps an untied head (``from_pretrained`` refuses tied checkpoints).
    """
    model = qwen3_5_config(
        vocab_size=248320, hidden_size=2560, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, intermediate_size=9216, rope_theta=1e7,
        partial_rotary_factor=0.25, mrope_section=(11, 11, 10), rms_norm_eps=1e-6, max_position_embeddings=262144,
    )  # fmt: skip
    return qwen3_5_text_trainer("qwen3_5", model, debug=False)
