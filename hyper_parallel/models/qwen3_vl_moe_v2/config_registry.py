"""Recipes of VL runs: plain functions returning ``Trainer.Config``; variants call and change another.

    python -m hyper_parallel.train --module qwen3_vl_moe --config qwen3_vl_moe_debug
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.components import CheckpointManager, LRSchedulersContainer, MetricsProcessor, OptimizersContainer
from hyper_parallel.config import ActivationCheckpointConfig, ParallelismConfig, TrainingConfig
from hyper_parallel.config.lora import LoRAConfig
from hyper_parallel.data import VisionLanguageDataLoader
from hyper_parallel.data.vision_language.preprocess import ImageProcessor
from hyper_parallel.data.vision_language.video import VideoProcessor
from hyper_parallel.models.qwen3_vl_moe_v2.model import (
    Qwen3VlMoeModel,
    qwen3_5_moe_vl_config,
    qwen3_5_vl_config,
    qwen3_vl_config,
    qwen3_vl_moe_config,
)
from hyper_parallel.trainer import Trainer

__all__ = [
    "qwen3_5_moe_vl_debug", "qwen3_5_moe_vl_mtp_debug", "qwen3_5_vl_debug", "qwen3_vl_moe_a3b", "qwen3_vl_moe_a3b_ep8",
    "qwen3_5_9b_vl", "qwen3_5_27b_vl",
    "qwen3_vl_debug", "qwen3_vl_moe_a3b_lora", "qwen3_vl_moe_debug", "qwen3_vl_moe_lora_debug", "qwen3_vl_moe_pp_debug",
    "qwen3_vl_moe_sft_debug",
]  # fmt: skip

# The toy VL corpus uses the 512-id toy tokenizer; image / vision-start / vision-end ids 512..514.
_TOY_IDS = dict(image_token_id=512, vision_start_token_id=513, vision_end_token_id=514, video_token_id=515)
_TOY_VISION = dict(depth=2, dim=32, n_heads=2, intermediate_size=64, patch_size=16, temporal_patch_size=2,
                   spatial_merge_size=2, num_position_embeddings=16)  # fmt: skip


def _debug_trainer(model, spec: str) -> Trainer.Config:
    return Trainer.Config(
        model_spec=spec,
        model=model,
        training=TrainingConfig(steps=60, max_norm=1.0),
        data=VisionLanguageDataLoader.Config(
            max_tokens_per_microbatch=512, global_batch_tokens=1024,
            image=ImageProcessor.Config(min_pixels=32 * 32, max_pixels=128 * 128),
            video=VideoProcessor.Config(min_pixels=4 * 32 * 32, max_pixels=8 * 64 * 64),
        ),  # fmt: skip
        optimizer=OptimizersContainer.Config(name="adamw", lr=3e-3, weight_decay=0.01),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=5, decay_type="cosine", min_lr_ratio=0.1),
        checkpoint=CheckpointManager.Config(enable=True, interval=50, keep_latest_k=2, export_hf=True, export_dtype="float32"),
        metrics=MetricsProcessor.Config(log_freq=10),
    )


def _debug_vl_moe(num_hidden_layers: int) -> Any:
    return qwen3_vl_moe_config(
        vocab_size=520, hidden_size=64, num_hidden_layers=num_hidden_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, mlp_only_layers=[2], rope_theta=5e6, mrope_section=(4, 2, 2),
        router_aux_loss_coef=0.001, max_position_embeddings=4096,
        vision={**_TOY_VISION, "deepstack_visual_indexes": (0, 1)}, **_TOY_IDS,
    )  # fmt: skip


def qwen3_vl_moe_debug() -> Trainer.Config:
    """Tiny Qwen3-VL-MoE (2-block tower with deepstack, 3 text layers, one dense) on the toy VL corpus."""
    return _debug_trainer(_debug_vl_moe(3), "qwen3_vl_moe")


def qwen3_vl_moe_pp_debug() -> Trainer.Config:
    """``qwen3_vl_moe_debug`` with 5 text layers: room for 4 pipeline stages (the 2 deepstack layers on stage 0)."""
    return _debug_trainer(_debug_vl_moe(5), "qwen3_vl_moe")


def qwen3_vl_debug() -> Trainer.Config:
    """Tiny Qwen3-VL dense (``Qwen3VLForConditionalGeneration``: 3 Qwen3 text layers with dense SwiGLU MLPs,
    2-block tower with deepstack after both blocks, tied embeddings as the 2B / 4B releases) on the toy VL
    corpus (images and videos)."""
    model = qwen3_vl_config(
        vocab_size=520, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, rope_theta=5e6, mrope_section=(4, 2, 2), max_position_embeddings=4096,
        vision={**_TOY_VISION, "deepstack_visual_indexes": (0, 1)}, tie_word_embeddings=True, **_TOY_IDS,
    )  # fmt: skip
    return _debug_trainer(model, "qwen3_vl_moe")


def qwen3_vl_moe_lora_debug() -> Trainer.Config:
    """``qwen3_vl_moe_debug`` as a LoRA run (rank 8): adapters on every linear projection (text attention and
    dense MLP, the vision tower's blocks and mergers: ``all-linear``) and every routed expert, everything else
    frozen; 10 steps."""
    cfg = qwen3_vl_moe_debug()
    cfg.lora = LoRAConfig(rank=8, alpha=16.0, targets=("all-linear", "experts"))
    cfg.training.steps = 10
    cfg.lr_scheduler.warmup_steps = 2
    return cfg


def qwen3_vl_moe_sft_debug() -> Trainer.Config:
    """``qwen3_vl_moe_debug`` fine-tuned on the embedded toy picture conversations (user: images + question in
    transformers' content-list form; assistant: the caption), assistant turns only."""
    cfg = qwen3_vl_moe_debug()
    cfg.data.chat.loss_on = "assistant"  # with an empty data.path: the toy corpus's all-conversation variant
    return cfg


def qwen3_5_moe_vl_debug(*, mtp_num_hidden_layers: int = 0) -> Trainer.Config:
    """Tiny Qwen3.5-MoE VL (3 DeltaNet + 1 gated-attention layer, tower without deepstack) on the toy VL corpus."""
    model = qwen3_5_moe_vl_config(
        vocab_size=520, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=48, rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=(2, 1, 1),
        router_aux_loss_coef=0.001, max_position_embeddings=4096, vision=dict(_TOY_VISION), **_TOY_IDS,
        mtp_num_hidden_layers=mtp_num_hidden_layers,
    )  # fmt: skip
    return _debug_trainer(model, "qwen3_vl_moe")


def qwen3_5_moe_vl_mtp_debug() -> Trainer.Config:
    """``qwen3_5_moe_vl_debug`` with the MTP block on (``mtp.*``, loss weight 0.1; ``--model.mtp_loss_weight``):
    the MTP input at a position before an image token is that token's visual feature; the HF export writes
    ``text_config.mtp_num_hidden_layers``."""
    return qwen3_5_moe_vl_debug(mtp_num_hidden_layers=1)


def qwen3_5_vl_debug(*, mtp_num_hidden_layers: int = 0) -> Trainer.Config:
    """Tiny Qwen3.5 dense VL (``Qwen3_5ForConditionalGeneration``: 3 DeltaNet + 1 gated-attention layer with
    dense SwiGLU MLPs, tied embeddings as the 0.8B-4B releases, tower without deepstack) on the toy VL corpus."""
    model = qwen3_5_vl_config(
        vocab_size=520, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, intermediate_size=96, rope_theta=1e7, partial_rotary_factor=0.25,
        mrope_section=(2, 1, 1), max_position_embeddings=4096, vision=dict(_TOY_VISION), **_TOY_IDS,
        tie_word_embeddings=True, mtp_num_hidden_layers=mtp_num_hidden_layers,
    )  # fmt: skip
    return _debug_trainer(model, "qwen3_vl_moe")


def _release_run(model: Qwen3VlMoeModel.Config, *, tokens_per_microbatch: int, ac: str, lr: float,
                 warmup_steps: int) -> Trainer.Config:
    """The run of a release-size recipe: bf16 FSDP over every rank (the tower in its own FSDP-only units), packed
    VL micro-batches of ``tokens_per_microbatch`` tokens, recomputation ``ac``, AdamW with a cosine schedule, async
    checkpoints."""
    return Trainer.Config(
        model_spec="qwen3_vl_moe",
        model=model,
        training=TrainingConfig(steps=10000, max_norm=1.0, mixed_precision_param="bfloat16"),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1),
        activation_checkpoint=ActivationCheckpointConfig(mode=ac),
        # a fixed global batch: one micro-batch per rank of one 8-GPU node (fewer ranks accumulate more)
        data=VisionLanguageDataLoader.Config(max_tokens_per_microbatch=tokens_per_microbatch,
                                             global_batch_tokens=8 * tokens_per_microbatch, num_workers=2),  # fmt: skip
        optimizer=OptimizersContainer.Config(name="adamw", lr=lr, weight_decay=0.1),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=warmup_steps, decay_type="cosine", min_lr_ratio=0.1),
        checkpoint=CheckpointManager.Config(enable=True, interval=500, keep_latest_k=3, async_mode="async"),
        metrics=MetricsProcessor.Config(log_freq=10),
    )


