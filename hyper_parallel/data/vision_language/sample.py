"""One vision-language record: text + images -> tokens with expanded images, index statistics, decode, collate.

A record (webdataset key ``<key>``) is ``<key>.json`` plus its images: ``<key>.jpg|jpeg|png|webp``
for one image, ``<key>.0.jpg``, ``<key>.1.png``, ... for several (numbered ``0..n-1``, in order).
The json holds ``{"text": "... <image> ..."}`` or ``{"messages": [{"role": ..., "content":
"... <image> ..."}, ...]}`` (rendered with the tokenizer's chat template); other fields are kept
but not used. The i-th ``<image>`` marker is the i-th image.

**Tokens.** The text (or rendered chat) is cut at the markers; each piece is tokenised without
special tokens (what HF's processor gets: its image tokens are added tokens, which split the text
the same way) and every marker becomes ``vision_start``, ``t*h*w / merge^2`` ``image_token``\\ s,
``vision_end``. Plain text starts with bos when the tokenizer's policy adds one and ends with eos
(as the text source does); a chat is exactly its rendered template. The number of image tokens
comes from the image header alone (:meth:`ImageProcessor.grid_thw`), so the shard index knows every
document's length without decoding a pixel.

**Labels** are the shifted tokens with ``image_token``, ``vision_start`` and ``vision_end`` targets
set to -100. HF's ``Qwen3VLMoeForConditionalGeneration`` takes labels as given; HF's Qwen2-VL
fine-tuning recipe (TRL cookbook) and NeMo's Qwen-VL collate mask exactly these three ids, and we
follow them: the model never learns to emit image tokens or the markers around them (the processor
writes those), while the text after an image is still a target.

**Model inputs** of a micro-batch: ``pixel_values`` float32 ``[N_patches, 3*T*p*p]`` (the documents'
images in order, merge-block order, equal to HF's processor) and ``image_grid_thw`` int64
``[n_images, 3]``; ``position_ids`` are the M-RoPE rows ``[3, 1, T]`` (:mod:`.mrope`), restarting
at 0 for every packed document.

**Bad records** (:data:`VL_BAD_KINDS`): the checks run in one order both on the index (headers
only) and on decode, so a record the index calls good decodes, except an image whose header is
fine but whose body is broken: that is only seen when its pixels are decoded, and stops the run
with a message pointing at ``python -m hyper_parallel.data.vision_language check``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from hyper_parallel.data.bad_samples import (
    BAD_SAMPLE_KINDS,
    IGNORE_INDEX,
    BadSample,
    BadSampleError,
    bad_sample_message,
)
from hyper_parallel.data.index import IndexSpec
from hyper_parallel.data.packing import collate_packed, shift_labels
from hyper_parallel.data.preset import register_batch_check
from hyper_parallel.data.tokenizer import HuggingFaceTokenizer, tokenizer_fingerprint
from hyper_parallel.data.vision_language.mrope import mrope_position_ids
from hyper_parallel.data.vision_language.preprocess import ImageError, ImageProcessor

__all__ = [
    "IMAGE_EXTENSIONS",
    "IMAGE_MARKER",
    "VL_BAD_KINDS",
    "VL_MODEL_FACTS",
    "ParsedRecord",
    "VisionLanguageCodec",
    "VisionLanguageDocument",
    "VisionLanguageEncoder",
    "collate_vision_language",
    "image_members",
    "make_encoder",
    "read_text",
    "vl_classify",
]

IMAGE_MARKER = "<image>"
"""Where an image goes in the text; the i-th marker is the record's i-th image."""

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
"""Member extensions that are images (``<key>.png`` or ``<key>.<i>.png``)."""

VL_MODEL_FACTS = (
    "vocab_size",
    "image_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
)
"""The model facts the ``vision_language`` source needs (``ModelSpec.data_facts``)."""

VL_BAD_KINDS = (
    *BAD_SAMPLE_KINDS,
    "missing_text",
    "bad_image_names",
    "count_mismatch",
    "empty_image",
    "too_many_pixels",
    "aspect_ratio",
    "reserved_token",
)
"""Kinds of bad vision-language records: the generic ones plus ``missing_text`` (the json has no
``text``/``messages``), ``bad_image_names`` (images not numbered ``0..n-1``), ``count_mismatch``
(markers != images), ``empty_image`` (0 bytes or 0 pixels), ``too_many_pixels`` (over
``image.max_input_pixels``), ``aspect_ratio`` (over 200, HF's limit), ``reserved_token`` (the text
itself tokenises to an image or vision marker id)."""

