"""Command line of ``python -m hyper_parallel.data.vision_language`` (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from hyper_parallel.data.vision_language.preprocess import ImageProcessor
from hyper_parallel.data.vision_language.sample import VisionLanguageEncoder, make_encoder

__all__ = ["main"]


def _iter_input(path: str, image_root: str | None) -> Iterator[dict[str, Any]]:
    """Records of a .jsonl file; ``images`` are file paths (relative to ``image_root`` or the file's folder)."""
    root = image_root or os.path.dirname(os.path.abspath(path))
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {path}:{line_no} is not valid JSON: {e}") from None
            images = []
            for p in record.pop("images", []):
                with open(os.path.join(root, p), "rb") as im:
                    images.append(im.read())
            yield {**record, "images": images}


def _model_facts(p: argparse.ArgumentParser, *, required: bool) -> None:
    defaults = ImageProcessor.Config()
    g = p.add_argument_group("model facts and image settings (what the loader will use)")
    g.add_argument("--tokenizer", default="", help="HF tokenizer folder; empty = the toy tokenizer under --cache-dir")
    g.add_argument("--cache-dir", default="~/.cache/hyper_parallel", help="where the toy tokenizer is cached")
    for name in ("image-token-id", "vision-start-token-id", "vision-end-token-id"):
        g.add_argument(f"--{name}", type=int, required=required, default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="model vocabulary (default: tokenizer's or past the ids)")
    g.add_argument("--patch-size", type=int, default=16)
    g.add_argument("--temporal-patch-size", type=int, default=2)
    g.add_argument("--merge-size", type=int, default=2)
    g.add_argument("--min-pixels", type=int, default=defaults.min_pixels)
    g.add_argument("--max-pixels", type=int, default=defaults.max_pixels)
    g.add_argument("--max-input-pixels", type=int, default=defaults.max_input_pixels)


def _encoder(args: argparse.Namespace) -> VisionLanguageEncoder | None:
    ids = (args.image_token_id, args.vision_start_token_id, args.vision_end_token_id)
    if all(i is None for i in ids):
        return None
    if any(i is None for i in ids):
        raise SystemExit("error: give all of --image-token-id, --vision-start-token-id, --vision-end-token-id")
    tokenizer = args.tokenizer
    if not tokenizer:
        from hyper_parallel.data.text import cached_toy_text

        tokenizer = cached_toy_text(args.cache_dir).tokenizer_dir
    vocab = args.vocab_size
    if vocab is None:
        from hyper_parallel.data.tokenizer import HuggingFaceTokenizer

        vocab = max(HuggingFaceTokenizer.from_folder(tokenizer).vocab_size, max(ids) + 1)
    image = ImageProcessor.Config(
        min_pixels=args.min_pixels, max_pixels=args.max_pixels, max_input_pixels=args.max_input_pixels
    )
    facts = {
        "vocab_size": vocab,
        "image_token_id": args.image_token_id,
        "vision_start_token_id": args.vision_start_token_id,
        "vision_end_token_id": args.vision_end_token_id,
        "patch_size": args.patch_size,
        "temporal_patch_size": args.temporal_patch_size,
        "merge_size": args.merge_size,
    }
    return make_encoder(tokenizer, image, facts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hyper_parallel.data.vision_language",
        description="Write, check, index and generate vision-language webdataset shards.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("write", help="write shards from a .jsonl file ({images: [paths], text | messages})")
    w.add_argument("--input", required=True, help=".jsonl file: one record per line")
    w.add_argument("--image-root", default=None, help="folder the image paths are relative to (default: the file's)")
    w.add_argument("--output-dir", required=True)
    w.add_argument("--prefix", default="train", help="shard file prefix: <prefix>-000000.tar")
    w.add_argument("--samples-per-shard", type=int, default=1000)
    _model_facts(w, required=False)

    t = sub.add_parser("toy", help="write the embedded toy corpus (coloured shapes with captions)")
    t.add_argument("--output-dir", required=True)
    t.add_argument("--num-samples", type=int, default=None)
    t.add_argument("--seed", type=int, default=0)
    _model_facts(t, required=False)

    c = sub.add_parser("check", help="decode every record (pixels included) and count bad ones by kind")
    c.add_argument("--path", required=True, help="directory, glob or brace pattern")
    c.add_argument("--max-tokens", type=int, required=True, help="packing budget (data.max_tokens_per_microbatch)")
    _model_facts(c, required=True)

    x = sub.add_parser("index", help="write the index side file (<shard>.idx.npz) for the given model facts")
    x.add_argument("--path", required=True, help="directory, glob or brace pattern")
    _model_facts(x, required=True)

    args = parser.parse_args(argv)
    try:
        if args.command == "write":
            from hyper_parallel.data.vision_language.writer import write_shards

            shards = write_shards(
                args.output_dir,
                _iter_input(args.input, args.image_root),
                encoder=_encoder(args),
                samples_per_shard=args.samples_per_shard,
                prefix=args.prefix,
            )
            print(f"wrote {len(shards)} shard(s) to {args.output_dir}")
        elif args.command == "toy":
            from hyper_parallel.data.vision_language.toy import ToyVisionLanguageSpec, write_toy_vision_language

            extra = {"num_samples": args.num_samples} if args.num_samples else {}
            spec = ToyVisionLanguageSpec(seed=args.seed, **extra)
            shards = write_toy_vision_language(args.output_dir, spec, encoder=_encoder(args))
            print(f"wrote {len(shards)} toy shard(s) to {args.output_dir}")
        elif args.command == "index":
            from hyper_parallel.data.shards import resolve_shards
            from hyper_parallel.data.vision_language.writer import write_shard_index

            encoder = _encoder(args)
            shards = resolve_shards(args.path)
            for shard in shards:
                write_shard_index(shard, encoder)
            print(f"indexed {len(shards)} shard(s)")
        else:
            from hyper_parallel.data.vision_language.writer import check_shards

            report = check_shards(args.path, _encoder(args), max_tokens=args.max_tokens)
            for message in report["messages"]:
                print(message)
            print(json.dumps({k: report[k] for k in ("samples", "tokens", "images", "bad")}))
            return 1 if report["bad"] else 0
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
