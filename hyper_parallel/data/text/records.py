"""Raw text records from local jsonl / json / parquet / arrow files, tokenised into documents.

Reading, one file at a time so every document knows its file and row:

- **parquet / arrow** through HF ``datasets``: ``load_dataset("parquet" | "arrow", data_files=[f],
  split="train", streaming=True)``. Streaming because the caller tokenises every record once, in
  order, into its own cached index: a streaming pass reads the file sequentially in constant
  memory and writes no Arrow copy of the corpus into the HF cache (no disk doubling, no cache
  locks between ranks). No network: while ``load_dataset`` resolves the file, ``datasets`` runs
  in offline mode with its download counter off (left alone, loading a packaged builder pings the
  Hub). These formats carry a typed schema, so values arrive exactly as stored.
- **jsonl / json** line by line with :mod:`json` (a ``.json`` file that starts with ``[`` is one
  array of records). Not through ``datasets``: its json builder parses 10 MB blocks with pyarrow
  and, when a block mixes types in a column, re-encodes that column of the whole block as JSON
  text and casts it to the first block's type, so good rows silently become ``'"text"'`` (quotes
  included) and a bad row's ``5`` becomes ``'5'``; it also cannot name the line that broke a block.
  Reading lines ourselves keeps every value's JSON type and names the bad line.

A row is plain text (``spec.text_column``) or a chat (``spec.chat_column``: a list of
``{"role", "content"}`` messages, checked by :func:`~hyper_parallel.data.chat.check_conversation`,
``spec.system_prompt`` prepended when it has no system message, and rendered with the tokenizer's
chat template). Tokens:

- text: ``tokenizer.encode(text)`` (the folder's bos/eos policy, see ``data/tokenizer.py``), then
  ``eos_id`` appended when ``spec.append_eos`` and the policy did not already end it with eos, so
  a model learns where documents end;
- chat: ``tokenizer.encode(rendered, add_special_tokens=False)``, exactly what transformers'
  ``apply_chat_template(messages, tokenize=True)`` returns (the template writes its own special
  tokens; nothing is appended); the document also carries ``assistant_mask`` (which tokens belong
  to assistant turns, :func:`~hyper_parallel.data.chat.encode_chat`).

A row is addressed by its 0-based index in its file (blank lines of a jsonl file are not rows).
A bad record (kinds: :data:`TEXT_BAD_SAMPLE_KINDS`) raises
:class:`~hyper_parallel.data.bad_samples.BadSampleError` naming file and row with
``on_bad_sample="error"``, or is skipped and counted per kind with ``"skip"``. Length limits are
the caller's: a document's length is ``len(doc.tokens)``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np

from hyper_parallel.data.bad_samples import BadSample, BadSampleError
from hyper_parallel.data.chat import ChatTemplateError, check_conversation, encode_chat, template_options
from hyper_parallel.data.tokenizer import BaseTokenizer, HuggingFaceTokenizer

__all__ = [
    "TEXT_BAD_SAMPLE_KINDS",
    "TEXT_FILE_SUFFIXES",
    "TextDocument",
    "TextRecordSpec",
    "TokenizedText",
    "iter_text_documents",
    "resolve_text_files",
    "tokenize_text_files",
]

TEXT_BAD_SAMPLE_KINDS = ("unreadable_shard", "undecodable", "empty", "missing_column", "bad_type", "bad_conversation")
"""How a text record can be rejected (the keys of the bad-record counts):
``unreadable_shard`` the file (or its rest) cannot be read; ``undecodable`` a jsonl line that is not
UTF-8 JSON, text the tokenizer cannot take, or a chat the template rejects; ``empty`` blank text or
no messages; ``missing_column`` the row has no (or a null) text/chat column; ``bad_type`` the column
holds the wrong type (text not a string, a chat not a list of messages with string roles, a jsonl
line not an object); ``bad_conversation`` a chat whose roles come in a wrong order, with an unknown
role, or with a content part that is not text (see :data:`~hyper_parallel.data.chat.CHAT_BAD_KINDS`)."""

TEXT_FILE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
"""File suffix -> format (parquet and arrow are read by the HF ``datasets`` builder of that name)."""

_BATCH = 256
"""Texts per ``encode_batch`` call (the tokenizer parallelises inside a batch; results are identical)."""


@dataclass(frozen=True, slots=True)
class TextRecordSpec:
    """Which columns a record uses and how its tokens end."""

    text_column: str = "text"
    """Column holding plain text (used when ``chat_column`` is None)."""
    chat_column: str | None = None
    """Column holding a chat (list of {role, content} messages) to render with the chat template; None: plain text."""
    key_column: str | None = None
    """Column whose value names a record in messages (e.g. "id"); None or absent: the row index."""
    append_eos: bool = True
    """Append eos to plain-text documents unless the tokenizer's policy already ends them with it."""
    system_prompt: str = ""
    """Chats: a system message put first in every conversation that has none (empty: none added)."""
    reasoning_effort: str = ""
    """Chats: the template's ``reasoning_effort`` for records without that field (empty: the template's default)."""
    preserve_thinking: bool | None = None
    """Chats: the template's ``preserve_thinking`` for records without that field (None: the template's default)."""