INDEX_KIND = "vision_language/1"
"""Name and version of the index statistics (bump when :meth:`VisionLanguageEncoder.parse` changes)."""


def _bad(kind: str, detail: str) -> BadSample:
    assert kind in VL_BAD_KINDS, kind
    return BadSample(kind, detail)


# -- the parts of a record ----------------------------------------------------------------------
def read_text(files: Mapping[str, bytes]) -> tuple[str | None, list[dict[str, Any]] | None]:
    """``(text, None)`` or ``(None, messages)`` from the record's json (raises ``BadSample``)."""
    raw = files.get("json")
    if raw is None:
        raise _bad("missing_file", f"the record has no .json (its text); it has {sorted(files) or 'no files'}")
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad("undecodable", f"its .json is not UTF-8 JSON ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict):
        raise _bad("bad_metadata", f"its .json must be an object, got {type(meta).__name__}")
    text, messages = meta.get("text"), meta.get("messages")
    if text is None and messages is None:
        raise _bad("missing_text", f"its .json has neither a 'text' nor a 'messages' field (it has {sorted(meta)})")
    if text is not None and messages is not None:
        raise _bad("bad_metadata", "its .json has both 'text' and 'messages'; give one")
    if text is not None:
        if not isinstance(text, str):
            raise _bad("bad_metadata", f"'text' must be a string, got {type(text).__name__}")
        return text, None
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    )
    if not ok:
        raise _bad("bad_metadata", "'messages' must be a list of {\"role\": str, \"content\": str} objects")
    if not messages:
        raise _bad("empty", "'messages' is an empty list")
    return None, messages


def image_members(files: Mapping[str, bytes]) -> list[str]:
    """The member names (extensions) of the record's images in order (raises ``BadSample``)."""
    single = sorted(e for e in files if e in IMAGE_EXTENSIONS)
    numbered: dict[int, list[str]] = {}
    for e in files:
        head, _, tail = e.partition(".")
        if tail in IMAGE_EXTENSIONS and head.isdigit():
            numbered.setdefault(int(head), []).append(e)
    if single and numbered or len(single) > 1:
        names = sorted(single + [e for es in numbered.values() for e in es])
        raise _bad("bad_image_names", f"images {names}: use <key>.<ext> for one image or <key>.<i>.<ext>, i = 0..n-1")
    if single:
        return single
    if any(len(es) > 1 for es in numbered.values()) or sorted(numbered) != list(range(len(numbered))):
        names = sorted(e for es in numbered.values() for e in es)
        raise _bad("bad_image_names", f"images {names} must be numbered 0..n-1 once each (<key>.0.jpg, <key>.1.png)")
    return [numbered[i][0] for i in range(len(numbered))]


