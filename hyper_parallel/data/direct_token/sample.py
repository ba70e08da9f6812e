"""One DirectToken sample: decoding, validation, per-document targets, index statistics, collate.

A sample on disk (docs/design.md section 5) is three files sharing a key inside a webdataset tar:
``<key>.tokens.npy`` (int ``[L]``, image positions hold ``placeholder_token_id``),
``<key>.vq_codes.npy`` (int ``[N]``, the codes of those positions in order) and ``<key>.json``
(``{"image_grids": [[h, w], ...], "loss_on": "all" | "image"}``, ``sum(h*w) == N``).

Decoding validates every invariant the model relies on and returns a :class:`Sample` whose
``labels`` are already shifted (``labels[t]`` is the target predicted at ``t``; image targets are
``code + lang_vocab_size``; the last position and, with ``loss_on: image``, text targets are -100).
A sample that breaks an invariant raises ``BadSample`` with a kind from
:data:`DIRECT_TOKEN_BAD_KINDS`.

The same checks run on the shard index before anything is read (:class:`DirectTokenStats` computes a
record's statistics once; :func:`classify` applies the model facts to them, in the order
:func:`make_sample` checks), so every rank knows which records are bad from the index alone.
:func:`collate_direct_token` is the generic packing collate plus the VQ model inputs
``visual_indices`` (flat positions of the image tokens in ``input_ids.view(-1)``) and
``vq_codes`` (their codes, in the same order), both int64 ``[N]``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from hyper_parallel.data.bad_samples import BAD_SAMPLE_KINDS, IGNORE_INDEX, BadSample
from hyper_parallel.data.index import IndexSpec
from hyper_parallel.data.npy import load_npy
from hyper_parallel.data.packing import collate_packed
from hyper_parallel.data.preset import register_batch_check

__all__ = [
    "DIRECT_TOKEN_BAD_KINDS",
    "DirectTokenCodec",
    "DirectTokenStats",
    "Sample",
    "SampleSpec",
    "check_vq_batch",
    "classify",
    "collate_direct_token",
    "decode_sample",
    "direct_token_index_spec",
    "encode_files",
    "make_sample",
]

DIRECT_TOKEN_BAD_KINDS = (*BAD_SAMPLE_KINDS, "count_mismatch", "grid_mismatch", "code_out_of_range")
"""Every way a DirectToken sample can be rejected; the keys of the loader's bad-sample counts."""

_LOSS_ON = ("all", "image")


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """What a valid sample must satisfy: model facts plus the packing budget."""

    lang_vocab_size: int
    codebook_size: int
    placeholder_token_id: int
    max_tokens: int


