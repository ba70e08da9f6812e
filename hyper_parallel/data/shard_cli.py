"""What the shard command lines (``python -m hyper_parallel.data.direct_token`` / ``.vision_language``) share:
the ``write`` / ``toy`` / ``check`` / ``index`` subcommands with their common flags, ``.jsonl`` input and
the ``check`` report."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["add_shard_commands", "iter_jsonl", "print_check_report"]


def add_shard_commands(
    parser: argparse.ArgumentParser, *, write: str, input_help: str, toy: str, check: str, index: str
) -> dict[str, argparse.ArgumentParser]:
    """Add the four subcommands (their help texts given) with the flags every source's CLI takes; returns
    them by name so the caller adds its own (model facts, ...)."""
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help=write)
    w.add_argument("--input", required=True, help=input_help)
    w.add_argument("--output-dir", required=True)
    w.add_argument("--prefix", default="train", help="shard file prefix: <prefix>-000000.tar")
    w.add_argument("--samples-per-shard", type=int, default=1000)
    t = sub.add_parser("toy", help=toy)
    t.add_argument("--output-dir", required=True)
    t.add_argument("--num-samples", type=int, default=None)
    t.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("check", help=check)
    c.add_argument("--path", required=True, help="directory, glob or brace pattern")
    c.add_argument("--max-tokens", type=int, required=True, help="packing budget (data.max_tokens_per_microbatch)")
    x = sub.add_parser("index", help=index)
    x.add_argument("--path", required=True, help="directory, glob or brace pattern")
    return {"write": w, "toy": t, "check": c, "index": x}


def iter_jsonl(path: str) -> Iterator[dict[str, Any]]:
    """The records of a ``.jsonl`` file (blank lines skipped); a broken line exits naming ``path:line``."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {path}:{line_no} is not valid JSON: {e}") from None


def print_check_report(report: Mapping[str, Any], keys: Sequence[str]) -> int:
    """Print a ``check_shards`` report (each bad sample's message, then the ``keys`` totals as JSON);
    returns the exit status: 1 when any sample is bad."""
    for message in report["messages"]:
        print(message)
    print(json.dumps({k: report[k] for k in keys}))
    return 1 if report["bad"] else 0