@dataclass(slots=True)
class ParsedRecord:
    """A record's tokens (images expanded) and its images, from headers only."""

    input_ids: np.ndarray
    """int64 ``[L]``."""
    images: list[str]
    """Member names of the images, in marker order."""
    grids: list[tuple[int, int, int]]
    """``(t, h, w)`` in patches per image."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(slots=True, eq=False)
class VisionLanguageDocument:
    """A decoded record: tokens, shifted labels, M-RoPE positions and the vision tower's inputs."""

    key: str
    shard: str
    input_ids: np.ndarray
    """int64 ``[L]``."""
    labels: np.ndarray
    """int64 ``[L]``, already shifted; -100 at image/marker targets and the last position."""
    position_ids: np.ndarray
    """int64 ``[3, L]`` M-RoPE positions from 0."""
    pixel_values: torch.Tensor
    """float32 ``[sum t*h*w, 3*T*p*p]``."""
    image_grid_thw: torch.Tensor
    """int64 ``[n_images, 3]``."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


class VisionLanguageEncoder:
    """Record files -> tokens (headers only, :meth:`parse`) -> a full document (:meth:`document`).

    Picklable (it runs in DataLoader workers). Build it with :func:`make_encoder`, which checks the
    tokenizer against the model facts.
    """

    def __init__(
        self,
        tokenizer: HuggingFaceTokenizer,
        processor: ImageProcessor,
        *,
        image_token_id: int,
        vision_start_token_id: int,
        vision_end_token_id: int,
        tokenizer_fingerprint: str,
    ) -> None:
        self.tokenizer, self.processor = tokenizer, processor
        self.image_token_id = image_token_id
        self.vision_start_token_id, self.vision_end_token_id = vision_start_token_id, vision_end_token_id
        self.reserved = (image_token_id, vision_start_token_id, vision_end_token_id)
        self.bos = [tokenizer.bos_id] if tokenizer.adds_bos else []
        self.eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        self.tokenizer_fingerprint = tokenizer_fingerprint

    @property
    def merge_size(self) -> int:
        return self.processor.merge_size

    def index_params(self) -> dict[str, Any]:
        """What the index statistics depend on (an index made with other values is rebuilt)."""
        c = self.processor.config
        return {
            "tokenizer": self.tokenizer_fingerprint,
            "image_token_id": self.image_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "patch_size": self.processor.patch_size,
            "merge_size": self.processor.merge_size,
            "min_pixels": c.min_pixels,
            "max_pixels": c.max_pixels,
            "max_input_pixels": c.max_input_pixels,
        }

    def index_spec(self) -> IndexSpec:
        """The index of vision-language shards for this tokenizer, processor and model ids."""
        stats = VisionLanguageStats(self)
        return IndexSpec(kind=INDEX_KIND, columns=stats.columns, stats=stats, params=self.index_params())

    # -- headers only --------------------------------------------------------------------------
    def _grid(self, key: str, member: str, data: bytes) -> tuple[int, int, int]:
        name = f"{key}.{member}"
        try:
            image = self.processor.open(data, name)
            return self.processor.grid_thw(image.height, image.width, name)
        except ImageError as e:
            raise _bad(e.kind, f"image {name!r} {e.detail}") from None

    def render(self, text: str | None, messages: list[dict[str, Any]] | None) -> str:
        """The string whose ``<image>`` markers are expanded: the text, or the rendered chat."""
        if messages is None:
            return text  # type: ignore[return-value]
        try:
            return self.tokenizer.apply_chat_template(messages)
        except Exception as e:  # noqa: BLE001 - a template that rejects a chat (raise_exception, missing fields)
            raise _bad("undecodable", f"the chat template rejects its messages ({type(e).__name__}: {e})") from None

    def parse(self, key: str, files: Mapping[str, bytes]) -> ParsedRecord:
        """Validate a record and expand its tokens, reading image headers only (raises ``BadSample``)."""
        text, messages = read_text(files)
        images = image_members(files)
        rendered = self.render(text, messages)
        contents = [text] if messages is None else [m["content"] for m in messages]
        if not images and all(not c.strip() for c in contents):
            raise _bad("empty", "its text is blank and it has no image")
        pieces = rendered.split(IMAGE_MARKER)
        if len(pieces) - 1 != len(images):
            raise _bad(
                "count_mismatch",
                f"its text has {len(pieces) - 1} {IMAGE_MARKER} marker(s) but the record has {len(images)} image(s) "
                f"{images}",
            )
        grids = [self._grid(key, member, files[member]) for member in images]
        encoded = self.tokenizer.encode_batch(pieces, add_special_tokens=False)
        for piece in encoded:
            hit = set(piece).intersection(self.reserved)
            if hit:
                raise _bad(
                    "reserved_token",
                    f"its text tokenises to {sorted(hit)}, an image or vision marker id of the model "
                    f"(image/vision_start/vision_end = {list(self.reserved)}); images go in as {IMAGE_MARKER} markers",
                )
        m2 = self.merge_size * self.merge_size
        start, image, end = self.vision_start_token_id, self.image_token_id, self.vision_end_token_id
        parts: list[Sequence[int]] = [self.bos if messages is None else []]  # a chat template writes its own
        for i, piece in enumerate(encoded):
            parts.append(piece)
            if i < len(grids):
                t, h, w = grids[i]
                parts.append([start, *[image] * (t * h * w // m2), end])
        if messages is None:
            parts.append(self.eos)
        input_ids = np.fromiter((tok for part in parts for tok in part), dtype=np.int64)
        if not len(input_ids):  # a tokenizer that maps the whole text to nothing
            raise _bad("empty", "its text tokenises to no token")
        return ParsedRecord(input_ids, images, grids)

    # -- pixels --------------------------------------------------------------------------------
    def pixels(self, key: str, files: Mapping[str, bytes], record: ParsedRecord) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values, image_grid_thw)`` of a parsed record (raises ``BadSample`` for a broken image body)."""
        names = [f"{key}.{member}" for member in record.images]
        try:
            out = self.processor([files[m] for m in record.images], names=names)
        except ImageError as e:
            raise _bad(e.kind, f"image {e.name!r} {e.detail}") from None
        if out.image_grid_thw.tolist() != [list(g) for g in record.grids]:  # the header and the pixels disagree
            raise _bad(
                "undecodable",
                f"its images decode to grids {out.image_grid_thw.tolist()} but their headers say {record.grids}",
            )
        return out.pixel_values, out.image_grid_thw

    def document(
        self, key: str, shard: str, files: Mapping[str, bytes], record: ParsedRecord | None = None
    ) -> VisionLanguageDocument:
        """The full document (raises ``BadSample``)."""
        record = self.parse(key, files) if record is None else record
        pixel_values, grid_thw = self.pixels(key, files, record)
        ids = record.input_ids
        targets = np.where(np.isin(ids, self.reserved), IGNORE_INDEX, ids)
        positions = mrope_position_ids(
            ids, grid_thw.numpy(), image_token_id=self.image_token_id, merge_size=self.merge_size
        )
        return VisionLanguageDocument(key, shard, ids, shift_labels(targets), positions, pixel_values, grid_thw)