def qwen3_vl_moe_a3b() -> Trainer.Config:
    """Qwen3-VL-30B-A3B dims (reference doc section 6): text 30.5B total / ~3.35B active, bf16 FSDP.

    Text: hidden 2048, 48 layers, 32 q / 4 kv heads of 128, full-rotary M-RoPE (24, 20, 20), theta 5e6,
    128 experts top-8 of 768, vocab 151936, untied. Tower: depth 27, width 1152, 16 heads, MLP 4304,
    patch 16, 48 x 48 positions, deepstack after blocks 8, 16, 24. No MTP block: the release ships none. Start
    from the release with ``--checkpoint.initial_load_path`` (its config.json is then the model).
    """
    model = qwen3_vl_moe_config(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        rope_theta=5e6, mrope_section=(24, 20, 20), rms_norm_eps=1e-6, max_position_embeddings=262144,
        vision=dict(depth=27, dim=1152, n_heads=16, intermediate_size=4304, patch_size=16, temporal_patch_size=2,
                    spatial_merge_size=2, num_position_embeddings=2304, deepstack_visual_indexes=(8, 16, 24)),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    )  # fmt: skip
    # full recomputation: without it one 8192-token micro-batch peaks at ~147 GiB on 8 x 80 GiB (dry run)
    return _release_run(model, tokens_per_microbatch=8192, ac="full", lr=2e-5, warmup_steps=200)


