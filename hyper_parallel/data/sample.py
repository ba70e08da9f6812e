"""One DirectToken sample: decoding, validation and per-document targets.

A sample on disk (DESIGN.md section 5) is three files sharing a key inside a webdataset tar:
``<key>.tokens.npy`` (int ``[L]``, image positions hold ``placeholder_token_id``),
``<key>.vq_codes.npy`` (int ``[N]``, the codes of those positions in order) and ``<key>.json``
(``{"image_grids": [[h, w], ...], "loss_on": "all" | "image"}``, ``sum(h*w) == N``).

Decoding validates every invariant the model relies on and returns a :class:`Sample` whose
``labels`` are already shifted (``labels[t]`` is the target predicted at ``t``; image targets are
``code + lang_vocab_size``; the last position and, with ``loss_on: image``, text targets are -100).
A sample that breaks an invariant raises :class:`BadSample` with a ``kind`` from
:data:`BAD_SAMPLE_KINDS`; the reader turns it into an error naming shard and key, or a counted skip.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "BAD_SAMPLE_KINDS",
    "IGNORE_INDEX",
    "BadSample",
    "BadSampleError",
    "Sample",
    "SampleSpec",
    "decode_sample",
    "make_sample",
]

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
    "count_mismatch",
    "grid_mismatch",
    "code_out_of_range",
)
"""Every way a sample can be rejected; the keys of the loader's bad-sample counts."""

_LOSS_ON = ("all", "image")


class BadSample(Exception):
    """Internal: a sample broke an invariant (``kind`` is one of :data:`BAD_SAMPLE_KINDS`)."""

    def __init__(self, kind: str, detail: str) -> None:
        assert kind in BAD_SAMPLE_KINDS, kind
        super().__init__(detail)
        self.kind, self.detail = kind, detail


class BadSampleError(ValueError):
    """A malformed sample or unreadable shard with ``data.on_bad_sample=error``.

    Takes a single message argument so a DataLoader worker can re-raise it in the main process.
    """


def bad_sample_message(shard: str, key: str | None, kind: str, detail: str) -> str:
    where = f"shard {shard!r}" + (f", key {key!r}" if key is not None else "")
    return f"bad DirectToken sample in {where}: {detail} [{kind}]"


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

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Sample:
        return cls(**{f: d[f] for f in cls.__slots__})


# The header numpy writes for a 1-D little-endian integer array, e.g.
# {'descr': '<i4', 'fortran_order': False, 'shape': (41,), }. Parsing it with a regex instead of
# np.load's ast.literal_eval makes decoding ~3x faster; anything else goes through np.load.
_NPY_1D_INT = re.compile(rb"\{'descr': '([<|][iu][1248])', 'fortran_order': False, 'shape': \((\d+),\), \}\s*")


def _fast_npy(data: bytes) -> np.ndarray | None:
    if data[:8] != b"\x93NUMPY\x01\x00" or len(data) < 10:
        return None
    header_len = int.from_bytes(data[8:10], "little")
    m = _NPY_1D_INT.fullmatch(data[10 : 10 + header_len])
    if m is None:
        return None
    dtype, n = np.dtype(m.group(1).decode()), int(m.group(2))
    body = data[10 + header_len :]
    if len(body) != n * dtype.itemsize:
        return None  # let np.load produce the precise error
    return np.frombuffer(body, dtype=dtype)


def _load_npy(files: Mapping[str, bytes], name: str) -> np.ndarray:
    if name not in files:
        raise BadSample("missing_file", f"{name} is missing (the sample has: {sorted(files) or 'no files'})")
    fast = _fast_npy(files[name])
    if fast is not None:
        return fast
    try:
        arr = np.load(io.BytesIO(files[name]), allow_pickle=False)
    except Exception as e:  # any numpy parse failure: truncated header, bad magic, pickled object
        raise BadSample("undecodable", f"{name} is not a readable .npy array ({type(e).__name__}: {e})") from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise BadSample("undecodable", f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    return arr


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
    tokens = _load_npy(files, "tokens.npy")
    vq_codes = _load_npy(files, "vq_codes.npy")
    meta = _load_meta(files)
    return make_sample(key, shard, tokens, vq_codes, meta, spec)


def encode_files(tokens: Sequence[int] | np.ndarray, vq_codes: Sequence[int] | np.ndarray, meta: Mapping[str, Any]) -> dict:
    """The webdataset record fields of one sample (``TarWriter`` encodes ``.npy``/``.json`` by extension)."""
    return {
        "tokens.npy": np.asarray(tokens, dtype=np.int32),
        "vq_codes.npy": np.asarray(vq_codes, dtype=np.int32),
        "json": dict(meta),
    }
