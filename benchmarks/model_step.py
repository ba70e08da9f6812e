"""Forward+backward tokens/s of our GlmImageMoe vs HF Glm4MoeLiteForCausalLM, side by side in one run.

Same config, same weights (ours loads HF's save_pretrained output), fp32, 2 threads. One row of
``--seq`` tokens, three ways:

- HF: one document, HF's SDPA attention, ``F.cross_entropy`` on fp32 logits (HF's training step);
- ours, unpacked: the same row as one document (no ``cu_seqlens``);
- ours, packed: what the packing collate emits for the same budget, a ``seq - pad`` token document plus
  its padding run as a second segment (``cu_seqlens = [0, seq - pad, seq]``), so the packed attention
  path runs; ``--docs`` adds a row of several documents (less attention work: informative only).

Ours uses the trainer's loss (``CrossEntropyLoss``, chunked fp32). The three are timed in turn each
iteration (medians; the best time too, the steadier number on a shared machine), so machine noise
hits them alike. Prints tokens/s, the packed/unpacked ratio, the
speed-up over HF, and model FLOPs utilisation against a measured fp32 matmul peak of this machine.

    .venv/bin/python benchmarks/model_step.py [--seq 2048] [--pad 8] [--iters 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F


VOCAB = 4096


def glm_bench_config():
    """The benchmarks' GLM-4.7-Flash-shaped ``Glm4MoeLiteConfig`` (4 layers, 16 experts, MLA; also used by lora_step.py)."""
    from transformers import Glm4MoeLiteConfig

    return Glm4MoeLiteConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
        n_group=1, topk_group=1, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, max_position_embeddings=4096, pad_token_id=None, use_cache=False,
    )  # fmt: skip


def measure_matmul_peak(n: int = 1024, iters: int = 10) -> float:
    """fp32 FLOP/s of a square matmul (the attainable dense peak on this CPU)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    return 2 * n**3 * iters / (time.perf_counter() - t)


def packed_batch(ids: torch.Tensor, lengths: list[int]) -> dict:
    """The collate's view of one row holding ``lengths`` segments: labels, positions and boundaries."""
    from hyper_parallel.models.common.attention import AttentionMeta

    seq = ids.shape[1]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    labels = torch.roll(ids, -1, dims=1)
    labels[0, (cu[1:] - 1).long()] = -100  # a document's last token predicts nothing
    if lengths[-1] < 64:  # the padding run carries no loss
        labels[0, seq - lengths[-1] :] = -100
    position_ids = AttentionMeta(cu_seqlens=cu).position_ids(1, seq)
    return dict(labels=labels, cu_seqlens=cu, max_seqlen=max(lengths), position_ids=position_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--pad", type=int, default=8, help="padding segment of the packed row")
    parser.add_argument("--docs", type=str, default="", help="e.g. 1024,512,384,128: also time this packing")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import Glm4MoeLiteForCausalLM

    from hyper_parallel.components import CrossEntropyLoss
    from hyper_parallel.models.glm_image_moe_v2 import from_pretrained

    vocab = VOCAB
    hf_cfg = glm_bench_config()
    torch.manual_seed(0)
    hf = Glm4MoeLiteForCausalLM(hf_cfg)
    hf.config._attn_implementation = "sdpa"
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = from_pretrained(d, codebook_size=1024, vq_embed_dim=64)
    hf.train()
    ours.train()
    loss_fn = CrossEntropyLoss.Config().build()
    seq = args.seq
    ids = torch.randint(0, vocab - 1, (1, seq), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)

    def hf_step() -> None:
        logits = hf(input_ids=ids, use_cache=False).logits
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        hf.zero_grad(set_to_none=True)

    def our_step(batch: dict | None) -> None:
        if batch is None:
            out, step_labels = ours(ids), labels
        else:
            step_labels = batch["labels"]
            out = ours(
                ids, position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"]
            )
        logits = getattr(out, "logits", out)
        loss_fn(logits, step_labels).backward()
        ours.zero_grad(set_to_none=True)

    runs = {
        "HF    Glm4MoeLiteForCausalLM, 1 document     ": hf_step,
        "ours  GlmImageMoeModel, unpacked (1 document)": lambda: our_step(None),
        f"ours  packed: {seq - args.pad} + {args.pad} padding          ": lambda: our_step(
            packed_batch(ids, [seq - args.pad, args.pad])
        ),
    }
    if args.docs:
        lengths = [int(n) for n in args.docs.split(",")]
        if sum(lengths) != seq:
            lengths.append(seq - sum(lengths))
        runs[f"ours  packed: {len(lengths)} segments {lengths}"] = lambda: our_step(packed_batch(ids, lengths))
    for fn in runs.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.iters):  # in turn, so machine noise hits every path alike
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    best = {name: min(ts) for name, ts in times.items()}
    _, flops_per_token = ours.get_nparams_and_flops(seq)
    peak = measure_matmul_peak()
    names = list(runs)
    hf_s, unpacked_s, packed_s = (med[n] for n in names[:3])
    print(f"config: hidden 256, 4 layers, 16 experts top-4, seq {seq}, fp32, {args.threads} threads, "
          f"median of {args.iters}")  # fmt: skip
    for name in names:
        s = med[name]
        print(f"{name}: {seq / s:8.1f} tokens/s  ({s * 1e3:5.0f} ms/step, best {best[name] * 1e3:5.0f})  "
              f"MFU {flops_per_token * seq / s / peak:6.1%}")  # fmt: skip
    b_hf, b_unpacked, b_packed = (best[n] for n in names[:3])
    print(f"packed / unpacked time: {packed_s / unpacked_s:.3f} (best: {b_packed / b_unpacked:.3f})   "
          "(acceptance: <= 1.10)")  # fmt: skip
    print(f"speed-up over HF: unpacked {hf_s / unpacked_s:.2f}x, packed {hf_s / packed_s:.2f}x "
          f"(best: {b_hf / b_unpacked:.2f}x, {b_hf / b_packed:.2f}x)   (acceptance: packed >= 1.5x)")  # fmt: skip
    print(f"measured fp32 matmul peak {peak / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
