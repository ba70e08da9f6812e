"""Recipes of Qwen3.5 (dense) runs: plain functions returning ``Trainer.Config``.

    python -m hyper_parallel.train --module qwen3_5 --config qwen3_5_debug
"""

from __future__ import annotations

from hyper_parallel.components import CheckpointManager, LRSchedulersContainer, MetricsProcessor, OptimizersContainer
from hyper_parallel.config import ParallelismConfig, TrainingConfig
from hyper_parallel.data import HuggingFaceTextDataLoader
from hyper_parallel.models.qwen3_5_v2.model import qwen3_5_config
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
    return Trainer.Config(
        model_spec="qwen3_5",
        model=model,
        training=TrainingConfig(steps=120, max_norm=1.0),
        # path "" = the embedded toy text corpus and its 512-id tokenizer (no download).
        data=HuggingFaceTextDataLoader.Config(
            source="text", max_tokens_per_microbatch=512, global_batch_tokens=1024, shuffle_buffer=256,
            split_long_documents=True,
        ),
        optimizer=OptimizersContainer.Config(name="adamw", lr=3e-3, weight_decay=0.01),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=10, decay_type="cosine", min_lr_ratio=0.1),
        checkpoint=CheckpointManager.Config(enable=True, interval=50, keep_latest_k=2, export_hf=True, export_dtype="float32"),
        metrics=MetricsProcessor.Config(log_freq=10),
    )


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
    return Trainer.Config(
        model_spec="qwen3_5",
        model=model,
        training=TrainingConfig(steps=10000, max_norm=1.0, mixed_precision_param="bfloat16"),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1),
        data=HuggingFaceTextDataLoader.Config(
            source="text", max_tokens_per_microbatch=8192, global_batch_tokens=0, num_workers=2
        ),
        optimizer=OptimizersContainer.Config(name="adamw", lr=2e-5, weight_decay=0.1),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=200, decay_type="cosine", min_lr_ratio=0.1),
        checkpoint=CheckpointManager.Config(enable=True, interval=500, keep_latest_k=3, async_mode="async"),
        metrics=MetricsProcessor.Config(log_freq=10),
    )
