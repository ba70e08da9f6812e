"""Recipes of GlmImageMoe runs: plain functions returning ``Trainer.Config``; variants call and change another.

    python -m hyper_parallel.train --module glm_image_moe --config glm_image_moe_debug
"""

from __future__ import annotations

import dataclasses

from hyper_parallel.components import CheckpointManager, LRSchedulersContainer, MetricsProcessor, OptimizersContainer
from hyper_parallel.config import ActivationCheckpointConfig, ParallelismConfig, TrainingConfig
from hyper_parallel.config.lora import LoRAConfig
from hyper_parallel.data import ChatOptions, HuggingFaceTextDataLoader, SourceConfig, TextOptions, TokenDataLoader
from hyper_parallel.models.glm_image_moe_v2.model import glm_image_moe_config, glm_with_mtp
from hyper_parallel.trainer import Trainer

__all__ = [
    "glm_4_7_flash_sft", "glm_4_7_flash_sft_debug", "glm_4_7_flash_sft_lora", "glm_image_moe_a3b",
    "glm_image_moe_a3b_ep8", "glm_image_moe_a3b_lora", "glm_image_moe_a3b_mixed", "glm_image_moe_debug",
    "glm_image_moe_lora_debug", "glm_image_moe_mtp_debug",
]  # fmt: skip

# MLA's projections, the dense and shared MLPs and the routed experts (per expert): what GLM LoRA users target
_GLM_LORA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj", "experts")  # fmt: skip


def glm_image_moe_debug() -> Trainer.Config:
    """Tiny GlmImageMoe on the embedded toy DirectToken corpus; trains on a laptop CPU in seconds per step."""
    model = glm_image_moe_config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
        topk_group=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        codebook_size=256, vq_embed_dim=32, placeholder_token_id=511, image_start_token_id=509,
        image_end_token_id=510, rope_theta=10000.0,
    )  # fmt: skip
    return Trainer.Config(
        model_spec="glm_image_moe",
        model=model,
        training=TrainingConfig(steps=120, max_norm=1.0),
        data=TokenDataLoader.Config(max_tokens_per_microbatch=512, global_batch_tokens=1024, shuffle_buffer=256),
        optimizer=OptimizersContainer.Config(name="adamw", lr=3e-3, weight_decay=0.01),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=10, decay_type="cosine", min_lr_ratio=0.1),
        checkpoint=CheckpointManager.Config(enable=True, interval=50, keep_latest_k=2, export_hf=True, export_dtype="float32"),
        metrics=MetricsProcessor.Config(log_freq=10),
    )


def glm_image_moe_mtp_debug() -> Trainer.Config:
    """``glm_image_moe_debug`` with the GLM-4.7-Flash nextn (MTP) layer on, loss weight 0.3 (the family's
    ``MTP_LOSS_WEIGHT``; ``--model.mtp_loss_weight``): the MTP head also predicts image codes two ahead."""
    cfg = glm_image_moe_debug()
    cfg.model = glm_with_mtp(cfg.model)
    return cfg


def glm_image_moe_lora_debug() -> Trainer.Config:
    """``glm_image_moe_debug`` as a LoRA run (rank 8): adapters on MLA's projections, the MLPs and every routed
    expert, the VQ-to-LLM projection trained in full (``modules_to_save``), everything else frozen; 10 steps."""
    cfg = glm_image_moe_debug()
    cfg.lora = LoRAConfig(rank=8, alpha=16.0, targets=_GLM_LORA_TARGETS, modules_to_save=("vq_to_llm_proj",))
    cfg.training.steps = 10
    cfg.lr_scheduler.warmup_steps = 2
    return cfg


