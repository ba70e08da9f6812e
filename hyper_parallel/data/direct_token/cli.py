"""Command line of ``python -m hyper_parallel.data.direct_token`` (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from hyper_parallel.data.direct_token.reading import check_shards
from hyper_parallel.data.direct_token.writer import write_shards
from hyper_parallel.data.direct_token.sample import SampleSpec

__all__ = ["main"]


def _iter_input(path: str) -> Iterator[dict[str, Any]]:
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            if not name.endswith(".tokens.npy"):
                continue
            key = name[: -len(".tokens.npy")]
            base = os.path.join(path, key)
            meta = json.load(open(base + ".json")) if os.path.exists(base + ".json") else {}
            codes = np.load(base + ".vq_codes.npy") if os.path.exists(base + ".vq_codes.npy") else np.zeros(0, np.int64)
            yield {"key": key, "tokens": np.load(base + ".tokens.npy"), "vq_codes": codes, **meta}
        return
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {path}:{line_no} is not valid JSON: {e}") from None


def _model_facts(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument("--placeholder-token-id", type=int, required=True, help="token id of every image position")
    p.add_argument("--lang-vocab-size", type=int, required=required, help="text vocabulary size (range check)")
    p.add_argument("--codebook-size", type=int, required=required, help="VQ codebook size (range check)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.data.direct_token", description="Write, check and generate DirectToken webdataset shards.")
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("write", help="write shards from a .jsonl file or a directory of .npy arrays")
    w.add_argument("--input", required=True, help=".jsonl file, or directory of <key>.tokens.npy files")
    w.add_argument("--output-dir", required=True)
    w.add_argument("--prefix", default="train", help="shard file prefix: <prefix>-000000.tar")
    w.add_argument("--samples-per-shard", type=int, default=1000)
    _model_facts(w, required=False)

    t = sub.add_parser("toy", help="write the embedded toy corpus (learnable caption -> image-code structure)")
    t.add_argument("--output-dir", required=True)
    t.add_argument("--num-samples", type=int, default=None)
    t.add_argument("--seed", type=int, default=0)
    _model_facts(t, required=True)

    c = sub.add_parser("check", help="validate every sample of some shards and count bad ones by kind")
    c.add_argument("--path", required=True, help="directory, glob or brace pattern")
    c.add_argument("--max-tokens", type=int, required=True, help="packing budget (data.max_tokens_per_microbatch)")
    _model_facts(c, required=True)

    x = sub.add_parser("index", help="write the index side file (<shard>.idx.npz) of shards written without one")
    x.add_argument("--path", required=True, help="directory, glob or brace pattern")
    x.add_argument("--placeholder-token-id", type=int, required=True, help="token id of every image position")

    args = parser.parse_args(argv)
    if args.command == "index":
        from hyper_parallel.data.direct_token.sample import direct_token_index_spec
        from hyper_parallel.data.index import build_index, sidecar_path, write_index
        from hyper_parallel.data.shards import resolve_shards

        spec = direct_token_index_spec(args.placeholder_token_id)
        shards = resolve_shards(args.path)
        for shard in shards:
            write_index(build_index(shard, spec), sidecar_path(shard), shard_size=os.path.getsize(shard), spec=spec)
        print(f"indexed {len(shards)} shard(s)")
    elif args.command == "write":
        try:
            shards = write_shards(
                args.output_dir,
                _iter_input(args.input),
                placeholder_token_id=args.placeholder_token_id,
                lang_vocab_size=args.lang_vocab_size,
                codebook_size=args.codebook_size,
                samples_per_shard=args.samples_per_shard,
                prefix=args.prefix,
            )
        except (ValueError, KeyError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {len(shards)} shard(s) to {args.output_dir}")
    elif args.command == "toy":
        from hyper_parallel.data.toy_corpus import ToyCorpusSpec, write_toy_corpus

        spec = ToyCorpusSpec(
            lang_vocab_size=args.lang_vocab_size,
            codebook_size=args.codebook_size,
            placeholder_token_id=args.placeholder_token_id,
            seed=args.seed,
            **({"num_samples": args.num_samples} if args.num_samples else {}),
        )
        shards = write_toy_corpus(args.output_dir, spec)
        print(f"wrote {len(shards)} toy shard(s) to {args.output_dir}")
    else:
        spec = SampleSpec(args.lang_vocab_size, args.codebook_size, args.placeholder_token_id, args.max_tokens)
        report = check_shards(args.path, spec)
        for message in report["messages"]:
            print(message)
        print(json.dumps({k: report[k] for k in ("samples", "tokens", "bad")}))
        return 1 if report["bad"] else 0
    return 0