@dataclass(frozen=True, slots=True)
class VisionLanguageStats:
    """Per-record index statistics: expanded ``length``, bad ``kind`` code (0 good), ``images``, ``patches``."""

    encoder: VisionLanguageEncoder
    columns: ClassVar[tuple[str, ...]] = ("length", "kind", "images", "patches")

    def __call__(self, key: str, files: Mapping[str, bytes]) -> dict[str, int]:
        try:
            record = self.encoder.parse(key, files)
        except BadSample as e:
            return {"length": 0, "kind": 1 + VL_BAD_KINDS.index(e.kind), "images": 0, "patches": 0}
        patches = sum(t * h * w for t, h, w in record.grids)
        return {"length": len(record), "kind": 0, "images": len(record.grids), "patches": patches}


def vl_classify(stats: Mapping[str, np.ndarray], *, max_tokens: int) -> np.ndarray:
    """Kind code per record (0 good, ``1 + i`` for ``VL_BAD_KINDS[i]``): the index's own verdict, then the budget."""
    too_long = 1 + VL_BAD_KINDS.index("too_long")
    kind = stats["kind"]
    return np.where(kind > 0, kind, np.where(stats["length"] > max_tokens, too_long, 0)).astype(np.int64)


# -- collate -----------------------------------------------------------------------------------------
def _vision_inputs(documents: Sequence[VisionLanguageDocument], offsets: np.ndarray) -> dict[str, Any]:
    return {
        "pixel_values": torch.cat([d.pixel_values for d in documents]),
        "image_grid_thw": torch.cat([d.image_grid_thw for d in documents]),
    }


def collate_vision_language(
    documents: Sequence[VisionLanguageDocument], *, pad_token_id: int = 0, pad_to_multiple_of: int = 1
) -> dict[str, Any]:
    """One packed micro-batch: the generic contract with ``position_ids`` ``[3, 1, T]`` (M-RoPE per document,
    the padding run counts from 0 on all rows) plus ``pixel_values`` and ``image_grid_thw``."""
    batch = collate_packed(
        documents, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of, extras=_vision_inputs
    )
    total = batch["input_ids"].shape[1]
    pad = total - sum(len(d) for d in documents)
    rows = [d.position_ids for d in documents] + [np.broadcast_to(np.arange(pad, dtype=np.int64), (3, pad))]
    batch["position_ids"] = torch.from_numpy(np.concatenate(rows, axis=1)).view(3, 1, total)
    return batch


@dataclass(frozen=True, slots=True)
class VisionLanguageCodec:
    """Decode + collate of vision-language records (picklable: runs in DataLoader workers)."""

    encoder: VisionLanguageEncoder
    max_tokens: int
    label: ClassVar[str] = "vision_language"

    def decode(self, key: str, shard: str, files: Mapping[str, bytes], piece: int) -> VisionLanguageDocument:
        record = self.encoder.parse(key, files)  # BadSample here: the index said otherwise (the reader says so)
        if len(record) > self.max_tokens:
            raise _bad(
                "too_long",
                f"{len(record)} tokens (images expanded) exceed data.max_tokens_per_microbatch={self.max_tokens} "
                "(raise it, or lower image.max_pixels)",
            )
        try:
            return self.encoder.document(key, shard, files, record)
        except BadSample as e:
            # Only pixels fail here (a body broken behind a readable header): the index cannot see that.
            raise BadSampleError(
                bad_sample_message(self.label, shard, key, e.kind, e.detail)
                + ". The shard index reads image headers only, so it could not flag this image; find every such "
                "image with `python -m hyper_parallel.data.vision_language check --path ...` (it decodes all "
                "pixels) and fix or drop them"
            ) from None

    def collate(
        self, documents: Sequence[VisionLanguageDocument], *, pad_token_id: int, pad_to_multiple_of: int
    ) -> dict[str, Any]:
        return collate_vision_language(documents, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of)


