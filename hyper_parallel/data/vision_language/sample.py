"""One vision-language record: text + images -> tokens with expanded images, index statistics, decode, collate.

A record (webdataset key ``<key>``) is ``<key>.json`` plus its images: ``<key>.jpg|jpeg|png|webp``
for one image, ``<key>.0.jpg``, ``<key>.1.png``, ... for several (numbered ``0..n-1``, in order).
The json holds ``{"text": "... <image> ..."}`` or ``{"messages": [{"role": ..., "content":
"... <image> ..."}, ...]}`` (rendered with the tokenizer's chat template); a message's content may
also be transformers' list of parts ``[{"type": "image"}, {"type": "text", "text": "..."}]``, each
image part standing for the next image (:func:`~hyper_parallel.data.chat.check_conversation`);
other fields are kept but not used. The i-th ``<image>`` marker (or image part) is the i-th image.

**Tokens.** The text (or rendered chat) is cut at the markers; each piece is tokenised without
special tokens (what HF's processor gets: its image tokens are added tokens, which split the text
the same way) and every marker becomes ``vision_start``, ``t*h*w / merge^2`` ``image_token``\\ s,
``vision_end``. Plain text starts with bos when the tokenizer's policy adds one and ends with eos
(as the text source does); a chat is exactly its rendered template. The number of image tokens
comes from the image header alone (:meth:`ImageProcessor.grid_thw`), so the shard index knows every
document's length without decoding a pixel.

**Labels** are the shifted tokens with ``image_token``, ``vision_start`` and ``vision_end`` targets
set to -100; a conversation trains only its assistant turns by default (``loss_on``, see
:mod:`hyper_parallel.data.chat`). HF's ``Qwen3VLMoeForConditionalGeneration`` takes labels as given; HF's Qwen2-VL
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

import functools
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
from hyper_parallel.data.chat import (
    CHAT_BAD_KINDS,
    ChatTemplateError,
    check_conversation,
    encode_chat,
    resolve_loss_on,
    template_options,
)
from hyper_parallel.data.index import IndexSpec
from hyper_parallel.data.packing import collate_packed, shift_labels
from hyper_parallel.data.preset import register_batch_check
from hyper_parallel.data.tokenizer import HuggingFaceTokenizer, tokenizer_fingerprint
from hyper_parallel.data.vision_language.media import (
    VIDEO_BAD_KINDS,
    VIDEO_MARKER,
    VideoPlan,
    VideoRecords,
    split_media,
    video_members,
)
from hyper_parallel.data.vision_language.mrope import mrope_position_ids
from hyper_parallel.data.vision_language.preprocess import ImageError, ImageProcessor
from hyper_parallel.data.vision_language.video import VideoProcessor

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
    *CHAT_BAD_KINDS,
    *VIDEO_BAD_KINDS,
)
"""Kinds of bad vision-language records: the generic ones plus ``missing_text`` (the json has no
``text``/``messages``), ``bad_image_names`` (images not numbered ``0..n-1``), ``count_mismatch``
(markers != images), ``empty_image`` (0 bytes or 0 pixels), ``too_many_pixels`` (over
``image.max_input_pixels``), ``aspect_ratio`` (over 200, HF's limit), ``reserved_token`` (the text
itself tokenises to an image or vision marker id), ``bad_conversation`` (roles in a wrong order, a
content part that is not text or image), ``no_assistant`` (nothing to train with ``loss_on`` assistant), and
the video kinds (:data:`~.media.VIDEO_BAD_KINDS`)."""

INDEX_KIND = "vision_language/3"
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
    if not isinstance(messages, list):
        raise _bad("bad_metadata", f"'messages' must be a list of messages, got {type(messages).__name__}")
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
    assistant_mask: np.ndarray | None = None
    """Chats: bool ``[L]``, True at the tokens of assistant turns (never at image tokens); None for text."""
    videos: tuple[VideoPlan, ...] = ()
    """The videos, in marker order: frames to decode, grid, timestamps (:mod:`.media`)."""

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
    pixel_values_videos: torch.Tensor | None = None
    """float32 ``[sum t*h*w, 3*T*p*p]`` of the videos (HF ``pixel_values_videos``); None: no video."""
    video_grid_thw: torch.Tensor | None = None
    """int64 ``[n_videos, 3]``; None: no video."""

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
        system_prompt: str = "",
        videos: VideoRecords | None = None,
        template_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer, self.processor = tokenizer, processor
        self.template_defaults = dict(template_defaults or {})
        """The ``reasoning_effort`` / ``preserve_thinking`` defaults (``hyper_parallel.data.chat.template_options``)."""
        self.videos = videos
        """The video half (None: the model takes no video; a ``<video>`` marker is then a bad record)."""
        self.system_prompt = system_prompt
        self.image_token_id = image_token_id
        self.vision_start_token_id, self.vision_end_token_id = vision_start_token_id, vision_end_token_id
        self.reserved = (image_token_id, vision_start_token_id, vision_end_token_id)
        if videos is not None:
            self.reserved += (videos.video_token_id,)
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
            "system_prompt": self.system_prompt,
            **({"template_defaults": self.template_defaults} if self.template_defaults else {}),
            **(self.videos.index_params() if self.videos is not None else {}),
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

    def render(
        self, text: str | None, messages: list[dict[str, Any]] | None, options: Mapping[str, Any] | None = None
    ) -> str:
        """The string whose ``<image>`` markers are expanded: the text, or the chat rendered with the template
        variables ``options`` (:func:`~hyper_parallel.data.chat.template_options`)."""
        if messages is None:
            return text  # type: ignore[return-value]
        try:
            return self.tokenizer.apply_chat_template(messages, **(options or {}))
        except Exception as e:  # noqa: BLE001 - a template that rejects a chat (raise_exception, missing fields)
            raise _bad("undecodable", f"the chat template rejects its messages ({type(e).__name__}: {e})") from None

    def _expand(
        self, rendered: str, grids: Sequence[tuple[int, int, int]], videos: Sequence[VideoPlan] = ()
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Tokens of ``rendered`` with every ``<image>`` marker expanded (the i-th into ``grids[i]``'s image
        tokens) and every ``<video>`` marker (the j-th into ``videos[j]``'s frame groups, :mod:`.media`), and
        each token's characters in ``rendered`` (an image's or a video's tokens all point at its marker)."""
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        m2 = self.merge_size * self.merge_size
        start, image, end = self.vision_start_token_id, self.image_token_id, self.vision_end_token_id
        pos = 0
        n_image = n_video = 0
        for k, piece in enumerate(split_media(rendered)):
            if k % 2:  # a marker
                if piece == IMAGE_MARKER and n_image < len(grids):
                    t, h, w = grids[n_image]
                    expanded = [start, *[image] * (t * h * w // m2), end]
                    n_image += 1
                elif piece == VIDEO_MARKER and n_video < len(videos):
                    expanded = self.videos.ids(videos[n_video])
                    n_video += 1
                else:  # a marker beyond the media (count_mismatch was checked first): plain text
                    expanded = None
                if expanded is not None:
                    ids += expanded
                    offsets += [(pos, pos + len(piece))] * len(expanded)
                    pos += len(piece)
                    continue
            piece_ids, piece_offsets = self.tokenizer.encode_with_offsets(piece)
            hit = set(piece_ids).intersection(self.reserved)
            if hit:
                raise _bad(
                    "reserved_token",
                    f"its text tokenises to {sorted(hit)}, an image, video or vision marker id of the model "
                    f"(reserved ids {list(self.reserved)}); images and videos go in as {IMAGE_MARKER} / "
                    f"{VIDEO_MARKER} markers",
                )
            ids += piece_ids
            offsets += [(pos + a, pos + b) for a, b in piece_offsets]
            pos += len(piece)
        return ids, offsets

    def parse(self, key: str, files: Mapping[str, bytes]) -> ParsedRecord:
        """Validate a record and expand its tokens, reading image headers only (raises ``BadSample``)."""
        text, messages = read_text(files)
        images = image_members(files)
        video_names = video_members(files)
        options: dict[str, Any] = {}
        if messages is not None:
            messages = check_conversation(messages, system_prompt=self.system_prompt, images=True)[0]
            # the record's own reasoning_effort / preserve_thinking fields, else the data config's defaults
            options = template_options(json.loads(files["json"]), **self.template_defaults)
        rendered = self.render(text, messages, options)
        contents = [text] if messages is None else [m["content"] for m in messages]
        if not images and not video_names and all(not c.strip() for c in contents):
            raise _bad("empty", "its text is blank and it has no image")
        markers = rendered.count(IMAGE_MARKER)
        if markers != len(images):
            raise _bad(
                "count_mismatch",
                f"its text has {markers} {IMAGE_MARKER} marker(s) or image part(s) but the record has {len(images)} "
                f"image(s) {images}",
            )
        grids = [self._grid(key, member, files[member]) for member in images]
        plans = self._video_plans(key, files, rendered, video_names)
        ids, mask = self._tokens(rendered, messages, grids, plans, options)
        if plans and self.videos.token_budget is not None and len(ids) > self.videos.token_budget:
            other = len(ids) - sum(len(self.videos.ids(p)) for p in plans)
            plans = self.videos.fit(key, files, plans, other)  # too_long=fewer_frames: sparser videos
            ids, mask = self._tokens(rendered, messages, grids, plans, options)
        input_ids = np.asarray(ids, dtype=np.int64)
        if not len(input_ids):  # a tokenizer that maps the whole text to nothing
            raise _bad("empty", "its text tokenises to no token")
        return ParsedRecord(input_ids, images, grids, mask, tuple(plans))

    def _video_plans(self, key: str, files: Mapping[str, bytes], rendered: str, names: list[str]) -> list[VideoPlan]:
        markers = rendered.count(VIDEO_MARKER)
        if markers != len(names):
            raise _bad(
                "count_mismatch",
                f"its text has {markers} {VIDEO_MARKER} marker(s) or video part(s) but the record has {len(names)} "
                f"video(s) {names}",
            )
        if names and self.videos is None:
            raise _bad("bad_metadata", f"it has videos {names} but the model takes no video (no video_token_id)")
        return [self.videos.plan(key, member, files[member]) for member in names]

    def _tokens(
        self, rendered: str, messages: list[dict[str, Any]] | None, grids: list, plans: Sequence[VideoPlan],
        options: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], np.ndarray | None]:
        """Expanded ids and, for a chat (rendered with the template variables ``options``), its assistant mask."""
        mask = None
        if messages is None:
            ids, _ = self._expand(rendered, grids, plans)
            ids = [*self.bos, *ids, *self.eos]
        else:  # a chat template writes its own special tokens; find the assistant tokens in it
            try:
                encoded = encode_chat(self.tokenizer, messages, encode=lambda t: self._expand(t, grids, plans),
                                      **(options or {}))  # fmt: skip
            except (BadSample, ChatTemplateError):
                raise  # a bad record (reserved token), or the template, not the record
            except Exception as e:  # noqa: BLE001 - a template that rejects a chat (raise_exception, missing fields)
                raise _bad("undecodable", f"the chat template rejects its messages ({type(e).__name__}: {e})") from None
            ids = encoded.ids
            mask = encoded.assistant_mask & ~np.isin(np.asarray(ids, dtype=np.int64), self.reserved)
        return ids, mask

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
        self,
        key: str,
        shard: str,
        files: Mapping[str, bytes],
        record: ParsedRecord | None = None,
        *,
        loss_on: str = "document",
    ) -> VisionLanguageDocument:
        """The full document (raises ``BadSample``); ``loss_on`` as ``data.chat.loss_on``."""
        record = self.parse(key, files) if record is None else record
        mask = record.assistant_mask
        train_assistant = resolve_loss_on(loss_on, is_chat=mask is not None) == "assistant"
        if train_assistant and (mask is None or not mask.any()):
            what = "no assistant turn" if mask is not None else "plain text, not messages"
            raise _bad("no_assistant", f"loss_on assistant, but the record has {what}")
        pixel_values, grid_thw = self.pixels(key, files, record)
        ids = record.input_ids
        targets = np.where(np.isin(ids, self.reserved), IGNORE_INDEX, ids)
        if train_assistant:
            targets = np.where(mask, targets, IGNORE_INDEX)
        videos = video_grid = None  # a model without a video path gets no video keys
        if self.videos is not None:
            videos, video_grid = self.videos.pixels(key, files, record.videos)
        positions = mrope_position_ids(
            ids, grid_thw.numpy(), image_token_id=self.image_token_id, merge_size=self.merge_size,
            video_grid_thw=None if video_grid is None else video_grid.numpy(),
            video_token_id=None if self.videos is None else self.videos.video_token_id,
        )  # fmt: skip
        return VisionLanguageDocument(key, shard, ids, shift_labels(targets), positions, pixel_values, grid_thw,
                                      videos, video_grid)  # fmt: skip


