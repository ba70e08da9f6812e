"""Image preprocessing for Qwen-VL vision towers, equal to HF's Qwen2-VL image processor (PIL backend).

Qwen3-VL and Qwen3.5 checkpoints use HF's ``Qwen2VLImageProcessor``. ``AutoImageProcessor`` gives its
torchvision variant when torchvision is installed and ``Qwen2VLImageProcessorPil`` otherwise; the two
resize differently (torchvision's antialiased bicubic on tensors vs PIL's bicubic), so the output is
only reproducible against one of them. We reproduce the PIL one **exactly** (bit-equal ``pixel_values``),
the slow processor HF treats as the reference, and the one that needs no torchvision. Per image:

1. ``convert_to_rgb``: images with alpha (or a transparency key) are composited on white, others
   converted with ``Image.convert("RGB")``.
2. ``smart_resize``: the target ``(H, W)`` is the size rounded to multiples of ``patch * merge``,
   scaled (aspect kept) into ``[min_pixels, max_pixels]``; aspect ratios over 200 are rejected.
3. PIL resize to ``(W, H)`` with the configured filter (bicubic), on uint8.
4. ``(x * rescale_factor)`` in float64, cast to float32, then ``(x - mean) / std`` in float32.
5. Patchify in merge-block order ``(H/p/m, W/p/m, m, m)``, each patch flattened as ``(C, T, p, p)``
   with the still image repeated over ``T = temporal_patch_size``.

Steps 4-5 run as one table lookup: every uint8 value of every channel maps to exactly the float32 HF
computes, and the lookup writes straight into the patch layout (patchify moves uint8, not float32).

Patch, temporal and merge sizes are facts of the vision tower: ``ImageProcessor.Config(...).build(
patch_size=, temporal_patch_size=, merge_size=)`` takes them from the model.

Defaults are those of the published Qwen3-VL / Qwen3.5 ``preprocessor_config.json`` (mean = std = 0.5,
``min_pixels = 256*256``, ``max_pixels = 4096*4096``); HF's class defaults (CLIP mean/std, Qwen2-VL's
pixel bounds) apply to Qwen2-VL checkpoints only.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from PIL import Image

from hyper_parallel.config.configurable import Configurable

__all__ = ["IMAGE_ERROR_KINDS", "ImageError", "ImageProcessor", "ProcessedImages", "smart_resize"]

IMAGE_ERROR_KINDS = ("undecodable", "empty_image", "too_many_pixels", "aspect_ratio")
"""Every way an image can be rejected (``ImageError.kind``)."""

MAX_ASPECT_RATIO = 200
"""HF's ``smart_resize`` rejects images whose long side exceeds 200x the short side."""

_PATCH_CHUNK = 128
"""Patches per lookup chunk in ``patchify`` (a cache-sized block of the output)."""

_RESAMPLE = {
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "lanczos": Image.Resampling.LANCZOS,
    "nearest": Image.Resampling.NEAREST,
}


class MediaError(ValueError):
    """A media item (image, video) that cannot be used; the message names it and its ``kind``."""

    noun: str = "media"
    kinds: tuple[str, ...] = ()

    def __init__(self, name: str, kind: str, detail: str) -> None:
        assert kind in self.kinds, kind
        super().__init__(f"{self.noun} {name!r}: {detail} [{kind}]")
        self.name, self.kind, self.detail = name, kind, detail

    def __reduce__(self):  # picklable across DataLoader workers
        return (type(self), (self.name, self.kind, self.detail))


class ImageError(MediaError):
    """An image that cannot be preprocessed; ``kind`` is one of ``IMAGE_ERROR_KINDS``."""

    noun = "image"
    kinds = IMAGE_ERROR_KINDS


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int,
                 name: str = "image") -> tuple[int, int]:  # fmt: skip
    """HF ``smart_resize``: ``(H, W)`` multiples of ``factor`` with ``min_pixels <= H*W <= max_pixels``, aspect kept.

    Raises :class:`ImageError` (naming ``name``) for an empty image or an aspect ratio over 200.
    """
    if height <= 0 or width <= 0:
        raise ImageError(name, "empty_image", f"has size {width}x{height} (width x height); it holds no pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(
            name, "aspect_ratio",
            f"size {width}x{height} has aspect ratio {max(height, width) / min(height, width):.1f} > "
            f"{MAX_ASPECT_RATIO} (HF's limit); crop or pad it",
        )  # fmt: skip
    # Python's round() (half to even) and the float order of operations are HF's, so sizes agree exactly.
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class ProcessedImages:
    """The vision tower's inputs for a list of images (HF ``pixel_values`` / ``image_grid_thw``)."""

    pixel_values: torch.Tensor
    """float32 ``[sum t*h*w, C*T*p*p]``: every image's patches, image after image, in merge-block order."""
    image_grid_thw: torch.Tensor
    """int64 ``[n_images, 3]``: ``(t, h, w)`` in patches (``t = 1`` for a still image)."""