def glm_image_moe_a3b() -> Trainer.Config:
    """GLM-4.7-Flash dimensions (30B total, ~3B active) with the GlmImage VQ path and the release's nextn (MTP)
    layer (``num_nextn_predict_layers`` 1, loss weight 0.3), bf16 FSDP: 30.66B parameters.

    Full activation checkpointing: without it one 8192-token micro-batch needs ~88 GiB of activations
    (``python -m hyper_parallel.dry_run`` on 8-64 ranks), more than an 80 GiB GPU holds; with it the dry run
    peaks at 69.15 GiB per rank on 8 ranks (10.85 GiB headroom, MTP layer included). A step is 1M tokens (128
    micro-batches of 8192 over the data-parallel ranks, whatever their number).
    """
    model = glm_image_moe_config(
        vocab_size=154880, hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536,
        num_hidden_layers=47, num_attention_heads=20, n_routed_experts=64, num_experts_per_tok=4,
        n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True,
        q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
        codebook_size=16384, vq_embed_dim=2048, placeholder_token_id=154879, rope_theta=1000000.0,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    return Trainer.Config(
        model_spec="glm_image_moe",
        model=glm_with_mtp(model),  # the release's nextn layer (num_nextn_predict_layers 1)
        training=TrainingConfig(steps=10000, max_norm=1.0, mixed_precision_param="bfloat16"),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1),
        activation_checkpoint=ActivationCheckpointConfig(mode="full"),
        data=TokenDataLoader.Config(max_tokens_per_microbatch=8192, global_batch_tokens=1 << 20, num_workers=2),
        optimizer=OptimizersContainer.Config(name="adamw", lr=2e-5, weight_decay=0.1),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=200, decay_type="cosine", min_lr_ratio=0.1),
        checkpoint=CheckpointManager.Config(enable=True, interval=500, keep_latest_k=3, async_mode="async"),
        metrics=MetricsProcessor.Config(log_freq=10),
    )


def glm_image_moe_a3b_lora() -> Trainer.Config:
    """``glm_image_moe_a3b`` as a LoRA run on 2 x 80 GiB or 4 x 40 GiB (FSDP over the ranks launched).

    Rank-16 adapters (alpha 32) on MLA's projections, the dense and shared MLPs and each of the 64 routed experts per
    layer: 439.5M trained parameters, plus ``vq_to_llm_proj`` in full (4.2M); the recipe's nextn (MTP) layer off
    (a run from the release folder follows the folder's, frozen, unless ``--model.use_mtp false``). The frozen base
    is stored once in bf16 (routers fp32), FSDP-sharded, with no gradient or optimizer state. Dry run (``python -m
    hyper_parallel.dry_run --module glm_image_moe --config glm_image_moe_a3b_lora --world_size N
    --device_memory_gib G``), GiB per rank:

        ranks x GiB   params  grads  optim  static  peak
        2 x 80         28.88   0.83   1.65   31.35  40.08
        4 x 40         14.50   0.41   0.83   15.74  24.47
    """
    cfg = glm_image_moe_a3b()
    cfg.model = dataclasses.replace(cfg.model, use_mtp=False)  # frozen, unadapted: the release's block passes through
    cfg.lora = LoRAConfig(rank=16, alpha=32.0, targets=_GLM_LORA_TARGETS, modules_to_save=("vq_to_llm_proj",))
    cfg.optimizer.lr, cfg.optimizer.weight_decay = 1e-4, 0.0
    cfg.lr_scheduler.warmup_steps = 50
    return cfg


def glm_image_moe_a3b_ep8() -> Trainer.Config:
    """``glm_image_moe_a3b`` with the 64 routed experts spread over 8 expert-parallel ranks."""
    cfg = glm_image_moe_a3b()
    cfg.parallelism.expert_parallel_degree = 8
    return cfg


# ---- GLM-4.7-Flash itself (no image path) and GlmImageMoe on images + conversations ------------------------------


def _chat_data(cfg: Trainer.Config, *, tokens: int, global_tokens: int) -> None:
    """Chat SFT data: a jsonl with a ``messages`` column, assistant turns only, long conversations cut at a turn."""
    cfg.data = HuggingFaceTextDataLoader.Config(
        source="text", text=TextOptions(chat_column="messages", split_long_documents=False),
        chat=ChatOptions(loss_on="assistant", long_conversations="cut"),
        max_tokens_per_microbatch=tokens, global_batch_tokens=global_tokens,
        num_workers=cfg.data.num_workers,
    )  # fmt: skip