@dataclass(frozen=True, slots=True)
class VisionLanguageStats:
    """Per-record index statistics: expanded ``length``, bad ``kind`` code (0 good), ``images``, ``patches``,
    ``trained``, ``videos`` and ``video_patches``."""

    encoder: VisionLanguageEncoder
    columns: ClassVar[tuple[str, ...]] = ("length", "kind", "images", "patches", "trained", "videos", "video_patches")

    def __call__(self, key: str, files: Mapping[str, bytes]) -> dict[str, int]:
        try:
            record = self.encoder.parse(key, files)
        except BadSample as e:
            return {"length": 0, "kind": 1 + VL_BAD_KINDS.index(e.kind), "images": 0, "patches": 0, "trained": -1,
                    "videos": 0, "video_patches": 0}  # fmt: skip
        patches = sum(t * h * w for t, h, w in record.grids)
        trained = -1 if record.assistant_mask is None else int(record.assistant_mask.sum())
        video_patches = sum(t * h * w for t, h, w in (v.grid for v in record.videos))
        return {"length": len(record), "kind": 0, "images": len(record.grids), "patches": patches, "trained": trained,
                "videos": len(record.videos), "video_patches": video_patches}  # fmt: skip


def vl_classify(stats: Mapping[str, np.ndarray], *, max_tokens: int, loss_on: str = "all") -> np.ndarray:
    """Kind code per record (0 good, ``1 + i`` for ``VL_BAD_KINDS[i]``): the index's own verdict, the budget,
    then whether ``loss_on`` leaves anything to train."""
    too_long = 1 + VL_BAD_KINDS.index("too_long")
    no_assistant = 1 + VL_BAD_KINDS.index("no_assistant")
    kind, trained = stats["kind"], stats["trained"]
    needs = (trained >= 0) if loss_on == "document" else np.full(kind.shape, loss_on == "assistant")
    verdict = np.where(needs & (trained <= 0), no_assistant, 0)
    verdict = np.where(stats["length"] > max_tokens, too_long, verdict)
    return np.where(kind > 0, kind, verdict).astype(np.int64)