class TextDocument(NamedTuple):
    """One tokenised record: ``(source, row, key, tokens)``."""

    source: str
    """The file it came from (as given to the reader)."""
    row: int
    """0-based row index in that file."""
    key: str
    tokens: np.ndarray
    """int32 ``[L]``; ``L = len(tokens)`` is the document length."""
    assistant_mask: np.ndarray | None = None
    """Chats: bool ``[L]``, True at the tokens of assistant turns; None for plain text."""
    line: int | None = None
    """jsonl files: the record's line (from 1, as an editor numbers them); None for other files."""


@dataclass(slots=True)
class TokenizedText:
    """Every document of a file list, in order, plus what was skipped."""

    documents: list[TextDocument]
    bad_counts: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def _bad_sample(kind: str, detail: str) -> BadSample:
    assert kind in TEXT_BAD_SAMPLE_KINDS, kind
    return BadSample(kind, detail)


def resolve_text_files(paths: str | Sequence[str]) -> list[str]:
    """Expand files, folders (recursively) and glob patterns into a sorted, de-duplicated file list.

    Only files with a suffix in :data:`TEXT_FILE_SUFFIXES` are taken from folders and globs; a file
    named explicitly must have one. Raises when nothing matches.
    """
    items = [paths] if isinstance(paths, str) else list(paths)
    found: set[str] = set()
    for item in items:
        item = os.path.expanduser(item)
        if os.path.isfile(item):
            _builder(item)  # an explicit file must be readable
            found.add(item)
            continue
        matches = (
            [os.path.join(d, f) for d, _, fs in os.walk(item) for f in fs]
            if os.path.isdir(item)
            else glob.glob(item, recursive=True)
        )
        kept = [m for m in matches if os.path.isfile(m) and _suffix(m) in TEXT_FILE_SUFFIXES]
        if not kept:
            raise FileNotFoundError(
                f"no text data file ({', '.join(TEXT_FILE_SUFFIXES)}) matches {item!r}: check the data path"
            )
        found.update(kept)
    return sorted(found)


