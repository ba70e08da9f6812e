"""DirectToken data pipeline: throughput and padding (a measurement, not a test).

Prints, for the embedded toy corpus and for a long-tailed length mix:

- read + decode + validate + shuffle + pack + collate throughput of one reader, in real tokens/s,
  in the training process (``num_workers=0``) and in one DataLoader worker (``num_workers=1``);
- the fraction of padding tokens when micro-batches are padded to the token budget (static shapes)
  with first-fit packing (``packing_bins`` 1 = next-fit, 8 = default) versus pad-to-longest batching
  under the same token budget (as many documents per batch as ``B * longest <= budget`` allows) and
  with a fixed batch size.

Run: ``python benchmarks/data_pipeline.py [--steps 200]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from hyper_parallel.data import DataConfig, ToyCorpusSpec, cached_toy_corpus, read_samples, write_shards
from hyper_parallel.data.packing import Packer
from hyper_parallel.data.sample import Sample

V, C, P = 512, 256, 511


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


def throughput(path: str, max_tokens: int, num_workers: int, steps: int) -> float:
    cfg = DataConfig(path=path, max_tokens_per_microbatch=max_tokens, num_workers=num_workers)
    loader = cfg.build(lang_vocab_size=V, codebook_size=C, placeholder_token_id=P)
    loader.next_step()  # start-up (worker fork, first shard open, shuffle buffer fill) excluded
    tokens, t0 = 0, time.perf_counter()
    for _ in range(steps):
        for mb in loader.next_step():
            tokens += mb["input_ids"].numel()  # pad_to_multiple_of=1: every token is a real one
    elapsed = time.perf_counter() - t0
    loader.close()
    return tokens / elapsed


def padding_fractions(path: str, max_tokens: int, num_docs: int = 4000, seed: int = 0) -> dict[str, float]:
    lengths = [len(s["tokens"]) for s in read_samples(path)]
    lengths = [n for n in lengths if n <= max_tokens]
    order = np.random.default_rng(seed).permutation(len(lengths))
    docs = [lengths[i] for i in np.resize(order, num_docs)]
    out: dict[str, float] = {}
    for bins in (1, 8):
        it = iter(docs)
        fake = lambda: Sample("k", "s", np.zeros(next(it), np.int32), None, None, None)  # noqa: E731
        packer, used, rows = Packer(fake, max_tokens, bins), 0, 0
        try:
            while True:
                used += sum(len(s) for s in packer.next())
                rows += 1
        except StopIteration:
            pass
        out[f"packing (first-fit, {bins} open bin{'s' * (bins > 1)}), padded to budget"] = 1 - used / (rows * max_tokens)
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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        toy = cached_toy_corpus(os.path.join(tmp, "cache"), ToyCorpusSpec(lang_vocab_size=V, codebook_size=C,
                                                                            placeholder_token_id=P))
        tail = long_tail_corpus(os.path.join(tmp, "long_tail"))
        for name, path, max_tokens in (("toy corpus", toy, 2048), ("long-tailed mix", tail, 4096)):
            lengths = np.array([len(s["tokens"]) for s in read_samples(path)])
            print(f"\n== {name}: {len(lengths)} docs, length mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, "
                  f"max {lengths.max()}; budget {max_tokens} tokens/micro-batch")
            for workers in (0, 1):
                tps = throughput(path, max_tokens, workers, args.steps)
                print(f"  read+decode+pack, num_workers={workers}: {tps / 1e3:,.0f} k tokens/s")
            for label, frac in padding_fractions(path, max_tokens).items():
                print(f"  padding fraction, {label}: {100 * frac:.2f} %")


if __name__ == "__main__":
    main()
