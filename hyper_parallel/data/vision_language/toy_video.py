"""Toy videos for the embedded vision-language corpus: one coloured shape moving across a background.

A clip is ``min_frames..max_frames`` frames at ``fps`` of one shape (circle, square, triangle, cross)
of one colour gliding in a straight line (left, right, up or down) over a background of another
colour, encoded as MPEG-4 in mp4 (PyAV). Its caption says what moves where: "a red circle moves right
on a blue background". The direction is only visible across frames, so learning it needs the temporal
patches of the vision tower, not one frame.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from hyper_parallel.data.vision_language.video import encode_video

__all__ = ["DIRECTIONS", "draw_moving_shape", "paint_shape", "toy_video_sample"]

DIRECTIONS = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}


def paint_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, colour: tuple[int, int, int]) -> None:
    """Draw one toy shape (circle, square, triangle, else a cross) of radius ``r`` centred at ``(cx, cy)``."""
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    else:
        a = r / 3
        draw.rectangle((cx - r, cy - a, cx + r, cy + a), fill=colour)
        draw.rectangle((cx - a, cy - r, cx + a, cy + r), fill=colour)


def draw_moving_shape(
    rng: np.random.Generator, colours: Mapping[str, tuple[int, int, int]], shapes: Sequence[str], *,
    min_size: int = 32, max_size: int = 64, min_frames: int = 8, max_frames: int = 16,
) -> tuple[np.ndarray, str]:  # fmt: skip
    """uint8 frames ``[t, H, W, 3]`` (even H, W) and the caption ("a red circle moves right on a blue background")."""
    names = list(colours)
    fg, bg = rng.choice(len(names), size=2, replace=False)
    shape = shapes[int(rng.integers(len(shapes)))]
    direction = list(DIRECTIONS)[int(rng.integers(len(DIRECTIONS)))]
    dx, dy = DIRECTIONS[direction]
    width, height = (2 * int(v) for v in rng.integers(min_size // 2, max_size // 2 + 1, size=2))
    t = int(rng.integers(min_frames, max_frames + 1))
    r = 0.18 * min(width, height)
    # start near one edge and end near the opposite one (along the motion), anywhere across it
    along = np.linspace(r, (width if dx else height) - r, t)
    if dx < 0 or dy < 0:
        along = along[::-1]
    across = float(rng.uniform(r, (height if dx else width) - r))
    frames = np.empty((t, height, width, 3), dtype=np.uint8)
    for i in range(t):
        image = Image.new("RGB", (width, height), colours[names[bg]])
        cx, cy = (along[i], across) if dx else (across, along[i])
        paint_shape(ImageDraw.Draw(image), shape, float(cx), float(cy), r, colours[names[fg]])
        frames[i] = np.asarray(image)
    return frames, f"{_a(names[fg])} {shape} moves {direction} on {_a(names[bg])} background"


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def toy_video_sample(
    rng: np.random.Generator, key: str, colours: Mapping[str, tuple[int, int, int]], shapes: Sequence[str], *,
    chat: bool, content_parts: bool, fps: float = 4.0,
) -> dict[str, Any]:  # fmt: skip
    """A toy record with one video: ``{"key", "images": [], "videos": [mp4 bytes], "text" | "messages"}``."""
    frames, caption = draw_moving_shape(rng, colours, shapes)
    answer = caption[0].upper() + caption[1:] + "."
    sample: dict[str, Any] = {"key": key, "images": [], "videos": [encode_video(frames, fps)]}
    if chat:
        question = "What happens in the video?"
        user: Any = [{"type": "video"}, {"type": "text", "text": question}] if content_parts else f"<video>\n{question}"
        sample["messages"] = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    else:
        sample["text"] = "<video>" + answer
    return sample
