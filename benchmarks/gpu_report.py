"""The GPU check's one JSON: every check records its result here; ``finalize`` merges them and prints the table.

Each check writes ``$GPU_CHECK_OUT/parts/<name>.json`` (``record``), so a check that dies loses only its own
entry; ``finalize`` joins the parts into ``$GPU_CHECK_OUT/gpu_check.json`` in check order and prints one
readable row per check, last on stdout.

    python benchmarks/gpu_report.py record NAME STATUS "SUMMARY" [key=value ...]   # from a shell check
    python benchmarks/gpu_report.py finalize                                      # the JSON and the table
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

STATUSES = ("PASS", "FAIL", "SKIP", "INFO")


def _out() -> Path:
    out = os.environ.get("GPU_CHECK_OUT")
    if not out:
        raise SystemExit("gpu_report: set GPU_CHECK_OUT to the folder that receives gpu_check.json")
    return Path(out)


def record(name: str, status: str, summary: str, **values: Any) -> None:
    """Write one check's result (``status`` PASS / FAIL / SKIP / INFO, a one-line summary, its numbers)."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r} is not one of {STATUSES}")
    parts = _out() / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    entry = {"name": name, "status": status, "summary": summary, "values": _clean(values), "time": time.time()}
    (parts / f"{name}.json").write_text(json.dumps(entry, indent=1, default=_jsonable))


def _clean(x: Any) -> Any:
    """NaN / inf -> None (strict JSON), recursively."""
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def finalize() -> int:
    """Join the parts into ``gpu_check.json``, print the table; returns the number of failed checks."""
    out = _out()
    entries = [json.loads(p.read_text()) for p in (out / "parts").glob("*.json")] if (out / "parts").exists() else []
    entries.sort(key=lambda e: e["time"])
    failed = sum(e["status"] == "FAIL" for e in entries)
    doc = {"device": os.environ.get("DEV", "?"), "failed": failed, "checks": {e["name"]: e for e in entries}}
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=1))
    width = max([len(e["name"]) for e in entries] + [5])
    print(f"\n== GPU check ({doc['device']}): {len(entries)} results, {failed} failed -> {out / 'gpu_check.json'}")
    print(f"{'check':<{width}}  status  summary")
    for e in entries:
        print(f"{e['name']:<{width}}  {e['status']:<6}  {e['summary']}")
    return failed


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "finalize":
        raise SystemExit(min(finalize(), 125))
    if len(sys.argv) >= 5 and sys.argv[1] == "record":
        kv = dict(a.split("=", 1) for a in sys.argv[5:])
        record(sys.argv[2], sys.argv[3], sys.argv[4], **{k: _parse_value(v) for k, v in kv.items()})
        raise SystemExit(0)
    raise SystemExit(__doc__)