class ImageProcessor(Configurable):
    """Decode, resize, normalise and patchify images exactly like HF's ``Qwen2VLImageProcessorPil``.

    ``build(patch_size=, temporal_patch_size=, merge_size=)`` with the vision tower's sizes.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        min_pixels: int = 256 * 256
        """Smallest resized area in pixels (HF ``size["shortest_edge"]``; Qwen3-VL: 65536)."""
        max_pixels: int = 4096 * 4096
        """Largest resized area in pixels (HF ``size["longest_edge"]``; Qwen3-VL: 16777216)."""
        image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
        """Per-channel mean subtracted after rescaling (Qwen3-VL: 0.5; Qwen2-VL: CLIP's)."""
        image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
        """Per-channel std dividing after the mean (Qwen3-VL: 0.5; Qwen2-VL: CLIP's)."""
        rescale_factor: float = 1 / 255
        """Multiplies uint8 pixel values before normalising."""
        resample: Literal["bicubic", "bilinear", "lanczos", "nearest"] = "bicubic"
        """PIL resampling filter (HF: bicubic)."""
        max_input_pixels: int = 89_478_485
        """Reject decoded images larger than this many pixels before decoding them (a decompression-bomb
        guard; PIL's own warning threshold). Images under it are resized down to ``max_pixels``."""

    def __init__(self, config: Config, *, patch_size: int, temporal_patch_size: int, merge_size: int) -> None:
        super().__init__(config)
        c = config
        if len(c.image_mean) != 3 or len(c.image_std) != 3:
            raise ValueError(
                f"ImageProcessor.Config.image_mean/image_std need 3 values (RGB), got {c.image_mean} / {c.image_std}"
            )
        if not 0 < c.min_pixels <= c.max_pixels:
            raise ValueError(
                f"ImageProcessor.Config: need 0 < min_pixels ({c.min_pixels}) <= max_pixels ({c.max_pixels})"
            )
        self.patch_size, self.temporal_patch_size, self.merge_size = patch_size, temporal_patch_size, merge_size
        self.factor = patch_size * merge_size
        self.patch_dim = 3 * temporal_patch_size * patch_size * patch_size
        # uint8 value v of channel c -> HF's float32: float32(float64(v) * rescale) then (x - mean) / std in float32.
        values = (np.arange(256, dtype=np.float64) * c.rescale_factor).astype(np.float32)
        mean = np.asarray(c.image_mean, dtype=np.float32)[:, None]
        std = np.asarray(c.image_std, dtype=np.float32)[:, None]
        self._lut = np.ascontiguousarray((values[None, :] - mean) / std)  # [3, 256] float32

    # --- sizes (no pixels needed: the data pipeline counts image tokens from the header alone) ----------

    def target_size(self, height: int, width: int, name: str = "image") -> tuple[int, int]:
        """Resized ``(H, W)`` in pixels (raises :class:`ImageError` naming ``name``)."""
        c = self.config
        return smart_resize(height, width, factor=self.factor, min_pixels=c.min_pixels, max_pixels=c.max_pixels,
                            name=name)  # fmt: skip

    def grid_thw(self, height: int, width: int, name: str = "image") -> tuple[int, int, int]:
        """``(1, H/p, W/p)``: the patch grid of a still image of ``height x width`` pixels."""
        h, w = self.target_size(height, width, name)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, height: int, width: int, name: str = "image") -> int:
        """Visual tokens the image becomes after the vision tower's ``m x m`` merge (``t*h*w / m^2``)."""
        t, h, w = self.grid_thw(height, width, name)
        return t * h * w // (self.merge_size * self.merge_size)

    # --- pixels ---------------------------------------------------------------------------------------

    def open(self, data: bytes, name: str = "image") -> Image.Image:
        """Open encoded bytes (jpg/png/webp/...) reading the header only, checking the size limits.

        The pixels are not decoded (``.size`` is known, a broken body is found by :meth:`decode`): the
        data pipeline sizes every image this way when it indexes a shard."""
        if not data:
            raise ImageError(name, "empty_image", "is an empty file (0 bytes)")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # we check the size ourselves
                image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:
            raise ImageError(name, "too_many_pixels", f"is a decompression bomb per PIL ({e})") from None
        except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ...
            raise ImageError(name, "undecodable", f"cannot be opened ({type(e).__name__}: {e})") from None
        self._check_size(image, name)
        return image

    def decode(self, data: bytes, name: str = "image") -> Image.Image:
        """Open encoded bytes (jpg/png/webp/...), checking size limits from the header before decoding."""
        image = self.open(data, name)
        try:
            image.load()
        except Exception as e:
            raise ImageError(name, "undecodable", f"cannot be decoded ({type(e).__name__}: {e})") from None
        return image

    def _check_size(self, image: Image.Image, name: str) -> None:
        width, height = image.size
        if width <= 0 or height <= 0:
            raise ImageError(name, "empty_image", f"has size {width}x{height} (width x height); it holds no pixels")
        if width * height > self.config.max_input_pixels:
            raise ImageError(
                name, "too_many_pixels",
                f"has {width}x{height} = {width * height} pixels > ImageProcessor.Config.max_input_pixels="
                f"{self.config.max_input_pixels}",
            )  # fmt: skip

    @staticmethod
    def to_rgb(image: Image.Image) -> Image.Image:
        """HF ``convert_to_rgb``: alpha (or a transparency key) is composited on white."""
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, rgba).convert("RGB")
        return image if image.mode == "RGB" else image.convert("RGB")

    def resize(self, image: Image.Image, name: str = "image") -> Image.Image:
        """RGB image resized to ``smart_resize`` of its size (PIL, uint8)."""
        self._check_size(image, name)
        width, height = image.size
        h, w = self.target_size(height, width, name)
        image = self.to_rgb(image)
        if (w, h) == image.size:  # PIL's resize to the same size is a copy
            return image
        return image.resize((w, h), resample=_RESAMPLE[self.config.resample])

    def patchify(self, image: Image.Image, out: np.ndarray | None = None) -> torch.Tensor:
        """A resized RGB image ``H x W`` -> float32 ``[H/p * W/p, 3*T*p*p]`` in merge-block order.

        ``out``: an optional float32 array of that shape to write into (``__call__`` writes every image
        straight into the batch's buffer, saving a concatenation).
        """
        p, m, T = self.patch_size, self.merge_size, self.temporal_patch_size
        rgb = np.asarray(image)  # [H, W, 3] uint8
        H, W, C = rgb.shape
        gh, gw = H // p, W // p
        n = gh * gw
        # Patchify the uint8 pixels (a quarter of the float bytes): [gh/m, m, p, gw/m, m, p, C] ->
        # [gh/m, gw/m, m, m, C, p, p], i.e. merge-block order with (C, p, p) per patch.
        blocks = np.ascontiguousarray(rgb.reshape(gh // m, m, p, gw // m, m, p, C).transpose(0, 3, 1, 4, 6, 2, 5))
        blocks = blocks.reshape(n, C, p * p)
        if out is None:
            out = np.empty((n, self.patch_dim), dtype=np.float32)
        elif out.shape != (n, self.patch_dim) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"patchify: out must be a C-contiguous float32 array of shape {(n, self.patch_dim)}")
        slots = out.reshape(n, C, T, p * p)
        # Chunks of patches keep the written rows in cache for the temporal copy (1.6x faster than whole-image
        # passes on a 1920x1088 image); mode="clip" lets np.take write into the strided slot without a buffer
        # (uint8 indices never leave the 256-entry table, so clipping changes nothing).
        for start in range(0, n, _PATCH_CHUNK):
            chunk = slots[start : start + _PATCH_CHUNK]
            for c in range(C):  # rescale + normalise = one lookup per value, into temporal slot 0
                np.take(self._lut[c], blocks[start : start + _PATCH_CHUNK, c], out=chunk[:, c, 0], mode="clip")
            chunk[:, :, 1:] = chunk[:, :, :1]  # the still image repeated over the temporal patch
        return torch.from_numpy(out)

    def process(self, image: Image.Image | bytes, name: str = "image") -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One image (PIL or encoded bytes) -> ``(pixel rows [h*w, P], (1, h, w))``."""
        resized = self._resized(image, name)
        return self.patchify(resized), self._grid_of(resized)

    def _resized(self, image: Image.Image | bytes, name: str) -> Image.Image:
        if isinstance(image, (bytes, bytearray, memoryview)):
            image = self.decode(bytes(image), name)
        return self.resize(image, name)

    def _grid_of(self, resized: Image.Image) -> tuple[int, int, int]:
        return 1, resized.height // self.patch_size, resized.width // self.patch_size

    def __call__(self, images: Sequence[Image.Image | bytes], names: Sequence[str] | None = None) -> ProcessedImages:
        """A list of images (PIL or encoded bytes) -> :class:`ProcessedImages` (HF's ``pixel_values``,
        ``image_grid_thw``). Errors name the image: ``names[i]``, or ``#i`` without names."""
        if names is not None and len(names) != len(images):
            raise ValueError(f"got {len(images)} images but {len(names)} names")
        resized = [self._resized(im, names[i] if names is not None else f"#{i}") for i, im in enumerate(images)]
        grids = [self._grid_of(r) for r in resized]
        counts = [t * h * w for t, h, w in grids]
        out = np.empty((sum(counts), self.patch_dim), dtype=np.float32)
        start = 0
        for r, n in zip(resized, counts):
            self.patchify(r, out=out[start : start + n])
            start += n
        return ProcessedImages(
            pixel_values=torch.from_numpy(out),
            image_grid_thw=torch.tensor(grids, dtype=torch.int64).view(-1, 3),
        )
