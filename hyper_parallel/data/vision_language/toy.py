"""The embedded toy vision-language corpus: generated pictures of coloured shapes with captions.

Used when ``data.path`` is empty (the debug recipe), written once into ``data.cache_dir``.

Each picture is one shape (circle, square, triangle, cross) of one colour on a background of
another colour, ``min_size..max_size`` pixels a side (independently), saved as PNG, JPEG or WebP.
Its caption names both colours and the shape: "a red circle on a blue background". A sample is a
caption after its picture (``"<image>A red circle on a blue background."``), two pictures with one
sentence about both, a chat (``user: "<image>\\nWhat is in the picture?"``, ``assistant:`` the
caption; with ``content_parts`` the user turn is ``[{"type": "image"}, {"type": "text", "text": "What is in
the picture?"}]``), or (rarely) a caption without a picture. The caption words after the image are only
predictable from the pixels, so a model that uses the vision tower learns faster than one that
does not. With ``video_fraction`` a share of the samples are short videos of a shape moving across a
background (:mod:`.toy_video`: "<video>A red circle moves right on a blue background.", or the same as
a chat); the loader asks for them when the model has a video path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from hyper_parallel.data.cache import cached_build, spec_digest
from hyper_parallel.data.vision_language.sample import VisionLanguageEncoder
from hyper_parallel.data.vision_language.toy_video import paint_shape, toy_video_sample
from hyper_parallel.data.vision_language.writer import VisionLanguageWriter, encode_image

__all__ = [
    "ToyVisionLanguageSpec",
    "cached_toy_vision_language",
    "draw_shape",
    "make_toy_samples",
    "write_toy_vision_language",
]

TOY_VL_VERSION = 1
"""Bump when the generator changes, so stale caches are not reused."""

COLOURS = {
    "red": (214, 39, 40),
    "green": (44, 160, 44),
    "blue": (31, 119, 220),
    "yellow": (240, 220, 30),
    "orange": (255, 127, 14),
    "purple": (148, 73, 189),
    "black": (20, 20, 20),
    "white": (245, 245, 245),
}
SHAPES = ("circle", "square", "triangle", "cross")
_FORMATS = ("png", "jpg", "webp")


@dataclass(frozen=True, slots=True)
class ToyVisionLanguageSpec:
    """Everything that determines the toy corpus (its hash names the cache folder)."""

    num_samples: int = 1024
    samples_per_shard: int = 128
    min_size: int = 28
    max_size: int = 96
    two_image_fraction: float = 0.2
    chat_fraction: float = 0.25
    text_only_fraction: float = 0.03
    content_parts: bool = False
    """Chats in transformers' content-list form (``[{"type": "image"}, {"type": "text", "text": ...}]``)
    instead of ``<image>`` markers in the text."""
    video_fraction: float = 0.0
    """Share of the samples that are a short video of a moving shape (0: images and text only)."""
    seed: int = 0

    def digest(self) -> str:
        return spec_digest(self, TOY_VL_VERSION)


def draw_shape(rng: np.random.Generator, min_size: int, max_size: int) -> tuple[Image.Image, str]:
    """One picture and its description ("a red circle on a blue background")."""
    names = list(COLOURS)
    fg, bg = rng.choice(len(names), size=2, replace=False)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    width, height = (int(v) for v in rng.integers(min_size, max_size + 1, size=2))
    image = Image.new("RGB", (width, height), COLOURS[names[bg]])
    draw = ImageDraw.Draw(image)
    side = min(width, height)
    r = float(rng.uniform(0.25, 0.45)) * side
    cx, cy = float(rng.uniform(r, width - r)), float(rng.uniform(r, height - r))
    paint_shape(draw, shape, cx, cy, r, COLOURS[names[fg]])
    return image, f"{_a(names[fg])} {shape} on {_a(names[bg])} background"


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def make_toy_samples(spec: ToyVisionLanguageSpec) -> list[dict[str, Any]]:
    """The corpus as ``{"key", "images": [(format, PIL image)], "text" | "messages"}`` dicts."""
    samples = []
    for index in range(spec.num_samples):
        if spec.video_fraction > 0:  # its own stream: the image samples stay what they are without videos
            vrng = np.random.default_rng([spec.seed, 0x716, index])
            if vrng.random() < spec.video_fraction:
                samples.append(toy_video_sample(vrng, f"toyvl{index:07d}", COLOURS, SHAPES,
                                                chat=bool(vrng.random() < spec.chat_fraction),
                                                content_parts=spec.content_parts))  # fmt: skip
                continue
        rng = np.random.default_rng([spec.seed, 0x715, index])
        u = rng.random()
        n = 0 if u < spec.text_only_fraction else 2 if u < spec.text_only_fraction + spec.two_image_fraction else 1
        drawn = [draw_shape(rng, spec.min_size, spec.max_size) for _ in range(max(n, 1))]
        images = [(_FORMATS[int(rng.integers(len(_FORMATS)))], im) for im, _ in drawn[:n]]
        captions = [c for _, c in drawn]
        if n == 2:
            answer = f"The first picture shows {captions[0]}; the second shows {captions[1]}."
            prompt = "<image>\n<image>\nDescribe the two pictures."
        else:
            answer = captions[0][0].upper() + captions[0][1:] + "."
            prompt = "<image>\nWhat is in the picture?" if n else "Describe a picture."
        sample: dict[str, Any] = {"key": f"toyvl{index:07d}", "images": images}
        if rng.random() < spec.chat_fraction:
            question = prompt.replace("<image>\n", "")
            user: Any = prompt
            if spec.content_parts:
                user = [*({"type": "image"} for _ in range(n)), {"type": "text", "text": question}]
            sample["messages"] = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        else:
            sample["text"] = "<image>" * n + answer
        samples.append(sample)
    return samples


def write_toy_vision_language(
    out_dir: str, spec: ToyVisionLanguageSpec, *, encoder: VisionLanguageEncoder | None = None, tokenizer: str | None = None
) -> list[str]:
    """Write the toy corpus as vision-language shards into ``out_dir``; returns the shard paths.

    With an ``encoder`` (the model's tokenizer, image settings and ids) each shard gets its index; ``tokenizer``
    is recorded for the loader (:class:`~.writer.VisionLanguageWriter`)."""
    with VisionLanguageWriter(
        out_dir, samples_per_shard=spec.samples_per_shard, prefix="toy", encoder=encoder, tokenizer=tokenizer
    ) as writer:
        for s in make_toy_samples(spec):
            images = [encode_image(im, fmt)[1] for fmt, im in s["images"]]
            writer.write(images, videos=s.get("videos", ()), text=s.get("text"), messages=s.get("messages"),
                         key=s["key"])  # fmt: skip
    return writer.shards


def cached_toy_vision_language(
    cache_dir: str = "~/.cache/hyper_parallel", spec: ToyVisionLanguageSpec | None = None
) -> str:
    """The folder of the toy corpus for ``spec`` under ``cache_dir``, written on first use.

    Safe when several ranks call it at once: each writes into its own temporary folder and the
    first atomic rename wins (the contents are identical). Shard indexes depend on the model's
    tokenizer and image settings, so the loader builds them on first use under ``cache_dir``.
    """
    spec = spec or ToyVisionLanguageSpec()
    return cached_build(
        cache_dir, f"toy_vision_language-{spec.digest()}", lambda tmp: write_toy_vision_language(tmp, spec)
    )