# -- collate -----------------------------------------------------------------------------------------
def _vision_inputs(documents: Sequence[VisionLanguageDocument], offsets: np.ndarray) -> dict[str, Any]:
    out = {
        "pixel_values": torch.cat([d.pixel_values for d in documents]),
        "image_grid_thw": torch.cat([d.image_grid_thw for d in documents]),
    }
    videos = [d for d in documents if d.video_grid_thw is not None]
    if videos:  # a source that can hold videos: every micro-batch has the keys (empty without videos)
        out["pixel_values_videos"] = torch.cat([d.pixel_values_videos for d in videos])
        out["video_grid_thw"] = torch.cat([d.video_grid_thw for d in videos])
    return out


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
    loss_on: str = "document"
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
            if resolve_loss_on(self.loss_on, is_chat=record.assistant_mask is not None) == "assistant" and (
                record.assistant_mask is None or not record.assistant_mask.any()
            ):
                raise _bad("no_assistant", "loss_on assistant, but the record has no assistant turn")
            return self.encoder.document(key, shard, files, record, loss_on=self.loss_on)
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
def make_encoder(
    tokenizer: str,
    image: ImageProcessor.Config,
    facts: Mapping[str, Any],
    *,
    system_prompt: str = "",
    video: VideoProcessor.Config | None = None,
    token_budget: int | None = None,
    reasoning_effort: str = "",
    preserve_thinking: bool | None = None,
) -> VisionLanguageEncoder:
    """The encoder for a tokenizer folder, image settings and the model facts :data:`VL_MODEL_FACTS`.

    Videos are taken when the facts hold a ``video_token_id`` >= 0 (the model has a video path), with
    ``video`` settings (defaults: HF's Qwen3-VL video processor); ``token_budget`` is the packing
    budget the ``too_long=fewer_frames`` policy fits videos into.

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
    video_id = int(facts.get("video_token_id", -1))
    if video_id >= 0 and video_id in ids.values():
        raise ValueError(f"model fact video_token_id={video_id} must differ from the image token ids {ids}")
    for name, i in {**ids, **({"video_token_id": video_id} if video_id >= 0 else {})}.items():
        if not 0 <= i < vocab:
            raise ValueError(f"model fact {name}={i} must be a token id in [0, vocab_size={vocab})")
        if i < tok.vocab_size and tok.decode([i], skip_special_tokens=True) != "":
            raise ValueError(
                f"model fact {name}={i} is an ordinary token of data.tokenizer={tokenizer!r} "
                f"({tok.decode([i])!r}): text would produce it. Use the model's own tokenizer (its image tokens are "
                "special tokens) or ids beyond the tokenizer's vocabulary"
            )
    sizes = dict(patch_size=f["patch_size"], temporal_patch_size=f["temporal_patch_size"], merge_size=f["merge_size"])
    processor = image.build(**sizes)
    videos = None
    if video_id >= 0:
        videos = VideoRecords(
            (video or VideoProcessor.Config()).build(**sizes),
            functools.partial(tok.encode_batch, add_special_tokens=False),
            video_token_id=video_id, vision_start_token_id=ids["vision_start_token_id"],
            vision_end_token_id=ids["vision_end_token_id"], token_budget=token_budget,
        )  # fmt: skip
    return VisionLanguageEncoder(
        tok, processor, **ids, tokenizer_fingerprint=tokenizer_fingerprint(tok.folder), system_prompt=system_prompt,
        videos=videos, template_defaults=template_options(reasoning_effort=reasoning_effort,
                                                          preserve_thinking=preserve_thinking),
    )  # fmt: skip


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
    if "video_grid_thw" in batch:  # videos: the same checks with the video token
        vpv, vgrid = batch.get("pixel_values_videos"), batch["video_grid_thw"]
        video_id = int(facts.get("video_token_id", -1))
        if video_id < 0 and vgrid.numel():
            fail("holds videos, but the model has no video_token_id")
        if not isinstance(vpv, torch.Tensor) or vpv.dim() != 2 or vgrid.dim() != 2 or vgrid.shape[1] != 3:
            fail("pixel_values_videos must be [N_patches, C*T*p*p] and video_grid_thw [n_videos, 3]")
        batch["video_grid_thw"] = vgrid = vgrid.to(torch.int64)
        vpatches = int(vgrid.prod(dim=1).sum())
        if vpv.shape[0] != vpatches:
            fail(f"pixel_values_videos has {vpv.shape[0]} rows but video_grid_thw covers {vpatches} patches")
        n_video = int((batch["input_ids"] == video_id).sum()) if video_id >= 0 else 0
        if n_video * m * m != vpatches:
            fail(f"input_ids hold {n_video} video tokens (id {video_id}) but the grids give {vpatches // (m * m)}")
    ids, labels = batch["input_ids"], batch["labels"]
    if bool((ids >= vocab).any()) or bool(((labels != IGNORE_INDEX) & (labels >= vocab)).any()):
        fail(f"input_ids and labels must lie below the model's vocab_size={vocab}")


register_batch_check("image_grid_thw", check_vision_batch)
