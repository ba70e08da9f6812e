"""The per-source sections of the ``data`` config, and one entry of ``data.sources`` (a mixture, :mod:`.mixture`).

The ``data`` section holds what every source reads (path, budgets, packing, seed, workers, tokenizer, ...) plus one
section per option group that only some sources read:

- ``text`` (:class:`TextOptions`): how raw text files become documents (source ``text``);
- ``chat`` (:class:`ChatOptions`): which tokens of a conversation train and how it renders (``text`` and
  ``vision_language``);
- ``direct_token`` (:class:`DirectTokenOptions`): which targets of a DirectToken stream train.

A mixture entry (:class:`SourceConfig`) is a source type, a path, a weight and the same sections: each source of a
mixture carries its own (the ``data`` section's are then unused and must stay at their defaults). Run files give an
entry as a table, Python callers may give a dict: :meth:`SourceConfig.from_mapping` is the one reader of either
(``ConfigManager`` calls it while it reads a run file, the data config's ``__post_init__`` through
:func:`coerce_sources`), so the loaders only ever see dataclasses.

Kept apart from :mod:`.base` (which declares these sections) and from :mod:`.mixture` (which builds the entries),
so neither imports the other at module level.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

__all__ = [
    "MIXTURE_SOURCE_TYPES",
    "SECTION_SOURCES",
    "ChatOptions",
    "DirectTokenOptions",
    "SourceConfig",
    "TextOptions",
    "coerce_sources",
    "first_set_option",
]

MIXTURE_SOURCE_TYPES = ("direct_token", "text", "vision_language")
"""Source types a mixture can hold (shard-backed sources with a global packing plan)."""


@dataclass(kw_only=True, slots=True)
class TextOptions:
    """Source ``text``: how raw .jsonl/.json/.parquet/.arrow records become documents.

    ``chat_column`` names a list of ``{role, content}`` messages rendered with the tokenizer's chat template (empty:
    plain text from ``text_column``). ``split_long_documents`` cuts a document longer than
    ``max_tokens_per_microbatch`` into pieces of at most that many tokens instead of treating it as a bad sample.
    """

    text_column: str = "text"
    """The raw records' document-text column."""
    chat_column: str = ""
    """The conversation column (chat template); empty: plain text."""
    split_long_documents: bool = False
    """Cut documents over the micro-batch budget into pieces."""


@dataclass(kw_only=True, slots=True)
class ChatOptions:
    """Sources ``text`` and ``vision_language``: which tokens train, and how conversations render.

    ``loss_on="document"``: a conversation trains its assistant turns (content, reasoning, tool calls, end token),
    plain text every token; ``"assistant"``: assistant turns only (a record without one is a ``no_assistant`` bad
    sample); ``"all"``: every token (image tokens never train). A conversation longer than
    ``max_tokens_per_microbatch`` is a ``too_long`` bad sample (``on_bad_sample``) with ``long_conversations="drop"``,
    or is kept up to its last assistant turn that fits with ``"cut"`` (counted in ``data/conversations_cut``).
    """

    loss_on: Literal["document", "assistant", "all"] = "document"
    """`document`: a conversation's assistant turns, plain text every token; `assistant`: assistant turns only (none: a no_assistant bad sample); `all`: every token but image tokens."""
    system_prompt: str = ""
    """System message for conversations that have none."""
    reasoning_effort: str = ""
    """Chat template `reasoning_effort` where a record sets none."""
    preserve_thinking: bool | None = None
    """Chat template `preserve_thinking` (keep past reasoning)."""
    long_conversations: Literal["drop", "cut"] = "drop"
    """`drop` (a too_long bad sample) or `cut` at the last assistant turn that fits."""


@dataclass(kw_only=True, slots=True)
class DirectTokenOptions:
    """Source ``direct_token``: which targets of the image+text stream train (``loss_on="document"``: as each
    document's json ``loss_on`` says)."""

    loss_on: Literal["document", "image", "text"] = "document"
    """`document`: per document; `image` / `text`: only those."""


