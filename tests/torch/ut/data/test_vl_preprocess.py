"""Image preprocessing vs HF's ``Qwen2VLImageProcessorPil`` (the oracle; see preprocess.py for why the PIL one)."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from hyper_parallel.data.vision_language.preprocess import ImageError, ImageProcessor, smart_resize

QWEN3_VL = dict(patch_size=16, temporal_patch_size=2, merge_size=2)


def _hf(min_pixels=256 * 256, max_pixels=4096 * 4096, mean=(0.5,) * 3, std=(0.5,) * 3, **sizes):
    sizes = {**QWEN3_VL, **sizes}
    return Qwen2VLImageProcessorPil(image_mean=list(mean), image_std=list(std), min_pixels=min_pixels,
                                    max_pixels=max_pixels, **sizes)  # fmt: skip


def _ours(sizes=QWEN3_VL, **config) -> ImageProcessor:
    return ImageProcessor.Config(**config).build(**sizes)


def _picture(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    """A real-looking picture: smooth colour gradients, a bright disc, sensor noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    u, v = x / max(width - 1, 1), y / max(height - 1, 1)
    phase = rng.uniform(0, 2 * np.pi, 3)
    img = np.stack([127 + 100 * np.sin(3 * u + 2 * v + ph) for ph in phase], axis=-1)
    disc = (u - rng.uniform()) ** 2 + (v - rng.uniform()) ** 2 < 0.05
    img[disc] = rng.uniform(180, 255, 3)
    img += rng.normal(0, 12, img.shape)
    rgb = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")
    if mode == "RGB":
        return rgb
    if mode == "RGBA":  # a soft alpha ramp: compositing on white matters everywhere
        alpha = Image.fromarray((255 * np.clip(u + 0.2 * rng.normal(size=u.shape), 0, 1)).astype(np.uint8), "L")
        rgba = rgb.copy()
        rgba.putalpha(alpha)
        return rgba
    if mode == "P":  # palette with one transparent index
        pal = rgb.quantize(colors=16)
        pal.info["transparency"] = 3
        return pal
    return rgb.convert(mode)


def _assert_equal_to_hf(ours: ImageProcessor, hf, images) -> None:
    ref = hf(images=images, return_tensors="pt")
    got = ours(images)
    assert torch.equal(got.image_grid_thw, ref["image_grid_thw"])
    assert got.pixel_values.dtype == ref["pixel_values"].dtype == torch.float32
    assert got.pixel_values.shape == ref["pixel_values"].shape
    assert (got.pixel_values - ref["pixel_values"]).abs().max().item() <= 1e-6


# (width, height): tiny, odd, wide (aspect up to ~166), tall, and one larger than a merge block everywhere.
SIZES = [(1, 1), (5, 7), (37, 999), (500, 3), (7, 1000), (641, 479), (333, 97), (64, 64), (1201, 17)]


