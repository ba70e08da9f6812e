"""Data pipeline: throughput per rank, resume cost, tokenisation, padding (a measurement, not a test).

Prints:

1. **read + decode + pack + collate, per rank**, on the embedded DirectToken toy corpus and on a
   long-tailed length mix: real tokens/s of DP rank 0 in layouts of 1, 2 and 4 ranks
   (``num_workers`` 0 and 1). Every rank plans the whole global stream from the shard indexes but
   reads only its own records, so per-rank throughput should hold as ranks are added.
2. **resume at step 10,000** on the toy corpus repeated to a large size (symlinked shards + their
   indexes): the time to build the loader, load a step-10,000 state and return the first step,
   next to the time a replay of 10,000 steps would take at the measured step rate. Also the time to
   plan 10,000 steps ahead without any state (``advance``: planning only, no reads).
3. **text**: tokenise + cache raw jsonl on first use (tokens/s), then read + pack from the cache.
4. **padding** of first-fit packing (``packing_bins`` 1 and 8) versus pad-to-longest batching.

Run: ``python benchmarks/data_pipeline.py [--steps 200] [--repeat 64]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from hyper_parallel.data import DataConfig, ToyCorpusSpec, cached_toy_corpus, read_samples, write_shards
from hyper_parallel.data.packing import FirstFitPacker

V, C, P = 512, 256, 511
FACTS = {"vocab_size": V, "codebook_size": C, "placeholder_token_id": P}


def long_tail_corpus(out_dir: str, num_samples: int = 3000, seed: int = 0) -> str:
    """Lognormal document lengths (median ~150 tokens, tail to 4096), a third of them with an image."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(num_samples):
        length = int(np.clip(rng.lognormal(mean=5.0, sigma=1.0), 8, 4096))
        grids = []
        if i % 3 == 0 and length > 80:
            side = int(min(32, np.sqrt(length * 0.6)))
            grids = [[side, side]]
        n_img = sum(h * w for h, w in grids)
        text = rng.integers(5, V - 1, size=length - n_img)
        tokens = np.concatenate([text[:2], np.full(n_img, P), text[2:]]).astype(np.int32)
        samples.append({"tokens": tokens, "vq_codes": rng.integers(0, C, n_img), "image_grids": grids})
    write_shards(out_dir, samples, placeholder_token_id=P, samples_per_shard=250)
    return out_dir


def throughput(cfg: DataConfig, facts: dict, dp: int, steps: int) -> float:
    """Real (non-padding) tokens/s of DP rank 0 of ``dp`` ranks."""
    loader = cfg.build(model_facts=facts, dp_rank=0, dp_world_size=dp)
    loader.next_step()  # start-up (worker fork, first window planned) excluded
    tokens, t0 = 0, time.perf_counter()
    for _ in range(steps):
        for mb in loader.next_step():
            tokens += mb["input_ids"].numel()  # pad_to_multiple_of=1: every token is a real one
    elapsed = time.perf_counter() - t0
    loader.close()
    return tokens / elapsed


def per_rank_table(name: str, path: str, facts: dict, budget: int, steps: int, cache: str, **extra) -> None:
    print(f"\n== {name}: read + decode + pack + collate of DP rank 0, real tokens/s ({budget} tokens/micro-batch, "
          "4 micro-batches per step over all ranks)")  # fmt: skip
    for workers in (0, 1):
        row = []
        for dp in (1, 2, 4):
            cfg = DataConfig(path=path, cache_dir=cache, max_tokens_per_microbatch=budget, global_batch_tokens=4 * budget,
                             num_workers=workers, **extra)  # fmt: skip
            row.append(f"{dp} rank{'s' * (dp > 1)}: {throughput(cfg, facts, dp, max(steps // dp, 20)) / 1e3:8,.0f} k")
        print(f"  num_workers={workers}:  " + "   ".join(row))


