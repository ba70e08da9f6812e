"""Vision-language shards: write them (:class:`VisionLanguageWriter`), read them back, check them."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from PIL import Image

from hyper_parallel.data.bad_samples import BadSample, bad_sample_message
from hyper_parallel.data.chat import check_conversation
from hyper_parallel.data.index import IndexSpec, build_index, sidecar_path, write_index
from hyper_parallel.data.shard_writer import ShardWriter
from hyper_parallel.data.shards import iter_tar_records, resolve_shards
from hyper_parallel.data.vision_language.media import VideoInput, check_videos, encode_video_member
from hyper_parallel.data.vision_language.sample import (
    IMAGE_MARKER,
    VL_BAD_KINDS,
    VisionLanguageEncoder,
    image_members,
    read_text,
)

__all__ = [
    "DATASET_FILE",
    "TOY_TOKENIZER",
    "VisionLanguageWriter",
    "check_shards",
    "read_dataset_tokenizer",
    "read_samples",
    "write_dataset_tokenizer",
    "write_shards",
]

DATASET_FILE = "vl_dataset.json"
"""Written next to the shards: ``{"tokenizer": folder | "toy", "tokenizer_fingerprint": ...}``, the tokenizer
the shards (and their index side files) were written for; the loader checks it."""

TOY_TOKENIZER = "toy"
"""The ``tokenizer`` of a dataset written with the toy tokenizer (it lives under each machine's cache_dir)."""


def toy_tokenizer_folder(cache_dir: str = "~/.cache/hyper_parallel") -> str:
    """The toy tokenizer's folder under ``cache_dir`` (written on first use)."""
    from hyper_parallel.data.text import cached_toy_text

    return cached_toy_text(cache_dir).tokenizer_dir


def write_dataset_tokenizer(out_dir: str, tokenizer: str, fingerprint: str) -> None:
    """Record which tokenizer (an HF folder, or :data:`TOY_TOKENIZER`) the shards in ``out_dir`` were written with."""
    folder = tokenizer if tokenizer == TOY_TOKENIZER else os.path.abspath(os.path.expanduser(tokenizer))
    path = os.path.join(out_dir, DATASET_FILE)
    with open(path + ".partial", "w", encoding="utf-8") as f:
        json.dump({"tokenizer": folder, "tokenizer_fingerprint": fingerprint}, f, indent=2)
    os.replace(path + ".partial", path)


def read_dataset_tokenizer(shards: Sequence[str]) -> tuple[str, dict[str, str]] | None:
    """``(file, {"tokenizer", "tokenizer_fingerprint"})`` recorded next to the shards (the folder of the first
    one), or None when they were written without one (by another tool, or an older writer)."""
    if not shards:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(shards[0])), DATASET_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), str) for k in ("tokenizer", "tokenizer_fingerprint")):
        raise ValueError(f"{path} must hold {{'tokenizer': str, 'tokenizer_fingerprint': str}}; delete or rewrite it")
    return path, meta

_FORMAT_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}

ImageInput = bytes | Image.Image


def encode_image(image: ImageInput, image_format: str = "png") -> tuple[str, bytes]:
    """``(ext, bytes)`` of an image: encoded bytes keep their format, a PIL image is saved as ``image_format``."""
    if isinstance(image, Image.Image):
        fmt = image_format.upper().replace("JPG", "JPEG")
        if fmt not in _FORMAT_EXT:
            raise ValueError(f"image_format={image_format!r} must be one of png, jpg, webp")
        buf = io.BytesIO()
        (image.convert("RGB") if fmt == "JPEG" and image.mode not in ("RGB", "L") else image).save(buf, format=fmt)
        return _FORMAT_EXT[fmt], buf.getvalue()
    data = bytes(image)
    try:
        fmt = Image.open(io.BytesIO(data)).format
    except Exception as e:  # noqa: BLE001 - any PIL failure: not an image we can name
        raise ValueError(f"image bytes are not a readable image ({type(e).__name__}: {e})") from None
    if fmt not in _FORMAT_EXT:
        raise ValueError(f"images must be JPEG, PNG or WebP, got {fmt}: convert it (e.g. PIL .save(format='PNG'))")
    return _FORMAT_EXT[fmt], data