# -- building the encoder from a tokenizer folder and the model facts -------------------------------
def make_encoder(tokenizer: str, image: ImageProcessor.Config, facts: Mapping[str, Any]) -> VisionLanguageEncoder:
    """The encoder for a tokenizer folder, image settings and the model facts :data:`VL_MODEL_FACTS`.

    Checks that every token the tokenizer produces lies below ``vocab_size``, that the three image
    ids are distinct ids of the model, and that an id inside the tokenizer's range is one of its
    special tokens (so ordinary text cannot produce it).
    """
    missing = [k for k in VL_MODEL_FACTS if k not in facts]
    if missing:
        raise ValueError(f"the vision_language source needs the model facts {missing} (ModelSpec.data_facts)")
    f = {k: int(facts[k]) for k in VL_MODEL_FACTS}
    vocab = f["vocab_size"]
    for k in ("patch_size", "temporal_patch_size", "merge_size"):
        if f[k] < 1:
            raise ValueError(f"model fact {k}={f[k]} must be >= 1")
    tok = HuggingFaceTokenizer.from_folder(tokenizer)
    if tok.vocab_size > vocab:
        raise ValueError(
            f"data.tokenizer={tokenizer!r} produces ids up to {tok.vocab_size - 1}, but the model's vocab_size is "
            f"{vocab}: use the model's tokenizer (or a model with a larger vocabulary)"
        )
    ids = {k: f[k] for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id")}
    if len(set(ids.values())) != 3:
        raise ValueError(f"the model's image token ids must be three different ids, got {ids}")
    for name, i in ids.items():
        if not 0 <= i < vocab:
            raise ValueError(f"model fact {name}={i} must be a token id in [0, vocab_size={vocab})")
        if i < tok.vocab_size and tok.decode([i], skip_special_tokens=True) != "":
            raise ValueError(
                f"model fact {name}={i} is an ordinary token of data.tokenizer={tokenizer!r} "
                f"({tok.decode([i])!r}): text would produce it. Use the model's own tokenizer (its image tokens are "
                "special tokens) or ids beyond the tokenizer's vocabulary"
            )
    processor = image.build(
        patch_size=f["patch_size"], temporal_patch_size=f["temporal_patch_size"], merge_size=f["merge_size"]
    )
    return VisionLanguageEncoder(tok, processor, **ids, tokenizer_fingerprint=tokenizer_fingerprint(tok.folder))


# -- preset_pt: saved vision-language micro-batches ---------------------------------------------------
def check_vision_batch(batch: dict[str, Any], facts: Mapping[str, Any], where: str) -> None:
    """``preset_pt`` check of a saved micro-batch with ``pixel_values`` / ``image_grid_thw`` (normalises dtypes)."""

    def fail(msg: str) -> None:
        raise ValueError(f"{where}: {msg}")

    missing = [k for k in ("vocab_size", "image_token_id", "merge_size") if k not in facts]
    if missing:
        fail(f"holds image_grid_thw, but the model gives no {missing}: it takes no pixel inputs")
    vocab, image_id, m = int(facts["vocab_size"]), int(facts["image_token_id"]), int(facts["merge_size"])
    pv, grid = batch.get("pixel_values"), batch.get("image_grid_thw")
    if not isinstance(pv, torch.Tensor) or not pv.dtype.is_floating_point or pv.dim() != 2:
        fail("pixel_values must be a 2-D float tensor [N_patches, C*T*p*p]")
    if not isinstance(grid, torch.Tensor) or grid.dtype.is_floating_point or grid.dim() != 2 or grid.shape[1] != 3:
        fail("image_grid_thw must be an integer tensor [n_images, 3]")
    batch["image_grid_thw"] = grid = grid.to(torch.int64)
    patches = int(grid.prod(dim=1).sum())
    if pv.shape[0] != patches:
        fail(f"pixel_values has {pv.shape[0]} rows but image_grid_thw covers {patches} patches")
    n_image = int((batch["input_ids"] == image_id).sum())
    if n_image * m * m != patches:
        fail(f"input_ids hold {n_image} image tokens (id {image_id}) but the grids give {patches // (m * m)}")
    ids, labels = batch["input_ids"], batch["labels"]
    if bool((ids >= vocab).any()) or bool(((labels != IGNORE_INDEX) & (labels >= vocab)).any()):
        fail(f"input_ids and labels must lie below the model's vocab_size={vocab}")


register_batch_check("image_grid_thw", check_vision_batch)
