"""Command line of ``python -m hyper_parallel.data.vision_language`` (see the package docstring)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from hyper_parallel.data.shard_cli import add_shard_commands, iter_jsonl_lines, print_check_report, write_records
from hyper_parallel.data.vision_language.preprocess import ImageProcessor
from hyper_parallel.data.vision_language.sample import VisionLanguageEncoder, make_encoder
from hyper_parallel.data.vision_language.video import VideoProcessor

__all__ = ["main"]


def _iter_input(path: str, image_root: str | None) -> Iterator[tuple[str, Any]]:
    """``(where, load)`` per record of a .jsonl file: ``where`` names the file and line, ``load()`` returns the
    record with its ``images`` and ``videos`` read (file paths relative to ``image_root`` or the file's folder)."""
    root = image_root or os.path.dirname(os.path.abspath(path))

    def read(paths: list[str]) -> list[bytes]:
        out = []
        for p in paths:
            with open(os.path.join(root, p), "rb") as f:
                out.append(f.read())
        return out

    def loader(record: dict[str, Any]) -> Any:
        def load() -> dict[str, Any]:
            images, videos = read(record.pop("images", [])), read(record.pop("videos", []))
            return {**record, "images": images, **({"videos": videos} if videos else {})}

        return load

    for line, record in iter_jsonl_lines(path):
        yield f"{path} line {line}", loader(record)


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
    v = VideoProcessor.Config()
    g.add_argument("--video-token-id", type=int, default=None, help="the model's video token id (records with videos)")
    g.add_argument("--video-fps", type=float, default=v.fps, help="frames sampled per second of video")
    g.add_argument("--video-min-pixels", type=int, default=v.min_pixels, help="smallest frames*H*W of a video")
    g.add_argument("--video-max-pixels", type=int, default=v.max_pixels, help="largest frames*H*W of a video")


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

        vocab = max(HuggingFaceTokenizer.from_folder(tokenizer).vocab_size, max(ids) + 1, (args.video_token_id or 0) + 1)
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
    if args.video_token_id is not None:
        facts["video_token_id"] = args.video_token_id
    video = VideoProcessor.Config(fps=args.video_fps, min_pixels=args.video_min_pixels, max_pixels=args.video_max_pixels)
    return make_encoder(tokenizer, image, facts, video=video)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hyper_parallel.data.vision_language",
        description="Write, check, index and generate vision-language webdataset shards.",
    )
    commands = add_shard_commands(
        parser,
        write="write shards from a .jsonl file ({images: [paths], videos: [paths], text | messages})",
        input_help=".jsonl file: one record per line",
        toy="write the embedded toy corpus (coloured shapes with captions)",
        check="decode every record (pixels included) and count bad ones by kind",
        index="write the index side file (<shard>.idx.npz) for the given model facts",
    )
    commands["write"].add_argument(
        "--image-root", default=None, help="folder the image and video paths are relative to (default: the file's)"
    )
    for name, required in (("write", False), ("toy", False), ("check", True), ("index", True)):
        _model_facts(commands[name], required=required)

    args = parser.parse_args(argv)
    try:
        if args.command == "write":
            from hyper_parallel.data.vision_language.writer import TOY_TOKENIZER, VisionLanguageWriter

            def write(load: Any) -> None:
                s = load()
                writer.write(s.pop("images", ()), videos=s.pop("videos", ()), text=s.pop("text", None),
                             messages=s.pop("messages", None), key=s.pop("key", None), **s)  # fmt: skip

            # all or nothing: a record that fails (named by its line) leaves no shard and no vl_dataset.json
            with VisionLanguageWriter(
                args.output_dir, encoder=_encoder(args), samples_per_shard=args.samples_per_shard, prefix=args.prefix,
                tokenizer=args.tokenizer or TOY_TOKENIZER,  # recorded in vl_dataset.json: the loader uses it
            ) as writer:  # fmt: skip
                write_records(write, _iter_input(args.input, args.image_root))
            shards = writer.shards
            print(f"wrote {len(shards)} shard(s) to {args.output_dir}")
        elif args.command == "toy":
            from hyper_parallel.data.vision_language.toy import ToyVisionLanguageSpec, write_toy_vision_language
            from hyper_parallel.data.vision_language.writer import TOY_TOKENIZER

            extra = {"num_samples": args.num_samples} if args.num_samples else {}
            spec = ToyVisionLanguageSpec(seed=args.seed, **extra)
            shards = write_toy_vision_language(
                args.output_dir, spec, encoder=_encoder(args), tokenizer=args.tokenizer or TOY_TOKENIZER
            )
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
            return print_check_report(report, ("samples", "tokens", "images", "videos", "bad"))
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
