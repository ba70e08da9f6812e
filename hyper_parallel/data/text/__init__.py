"""Raw text data: local jsonl/parquet/arrow records tokenised with an HF tokenizer, and a toy corpus.

:func:`tokenize_text_files` / :func:`iter_text_documents` turn files into :class:`TextDocument`
``(source, row, key, tokens)`` in a deterministic order; :func:`cached_toy_text` writes an embedded
toy corpus plus a byte-level BPE tokenizer folder for offline runs and tests. The tokenizer itself
lives in :mod:`hyper_parallel.data.tokenizer`.
"""

from hyper_parallel.data.text.records import (
    TEXT_BAD_SAMPLE_KINDS,
    TEXT_FILE_SUFFIXES,
    TextDocument,
    TextRecordSpec,
    TokenizedText,
    iter_text_documents,
    resolve_text_files,
    tokenize_text_files,
)
from hyper_parallel.data.text.toy_text import ToyText, ToyTextSpec, cached_toy_text, make_toy_chats, make_toy_documents

__all__ = [
    "TEXT_BAD_SAMPLE_KINDS",
    "TEXT_FILE_SUFFIXES",
    "TextDocument",
    "TextRecordSpec",
    "TokenizedText",
    "ToyText",
    "ToyTextSpec",
    "cached_toy_text",
    "iter_text_documents",
    "make_toy_chats",
    "make_toy_documents",
    "resolve_text_files",
    "tokenize_text_files",
]
