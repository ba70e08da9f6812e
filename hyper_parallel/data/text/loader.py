"""``HuggingFaceTextDataLoader``: the ``text`` source (plain token documents, no images).

``data.path`` names either

- **pre-tokenised shards**: webdataset tars with ``<key>.tokens.npy`` (int ``[L]``) per document
  (an optional ``<key>.json`` is ignored except for messages); or
- **raw files** (``.jsonl``/``.json``/``.parquet``/``.arrow``, files, folders or globs), read with HF
  ``datasets`` and tokenised with ``data.tokenizer`` (:mod:`hyper_parallel.data.text`). The global
  plan needs every document's length up front, so each file is tokenised ONCE into pre-tokenised
  shards (with their index) under ``<data.cache_dir>/text_tokens/``, keyed by a digest of the file
  (path, size, mtime), the tokenizer files and the record options. Ranks share the work: each
  starts at its own file and skips files another rank already finished. Bad records found while
  tokenising (empty, undecodable, missing column, wrong type) are kept in the cache's manifest:
  with ``on_bad_sample=error`` the loader stops naming file and row, with ``skip`` they count from
  the first step.

An empty ``data.path`` uses the embedded toy text corpus and its tokenizer (its conversations when
``data.text.chat_column`` is set). From the shards on it is
the shared shard machinery (:mod:`.sharded`): a layout-independent global plan, reads by offset.
Documents longer than ``max_tokens_per_microbatch`` are bad samples (``too_long``) or, with
``data.text.split_long_documents``, cut into pieces of at most that many tokens.

**Chats** (``data.text.chat_column``): each record is a conversation rendered with the tokenizer's chat
template; its shard record holds ``<key>.assistant_mask.npy`` (uint8 ``[L]``, 1 at the tokens of
assistant turns, :mod:`hyper_parallel.data.chat`) next to its tokens (a pre-tokenised shard may carry
one too). ``data.chat.loss_on``: ``document`` (default) trains a chat on its assistant turns and plain text
on every token; ``assistant`` trains assistant turns only (a record without any is a ``no_assistant``
bad sample); ``all`` trains every token. A conversation longer than the micro-batch is a
``too_long`` bad sample with ``data.chat.long_conversations=drop`` (stops the run, or skipped and counted
with ``on_bad_sample=skip``), or with ``cut`` ends after its last assistant turn that fits (counted in
the metric ``data/conversations_cut``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from hyper_parallel.data.bad_samples import BAD_SAMPLE_KINDS, IGNORE_INDEX, BadSample, BadSampleError
from hyper_parallel.data.base import BaseDataLoader
from hyper_parallel.data.cache import cached_build
from hyper_parallel.data.chat import resolve_loss_on
from hyper_parallel.data.index import IndexSpec, load_stats
from hyper_parallel.data.npy import load_npy
from hyper_parallel.data.packing import TokenDocument, collate_packed, shift_labels
from hyper_parallel.data.shards import resolve_shards
from hyper_parallel.data.shard_writer import ShardWriter
from hyper_parallel.data.sharded import ShardedDataLoader

__all__ = ["TEXT_INDEX_SPEC", "HuggingFaceTextDataLoader", "TextCodec", "TextShardWriter", "tokenize_to_shards"]

logger = logging.getLogger("hyper_parallel.data")

TEXT_CACHE_VERSION = 2
"""Bump when the tokenised-text cache layout changes, so stale caches are not reused."""

TEXT_DOCS_PER_SHARD = 4096

_MISSING, _UNDECODABLE = -1, -2


# -- the record format ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TextStats:
    """Index statistics of a text record: its length (< 0: tokens missing or undecodable) and id range."""

    cut_at: int = 0
    """> 0: a conversation longer than this is cut after its last assistant turn that fits (the index
    then holds the cut length, and ``cut`` = 1)."""
    columns: ClassVar[tuple[str, ...]] = ("length", "min_token", "max_token", "trained", "cut")

    def __call__(self, key: str, files: Mapping[str, bytes]) -> dict[str, int]:
        none = {"min_token": 0, "max_token": -1, "trained": -1, "cut": 0}
        try:
            tokens = load_npy(files, "tokens.npy").astype(np.int64)
            mask = load_mask(files, len(tokens))
        except BadSample as e:
            return {"length": _MISSING if e.kind == "missing_file" else _UNDECODABLE, **none}
        cut = 0
        if mask is not None and self.cut_at and len(tokens) > self.cut_at:
            end = conversation_cut(mask, self.cut_at)
            if end:
                tokens, mask, cut = tokens[:end], mask[:end], 1
        if not len(tokens):
            return {"length": 0, **none}
        trained = -1 if mask is None else int(mask.sum())
        return {"length": len(tokens), "min_token": int(tokens.min()), "max_token": int(tokens.max()),
                "trained": trained, "cut": cut}  # fmt: skip


def load_mask(files: Mapping[str, bytes], n: int) -> np.ndarray | None:
    """The record's ``assistant_mask.npy`` as bool ``[n]`` (None when it has none; raises ``BadSample``)."""
    if "assistant_mask.npy" not in files:
        return None
    mask = load_npy(files, "assistant_mask.npy")
    if mask.shape != (n,):
        raise BadSample("undecodable", f"assistant_mask.npy has shape {mask.shape}, its tokens {n}")
    return mask.astype(bool)