def qwen3_vl_moe_a3b_lora() -> Trainer.Config:
    """``qwen3_vl_moe_a3b`` as a LoRA run on 2 x 80 GiB or 4 x 40 GiB (FSDP over the ranks launched): adapters on
    the text model's attention and routed experts; the vision tower frozen.

    Rank 16 (alpha 32) on q/k/v/o and each of the 128 routed experts per layer: 642.5M trained parameters. The frozen
    base is stored once in bf16 (routers fp32), FSDP-sharded, with no gradient or optimizer state. Dry run (``python
    -m hyper_parallel.dry_run --module qwen3_vl_moe --config qwen3_vl_moe_a3b_lora --world_size N
    --device_memory_gib G``; text-only micro-batches), GiB per rank:

        ranks x GiB   params  grads  optim  static  peak
        2 x 80         30.15   1.20   2.39   33.74  40.49
        4 x 40         15.07   0.60   1.20   16.87  24.22
    """
    cfg = qwen3_vl_moe_a3b()
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "experts")  # every text layer is MoE
    cfg.lora = LoRAConfig(rank=16, alpha=32.0, targets=targets)
    cfg.data.global_batch_tokens = 4 * cfg.data.max_tokens_per_microbatch  # one sequence per rank of 4 (2 on 2 ranks)
    cfg.optimizer.lr, cfg.optimizer.weight_decay = 1e-4, 0.0
    cfg.lr_scheduler.warmup_steps = 50
    return cfg


def qwen3_vl_moe_a3b_ep8() -> Trainer.Config:
    """``qwen3_vl_moe_a3b`` with the 128 routed experts spread over 8 expert-parallel ranks."""
    cfg = qwen3_vl_moe_a3b()
    cfg.parallelism.expert_parallel_degree = 8
    return cfg


# ---- Qwen3.5 dense VL releases (Qwen3_5ForConditionalGeneration), sized for one 8 x 80 GiB node ------------