def _suffix(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _builder(path: str) -> str:
    builder = TEXT_FILE_SUFFIXES.get(_suffix(path))
    if builder is None:
        raise ValueError(f"{path!r}: unsupported text data file type; use one of {sorted(TEXT_FILE_SUFFIXES)}")
    return builder


@contextlib.contextmanager
def _datasets_offline() -> Iterator[None]:
    import datasets.config as cfg

    saved = cfg.HF_HUB_OFFLINE, cfg.HF_UPDATE_DOWNLOAD_COUNTS
    cfg.HF_HUB_OFFLINE, cfg.HF_UPDATE_DOWNLOAD_COUNTS = True, False
    try:
        yield
    finally:
        cfg.HF_HUB_OFFLINE, cfg.HF_UPDATE_DOWNLOAD_COUNTS = saved


def _json_record(obj: Any) -> Mapping[str, Any] | BadSample:
    if isinstance(obj, dict):
        return obj
    return _bad_sample("bad_type", f"a record must be a JSON object, got {type(obj).__name__}")


def _json_rows(path: str, lines: dict[int, int] | None = None) -> Iterator[tuple[int, Mapping[str, Any] | BadSample]]:
    """Records of a jsonl file (or of a .json array), with their JSON types intact; ``lines`` gets each jsonl
    row's line number (from 1, as an editor numbers them: blank lines count there, not as rows)."""
    with open(path, "rb") as f:
        head = f.read(64).lstrip(b"\xef\xbb\xbf \t\r\n")
        f.seek(0)
        if head.startswith(b"["):
            try:
                records = json.loads(f.read().decode("utf-8-sig"))
            except (UnicodeDecodeError, ValueError) as e:
                yield 0, _bad_sample("unreadable_shard", f"the file is not a UTF-8 JSON array ({e})")
                return
            for row, obj in enumerate(records):
                yield row, _json_record(obj)
            return
        row = 0
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue  # blank lines are not rows
            if lines is not None:
                lines[row] = line_no
            try:
                obj = json.loads(line.decode("utf-8-sig" if row == 0 else "utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                yield row, _bad_sample("undecodable", f"the line is not UTF-8 JSON ({e})")
            else:
                yield row, _json_record(obj)
            row += 1


def _datasets_rows(path: str) -> Iterator[tuple[int, Mapping[str, Any] | BadSample]]:
    """Records of a parquet / arrow file through HF datasets (streaming, offline)."""
    import datasets

    row = 0
    try:
        with _datasets_offline():
            rows = iter(datasets.load_dataset(_builder(path), data_files=[path], split="train", streaming=True))
        for record in rows:
            yield row, record
            row += 1
    except Exception as e:  # any reader failure (pyarrow, datasets, I/O): the rest of the file is lost
        after = f" after row {row - 1}" if row else ""
        yield row, _bad_sample("unreadable_shard", f"the file cannot be read{after} ({type(e).__name__}: {e})")


def _file_rows(path: str, lines: dict[int, int] | None = None) -> Iterator[tuple[int, Mapping[str, Any] | BadSample]]:
    """``(row, record)`` of one file; ``record`` is a ``BadSample`` where it cannot be read; ``lines``: see
    :func:`_json_rows`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"text data file {path!r} does not exist")
    return _json_rows(path, lines) if _builder(path) == "json" else _datasets_rows(path)


def _check_text(record: Mapping[str, Any], spec: TextRecordSpec) -> str:
    value = record.get(spec.text_column)
    if value is None:
        chats = [k for k, v in record.items() if _looks_like_messages(v)]
        hint = (
            f"; column {chats[0]!r} holds a conversation: train on it with --data.text.chat_column {chats[0]} "
            "(and --data.chat.loss_on assistant for assistant turns only)"
            if chats else ""
        )
        raise _bad_sample(
            "missing_column", f"no {spec.text_column!r} value (the record has: {sorted(record)}){hint}"
        )
    if not isinstance(value, str):
        raise _bad_sample("bad_type", f"{spec.text_column!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise _bad_sample("empty", f"{spec.text_column!r} is blank")
    return value


def _looks_like_messages(value: Any) -> bool:
    """A list of ``{"role": ..., ...}`` dicts: a conversation column."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, Mapping) and "role" in m for m in value)


def _chat_messages(record: Mapping[str, Any], spec: TextRecordSpec) -> list[dict[str, Any]]:
    column = spec.chat_column
    messages = record.get(column)
    if messages is None:
        raise _bad_sample("missing_column", f"no {column!r} value (the record has: {sorted(record)})")
    if not isinstance(messages, list) or not all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages
    ):
        raise _bad_sample("bad_type", f"{column!r} must be a list of messages with a string 'role', got {messages!r:.200}")
    if not messages:
        raise _bad_sample("empty", f"{column!r} has no messages")
    try:
        return check_conversation(messages, system_prompt=spec.system_prompt)[0]
    except BadSample as e:
        raise _bad_sample(e.kind, f"{column!r}: {e.detail}") from None


def _key(record: Mapping[str, Any], row: int, spec: TextRecordSpec) -> str:
    value = record.get(spec.key_column) if spec.key_column else None
    return str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else str(row)


def iter_text_documents(
    files: Iterable[str],
    tokenizer: BaseTokenizer | str,
    spec: TextRecordSpec | None = None,
    *,
    on_bad_sample: Literal["error", "skip"] = "error",
    bad_counts: dict[str, int] | None = None,
    on_skip: Callable[[str], None] | None = None,
) -> Iterator[TextDocument]:
    """Tokenise every record of ``files`` (in the given order, rows in file order).

    ``tokenizer`` is a tokenizer or an HF folder. With ``on_bad_sample="skip"`` a bad record
    increments ``bad_counts[kind]`` (a dict the caller passes and reads) and its message goes to
    ``on_skip``; with ``"error"`` it raises :class:`BadSampleError` naming file and row.
    """
    if on_bad_sample not in ("error", "skip"):
        raise ValueError(f"on_bad_sample must be 'error' or 'skip', got {on_bad_sample!r}")
    spec = spec or TextRecordSpec()
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = HuggingFaceTokenizer.from_folder(tokenizer)
    if spec.chat_column is not None and tokenizer.chat_template is None:
        raise ValueError(
            f"chat_column={spec.chat_column!r} needs a chat template, but {tokenizer!r} has none "
            "(tokenizer_config.json chat_template or chat_template.jinja); use text_column for plain text"
        )
    counts = bad_counts if bad_counts is not None else {}
    eos = [tokenizer.eos_id] if spec.append_eos and tokenizer.eos_id is not None and not tokenizer.adds_eos else []

    lines: dict[int, int] = {}  # row -> line of the current jsonl file: messages name lines as an editor does

    def bad(path: str, row: int, key: str | None, e: BadSample) -> None:
        at = f"line {lines[row]}" if row in lines else f"row {row}"
        where = f"file {path!r}, {at}" + (f" (key {key!r})" if key is not None and key != str(row) else "")
        message = f"bad text sample in {where}: {e.detail} [{e.kind}]"
        if on_bad_sample == "error":
            raise BadSampleError(message + ". Fix the data, or set --data.on_bad_sample skip to drop and count such records.")
        counts[e.kind] = counts.get(e.kind, 0) + 1
        if on_skip is not None:
            on_skip(message)

    def flush(path: str, pending: list[tuple[int, str, str]]) -> Iterator[TextDocument]:
        """Plain-text records, tokenised in one batch (the folder's bos/eos policy applies)."""
        texts = [t for _, _, t in pending]
        add_special = True
        try:
            encoded = tokenizer.encode_batch(texts, add_special_tokens=add_special)
        except Exception:  # find the text the tokenizer cannot take (e.g. a lone surrogate)
            encoded = []
            for row, key, text in pending:
                try:
                    encoded.append(tokenizer.encode(text, add_special_tokens=add_special))
                except Exception as e:
                    bad(path, row, key, _bad_sample("undecodable", f"the tokenizer cannot encode it ({type(e).__name__}: {e})"))
                    encoded.append(None)
        for (row, key, _), ids in zip(pending, encoded, strict=True):
            if ids is None:
                continue
            if not ids:
                bad(path, row, key, _bad_sample("empty", "it encodes to no tokens"))
                continue
            yield TextDocument(path, row, key, np.asarray(ids + eos, dtype=np.int32), line=lines.get(row))

    def chat_document(
        path: str, row: int, key: str, messages: list[dict[str, Any]], options: dict[str, Any]
    ) -> TextDocument | None:
        try:
            encoded = encode_chat(tokenizer, messages, **options)
        except ChatTemplateError:
            raise  # the template, not the record: an error naming the tokenizer folder
        except Exception as e:  # noqa: BLE001 - jinja raise_exception(), a template that needs other fields, ...
            detail = f"the chat template rejects {spec.chat_column!r} ({type(e).__name__}: {e})"
            bad(path, row, key, _bad_sample("undecodable", detail))
            return None
        if not encoded.ids:  # e.g. a chat template that renders nothing for these messages
            bad(path, row, key, _bad_sample("empty", "it encodes to no tokens"))
            return None
        return TextDocument(path, row, key, np.asarray(encoded.ids, dtype=np.int32), encoded.assistant_mask, lines.get(row))

    for path in files:
        pending: list[tuple[int, str, str]] = []
        lines.clear()
        for row, record in _file_rows(path, lines):
            if isinstance(record, BadSample):
                bad(path, row, None, record)
                continue
            key = _key(record, row, spec)
            try:
                if spec.chat_column is not None:
                    messages = _chat_messages(record, spec)
                    options = template_options(
                        record, reasoning_effort=spec.reasoning_effort, preserve_thinking=spec.preserve_thinking
                    )
                else:
                    text = _check_text(record, spec)
            except BadSample as e:
                bad(path, row, key, e)
                continue
            if spec.chat_column is not None:
                doc = chat_document(path, row, key, messages, options)
                if doc is not None:
                    yield doc
                continue
            pending.append((row, key, text))
            if len(pending) == _BATCH:
                yield from flush(path, pending)
                pending = []
        if pending:
            yield from flush(path, pending)


def tokenize_text_files(
    files: str | Sequence[str],
    tokenizer: BaseTokenizer | str,
    spec: TextRecordSpec | None = None,
    *,
    on_bad_sample: Literal["error", "skip"] = "error",
) -> TokenizedText:
    """All documents of ``files`` (resolved with :func:`resolve_text_files`), deterministically ordered:
    files sorted by path, rows in file order. The same files, tokenizer and spec give the same list."""
    out = TokenizedText(documents=[])
    out.documents = list(
        iter_text_documents(
            resolve_text_files(files),
            tokenizer,
            spec,
            on_bad_sample=on_bad_sample,
            bad_counts=out.bad_counts,
            on_skip=out.skipped.append,
        )
    )
    return out
