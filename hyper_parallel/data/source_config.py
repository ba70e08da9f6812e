"""One entry of ``data.sources``: a named, weighted data source of a mixture (:mod:`.mixture`).

Kept apart from :mod:`.base` (which declares ``data.sources: list[SourceConfig]``) and from
:mod:`.mixture` (which builds it), so neither imports the other at module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["MIXTURE_SOURCE_TYPES", "SourceConfig"]

MIXTURE_SOURCE_TYPES = ("direct_token", "text", "vision_language")
"""Source types a mixture can hold (shard-backed sources with a global packing plan)."""


@dataclass(kw_only=True, slots=True)
class SourceConfig:
    """A source of a data mixture; options left empty take the value of the ``data`` section."""

    name: str = ""
    """Unique name of the source: metric keys (`data/<name>/share`, `loss/<name>`) and the checkpointed mixture state use it."""
    source: Literal["direct_token", "text", "vision_language"] = "direct_token"
    """The source type (as data.source): `direct_token`, `text` or `vision_language`."""
    path: str = ""
    """Shards (or raw text files) of this source, as data.path; empty = the source type's embedded toy corpus."""
    weight: float = 1.0
    """Relative share of the step's tokens (weights are normalised over the sources; > 0)."""
    on_bad_sample: Literal["", "error", "skip"] = ""
    """As data.on_bad_sample, for this source only; empty = data.on_bad_sample."""
    loss_on: Literal["", "document", "assistant", "all", "image", "text"] = ""
    """Which labels train; empty = data.loss_on. `document`: as each document says (DirectToken json `loss_on`; a conversation trains its assistant turns, plain text every token); text and vision_language: `assistant` (assistant turns only) or `all` (every token); direct_token: `image` keeps only image targets, `text` only text targets."""
    chat_column: str = ""
    """As data.chat_column (text raw files holding conversations); empty = data.chat_column."""
    tokenizer: str = ""
    """As data.tokenizer (text raw files, vision_language); empty = data.tokenizer."""
    text_column: str = ""
    """As data.text_column (text raw files); empty = data.text_column."""
    split_long_documents: bool = False
    """text: cut documents longer than max_tokens_per_microbatch into pieces (as data.split_long_documents; either flag enables it)."""