# The Qwen3.5 tower (all dense releases): 27 blocks of width 1152, 16 heads, MLP 4304, patch 16, 48 x 48
# positions, no deepstack; its ids are the Qwen3.5 tokenizer's (Qwen3_5Config defaults).
_QWEN3_5_VISION = dict(depth=27, dim=1152, n_heads=16, intermediate_size=4304, patch_size=16, temporal_patch_size=2,
                       spatial_merge_size=2, num_position_embeddings=2304)  # fmt: skip
_QWEN3_5_IDS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                    vision_end_token_id=248054)  # fmt: skip
# micro-batch tokens and recomputation per release, from the dry run on 8 x 80 GiB (the recipes' docstrings)
_SIZING_9B = dict(tokens_per_microbatch=16384, ac="full")  # dry-run peak 35.8 GiB of 80 (docstring)
_SIZING_27B = dict(tokens_per_microbatch=8192, ac="full")  # dry-run peak 59.4 GiB of 80


def _qwen3_5_dense_vl(*, tokens_per_microbatch: int, ac: str, **text) -> Trainer.Config:
    """A Qwen3.5 dense VL release's trainer: bf16 FSDP over every rank, the tower FSDP-only (its own units),
    ``tokens_per_microbatch`` packed tokens per micro-batch, activation checkpointing ``ac``. Start from the
    release with ``--checkpoint.initial_load_path`` (its config.json is then the model, MTP block included)."""
    model = qwen3_5_vl_config(
        vocab_size=248320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=(11, 11, 10), rms_norm_eps=1e-6,
        max_position_embeddings=262144, vision=dict(_QWEN3_5_VISION), **_QWEN3_5_IDS, **text,
    )  # fmt: skip
    return _release_run(model, tokens_per_microbatch=tokens_per_microbatch, ac=ac, lr=1e-5, warmup_steps=100)


def qwen3_5_9b_vl() -> Trainer.Config:
    """Qwen3.5-9B VL on one 8 x 80 GiB node: FSDP 8, bf16, 16384-token micro-batches, full recomputation.

    Dry run (``python -m hyper_parallel.dry_run --module qwen3_vl_moe --config qwen3_5_9b_vl --world_size 8``), peak
    GiB per rank: 35.8 (static 17.5: params 4.4, grads 4.4, AdamW 8.8); 8192 tokens 25.9, 32768 tokens 55.6; without
    recomputation 139.4 at 8192 tokens (does not fit). The headroom is for the tower's images (the dry run's
    micro-batches are text) and the allocator.

    Text (transformers' ``Qwen3_5TextConfig`` defaults, "Qwen3.5-9B style", and a public description of the
    release's config.json): hidden 4096, 32 layers (3 DeltaNet : 1 gated attention), 16 q / 4 kv heads of 256,
    intermediate 12288, DeltaNet Hk 16 / Hv 32 of 128, rotary 0.25 with M-RoPE (11, 11, 10), theta 1e7, vocab
    248320, untied. Tower: the Qwen3.5 one (out 4096).
    """
    return _qwen3_5_dense_vl(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, linear_num_key_heads=16,
        linear_num_value_heads=32, intermediate_size=12288, tie_word_embeddings=False, **_SIZING_9B,
    )  # fmt: skip


def qwen3_5_27b_vl() -> Trainer.Config:
    """Qwen3.5-27B VL on one 8 x 80 GiB node: FSDP 8, bf16, 8192-token micro-batches, full recomputation.

    Dry run (``python -m hyper_parallel.dry_run --module qwen3_vl_moe --config qwen3_5_27b_vl --world_size 8``), peak
    GiB per rank: 59.4 (static 51.0: params 12.7, grads 12.7, AdamW 25.5; the peak is at the end of the backward);
    selective recomputation 238.9 (does not fit).

    Dimensions of the release's config.json (tests/torch/ut/released_configs/qwen3_5_27b.json): hidden 5120,
    64 layers (3 DeltaNet : 1 gated attention), 24 q / 4 kv heads of 256, intermediate 17408, DeltaNet Hk 16 /
    Hv 48 of 128, rotary 0.25 with M-RoPE (11, 11, 10), theta 1e7, vocab 248320, untied. Tower: the Qwen3.5
    one (out 5120).
    """
    return _qwen3_5_dense_vl(
        hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, linear_num_key_heads=16,
        linear_num_value_heads=48, intermediate_size=17408, tie_word_embeddings=False, **_SIZING_27B,
    )  # fmt: skip