SECTION_SOURCES: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "chat": ("text", "vision_language"),
    "direct_token": ("direct_token",),
}
"""Each per-source section of the data config, and the source types that read it."""


def first_set_option(section: TextOptions | ChatOptions | DirectTokenOptions) -> str | None:
    """The first field of ``section`` that is not at its default (None: all are): what an error names."""
    return next((f.name for f in fields(section) if getattr(section, f.name) != f.default), None)


@dataclass(kw_only=True, slots=True)
class SourceConfig:
    """A source of a data mixture: its type, path and weight, and its own sections (as the ``data`` section's)."""

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
    tokenizer: str = ""
    """As data.tokenizer (text raw files, vision_language), for this source only; empty = data.tokenizer."""
    text: TextOptions = field(default_factory=TextOptions)
    """This source's text options (source text), as data.text."""
    chat: ChatOptions = field(default_factory=ChatOptions)
    """This source's chat options (sources text and vision_language), as data.chat."""
    direct_token: DirectTokenOptions = field(default_factory=DirectTokenOptions)
    """This source's DirectToken options (source direct_token), as data.direct_token."""

    @classmethod
    def from_mapping(cls, value: Mapping[str, Any], *, where: str) -> SourceConfig:
        """An entry given as a mapping (a run file's ``[[data.sources]]`` table, a Python dict; its sections as
        nested tables): the one place a mapping becomes a :class:`SourceConfig` (``ConfigManager`` calls it for run
        files, the data config's ``__post_init__`` for Python callers). Errors name ``where``, the entry and the key."""
        label = f"{where} ({value.get('name', '?')!r})" if isinstance(value, Mapping) else where
        return _from_mapping(cls, value, label)


_SECTIONS: dict[str, type] = {"text": TextOptions, "chat": ChatOptions, "direct_token": DirectTokenOptions}


def _from_mapping(cls: type, value: Any, label: str) -> Any:
    if not isinstance(value, Mapping):
        raise ValueError(f"{label} must be a mapping of {cls.__name__} fields, got {value!r}")
    known = {f.name: f for f in fields(cls)}
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key not in known:
            homes = [s for s, c in _SECTIONS.items() if key in c.__dataclass_fields__] if cls is SourceConfig else []
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = (
                f"; it is a field of the entry's {' / '.join(homes)} section ({', '.join(f'{h}.{key}' for h in homes)})"
                if homes else f"; did you mean {close[0]!r}?" if close else f"; keys: {', '.join(known)}"
            )  # fmt: skip
            raise ValueError(f"{label}: unknown key {key!r}{hint}")
        if cls is SourceConfig and key in _SECTIONS:
            section = _SECTIONS[key]
            out[key] = item if isinstance(item, section) else _from_mapping(section, item, f"{label}.{key}")
            continue
        _check_type(label, key, known[key].default, item)
        out[key] = item
    return cls(**out)


def _check_type(label: str, key: str, default: Any, value: Any) -> None:
    """``value`` has the kind of ``default`` (the field's): true/false, a number or a string (None: anything)."""
    if isinstance(default, bool):
        ok, kind = isinstance(value, bool), "true or false"
    elif isinstance(default, (int, float)):
        ok, kind = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif isinstance(default, str):
        ok, kind = isinstance(value, str), "a string"
    else:
        return
    if not ok:
        raise ValueError(f"{label}: {key}={value!r} must be {kind}")


def coerce_sources(entries: Sequence[SourceConfig | Mapping[str, Any]]) -> list[SourceConfig]:
    """``data.sources`` with every entry given as a mapping read by :meth:`SourceConfig.from_mapping`."""
    return [e if isinstance(e, SourceConfig) else SourceConfig.from_mapping(e, where=f"data.sources[{i}]")
            for i, e in enumerate(entries)]  # fmt: skip