def _check_structure(key: str, files: Mapping[str, bytes]) -> None:
    """Validation without a tokenizer: text field, image and video names, markers in the raw text, media decode."""
    text, messages = read_text(files)
    images = image_members(files)
    if messages is not None:  # roles in order, content parts text or image (image parts become markers)
        messages = check_conversation(messages, images=True)[0]
    raw = text if messages is None else "".join(m["content"] for m in messages)
    if raw.count(IMAGE_MARKER) != len(images):
        markers = raw.count(IMAGE_MARKER)
        raise BadSample(
            "count_mismatch", f"its text has {markers} {IMAGE_MARKER} marker(s) or image part(s) but {len(images)} image(s)"
        )
    for member in images:
        try:
            with Image.open(io.BytesIO(files[member])) as im:
                im.load()
                if im.width == 0 or im.height == 0:
                    raise BadSample("empty_image", f"image {key}.{member} has no pixels")
        except BadSample:
            raise
        except Exception as e:  # noqa: BLE001
            detail = f"image {key}.{member} cannot be decoded ({type(e).__name__}: {e})"
            raise BadSample("undecodable", detail) from None
    check_videos(key, files, raw)


class VisionLanguageWriter(ShardWriter):
    """Writes vision-language records into ``<out_dir>/<prefix>-NNNNNN.tar``, ``samples_per_shard`` each.

    ``write(images, text=...)`` or ``write(images, messages=[...])``: the text holds one
    ``<image>`` marker per image (and one ``<video>`` marker per video of ``videos=``: file bytes kept as
    they are, or ``(frames, fps)`` encoded as mp4; one video is ``<key>.mp4``, several ``<key>.<i>.mp4``). Images are encoded bytes (JPEG/PNG/WebP, kept as they are) or PIL
    images (saved as ``image_format``); one image is stored as ``<key>.<ext>``, several as
    ``<key>.<i>.<ext>``. ``tokenizer`` (an HF folder, or ``"toy"``; default: the encoder's) is recorded in
    ``<out_dir>/vl_dataset.json`` (:data:`DATASET_FILE`), so the loader uses (or checks) the same one.
    Every record is validated before it is written: with an ``encoder``
    (:func:`~.sample.make_encoder`, the model's tokenizer and image settings) exactly as the loader
    will decode it, pixels included, and each finished shard gets its index side file; without
    one, the structure only (text field, markers vs images, images decode). ``validate=False``
    writes anything (for tests that need malformed shards).
    """

    def __init__(
        self,
        out_dir: str,
        *,
        samples_per_shard: int = 1000,
        prefix: str = "train",
        encoder: VisionLanguageEncoder | None = None,
        image_format: str = "png",
        validate: bool = True,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__(out_dir, samples_per_shard=samples_per_shard, prefix=prefix)
        self.encoder, self.image_format, self.validate = encoder, image_format, validate
        # which tokenizer the shards are for (the one named, else the encoder's): the loader checks it. Recorded
        # when the write completes (_commit), so a failed write leaves no vl_dataset.json either.
        self._tokenizer = tokenizer if tokenizer is not None else encoder.tokenizer.folder if encoder is not None else None

    def _commit(self) -> None:
        if self._tokenizer is not None:
            from hyper_parallel.data.tokenizer import tokenizer_fingerprint

            folder = self._tokenizer
            resolved = toy_tokenizer_folder() if folder == TOY_TOKENIZER else folder
            write_dataset_tokenizer(self.out_dir, folder, tokenizer_fingerprint(os.path.expanduser(resolved)))

    def _index_spec(self) -> IndexSpec | None:
        return self.encoder.index_spec() if self.encoder is not None else None

    def write(
        self,
        images: Sequence[ImageInput] = (),
        *,
        videos: Sequence[VideoInput] = (),
        text: str | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        key: str | None = None,
        **meta: Any,
    ) -> str:
        """Write one record; extra keyword arguments go into its json. Returns its key."""
        fields: dict[str, Any] = {}
        if text is not None:
            fields["text"] = text
        if messages is not None:
            fields["messages"] = [dict(m) for m in messages]
        encoded = [encode_image(im, self.image_format) for im in images]
        files: dict[str, bytes] = {"json": json.dumps({**fields, **meta}, ensure_ascii=False).encode()}
        for i, (ext, data) in enumerate(encoded):
            files[ext if len(encoded) == 1 else f"{i}.{ext}"] = data
        clips = [encode_video_member(v) for v in videos]
        for i, (ext, data) in enumerate(clips):  # numbered among the videos: <key>.mp4 or <key>.<i>.mp4
            files[ext if len(clips) == 1 else f"{i}.{ext}"] = data
        return self.write_files(files, key=key)

    def write_files(self, files: Mapping[str, bytes], *, key: str | None = None) -> str:
        """Write one record given as its member files (``{"json": b"...", "0.png": b"...", ...}``)."""
        key = self._key(key)
        if self.validate:
            try:
                if self.encoder is not None:
                    # loss_on is the loader's choice: a chat without assistant turns is still a valid record
                    self.encoder.document(key, "<writer>", files, loss_on="all")
                else:
                    _check_structure(key, files)
            except BadSample as e:
                raise ValueError(f"refusing to write sample {key!r}: {e.detail} [{e.kind}]") from None
        return self._add(key, files)


def write_shard_index(shard: str, encoder: VisionLanguageEncoder) -> None:
    """Write ``<shard>.idx.npz`` for the loader that uses ``encoder``'s tokenizer, image settings and ids."""
    spec = encoder.index_spec()
    write_index(build_index(shard, spec), sidecar_path(shard), shard_size=os.path.getsize(shard), spec=spec)


def write_shards(out_dir: str, samples: Iterable[Mapping[str, Any]], **writer_kwargs: Any) -> list[str]:
    """Write ``samples`` (mappings with ``images``, ``text`` or ``messages``, optional ``key`` and extra
    json fields) with a :class:`VisionLanguageWriter`; returns the shard paths."""
    with VisionLanguageWriter(out_dir, **writer_kwargs) as writer:
        for s in samples:
            s = dict(s)
            writer.write(s.pop("images", ()), videos=s.pop("videos", ()), text=s.pop("text", None),
                         messages=s.pop("messages", None), key=s.pop("key", None), **s)  # fmt: skip
    return writer.shards


def read_samples(path: str) -> Iterator[dict[str, Any]]:
    """Every record of the shards named by ``path``, in file order: ``{"key", "shard", "files"}``
    (the raw member bytes; raises on unreadable shards)."""
    for shard in resolve_shards(path):
        for record in iter_tar_records(shard):
            yield {"key": record.key, "shard": shard, "files": dict(record.files or {})}


def check_shards(path: str, encoder: VisionLanguageEncoder, *, max_tokens: int) -> dict[str, Any]:
    """Decode every record fully (pixels included); returns ``{"samples", "tokens", "images", "bad":
    {kind: n}, "messages": [...]}``."""
    report: dict[str, Any] = {"samples": 0, "tokens": 0, "images": 0, "videos": 0, "bad": {}, "messages": []}

    def bad(shard: str, key: str | None, kind: str, detail: str) -> None:
        report["bad"][kind] = report["bad"].get(kind, 0) + 1
        report["messages"].append(bad_sample_message("vision_language", shard, key, kind, detail))

    for shard in resolve_shards(path):
        try:
            for record in iter_tar_records(shard):
                key, files = record.key, record.files or {}
                try:
                    parsed = encoder.parse(key, files)
                    if len(parsed) > max_tokens:
                        detail = f"{len(parsed)} tokens (images expanded) exceed --max-tokens={max_tokens}"
                        raise BadSample("too_long", detail)
                    doc = encoder.document(key, shard, files, parsed, loss_on="all")
                except BadSample as e:
                    bad(shard, key, e.kind, e.detail)
                    continue
                report["samples"] += 1
                report["tokens"] += len(doc)
                report["images"] += int(doc.image_grid_thw.shape[0])
                report["videos"] += 0 if doc.video_grid_thw is None else int(doc.video_grid_thw.shape[0])
        except Exception as e:  # noqa: BLE001 - any tar failure is reported per shard
            bad(shard, None, "unreadable_shard", f"{type(e).__name__}: {e}")
    assert set(report["bad"]) <= set(VL_BAD_KINDS)
    return report
