"""Recipes of Qwen3.5-MoE runs: plain functions returning ``Trainer.Config``; variants call and change another.

    python -m hyper_parallel.train --module qwen3_5_moe --config qwen3_5_moe_debug
"""

from __future__ import annotations

import dataclasses

from hyper_parallel.config.lora import LoRAConfig
from hyper_parallel.models.qwen3_5_moe_v2.model import qwen3_5_moe_config
from hyper_parallel.models.qwen3_5_v2.trainer_config import qwen3_5_text_trainer
from hyper_parallel.trainer import Trainer

__all__ = [
    "qwen3_5_moe_397b", "qwen3_5_moe_397b_lora", "qwen3_5_moe_a3b", "qwen3_5_moe_a3b_128k", "qwen3_5_moe_a3b_256k",
    "qwen3_5_moe_a3b_ep8", "qwen3_5_moe_a3b_lora", "qwen3_5_moe_debug", "qwen3_5_moe_lora_debug", "qwen3_5_moe_sft_debug",
]  # fmt: skip


def qwen3_5_moe_debug() -> Trainer.Config:
    """Tiny Qwen3.5-MoE (3 DeltaNet + 1 gated-attention layer, 8 experts) that trains on a laptop CPU."""
    model = qwen3_5_moe_config(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=(2, 1, 1),
        router_aux_loss_coef=0.001, max_position_embeddings=4096,
    )  # fmt: skip
    return qwen3_5_text_trainer("qwen3_5_moe", model, debug=True)


def qwen3_5_moe_lora_debug() -> Trainer.Config:
    """``qwen3_5_moe_debug`` as a LoRA run (rank 8): adapters on every Gated DeltaNet and attention projection, the
    shared expert and every routed expert (per expert, through the grouped matmul), everything else frozen; 10
    steps."""
    cfg = qwen3_5_moe_debug()
    targets = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
               "shared_expert", "experts")  # fmt: skip
    cfg.lora = LoRAConfig(rank=8, alpha=16.0, targets=targets)
    cfg.training.steps = 10
    cfg.lr_scheduler.warmup_steps = 2
    return cfg


def qwen3_5_moe_sft_debug() -> Trainer.Config:
    """``qwen3_5_moe_debug`` fine-tuned on the embedded toy conversations (toy_chat.jsonl), assistant turns only.

    Your own chats: ``--data.path chats.jsonl --data.tokenizer /models/Qwen3.5-35B-A3B`` (README, "Fine-tune on
    your own chat data")."""
    cfg = qwen3_5_moe_debug()
    cfg.training.steps = 60
    cfg.data.text.chat_column = "messages"
    cfg.data.text.split_long_documents = False  # a conversation is cut at a turn boundary, never mid-turn
    cfg.data.chat.loss_on = "assistant"
    cfg.data.chat.long_conversations = "cut"
    cfg.data.max_tokens_per_microbatch = 256
    cfg.data.global_batch_tokens = 512
    return cfg


A3B_CP = 2
"""Context-parallel degree of ``qwen3_5_moe_a3b`` on its 8 x 80 GiB node."""


