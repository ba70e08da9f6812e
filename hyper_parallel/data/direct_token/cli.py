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
from hyper_parallel.data.direct_token.writer import DirectTokenWriter
from hyper_parallel.data.direct_token.sample import SampleSpec
from hyper_parallel.data.shard_cli import add_shard_commands, iter_jsonl_lines, print_check_report, write_records

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
    for line, record in iter_jsonl_lines(path):
        yield {**record, "__where__": f"{path} line {line}"}


def _model_facts(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument("--placeholder-token-id", type=int, required=True, help="token id of every image position")
    p.add_argument("--lang-vocab-size", type=int, required=required, help="text vocabulary size (range check)")
    p.add_argument("--codebook-size", type=int, required=required, help="VQ codebook size (range check)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.data.direct_token", description="Write, check and generate DirectToken webdataset shards.")
    commands = add_shard_commands(
        parser,
        write="write shards from a .jsonl file or a directory of .npy arrays",
        input_help=".jsonl file, or directory of <key>.tokens.npy files",
        toy="write the embedded toy corpus (learnable caption -> image-code structure)",
        check="validate every sample of some shards and count bad ones by kind",
        index="write the index side file (<shard>.idx.npz) of shards written without one",
    )
    _model_facts(commands["write"], required=False)
    _model_facts(commands["toy"], required=True)
    _model_facts(commands["check"], required=True)
    commands["index"].add_argument(
        "--placeholder-token-id", type=int, required=True, help="token id of every image position"
    )

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
            def write(s: dict[str, Any]) -> None:
                writer.write(s.pop("tokens"), s.pop("vq_codes", ()), s.pop("image_grids", ()), key=s.pop("key", None), **s)

            # all or nothing: a record that fails (named by its line or key) leaves no shard
            with DirectTokenWriter(
                args.output_dir, placeholder_token_id=args.placeholder_token_id, lang_vocab_size=args.lang_vocab_size,
                codebook_size=args.codebook_size, samples_per_shard=args.samples_per_shard, prefix=args.prefix,
            ) as writer:  # fmt: skip
                records = _iter_input(args.input)
                write_records(write, ((r.pop("__where__", f"{args.input} key {r.get('key')}"), r) for r in records))
            shards = writer.shards
        except (ValueError, KeyError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {len(shards)} shard(s) to {args.output_dir}")
    elif args.command == "toy":
        from hyper_parallel.data.direct_token.toy_corpus import ToyCorpusSpec, write_toy_corpus

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
        return print_check_report(check_shards(args.path, spec), ("samples", "tokens", "bad"))
    return 0