@dataclass(slots=True, eq=False)
class Sample:
    """A decoded, validated document, ready to be packed.

    ``input_ids``/``labels`` are int32 ``[L]`` (int32 keeps worker-to-main transfers small; the
    collate widens to int64); ``vq_codes``/``image_positions`` are int64 ``[N]``, positions local
    to the document.
    """

    key: str
    shard: str
    input_ids: np.ndarray
    labels: np.ndarray
    vq_codes: np.ndarray
    image_positions: np.ndarray

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def _load_meta(files: Mapping[str, bytes]) -> dict[str, Any]:
    if "json" not in files:
        raise BadSample("missing_file", f"json is missing (the sample has: {sorted(files) or 'no files'})")
    try:
        meta = json.loads(files["json"])
    except Exception as e:
        raise BadSample("undecodable", f"json is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise BadSample("bad_metadata", f"json must hold an object, got {type(meta).__name__}")
    return meta


def _grids(meta: Mapping[str, Any]) -> list[tuple[int, int]]:
    grids = meta.get("image_grids", [])
    ok = isinstance(grids, list) and all(
        isinstance(g, (list, tuple)) and len(g) == 2 and all(isinstance(v, int) and v > 0 for v in g) for g in grids
    )
    if not ok:
        raise BadSample("bad_metadata", f"image_grids must be a list of [h, w] positive ints, got {grids!r}")
    return [(int(h), int(w)) for h, w in grids]


def make_sample(
    key: str,
    shard: str,
    tokens: np.ndarray,
    vq_codes: np.ndarray,
    meta: Mapping[str, Any],
    spec: SampleSpec,
) -> Sample:
    """Validate one document against ``spec`` and compute its shifted labels (raises BadSample)."""
    tokens = np.asarray(tokens)
    vq_codes = np.asarray(vq_codes)
    loss_on = meta.get("loss_on", "all")
    if loss_on not in _LOSS_ON:
        raise BadSample("bad_metadata", f"loss_on must be one of {_LOSS_ON}, got {loss_on!r}")
    grids = _grids(meta)
    length = int(tokens.shape[0])
    if length == 0:
        raise BadSample("empty", "tokens.npy is empty")
    if length > spec.max_tokens:
        raise BadSample(
            "too_long",
            f"{length} tokens exceed the packing budget data.max_tokens_per_microbatch={spec.max_tokens} "
            "(raise it or split the document)",
        )
    tokens = tokens.astype(np.int64, copy=False)
    is_image = tokens == spec.placeholder_token_id
    bad = (tokens < 0) | ((tokens >= spec.lang_vocab_size) & ~is_image)
    if bad.any():
        pos = int(np.flatnonzero(bad)[0])
        raise BadSample(
            "token_out_of_range",
            f"token id {int(tokens[pos])} at position {pos} is outside [0, lang_vocab_size={spec.lang_vocab_size})",
        )
    num_codes = int(vq_codes.shape[0])
    num_placeholders = int(is_image.sum())
    if num_placeholders != num_codes:
        raise BadSample(
            "count_mismatch",
            f"{num_placeholders} placeholder tokens (id {spec.placeholder_token_id}) but {num_codes} vq_codes",
        )
    grid_total = sum(h * w for h, w in grids)
    if grid_total != num_codes:
        raise BadSample("grid_mismatch", f"image_grids {grids} cover {grid_total} codes but vq_codes has {num_codes}")
    vq_codes = vq_codes.astype(np.int64, copy=False)
    bad_code = (vq_codes < 0) | (vq_codes >= spec.codebook_size)
    if bad_code.any():
        pos = int(np.flatnonzero(bad_code)[0])
        raise BadSample(
            "code_out_of_range",
            f"vq code {int(vq_codes[pos])} (index {pos}) is outside [0, codebook_size={spec.codebook_size})",
        )
    # targets[t] is what position t contributes as "the next token" of position t-1.
    targets = tokens.copy()
    targets[is_image] = vq_codes + spec.lang_vocab_size
    if loss_on == "image":
        targets[~is_image] = IGNORE_INDEX
    labels = np.empty_like(targets)
    labels[:-1] = targets[1:]
    labels[-1] = IGNORE_INDEX  # never predict across the document boundary
    return Sample(
        key=key,
        shard=shard,
        input_ids=tokens.astype(np.int32),
        labels=labels.astype(np.int32),
        vq_codes=vq_codes,
        image_positions=np.flatnonzero(is_image).astype(np.int64),
    )


def decode_sample(key: str, shard: str, files: Mapping[str, bytes], spec: SampleSpec) -> Sample:
    """Decode the raw files of one tar sample (``{"tokens.npy": b"...", ...}``) and validate it."""
    tokens = load_npy(files, "tokens.npy")
    vq_codes = load_npy(files, "vq_codes.npy")
    meta = _load_meta(files)
    return make_sample(key, shard, tokens, vq_codes, meta, spec)


def encode_files(tokens: Sequence[int] | np.ndarray, vq_codes: Sequence[int] | np.ndarray, meta: Mapping[str, Any]) -> dict:
    """The webdataset record fields of one sample (``TarWriter`` encodes ``.npy``/``.json`` by extension)."""
    return {
        "tokens.npy": np.asarray(tokens, dtype=np.int32),
        "vq_codes.npy": np.asarray(vq_codes, dtype=np.int32),
        "json": dict(meta),
    }


# -- the same checks on the shard index ------------------------------------------------------------
_MISSING, _UNDECODABLE, _BAD_METADATA = -1, -2, -3
"""Markers in the ``length`` / ``n_codes`` / ``meta`` index columns (a decodable value is >= 0)."""

_MARK = {"missing_file": _MISSING, "undecodable": _UNDECODABLE, "bad_metadata": _BAD_METADATA}


@dataclass(frozen=True, slots=True)
class DirectTokenStats:
    """Per-record index statistics of DirectToken shards (``IndexSpec.stats``), for one placeholder id."""

    placeholder_token_id: int
    columns: ClassVar[tuple[str, ...]] = (
        "length",
        "n_codes",
        "meta",
        "grid_total",
        "n_placeholder",
        "min_token",
        "max_text_token",
        "min_code",
        "max_code",
    )

    def __call__(self, key: str, files: Mapping[str, bytes]) -> dict[str, int]:
        out = dict.fromkeys(self.columns, 0)
        out["max_text_token"] = out["max_code"] = -1
        try:
            tokens = load_npy(files, "tokens.npy").astype(np.int64)
        except BadSample as e:
            tokens, out["length"] = None, _MARK[e.kind]
        try:
            codes = load_npy(files, "vq_codes.npy").astype(np.int64)
        except BadSample as e:
            codes, out["n_codes"] = None, _MARK[e.kind]
        try:
            meta = _load_meta(files)
            if meta.get("loss_on", "all") not in _LOSS_ON:
                raise BadSample("bad_metadata", "loss_on")
            out["grid_total"] = sum(h * w for h, w in _grids(meta))
        except BadSample as e:
            out["meta"] = _MARK[e.kind]
        if tokens is not None:
            out["length"] = len(tokens)
            is_image = tokens == self.placeholder_token_id
            out["n_placeholder"] = int(is_image.sum())
            if len(tokens):
                out["min_token"] = int(tokens.min())
            if (~is_image).any():
                out["max_text_token"] = int(tokens[~is_image].max())
        if codes is not None:
            out["n_codes"] = len(codes)
            if len(codes):
                out["min_code"], out["max_code"] = int(codes.min()), int(codes.max())
        return out


def direct_token_index_spec(placeholder_token_id: int) -> IndexSpec:
    """The index DirectToken shards carry (written by ``DirectTokenWriter``, else built on first use)."""
    stats = DirectTokenStats(int(placeholder_token_id))
    return IndexSpec(
        kind="direct_token/1",
        columns=stats.columns,
        stats=stats,
        params={"placeholder_token_id": int(placeholder_token_id)},
    )


def classify(stats: Mapping[str, np.ndarray], spec: SampleSpec) -> np.ndarray:
    """Kind code of every record from its index statistics: 0 good, ``1 + i`` for
    ``DIRECT_TOKEN_BAD_KINDS[i]``; the first failing check in :func:`decode_sample`'s order wins."""
    s = stats
    rules = [
        (s["length"] == _MISSING, "missing_file"),
        (s["length"] == _UNDECODABLE, "undecodable"),
        (s["n_codes"] == _MISSING, "missing_file"),
        (s["n_codes"] == _UNDECODABLE, "undecodable"),
        (s["meta"] == _MISSING, "missing_file"),
        (s["meta"] == _UNDECODABLE, "undecodable"),
        (s["meta"] == _BAD_METADATA, "bad_metadata"),
        (s["length"] == 0, "empty"),
        (s["length"] > spec.max_tokens, "too_long"),
        ((s["min_token"] < 0) | (s["max_text_token"] >= spec.lang_vocab_size), "token_out_of_range"),
        (s["n_placeholder"] != s["n_codes"], "count_mismatch"),
        (s["grid_total"] != s["n_codes"], "grid_mismatch"),
        ((s["n_codes"] > 0) & ((s["min_code"] < 0) | (s["max_code"] >= spec.codebook_size)), "code_out_of_range"),
    ]
    codes = [1 + DIRECT_TOKEN_BAD_KINDS.index(kind) for _, kind in rules]
    return np.select([cond for cond, _ in rules], codes, default=0).astype(np.int64)


# -- collate ---------------------------------------------------------------------------------------
def _vq_inputs(samples: Sequence[Sample], offsets: np.ndarray) -> dict[str, Any]:
    import torch

    visual_indices = np.concatenate([s.image_positions + off for s, off in zip(samples, offsets)])
    vq_codes = np.concatenate([s.vq_codes for s in samples])
    return {
        "visual_indices": torch.from_numpy(visual_indices.astype(np.int64)),
        "vq_codes": torch.from_numpy(vq_codes.astype(np.int64)),
    }


def collate_direct_token(
    samples: Sequence[Sample], *, pad_token_id: int = 0, pad_to_multiple_of: int = 1
) -> dict[str, Any]:
    """One packed micro-batch: the generic contract plus ``visual_indices`` and ``vq_codes``."""
    return collate_packed(samples, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of, extras=_vq_inputs)


@dataclass(frozen=True, slots=True)
class DirectTokenCodec:
    """Decode + collate of DirectToken records (picklable: runs in DataLoader workers)."""

    spec: SampleSpec
    label: ClassVar[str] = "DirectToken"

    def decode(self, key: str, shard: str, files: Mapping[str, bytes], piece: int) -> Sample:
        return decode_sample(key, shard, files, self.spec)

    def collate(self, documents: Sequence[Sample], *, pad_token_id: int, pad_to_multiple_of: int) -> dict[str, Any]:
        return collate_direct_token(documents, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of)


def check_vq_batch(batch: dict[str, Any], facts: Mapping[str, Any], where: str) -> None:
    """``preset_pt`` check of a saved micro-batch with VQ inputs (normalises their dtypes in place)."""
    import torch

    def fail(msg: str) -> None:
        raise ValueError(f"{where}: {msg}")

    missing = [k for k in ("vocab_size", "codebook_size", "placeholder_token_id") if k not in facts]
    if missing:
        fail(f"holds vq_codes, but the model gives no {missing}: it takes no VQ image inputs")
    vocab, codebook = int(facts["vocab_size"]), int(facts["codebook_size"])
    placeholder = int(facts["placeholder_token_id"])
    for k in ("visual_indices", "vq_codes"):
        v = batch.get(k)
        if not isinstance(v, torch.Tensor) or v.dtype.is_floating_point or v.dtype.is_complex:
            fail(f"{k} must be an integer tensor")
        batch[k] = v.to(torch.int64)
    vi, codes, ids = batch["visual_indices"], batch["vq_codes"], batch["input_ids"]
    if vi.shape != codes.shape or vi.dim() != 1:
        fail(f"visual_indices {tuple(vi.shape)} and vq_codes {tuple(codes.shape)} must be matching 1-D tensors")
    flat = ids.reshape(-1)
    if vi.numel() and (int(vi.min()) < 0 or int(vi.max()) >= flat.numel() or bool((flat[vi] != placeholder).any())):
        fail("visual_indices must point at placeholder tokens of input_ids")
    if int((flat == placeholder).sum()) != vi.numel():
        fail("every placeholder token of input_ids needs a visual_indices entry")
    if bool(((flat >= vocab) & (flat != placeholder)).any()):
        fail(f"input_ids must be text ids below vocab_size={vocab} or the placeholder {placeholder}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= codebook):
        fail(f"vq_codes must lie in [0, codebook_size={codebook})")
    labels = batch["labels"]
    if bool(((labels != IGNORE_INDEX) & (labels >= vocab + codebook)).any()):
        fail(f"labels must be -100 or in [0, vocab_size + codebook_size={vocab + codebook})")


register_batch_check("vq_codes", check_vq_batch)