def resume_cost(toy: str, repeat: int, tmp: str, step: int = 10_000) -> None:
    big = os.path.join(tmp, "big")
    os.makedirs(big)
    shards = sorted(f for f in os.listdir(toy) if f.endswith(".tar"))
    for r in range(repeat):
        for s in shards:
            for suffix in ("", ".idx.npz"):
                os.symlink(os.path.join(toy, s + suffix), os.path.join(big, f"r{r:04d}-{s}{suffix}"))
    budget = 2048
    cfg = DataConfig(path=big, cache_dir=os.path.join(tmp, "cache"), max_tokens_per_microbatch=budget,
                     global_batch_tokens=8 * budget, shuffle_buffer=4096)  # fmt: skip
    records = repeat * 4096
    print(f"\n== resume at step {step:,} of the toy corpus x{repeat} ({repeat * len(shards)} shards, {records:,} "
          f"records; 8 x {budget} tokens per step)")  # fmt: skip
    t0 = time.perf_counter()
    planner_only = cfg.build(model_facts=FACTS)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    planner_only.advance(step)  # plan 10,000 steps ahead: no record is read
    t_plan = time.perf_counter() - t0
    state = json.loads(json.dumps(planner_only.state_dict()))  # plain data: what a checkpoint holds
    epoch = state["plan"]["epoch"]
    t0 = time.perf_counter()
    resumed = cfg.build(model_facts=FACTS, dp_rank=1, dp_world_size=4)
    resumed.load_state_dict(state)
    resumed.next_step()
    t_resume = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(20):
        resumed.next_step()
    per_step = (time.perf_counter() - t0) / 20
    print(f"  build the loader (load {repeat * len(shards)} index metas): {t_build:6.2f} s")
    print(f"  plan {step:,} steps ahead without a state (advance, reads nothing; epoch {epoch}): {t_plan:6.2f} s")
    print(f"  resume from the step-{step:,} state on rank 1 of 4 and return its first step: {t_resume:6.2f} s "
          f"(state {len(json.dumps(state))} bytes)")  # fmt: skip
    print(f"  a replay of {step:,} steps at {per_step * 1e3:.1f} ms/step (rank 1 of 4) would take {step * per_step:8.1f} s")


def text_tokenize(tmp: str, copies: int, steps: int) -> None:
    from hyper_parallel.data.text import cached_toy_text

    toy = cached_toy_text(os.path.join(tmp, "toy_text"))
    raw = os.path.join(tmp, "raw")
    os.makedirs(raw)
    lines = open(toy.text_file).read().splitlines()
    for k in range(4):
        with open(os.path.join(raw, f"part{k}.jsonl"), "w") as f:
            for c in range(copies):
                for line in lines:
                    f.write(line.replace('"text": "', f'"text": "{k}-{c} ', 1) + "\n")
    cfg = DataConfig(source="text", path=raw, tokenizer=toy.tokenizer_dir, cache_dir=os.path.join(tmp, "text_cache"),
                     max_tokens_per_microbatch=2048, global_batch_tokens=4 * 2048)  # fmt: skip
    t0 = time.perf_counter()
    loader = cfg.build(model_facts={"vocab_size": 512})
    elapsed = time.perf_counter() - t0
    docs = sum(t.documents for t in loader.tokenized_files)
    tokens = sum(int(np.load(s + ".idx.npz")["stat_length"].sum()) for s in loader.shards)
    print(f"\n== text: {docs:,} raw jsonl documents ({tokens:,} tokens) in 4 files")
    print(f"  tokenise + write the cache on first use (one process): {tokens / elapsed / 1e3:8,.0f} k tokens/s "
          f"({elapsed:.1f} s)")  # fmt: skip
    t0 = time.perf_counter()
    cfg.build(model_facts={"vocab_size": 512})
    print(f"  second start (cache hit): {time.perf_counter() - t0:.2f} s")
    tps = throughput(cfg, {"vocab_size": 512}, 1, steps)
    print(f"  read + pack from the cache, rank 0 of 1: {tps / 1e3:8,.0f} k tokens/s")
    step_tps = training_step_tokens_per_s(tmp)
    print(f"  the qwen3_5_moe_debug training step consumes {step_tps / 1e3:8,.1f} k tokens/s: tokenise is "
          f"{tokens / elapsed / step_tps:,.0f}x, read + pack {tps / step_tps:,.0f}x what one process trains on")