def conversation_cut(mask: np.ndarray, max_tokens: int) -> int:
    """Length of a conversation cut after its last assistant turn that ends within ``max_tokens`` (0: none)."""
    ends = np.flatnonzero(mask[:-1] & ~mask[1:]) + 1  # a turn ends where the mask falls ...
    ends = np.append(ends, len(mask)) if len(mask) and mask[-1] else ends  # ... or at the very end
    fit = ends[ends <= max_tokens]
    return int(fit[-1]) if len(fit) else 0


TEXT_INDEX_SPEC = IndexSpec(kind="text/2", columns=TextStats.columns, stats=TextStats())
"""The index of text shards (written by :class:`TextShardWriter`, else built on first use)."""

TEXT_BAD_KINDS = (*BAD_SAMPLE_KINDS, "missing_column", "bad_type", "bad_conversation", "no_assistant")
"""Kinds of bad text records (``missing_column``/``bad_type``/``bad_conversation`` come from raw files;
``no_assistant``: nothing to train with ``loss_on`` assistant)."""


def _where(files: Mapping[str, bytes]) -> str:
    """`` (file 'a.jsonl', row 7)`` for a record tokenised from a raw file, else empty."""
    try:
        origin = json.loads(files["json"])
        at = f"line {origin['line']}" if origin.get("line") is not None else f"row {origin['row']}"
        return f" (file {origin['file']!r}, {at})"
    except Exception:  # noqa: BLE001 - no or foreign metadata: nothing to add
        return ""


@dataclass(frozen=True, slots=True)
class TextCodec:
    """Decode + validate + collate text records (picklable: runs in DataLoader workers)."""

    vocab_size: int
    max_tokens: int
    split_long: bool
    loss_on: str = "document"
    """``document`` | ``assistant`` | ``all`` (:func:`~hyper_parallel.data.chat.resolve_loss_on`)."""
    cut_conversations: bool = False
    """Cut a conversation longer than ``max_tokens`` after its last assistant turn that fits."""
    label: ClassVar[str] = "text"

    def decode(self, key: str, shard: str, files: Mapping[str, bytes], piece: int) -> TokenDocument:
        try:
            tokens = load_npy(files, "tokens.npy")
        except BadSample as e:
            raise BadSample(e.kind, e.detail + _where(files)) from None
        try:
            mask = load_mask(files, len(tokens))
        except BadSample as e:
            raise BadSample(e.kind, e.detail + _where(files)) from None
        if mask is not None and self.cut_conversations and len(tokens) > self.max_tokens:
            end = conversation_cut(mask, self.max_tokens)
            if end:
                tokens, mask = tokens[:end], mask[:end]
        n = len(tokens)
        if n == 0:
            raise BadSample("empty", "tokens.npy is empty" + _where(files))
        if n > self.max_tokens and not self.split_long:
            raise BadSample(
                "too_long",
                f"{n} tokens exceed the packing budget data.max_tokens_per_microbatch={self.max_tokens}{_where(files)} "
                "(raise it, or set data.text.split_long_documents to cut long documents)",
            )
        tokens = tokens.astype(np.int64)
        bad = (tokens < 0) | (tokens >= self.vocab_size)
        if bad.any():
            pos = int(np.flatnonzero(bad)[0])
            raise BadSample(
                "token_out_of_range",
                f"token id {int(tokens[pos])} at position {pos} is outside [0, vocab_size={self.vocab_size}){_where(files)}",
            )
        targets = tokens
        if resolve_loss_on(self.loss_on, is_chat=mask is not None) == "assistant":
            if mask is None or not mask.any():
                what = "no assistant turn" if mask is not None else "no assistant_mask.npy (plain text)"
                raise BadSample("no_assistant", f"loss_on assistant, but the record has {what}{_where(files)}")
            targets = np.where(mask, tokens, IGNORE_INDEX)
        labels = shift_labels(targets)
        lo, hi = piece * self.max_tokens, min(n, (piece + 1) * self.max_tokens)
        # A piece keeps the true next token as its last label: it is still the right target.
        return TokenDocument(key, shard, tokens[lo:hi].astype(np.int32), labels[lo:hi].astype(np.int32))

    def collate(self, documents: Sequence[TokenDocument], *, pad_token_id: int, pad_to_multiple_of: int) -> dict[str, Any]:
        return collate_packed(documents, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of)


