"""Recipes of Qwen3.5 (dense) runs: plain functions returning ``Trainer.Config``.

    python -m hyper_parallel.train --module qwen3_5 --config qwen3_5_debug
"""

from __future__ import annotations

from hyper_parallel.config.lora import LoRAConfig
from hyper_parallel.models.qwen3_5_v2.model import qwen3_5_config
from hyper_parallel.models.qwen3_5_v2.trainer_config import qwen3_5_text_trainer
from hyper_parallel.trainer import Trainer

__all__ = ["qwen3_5_4b", "qwen3_5_debug", "qwen3_5_lora_debug", "qwen3_5_mtp_debug"]

_QWEN3_5_LORA_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj", "v_proj",
                        "o_proj", "gate_proj", "up_proj", "down_proj")  # fmt: skip
"""Every projection of a Qwen3.5 layer by its HF name: Gated DeltaNet's five, gated attention's four, the MLP's."""


def qwen3_5_debug(*, mtp_num_hidden_layers: int = 0) -> Trainer.Config:
    """Tiny dense Qwen3.5 (3 DeltaNet + 1 gated-attention layer) that trains on a laptop CPU."""
    model = qwen3_5_config(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, intermediate_size=128, rope_theta=1e7, partial_rotary_factor=0.25,
        mrope_section=(2, 1, 1), max_position_embeddings=4096, mtp_num_hidden_layers=mtp_num_hidden_layers,
    )  # fmt: skip
    return qwen3_5_text_trainer("qwen3_5", model, debug=True)


def qwen3_5_mtp_debug() -> Trainer.Config:
    """``qwen3_5_debug`` with the MTP block on (``mtp.*``, loss weight 0.1; ``--model.mtp_loss_weight``)."""
    return qwen3_5_debug(mtp_num_hidden_layers=1)


def qwen3_5_lora_debug() -> Trainer.Config:
    """``qwen3_5_debug`` as a LoRA run (rank 8): adapters on every Gated DeltaNet, attention and MLP projection,
    everything else frozen; 10 steps."""
    cfg = qwen3_5_debug()
    cfg.lora = LoRAConfig(rank=8, alpha=16.0, targets=_QWEN3_5_LORA_TARGETS)
    cfg.training.steps = 10
    cfg.lr_scheduler.warmup_steps = 2
    return cfg


def qwen3_5_4b() -> Trainer.Config:
    """Qwen3.5-4B text dimensions (4.21B parameters: the head is tied to the embedding), bf16 FSDP.

    As its released ``config.json`` states them (transcribed by a public design note, see
    tests/torch/ut/released_configs/SOURCES.md): hidden 2560, 32 layers (3 DeltaNet : 1 attention), 16 q / 4
    kv heads of 256, intermediate 9216, DeltaNet Hk 16 / Hv 32 of 128 with conv 4, rotary 0.25 with mrope
    (11, 11, 10), rope_theta 1e7, vocab 248320, ``tie_word_embeddings: true`` (so it starts from its own HF
    folder: ``--checkpoint.initial_load_path``).
    """
    model = qwen3_5_config(
        vocab_size=248320, hidden_size=2560, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, intermediate_size=9216, rope_theta=1e7,
        partial_rotary_factor=0.25, mrope_section=(11, 11, 10), rms_norm_eps=1e-6, max_position_embeddings=262144,
        tie_word_embeddings=True,
    )  # fmt: skip
    return qwen3_5_text_trainer("qwen3_5", model, debug=False)
