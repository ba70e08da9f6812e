"""Vision-language shards: write them (:class:`VisionLanguageWriter`), read them back, check them."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from PIL import Image

from hyper_parallel.data.bad_samples import BadSample, bad_sample_message
from hyper_parallel.data.index import IndexSpec, build_index, sidecar_path, write_index
from hyper_parallel.data.shard_writer import ShardWriter
from hyper_parallel.data.shards import iter_tar_records, resolve_shards
from hyper_parallel.data.vision_language.sample import (
    IMAGE_MARKER,
    VL_BAD_KINDS,
    VisionLanguageEncoder,
    image_members,
    read_text,
)

__all__ = ["VisionLanguageWriter", "check_shards", "read_samples", "write_shards"]

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
    """Validation without a tokenizer: text field, image names, markers in the raw text, images decode."""
    text, messages = read_text(files)
    images = image_members(files)
    raw = text if messages is None else "".join(m["content"] for m in messages)
    if raw.count(IMAGE_MARKER) != len(images):
        markers = raw.count(IMAGE_MARKER)
        raise BadSample("count_mismatch", f"its text has {markers} {IMAGE_MARKER} marker(s) but {len(images)} image(s)")
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


class VisionLanguageWriter(ShardWriter):
    """Writes vision-language records into ``<out_dir>/<prefix>-NNNNNN.tar``, ``samples_per_shard`` each.

    ``write(images, text=...)`` or ``write(images, messages=[...])``: the text holds one
    ``<image>`` marker per image. Images are encoded bytes (JPEG/PNG/WebP, kept as they are) or PIL
    images (saved as ``image_format``); one image is stored as ``<key>.<ext>``, several as
    ``<key>.<i>.<ext>``. Every record is validated before it is written: with an ``encoder``
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
    ) -> None:
        super().__init__(out_dir, samples_per_shard=samples_per_shard, prefix=prefix)
        self.encoder, self.image_format, self.validate = encoder, image_format, validate

    def _index_spec(self) -> IndexSpec | None:
        return self.encoder.index_spec() if self.encoder is not None else None

    def write(
        self,
        images: Sequence[ImageInput] = (),
        *,
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
        return self.write_files(files, key=key)

    def write_files(self, files: Mapping[str, bytes], *, key: str | None = None) -> str:
        """Write one record given as its member files (``{"json": b"...", "0.png": b"...", ...}``)."""
        key = self._key(key)
        if self.validate:
            try:
                if self.encoder is not None:
                    self.encoder.document(key, "<writer>", files)
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
            writer.write(s.pop("images", ()), text=s.pop("text", None), messages=s.pop("messages", None),
                         key=s.pop("key", None), **s)  # fmt: skip
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
    report: dict[str, Any] = {"samples": 0, "tokens": 0, "images": 0, "bad": {}, "messages": []}

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
                    doc = encoder.document(key, shard, files, parsed)
                except BadSample as e:
                    bad(shard, key, e.kind, e.detail)
                    continue
                report["samples"] += 1
                report["tokens"] += len(doc)
                report["images"] += int(doc.image_grid_thw.shape[0])
        except Exception as e:  # noqa: BLE001 - any tar failure is reported per shard
            bad(shard, None, "unreadable_shard", f"{type(e).__name__}: {e}")
    assert set(report["bad"]) <= set(VL_BAD_KINDS)
    return report