def text_classify(
    stats: Mapping[str, np.ndarray], *, vocab_size: int, max_tokens: int, split_long: bool, loss_on: str = "all"
) -> np.ndarray:
    """Kind code per record (0 good, ``1 + i`` for ``TEXT_BAD_KINDS[i]``), in :meth:`TextCodec.decode`'s order."""
    n = stats["length"]
    trained = stats["trained"]  # -1: plain text (no mask)
    # loss_on document trains a chat on its assistant turns; assistant does so for every record
    needs_assistant = (trained >= 0) if loss_on == "document" else np.full(n.shape, loss_on == "assistant")
    rules = [
        (n == _MISSING, "missing_file"),
        (n == _UNDECODABLE, "undecodable"),
        (n == 0, "empty"),
        ((n > max_tokens) & (not split_long), "too_long"),
        ((stats["min_token"] < 0) | (stats["max_token"] >= vocab_size), "token_out_of_range"),
        (needs_assistant & (trained <= 0), "no_assistant"),
    ]
    return np.select([c for c, _ in rules], [1 + TEXT_BAD_KINDS.index(k) for _, k in rules], default=0).astype(np.int64)


class TextShardWriter(ShardWriter):
    """Writes token documents into ``<out_dir>/<prefix>-NNNNNN.tar`` (``<key>.tokens.npy`` plus an
    optional ``<key>.json``), each finished shard with its index side file."""

    def __init__(self, out_dir: str, *, prefix: str = "text", docs_per_shard: int = TEXT_DOCS_PER_SHARD) -> None:
        super().__init__(out_dir, samples_per_shard=docs_per_shard, prefix=prefix)

    def _index_spec(self) -> IndexSpec:
        return TEXT_INDEX_SPEC

    def write(
        self, key: str, tokens: np.ndarray, meta: Mapping[str, Any] | None = None, *, assistant_mask: np.ndarray | None = None
    ) -> None:
        record: dict[str, Any] = {"tokens.npy": np.asarray(tokens, dtype=np.int32)}
        if assistant_mask is not None:
            record["assistant_mask.npy"] = np.asarray(assistant_mask, dtype=np.uint8)
        if meta:
            record["json"] = dict(meta)
        self._add(self._key(key), record)


# -- raw files -> cached shards ------------------------------------------------------------------
@dataclass(slots=True)
class TokenizedFile:
    """The cached shards of one raw file, and what tokenising it rejected."""

    file: str
    shards: list[str]
    documents: int
    bad_counts: dict[str, int]
    skipped: list[str]


