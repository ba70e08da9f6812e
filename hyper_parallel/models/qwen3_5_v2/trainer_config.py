"""The ``Trainer.Config`` around a Qwen3.5-family text model, shared by the dense and MoE recipes
(``config_registry.py`` of ``qwen3_5_v2`` and ``qwen3_5_moe_v2``): only the model differs between them."""

from __future__ import annotations

from typing import Any

from hyper_parallel.components import CheckpointManager, LRSchedulersContainer, MetricsProcessor, OptimizersContainer
from hyper_parallel.config import ParallelismConfig, TrainingConfig
from hyper_parallel.data import HuggingFaceTextDataLoader, TextOptions
from hyper_parallel.trainer import Trainer

__all__ = ["qwen3_5_text_trainer"]


NODE_RANKS = 8
"""Ranks of the node the full-size recipes are sized for: their global batch is one micro-batch per data-parallel
rank there (``data.global_batch_tokens``, fixed: another layout only splits it into other micro-batches)."""


def qwen3_5_text_trainer(model_spec: str, model: Any, *, debug: bool) -> Trainer.Config:
    """``debug``: a CPU run on the embedded toy text corpus (fp32, HF export); else a full-size bf16 FSDP run
    over every rank (``--data.path`` and ``--data.tokenizer`` to be given)."""
    if debug:
        return Trainer.Config(
            model_spec=model_spec,
            model=model,
            training=TrainingConfig(steps=120, max_norm=1.0),
            # path "" = the embedded toy text corpus and its 512-id tokenizer (no download).
            data=HuggingFaceTextDataLoader.Config(
                source="text", max_tokens_per_microbatch=512, global_batch_tokens=1024, shuffle_buffer=256,
                text=TextOptions(split_long_documents=True),
            ),
            optimizer=OptimizersContainer.Config(name="adamw", lr=3e-3, weight_decay=0.01),
            lr_scheduler=LRSchedulersContainer.Config(warmup_steps=10, decay_type="cosine", min_lr_ratio=0.1),
            checkpoint=CheckpointManager.Config(
                enable=True, interval=50, keep_latest_k=2, export_hf=True, export_dtype="float32"
            ),
            metrics=MetricsProcessor.Config(log_freq=10),
        )
    return Trainer.Config(
        model_spec=model_spec,
        model=model,
        training=TrainingConfig(steps=10000, max_norm=1.0, mixed_precision_param="bfloat16"),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1),
        data=HuggingFaceTextDataLoader.Config(
            # a fixed global batch: one 8192-token sequence per rank of one 8-GPU node; on fewer ranks (or with
            # context parallel) each rank accumulates more micro-batches, and the optimizer step stays the same
            source="text", max_tokens_per_microbatch=8192, global_batch_tokens=NODE_RANKS * 8192, num_workers=2
        ),
        optimizer=OptimizersContainer.Config(name="adamw", lr=2e-5, weight_decay=0.1),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=200, decay_type="cosine", min_lr_ratio=0.1),
        checkpoint=CheckpointManager.Config(enable=True, interval=500, keep_latest_k=3, async_mode="async"),
        metrics=MetricsProcessor.Config(log_freq=10),
    )