def test_equals_hf_qwen3_vl_defaults():
    images = [_picture(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    _assert_equal_to_hf(_ours(), _hf(), images)


def test_equals_hf_modes_and_downscaling():
    """Alpha on white, palette transparency, grayscale; ``max_pixels`` forces the downscaling branch."""
    images = [_picture(300, 200, 1, "RGBA"), _picture(123, 77, 2, "P"), _picture(90, 260, 3, "L"),
              _picture(260, 90, 4, "LA"), _picture(1500, 400, 5), _picture(51, 2000, 6)]  # fmt: skip
    ours = _ours(min_pixels=32 * 32, max_pixels=384 * 384)
    _assert_equal_to_hf(ours, _hf(min_pixels=32 * 32, max_pixels=384 * 384), images)
    assert max(ours.target_size(h, w)[0] * ours.target_size(h, w)[1] for w, h in [(1500, 400), (51, 2000)]) <= 384**2


def test_equals_hf_qwen2_vl_settings():
    """Qwen2-VL: patch 14, CLIP mean/std, its pixel bounds (HF's class defaults)."""
    images = [_picture(w, h, seed=10 + i) for i, (w, h) in enumerate([(45, 45), (200, 31), (29, 301)])]
    sizes = dict(patch_size=14, temporal_patch_size=2, merge_size=2)
    ours = _ours(sizes, min_pixels=56 * 56, max_pixels=28 * 28 * 1280, image_mean=tuple(OPENAI_CLIP_MEAN),
                 image_std=tuple(OPENAI_CLIP_STD))  # fmt: skip
    _assert_equal_to_hf(ours, Qwen2VLImageProcessorPil(), images)


def test_encoded_bytes_and_token_counts():
    """PNG/JPEG/WebP bytes decode to what HF gets from the decoded image; sizes need only the header."""
    ours, hf = _ours(), _hf()
    pics = [_picture(301, 45, 7), _picture(64, 640, 8), _picture(100, 100, 9, "RGBA")]
    blobs = []
    for pic, fmt in zip(pics, ["PNG", "JPEG", "WEBP"]):
        buf = io.BytesIO()
        (pic.convert("RGB") if fmt == "JPEG" else pic).save(buf, format=fmt)
        blobs.append(buf.getvalue())
    decoded = [Image.open(io.BytesIO(b)) for b in blobs]
    got = ours(blobs, names=["a.png", "b.jpg", "c.webp"])
    ref = hf(images=decoded, return_tensors="pt")
    assert torch.equal(got.image_grid_thw, ref["image_grid_thw"])
    assert (got.pixel_values - ref["pixel_values"]).abs().max().item() <= 1e-6
    for pic, grid in zip(pics, got.image_grid_thw.tolist()):
        assert list(ours.grid_thw(pic.height, pic.width)) == grid
        assert ours.num_tokens(pic.height, pic.width) == grid[1] * grid[2] // 4
        assert hf.get_number_of_image_patches(pic.height, pic.width) == grid[1] * grid[2]


@pytest.mark.parametrize("hw", [(1, 1), (3, 500), (1000, 7), (31, 33), (16, 16), (4097, 4095), (10_000, 60)])
def test_smart_resize_equals_hf(hw):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    kw = dict(factor=32, min_pixels=256 * 256, max_pixels=4096 * 4096)
    assert smart_resize(*hw, **kw) == hf_smart_resize(*hw, **kw)


def test_bad_images_raise_errors_naming_them():
    ours = _ours(max_input_pixels=50 * 50)
    with pytest.raises(ImageError, match=r"image 'empty\.png': has size 0x5.*\[empty_image\]"):
        ours([_picture(8, 8, 0), Image.new("RGB", (0, 5))], names=["ok.png", "empty.png"])
    with pytest.raises(ImageError, match=r"image 'header': has size 10x0.*\[empty_image\]"):
        ours.num_tokens(0, 10, name="header")  # token counting from a header alone checks too
    with pytest.raises(ImageError, match=r"image '#1': has 60x60 = 3600 pixels > .*max_input_pixels=2500"):
        ours([_picture(8, 8, 0), _picture(60, 60, 1)])
    with pytest.raises(ImageError, match=r"image 'wide\.png'.*aspect ratio 300\.0 > 200.*\[aspect_ratio\]"):
        ours([_picture(300, 1, 0)], names=["wide.png"])
    big = io.BytesIO()
    _picture(60, 60, 1).save(big, format="PNG")
    with pytest.raises(ImageError, match=r"'big\.png'.*too_many_pixels"):
        ours.decode(big.getvalue(), "big.png")  # rejected from the header, before decoding
    with pytest.raises(ImageError, match=r"'junk\.jpg': cannot be opened.*\[undecodable\]"):
        ours([b"definitely not an image"], names=["junk.jpg"])
    png = io.BytesIO()
    _picture(48, 48, 2).save(png, format="PNG")
    with pytest.raises(ImageError, match=r"'cut\.png': cannot be decoded.*\[undecodable\]"):
        ours([png.getvalue()[: len(png.getvalue()) // 2]], names=["cut.png"])
    err = ImageError("x.png", "empty_image", "has size 0x0")
    again = pickle.loads(pickle.dumps(err))  # crosses DataLoader worker processes intact
    assert (again.name, again.kind, str(again)) == ("x.png", "empty_image", str(err))


def test_bad_config_raises():
    with pytest.raises(ValueError, match="3 values"):
        _ours(image_mean=(0.5, 0.5))
    with pytest.raises(ValueError, match="min_pixels"):
        _ours(min_pixels=100, max_pixels=10)


def test_defaults_equal_auto_image_processor_of_a_qwen3_vl_folder(tmp_path):
    """A Qwen3-VL ``preprocessor_config.json`` through ``AutoImageProcessor``: without torchvision it is the PIL
    processor, and our default config reproduces it."""
    import json

    from transformers import AutoImageProcessor

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    }))  # fmt: skip
    auto = AutoImageProcessor.from_pretrained(str(tmp_path))
    if type(auto).__name__ != "Qwen2VLImageProcessorPil":
        pytest.skip(f"AutoImageProcessor gave {type(auto).__name__} (torchvision installed): not the PIL oracle")
    _assert_equal_to_hf(_ours(), auto, [_picture(211, 97, 20), _picture(40, 400, 21)])
