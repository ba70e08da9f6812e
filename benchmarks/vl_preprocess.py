"""Image preprocessing throughput: ours vs HF's ``Qwen2VLImageProcessorPil`` (a measurement, not a test).

Both turn the same list of images into ``pixel_values`` / ``image_grid_thw`` with Qwen3-VL settings
(patch 16, merge 2, temporal 2, mean = std = 0.5, 256^2..4096^2 pixels); the outputs are checked equal
first. Prints images/s and patches/s of each, from decoded PIL images and from encoded JPEG bytes
(decoding included; HF gets ``Image.open(...)`` of the same bytes), and ours / HF as a ratio. Each time
is the best of ``--rounds`` rounds, ours and HF interleaved (after a warm-up), so that load from other
processes on the machine distorts both alike.

Run: ``python benchmarks/vl_preprocess.py [--rounds 5] [--images 24]``.
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from hyper_parallel.data.vision_language.preprocess import ImageProcessor

# (width, height) of a web-like mix: thumbnails, phone photos, screenshots, a panorama, scans.
SIZES = [(320, 240), (640, 480), (1024, 768), (1280, 720), (1920, 1080), (800, 1200), (2048, 512), (150, 150)]


def pictures(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        base = np.stack([127 + 100 * np.sin(x / (17 + 5 * c) + y / (23 + 3 * c) + i) for c in range(3)], -1)
        img = np.clip(base + rng.normal(0, 10, base.shape).astype(np.float32), 0, 255).astype(np.uint8)
        out.append(Image.fromarray(img, "RGB"))
    return out


def best_seconds(fns: list[Callable[[], object]], rounds: int) -> list[float]:
    """Best-of-``rounds`` wall time of each function, rounds interleaved so machine load hits all alike."""
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--images", type=int, default=24)
    args = ap.parse_args()

    ours = ImageProcessor.Config().build(patch_size=16, temporal_patch_size=2, merge_size=2)
    hf = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                  image_std=[0.5] * 3, min_pixels=256 * 256, max_pixels=4096 * 4096)  # fmt: skip
    images = pictures(args.images)
    blobs = []
    for im in images:
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=90)
        blobs.append(buf.getvalue())

    got, ref = ours(images), hf(images=images, return_tensors="pt")
    assert torch.equal(got.image_grid_thw, ref["image_grid_thw"])
    assert torch.equal(got.pixel_values, ref["pixel_values"]), "outputs differ: fix before timing"
    patches = got.pixel_values.shape[0]
    print(f"{len(images)} images, {patches} patches ({got.pixel_values.nbytes / 2**20:.0f} MiB of pixel_values), "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip

    cases = {
        "decoded PIL images": (lambda: ours(images), lambda: hf(images=images, return_tensors="pt")),
        "JPEG bytes (decode included)": (
            lambda: ours(blobs),
            lambda: hf(images=[Image.open(io.BytesIO(b)) for b in blobs], return_tensors="pt"),
        ),
    }
    for name, (run_ours, run_hf) in cases.items():
        t_ours, t_hf = best_seconds([run_ours, run_hf], args.rounds)
        print(f"{name}:")
        for who, t in (("ours", t_ours), ("HF  ", t_hf)):
            print(f"  {who} {len(images) / t:8.1f} images/s  {patches / t:10.0f} patches/s  ({t * 1e3:.0f} ms)")
        print(f"  ours / HF throughput: {t_hf / t_ours:.2f}x")


if __name__ == "__main__":
    main()