def tokenize_to_shards(
    files: Sequence[str],
    tokenizer: str,
    record_spec: Any,
    *,
    cache_dir: str,
    start: int = 0,
) -> list[TokenizedFile]:
    """Pre-tokenised shards of every raw file, from the cache or tokenised now (see the module doc).

    Files are done in order from ``start`` (wrapping around); one another process finished
    meanwhile is reused. Each file's shards go to a temporary folder renamed into place, so a file
    is either fully cached or not at all.
    """
    from hyper_parallel.data.text.records import iter_text_documents
    from hyper_parallel.data.tokenizer import HuggingFaceTokenizer, tokenizer_fingerprint

    root = os.path.join(os.path.expanduser(cache_dir), "text_tokens")
    os.makedirs(root, exist_ok=True)
    tok_print = tokenizer_fingerprint(os.path.expanduser(tokenizer))
    keys = ("text_column", "chat_column", "key_column", "append_eos", "system_prompt")
    spec = {k: getattr(record_spec, k) for k in keys}
    # the chat-template options change the rendering: keyed only when set (caches made without them stay valid)
    for k in ("reasoning_effort", "preserve_thinking"):
        if getattr(record_spec, k, None) not in ("", None):
            spec[k] = getattr(record_spec, k)
    spec_json = json.dumps(spec, sort_keys=True)
    loaded = None
    out: list[TokenizedFile | None] = [None] * len(files)
    for j in range(len(files)):
        i = (start + j) % len(files)
        path = files[i]
        st = os.stat(path)
        ident = json.dumps([TEXT_CACHE_VERSION, os.path.abspath(path), st.st_size, st.st_mtime_ns, tok_print, spec_json])
        digest = hashlib.sha256(ident.encode()).hexdigest()[:20]

        def tokenize_into(tmp: str, path: str = path, digest: str = digest) -> None:
            nonlocal loaded
            if loaded is None:
                loaded = HuggingFaceTokenizer.from_folder(tokenizer)
            counts: dict[str, int] = {}
            skipped: list[str] = []
            documents = 0
            with TextShardWriter(tmp, prefix=digest) as writer:
                for doc in iter_text_documents(
                    [path], loaded, record_spec, on_bad_sample="skip", bad_counts=counts, on_skip=skipped.append
                ):
                    meta = {"file": path, "row": doc.row, "key": doc.key, **({"line": doc.line} if doc.line else {})}
                    writer.write(f"{doc.row:010d}", doc.tokens, meta, assistant_mask=doc.assistant_mask)
                    documents += 1
            with open(os.path.join(tmp, "manifest.json"), "w") as f:
                json.dump(
                    {"file": path, "documents": documents, "bad_counts": counts, "skipped": skipped,
                     "shards": [os.path.basename(s) for s in writer.shards]},
                    f,
                )  # fmt: skip

        # A folder counts as cached once its manifest (written last) is there.
        final = cached_build(
            root, digest, tokenize_into, ready=lambda folder: os.path.isfile(os.path.join(folder, "manifest.json"))
        )
        manifest = os.path.join(final, "manifest.json")
        with open(manifest) as f:
            m = json.load(f)
        shards = [os.path.join(final, s) for s in m["shards"]]
        out[i] = TokenizedFile(path, shards, m["documents"], dict(m["bad_counts"]), list(m["skipped"]))
    return [t for t in out if t is not None]


