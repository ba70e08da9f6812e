"""What the shard command lines (``python -m hyper_parallel.data.direct_token`` / ``.vision_language``) share:
the ``write`` / ``toy`` / ``check`` / ``index`` subcommands with their common flags, ``.jsonl`` input and
the ``check`` report."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["add_shard_commands", "iter_jsonl", "iter_jsonl_lines", "print_check_report", "write_records"]


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
    """The records of a ``.jsonl`` file (blank lines skipped); a broken line exits naming ``path`` and its line."""
    for _, record in iter_jsonl_lines(path):
        yield record


def iter_jsonl_lines(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line, record)`` of a ``.jsonl`` file, lines numbered from 1 as an editor numbers them (blank lines
    skipped); a broken line exits naming ``path`` and its line."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: --input {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {path} line {line_no} is not valid JSON: {e}") from None


def write_records(write: Callable[[Any], Any], records: Iterable[tuple[str, Any]]) -> None:
    """``write(record)`` for every ``(where, record)``; an error of one record (a missing image, a record the
    writer refuses) is raised again as a ValueError that starts with ``where`` (``file line N``). Use inside the
    writer's ``with`` block: the error then also drops the partial shards."""
    for where, record in records:
        try:
            write(record)
        except (ValueError, KeyError, OSError) as e:
            detail = e.args[0] if isinstance(e, KeyError) and e.args else e
            if isinstance(e, FileNotFoundError) and e.filename:
                detail = f"file {e.filename!r} does not exist"
            raise ValueError(f"{where}: {detail}") from None


def print_check_report(report: Mapping[str, Any], keys: Sequence[str]) -> int:
    """Print a ``check_shards`` report (each bad sample's message, then the ``keys`` totals as JSON);
    returns the exit status: 1 when any sample is bad."""
    for message in report["messages"]:
        print(message)
    print(json.dumps({k: report[k] for k in keys}))
    return 1 if report["bad"] else 0