def _fixed_global_batch(cfg: Trainer.Config, ranks: int) -> Trainer.Config:
    """Fix ``cfg``'s global batch at one micro-batch per data-parallel rank of the ``ranks`` it is sized for
    (``ranks / cp`` sequences of ``max_tokens_per_microbatch``): the optimizer step is then the same on any number
    of ranks, which only changes how many micro-batches each rank accumulates."""
    cfg.data.global_batch_tokens = max(1, ranks // cfg.parallelism.context_parallel_degree) * cfg.data.max_tokens_per_microbatch
    return cfg


def qwen3_5_moe_a3b() -> Trainer.Config:
    """Qwen3.5-35B-A3B text dimensions (34.66B total, ~3.45B active), bf16 FSDP.

    From the HF config defaults and the reference doc section 6: hidden 2048, 40 layers (3 DeltaNet : 1
    attention), 16 q / 2 kv heads of 256, rotary 0.25 with mrope (11, 11, 10), DeltaNet Hk 16 / Hv 32 of
    128, conv 4, 256 experts top-8 of 512, shared expert 512, vocab 248320, untied head, and the release's MTP
    block (``mtp_num_hidden_layers`` 1: one more gated-attention MoE layer, 0.85B parameters, 35.51B in all).
    ``rope_theta`` 1e7 is the released value; a run started from the release folder
    (``--checkpoint.initial_load_path``) takes every model field from its config.json anyway.

    Sized for one node of 8 x 80 GiB (dry run): FSDP's fp32 parameter and gradient shards and AdamW's two
    moments take 66.1 GiB per rank, so every 8192-token sequence is split over 2 ranks (context parallel 2:
    Ulysses over the 2 K/V heads and 16 DeltaNet key heads), the 256 routed experts are spread over the 8 ranks
    (expert parallel 8: no rank gathers a layer's experts or reduce-scatters their gradients, 1.6 GiB each with
    FSDP), every layer is recomputed in backward, and gradients are reduce-scattered in bf16: the dry run
    (``python -m hyper_parallel.dry_run --module qwen3_5_moe --config qwen3_5_moe_a3b --world_size 8``) peaks at
    69.78 GiB per rank with the MTP block (12.8% headroom; this recipe keeps at least 10%). FSDP over the experts
    instead peaked at 73.32 GiB (72.34 with context parallel 4, 74.53 with 8). Without recomputation it peaked at
    216 GiB. The global batch is fixed (one sequence per data-parallel rank of this node, 32768 tokens): fewer
    ranks accumulate more micro-batches for the same optimizer step. A small stand-in folder on one process:
    ``--parallelism.context_parallel_degree 1 --parallelism.expert_parallel_degree 1``.
    """
    model = qwen3_5_moe_config(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, rope_theta=1e7, partial_rotary_factor=0.25,
        mrope_section=(11, 11, 10), rms_norm_eps=1e-6, max_position_embeddings=262144, mtp_num_hidden_layers=1,
    )  # fmt: skip
    cfg = qwen3_5_text_trainer("qwen3_5_moe", model, debug=False)
    cfg.parallelism.context_parallel_degree = A3B_CP
    cfg.parallelism.expert_parallel_degree = 8
    cfg.activation_checkpoint.mode = "full"
    cfg.training.mixed_precision_reduce = "bfloat16"
    return _fixed_global_batch(cfg, 8)


def qwen3_5_moe_a3b_lora() -> Trainer.Config:
    """``qwen3_5_moe_a3b`` as a LoRA run on 2 x 80 GiB or 4 x 40 GiB (FSDP over the ranks launched).

    Rank-16 adapters (alpha 32) on every linear projection (Gated DeltaNet, gated attention, shared expert) and on
    each of the 256 routed experts per layer: 943.9M trained parameters, 2.7% of the model; the recipe's MTP block
    off (no adapter form can name it; a run from the release folder follows the folder's block, frozen, unless
    ``--model.use_mtp false``: 20.06 GiB static per rank on 4 x 40 GiB with it). The frozen base is stored once in
    bf16 (routers fp32), FSDP-sharded, with no gradient or optimizer state, so 8192-token sequences fit whole on a
    rank (no context parallel) with every layer recomputed. Dry run (``python -m hyper_parallel.dry_run --module qwen3_5_moe --config qwen3_5_moe_a3b_lora
    --world_size N --device_memory_gib G``), GiB per rank:

        ranks x GiB   params  grads  optim  static  peak
        2 x 80         34.06   1.76   3.52   39.33  49.31
        4 x 40         17.03   0.88   1.76   19.67  30.52
    """
    cfg = qwen3_5_moe_a3b()
    cfg.model = dataclasses.replace(cfg.model, use_mtp=False)  # frozen, unadapted: the release's block passes through
    cfg.lora = LoRAConfig(rank=16, alpha=32.0, targets=("all-linear", "experts"))
    cfg.parallelism.context_parallel_degree = 1  # 8192-token sequences fit whole on one rank
    cfg.parallelism.expert_parallel_degree = 1  # 2 or 4 ranks: the experts FSDP-sharded with the rest
    _fixed_global_batch(cfg, 4)  # one sequence per rank of 4 x 40 GiB (two on each of 2 x 80 GiB)
    cfg.optimizer.lr, cfg.optimizer.weight_decay = 1e-4, 0.0
    cfg.lr_scheduler.warmup_steps = 50
    return cfg


def qwen3_5_moe_a3b_ep8() -> Trainer.Config:
    """``qwen3_5_moe_a3b`` with the 256 routed experts spread over 8 expert-parallel ranks (now the a3b recipe's own
    layout; kept for the commands that name it)."""
    cfg = qwen3_5_moe_a3b()
    cfg.parallelism.expert_parallel_degree = 8
    return cfg


def qwen3_5_moe_a3b_128k() -> Trainer.Config:
    """``qwen3_5_moe_a3b`` at 128k tokens per sequence on one node (8 x 80 GiB): context parallel 8.

    Every rank holds 16k tokens of each sequence (balanced order: pieces r and 15 - r of 16). The gated
    attention has 2 K/V heads, so it gathers K/V over the 8 ranks (Llama 3's all-gather form); Gated DeltaNet's
    16 key heads split 2 per rank (Ulysses). Muon: AdamW's two fp32 moments take 32 GiB per rank here, which
    with the fp32 parameter and gradient shards (16 GiB each) leaves too little for 16k-token activations and
    the 248k-vocabulary logits. With the MTP block (a second head pass) the dry run peaks at 63.79 GiB per rank.
    """
    cfg = qwen3_5_moe_a3b()
    cfg.parallelism.context_parallel_degree = 8
    cfg.parallelism.expert_parallel_degree = 1  # sized with the experts FSDP-sharded (the docstring's dry run)
    cfg.data.max_tokens_per_microbatch = 131072
    cfg.optimizer.name = "muon"
    return _fixed_global_batch(cfg, 8)


def qwen3_5_moe_a3b_256k() -> Trainer.Config:
    """``qwen3_5_moe_a3b`` at 256k tokens per sequence on two nodes (16 x 80 GiB): context parallel 16.

    Every rank holds 16k tokens of each sequence; attention gathers K/V over the 16 ranks, Gated DeltaNet's
    16 key heads split one per rank (Ulysses). FSDP over the 16 ranks halves the static state per rank, so
    AdamW fits.
    """
    cfg = qwen3_5_moe_a3b()
    cfg.parallelism.context_parallel_degree = 16
    cfg.parallelism.expert_parallel_degree = 1  # sized with the experts FSDP-sharded (the docstring's dry run)
    cfg.data.max_tokens_per_microbatch = 262144
    return _fixed_global_batch(cfg, 16)


def qwen3_5_moe_397b() -> Trainer.Config:
    """Qwen3.5-397B-A17B text dimensions, bf16, 32k-token sequences, pipeline parallel 8 on 128 x 80 GiB.

    Dimensions of the release's config.json (Qwen/Qwen3.5-397B-A17B; transcribed from public tables that vendor it,
    not read from the release file here): hidden 4096, 60 layers (3 DeltaNet : 1 gated attention), 32 q / 2 kv heads
    of 256, rotary 0.25 with mrope (11, 11, 10), rope_theta 1e7, DeltaNet Hk 16 / Hv 64 of 128, conv 4, 512 experts
    top-10 of 1024, shared expert 1024, vocab 248320, untied head, context 262144, one MTP layer (396.3B + 6.6B).

    Layout: 8 stages (1F1B, split by layer cost: the head weighs on the last) of 16 ranks: context parallel 4 (8k
    tokens of every sequence per rank) x FSDP 4, experts over 16 expert-parallel ranks (an FSDP stage under torch's
    schedules keeps its unsharded weights and gradients for the whole step); every layer recomputed, bf16 gradient
    reduction, Muon, the MTP block off (its embeddings would double the p2p bytes and the 8 GiB of receive buffers
    torch's PipelineStage keeps per direction for 64 micro-batches; ``--model.use_mtp true`` adds them back). 8M
    tokens per step, bubble 7/71. Dry run (``--world_size 128``): peak 72.80 GiB on stage 0 (8 layers, 37.67 static),
    69.93 on stage 4. Full training does not fit 64 ranks (stage 0 holds 75.35 GiB of static state with Muon, 99.82
    with AdamW, before 8 GiB of receive buffers and the activations); LoRA does (``qwen3_5_moe_397b_lora``).
    """
    model = qwen3_5_moe_config(
        vocab_size=248320, hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=1024, shared_expert_intermediate_size=1024, rope_theta=1e7, partial_rotary_factor=0.25,
        mrope_section=(11, 11, 10), rms_norm_eps=1e-6, max_position_embeddings=262144, mtp_num_hidden_layers=1,
    )  # fmt: skip
    cfg = qwen3_5_text_trainer("qwen3_5_moe", dataclasses.replace(model, use_mtp=False), debug=False)
    cfg.parallelism.pipeline_parallel_degree = 8
    cfg.parallelism.pipeline_schedule = "1F1B"
    cfg.parallelism.context_parallel_degree = 4
    cfg.parallelism.expert_parallel_degree = 16
    cfg.activation_checkpoint.mode = "full"
    cfg.training.mixed_precision_reduce = "bfloat16"
    cfg.optimizer.name = "muon"
    cfg.data.max_tokens_per_microbatch = 32768
    cfg.data.global_batch_tokens = 1 << 23
    return cfg


def qwen3_5_moe_397b_lora() -> Trainer.Config:
    """``qwen3_5_moe_397b`` as a rank-16 LoRA run on 64 x 80 GiB (8 stages of 8 ranks), the frozen base in bf16."""
    cfg = qwen3_5_moe_397b()
    cfg.lora = LoRAConfig(rank=16, alpha=32.0, targets=("all-linear", "experts"))
    cfg.parallelism.expert_parallel_degree = 8  # the 8 ranks of a stage
    cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.weight_decay = "adamw", 1e-4, 0.0
    return cfg