def glm_4_7_flash_sft_debug() -> Trainer.Config:
    """``glm_image_moe_debug``'s trunk without image path (a tiny Glm4MoeLite) fine-tuned on the embedded toy
    conversations, assistant turns only; a laptop CPU runs it offline. A GLM-4.7-Flash folder given as
    ``--checkpoint.initial_load_path`` replaces the model (README, "GLM-4.7-Flash")."""
    cfg = glm_image_moe_debug()
    cfg.model = dataclasses.replace(cfg.model, image_path=False)
    _chat_data(cfg, tokens=256, global_tokens=512)
    cfg.training.steps = 60
    return cfg


def glm_4_7_flash_sft() -> Trainer.Config:
    """GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``: ~30B parameters, ~3B active, no image path, the release's
    nextn layer trained as MTP with weight 0.3) fine-tuned on conversations in full: bf16 FSDP over one node of
    8 x 80 GiB, every layer recomputed, 8192-token micro-batches, 256k tokens a step (32 micro-batches over the
    data-parallel ranks, whatever their number), lr 1e-5.

    Start from the release: ``--checkpoint.initial_load_path GLM-4.7-Flash --data.tokenizer GLM-4.7-Flash
    --data.path chats.jsonl``; the export is a Glm4MoeLite folder in bf16 (the release's form). Dry run
    (``python -m hyper_parallel.dry_run --module glm_image_moe --config glm_4_7_flash_sft --world_size 8``):

        ranks x GiB   params  grads  optim  static  peak   headroom
        8 x 80         14.24  14.24  28.49   56.97  68.41  11.59 GiB (14.5%)
    """
    cfg = glm_image_moe_a3b()
    cfg.model = dataclasses.replace(cfg.model, image_path=False)
    _chat_data(cfg, tokens=8192, global_tokens=1 << 18)
    cfg.optimizer.lr = 1e-5
    cfg.lr_scheduler.warmup_steps = 50
    cfg.training.steps = 2000
    return cfg


def glm_4_7_flash_sft_lora() -> Trainer.Config:
    """``glm_4_7_flash_sft`` as a LoRA run: rank-16 adapters (alpha 32) on MLA's projections, the dense and shared
    MLPs and each routed expert, the rest frozen in bf16; the release's nextn layer kept aside (passthrough,
    byte-equal in the export; ``--model.use_mtp true`` trains it frozen under the adapters' loss). Dry run on
    8 x 80 GiB (``--world_size 8``), GiB per rank:

        ranks x GiB   params  grads  optim  static  peak   headroom
        8 x 80          7.18   0.20   0.41    7.79  15.82  64.18 GiB
    """
    cfg = glm_4_7_flash_sft()
    cfg.model = dataclasses.replace(cfg.model, use_mtp=False)
    cfg.lora = LoRAConfig(rank=16, alpha=32.0, targets=_GLM_LORA_TARGETS)
    cfg.optimizer.lr, cfg.optimizer.weight_decay = 1e-4, 0.0
    return cfg


def glm_image_moe_a3b_mixed() -> Trainer.Config:
    """``glm_image_moe_a3b`` trained on DirectToken images and text conversations in one run (``data.sources``):
    70% of the tokens from image-token shards, 30% from chats (assistant turns only); ``loss/images`` and
    ``loss/chat`` logged per step. From a GLM-4.7-Flash folder the image path is grown at start (the DirectToken
    source needs it) and the export is the GlmImageMoe form. The sources' paths and the chats' tokenizer come from a
    run file (README, "GLM-4.7-Flash with images"); left empty they are the embedded toy corpora. Dry run on
    8 x 80 GiB (``--world_size 8``), GiB per rank:

        ranks x GiB   params  grads  optim  static  peak   headroom
        8 x 80         14.39  14.26  28.52   57.17  69.27  10.73 GiB (13.4%)
    """
    cfg = glm_image_moe_a3b()
    tokens = cfg.data.max_tokens_per_microbatch
    cfg.data.sources = [
        SourceConfig(name="images", source="direct_token", weight=0.7),
        SourceConfig(name="chat", source="text", weight=0.3, text=TextOptions(chat_column="messages"),
                     chat=ChatOptions(loss_on="assistant")),
    ]
    cfg.data.global_batch_tokens = 64 * tokens
    return cfg