# -- the loader ------------------------------------------------------------------------------------
class HuggingFaceTextDataLoader(ShardedDataLoader):
    """Text documents (pre-tokenised shards, raw files, or the toy corpus) for one DP rank.

    Model fact: ``vocab_size`` (every token id and the tokenizer's ids must lie below it).
    Micro-batches carry the generic contract only.
    """

    source: ClassVar[str] = "text"
    bad_kinds = TEXT_BAD_KINDS

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        source: Literal["direct_token", "text", "preset_pt", "dummy"] = "text"
        """`direct_token`: VQ image+text webdataset shards (docs/design.md section 5); `text`: pre-tokenised shards or raw jsonl/parquet/arrow files; `preset_pt`: replay a torch.save'd list of micro-batches; `dummy`: random tokens (smoke runs, benchmarks)."""

    def _prepare(self) -> None:
        self.vocab_size = int(self.fact("vocab_size"))
        self._check_pad_token(self.vocab_size)
        self.tokenized_files: list[TokenizedFile] = []

    def _resolve_shards(self) -> list[str]:
        c = self.config
        path, tokenizer = c.path, c.tokenizer
        if path:
            try:
                return resolve_shards(path)
            except FileNotFoundError:
                pass  # not shards: raw text files
        else:
            from hyper_parallel.data.text import cached_toy_text

            toy = cached_toy_text(c.cache_dir)
            # a chat column names the embedded conversations (toy_chat.jsonl: {"id", "messages"})
            path, tokenizer = toy.chat_file if c.text.chat_column else toy.text_file, tokenizer or toy.tokenizer_dir
        return self._tokenize(path, tokenizer)

    def _tokenize(self, path: str, tokenizer: str) -> list[str]:
        from hyper_parallel.data.text import TextRecordSpec, resolve_text_files
        from hyper_parallel.data.tokenizer import HuggingFaceTokenizer

        c = self.config
        files = resolve_text_files(path)
        if not tokenizer:
            raise ValueError(
                f"data.path={c.path!r} names raw text files: set --data.tokenizer to an HF tokenizer folder "
                "(with tokenizer.json), usually the model's own: the folder you pass as --checkpoint.initial_load_path"
            )
        vocab = HuggingFaceTokenizer.from_folder(tokenizer).vocab_size
        if vocab > self.vocab_size:
            raise ValueError(
                f"data.tokenizer={tokenizer!r} produces ids up to {vocab - 1}, but the model's vocab_size is "
                f"{self.vocab_size}: use the model's tokenizer (or a model with a larger vocabulary)"
            )
        spec = TextRecordSpec(
            text_column=c.text.text_column, chat_column=c.text.chat_column or None,
            system_prompt=c.chat.system_prompt, reasoning_effort=c.chat.reasoning_effort,
            preserve_thinking=c.chat.preserve_thinking,
        )  # fmt: skip
        start = self.dp_rank * len(files) // self.dp_world_size
        self.tokenized_files = tokenize_to_shards(files, tokenizer, spec, cache_dir=c.cache_dir, start=start)
        for t in self.tokenized_files:
            if t.skipped and c.on_bad_sample == "error":
                raise BadSampleError(
                    t.skipped[0] + ". Fix the data, or set --data.on_bad_sample skip to drop and count such records."
                )
            for kind, n in t.bad_counts.items():
                self._startup_bad[kind] = self._startup_bad.get(kind, 0) + n
            if self.dp_rank == 0:
                for message in t.skipped:
                    logger.warning("skipped %s", message)
        shards = [s for t in self.tokenized_files for s in t.shards]
        if not shards:
            raise BadSampleError(f"data.path={c.path!r} holds no usable text record (skipped: {self._startup_bad})")
        return shards

    def _cut(self) -> bool:
        return self.config.chat.long_conversations == "cut"

    def _index_spec(self) -> IndexSpec:
        if not self._cut():
            return TEXT_INDEX_SPEC
        cut_at = self.config.max_tokens_per_microbatch
        stats = TextStats(cut_at=cut_at)
        return IndexSpec(kind=TEXT_INDEX_SPEC.kind, columns=stats.columns, stats=stats, params={"cut_at": cut_at})

    def _classify(self, stats: Mapping[str, np.ndarray]) -> np.ndarray:
        c = self.config
        return text_classify(
            stats,
            vocab_size=self.vocab_size,
            max_tokens=c.max_tokens_per_microbatch,
            split_long=c.text.split_long_documents,
            loss_on=c.chat.loss_on,
        )

    def _codec(self) -> TextCodec:
        c = self.config
        split_long = c.text.split_long_documents
        return TextCodec(self.vocab_size, c.max_tokens_per_microbatch, split_long, c.chat.loss_on, self._cut())

    def conversations_cut(self) -> int:
        """Conversations of the corpus that are cut to fit the micro-batch (``long_conversations=cut``)."""
        if not self._cut():
            return 0
        if getattr(self, "_conversations_cut", None) is None:
            self._conversations_cut = sum(
                int(load_stats(s.index_path, self.index_spec)["cut"].sum()) for s in self.table.shards
            )
        return self._conversations_cut

    def metrics(self) -> dict[str, float]:
        """For chats, adds ``data/too_long_skipped`` (conversations dropped for their length, so far) and
        ``data/conversations_cut`` (conversations of the corpus cut to fit, with ``long_conversations=cut``)."""
        out = super().metrics()
        if self.config.text.chat_column:
            out["data/too_long_skipped"] = float(self.bad_sample_counts.get("too_long", 0))
            out["data/conversations_cut"] = float(self.conversations_cut())
        return out

    def _order(self) -> dict[str, Any]:
        # loss_on changes labels only, not which records come: a resume may change it
        return {**super()._order(), "vocab_size": self.vocab_size, "long_conversations": self.config.chat.long_conversations}