def training_step_tokens_per_s(tmp: str, steps: int = 4) -> float:
    """Tokens/s the text debug recipe's training steps consume (one process, after one warm-up step)."""
    from hyper_parallel.config import ConfigManager

    cfg = ConfigManager().parse_args([
        "--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--training.steps", str(steps + 1),
        "--checkpoint.no_enable", "--checkpoint.no_export_hf", "--dump_folder", os.path.join(tmp, "step"),
        "--data.cache_dir", os.path.join(tmp, "step_cache"),
    ])  # fmt: skip
    trainer = cfg.build()
    try:
        trainer.step = 1
        trainer.train_step()  # warm-up
        t0, tokens = time.perf_counter(), 0
        for _ in range(steps):
            trainer.step += 1
            tokens += trainer.train_step()["num_tokens"]
        return tokens / (time.perf_counter() - t0)
    finally:
        trainer.close()


def padding_fractions(path: str, max_tokens: int, num_docs: int = 4000, seed: int = 0) -> dict[str, float]:
    lengths = [len(s["tokens"]) for s in read_samples(path)]
    lengths = [n for n in lengths if n <= max_tokens]
    order = np.random.default_rng(seed).permutation(len(lengths))
    docs = [lengths[i] for i in np.resize(order, num_docs)]
    out: dict[str, float] = {}
    for bins in (1, 8):
        packer: FirstFitPacker[int] = FirstFitPacker(max_tokens, bins)
        emitted = [b for i, n in enumerate(docs) for b in packer.add(n, i)]
        used = sum(n for b in emitted for n, _ in b)
        label = f"packing (first-fit, {bins} open bin{'s' * (bins > 1)}), padded to budget"
        out[label] = 1 - used / (len(emitted) * max_tokens)
    # pad-to-longest, same token budget: grow the batch while B * longest fits.
    padded = real = 0
    batch: list[int] = []
    for n in docs + [max_tokens + 1]:
        if batch and (len(batch) + 1) * max(max(batch), n) > max_tokens:
            padded += len(batch) * max(batch)
            real += sum(batch)
            batch = []
        batch.append(n)
    out["pad-to-longest, same token budget"] = 1 - real / padded
    avg_docs = max(1, round(max_tokens / np.mean(docs)))
    padded = sum(len(b) * max(b) for b in (docs[i : i + avg_docs] for i in range(0, len(docs), avg_docs)))
    out[f"pad-to-longest, fixed batch of {avg_docs} docs"] = 1 - sum(docs) / padded
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=64, help="copies of the toy corpus for the resume measurement")
    parser.add_argument("--text-copies", type=int, default=12, help="copies of the toy text per raw file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "cache")
        toy = cached_toy_corpus(cache, ToyCorpusSpec(lang_vocab_size=V, codebook_size=C, placeholder_token_id=P))
        tail = long_tail_corpus(os.path.join(tmp, "long_tail"))
        per_rank_table("toy corpus", toy, FACTS, 2048, args.steps, cache)
        per_rank_table("long-tailed mix", tail, FACTS, 4096, args.steps, cache)
        resume_cost(toy, args.repeat, tmp)
        text_tokenize(tmp, args.text_copies, args.steps)
        for name, path, max_tokens in (("toy corpus", toy, 2048), ("long-tailed mix", tail, 4096)):
            print(f"\n== padding, {name} ({max_tokens} tokens/micro-batch)")
            for label, frac in padding_fractions(path, max_tokens).items():
                print(f"  {label}: {100 * frac:.2f} %")


if __name__ == "__main__":
    main()
