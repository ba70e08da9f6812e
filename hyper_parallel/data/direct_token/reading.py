"""Reading DirectToken shards back: raw samples, and a validation report."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from hyper_parallel.data.bad_samples import BadSample, bad_sample_message
from hyper_parallel.data.direct_token.sample import DIRECT_TOKEN_BAD_KINDS, SampleSpec, decode_sample
from hyper_parallel.data.shards import iter_tar_records, resolve_shards

__all__ = ["check_shards", "read_samples"]


def read_samples(path: str) -> Iterator[dict[str, Any]]:
    """Every sample of the shards named by ``path`` in file order, undecoded beyond npy/json:
    ``{"key", "shard", "tokens", "vq_codes", **json}`` (raises on unreadable files)."""
    for shard in resolve_shards(path):
        for record in iter_tar_records(shard):
            key, files = record.key, record.files or {}
            meta = json.loads(files["json"]) if "json" in files else {}
            yield {
                "key": key,
                "shard": shard,
                "tokens": np.load(io.BytesIO(files["tokens.npy"])) if "tokens.npy" in files else None,
                "vq_codes": np.load(io.BytesIO(files["vq_codes.npy"])) if "vq_codes.npy" in files else None,
                **meta,
            }


def check_shards(path: str, spec: SampleSpec) -> dict[str, Any]:
    """Validate every sample; returns ``{"samples", "tokens", "bad": {kind: n}, "messages": [...]}``."""
    report: dict[str, Any] = {"samples": 0, "tokens": 0, "bad": {}, "messages": []}

    def bad(shard: str, key: str | None, kind: str, detail: str) -> None:
        report["bad"][kind] = report["bad"].get(kind, 0) + 1
        report["messages"].append(bad_sample_message("DirectToken", shard, key, kind, detail))

    for shard in resolve_shards(path):
        try:
            for record in iter_tar_records(shard):
                key = record.key
                try:
                    sample = decode_sample(key, shard, record.files or {}, spec)
                except BadSample as e:
                    bad(shard, key, e.kind, e.detail)
                    continue
                report["samples"] += 1
                report["tokens"] += len(sample)
        except Exception as e:  # noqa: BLE001 - any tar failure is reported per shard
            bad(shard, None, "unreadable_shard", f"{type(e).__name__}: {e}")
    assert set(report["bad"]) <= set(DIRECT_TOKEN_BAD_KINDS)
    return report
