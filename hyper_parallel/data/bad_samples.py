"""Bad samples: how a source says a record is malformed, and how the loader reports it.

A source validates each record and raises :class:`BadSample` with a ``kind`` (a short string; the
generic kinds are :data:`BAD_SAMPLE_KINDS`, a source may add its own, e.g. DirectToken's
``count_mismatch``). With ``data.on_bad_sample=error`` the loader raises :class:`BadSampleError`
naming the shard (or file) and the key (or row); with ``skip`` it drops the record, counts it per
kind and logs it. Counting happens where the data order is decided (the global plan), so the
counts are the same on every rank and for every layout.
"""

from __future__ import annotations

__all__ = ["BAD_SAMPLE_KINDS", "IGNORE_INDEX", "BadSample", "BadSampleError", "bad_sample_message"]

IGNORE_INDEX = -100
"""Label of positions that carry no loss (a document's last position, padding, masked text)."""

BAD_SAMPLE_KINDS = (
    "unreadable_shard",
    "missing_file",
    "undecodable",
    "bad_metadata",
    "empty",
    "too_long",
    "token_out_of_range",
)
"""The kinds every token source shares (a source may add its own)."""


class BadSample(Exception):
    """Internal: a record broke an invariant of its source (``kind`` names which)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


class BadSampleError(ValueError):
    """A malformed sample or unreadable shard with ``data.on_bad_sample=error``.

    Takes a single message argument so a DataLoader worker can re-raise it in the main process.
    """


def bad_sample_message(source: str, shard: str, key: str | None, kind: str, detail: str) -> str:
    """``bad <source> sample in shard '<shard>', key '<key>': <detail> [<kind>]``."""
    where = f"shard {shard!r}" + (f", key {key!r}" if key is not None else "")
    return f"bad {source} sample in {where}: {detail} [{kind}]"
