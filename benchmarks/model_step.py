"""Forward+backward tokens/s of our GlmImageMoe vs HF Glm4MoeLiteForCausalLM, side by side in one run.

Same config, same weights (ours loads HF's save_pretrained output), same batch, fp32, 2 threads.
Prints both throughputs, their ratio, and each one's model FLOPs utilisation against a measured fp32
matmul peak of this machine.

    .venv/bin/python benchmarks/model_step.py [--seq 2048] [--iters 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F


def measure_matmul_peak(n: int = 1024, iters: int = 10) -> float:
    """fp32 FLOP/s of a square matmul (the attainable dense peak on this CPU)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    return 2 * n**3 * iters / (time.perf_counter() - t)


def time_step(fn, iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    from hyper_parallel.models.glm_image_moe_v2 import from_pretrained

    vocab = 4096
    hf_cfg = Glm4MoeLiteConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
        n_group=1, topk_group=1, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, max_position_embeddings=4096, pad_token_id=None, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Glm4MoeLiteForCausalLM(hf_cfg)
    hf.config._attn_implementation = "sdpa"
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = from_pretrained(d, codebook_size=1024, vq_embed_dim=64)
    hf.train()
    ours.train()
    ids = torch.randint(0, vocab - 1, (1, args.seq), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)

    def hf_step() -> None:
        logits = hf(input_ids=ids, use_cache=False).logits
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        hf.zero_grad(set_to_none=True)

    def our_step() -> None:
        logits = ours(ids)
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        ours.zero_grad(set_to_none=True)

    # interleave the two so machine noise hits both alike
    hf_t, our_t = [], []
    for _ in range(args.iters):
        hf_t.append(time_step(hf_step, 1))
        our_t.append(time_step(our_step, 1))
    hf_s, our_s = statistics.median(hf_t), statistics.median(our_t)
    _, flops_per_token = ours.get_nparams_and_flops(args.seq)
    peak = measure_matmul_peak()
    tok = args.seq
    print(f"config: hidden 256, 4 layers, 16 experts top-4, seq {args.seq}, fp32, {args.threads} threads")
    print(f"HF    Glm4MoeLiteForCausalLM: {tok / hf_s:9.1f} tokens/s  ({hf_s * 1e3:.0f} ms/step)  "
          f"MFU {flops_per_token * tok / hf_s / peak:6.1%}")  # fmt: skip
    print(f"ours  GlmImageMoeModel      : {tok / our_s:9.1f} tokens/s  ({our_s * 1e3:.0f} ms/step)  "
          f"MFU {flops_per_token * tok / our_s / peak:6.1%}")  # fmt: skip
    print(f"speed-up ours / HF: {hf_s / our_s:.2f}x   (measured fp32 matmul peak {peak / 1e9:.1f} GFLOP/s)")


if __name__ == "__main__":
    main()
