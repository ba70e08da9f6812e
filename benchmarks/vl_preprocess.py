"""Image preprocessing throughput: ours vs HF's ``Qwen2VLImageProcessorPil`` (a measurement, not a test).

Both turn the same list of images into ``pixel_values`` / ``image_grid_thw`` with Qwen3-VL settings
(patch 16, merge 2, temporal 2, mean = std = 0.5, 256^2..4096^2 pixels); the outputs are checked equal
first. Prints images/s and patches/s of each, from decoded PIL images and from encoded JPEG bytes
(decoding included; HF gets ``Image.open(...)`` of the same bytes), and ours / HF as a ratio. Each time
is the best of ``--rounds`` rounds, ours and HF interleaved (after a warm-up), so that load from other
processes on the machine distorts both alike.

**Videos** (issue 23): ours decodes (PyAV) only the sampled frames of mp4 bytes and preprocesses them
(``VideoProcessor``); HF decodes the same file with its PyAV reader (``load_video(backend="pyav")``, the
same sampling) and runs ``Qwen3VLVideoProcessor``. HF's video processor needs torchvision, which cannot
load beside this CPU torch; its Python code (``--hf-oracle-path``, see ``tests/torch/ut/hf_video_oracle.py``)
is put on the path with its C-op registration skipped. Outputs are checked equal first. Prints videos/s
and sampled frames/s of each and the ratio, and what the ``qwen3_vl_moe_debug`` training step consumes
(videos per step / step time) against our throughput on the toy videos.

Run: ``python benchmarks/vl_preprocess.py [--rounds 5] [--images 24] [--videos 4] [--skip-videos]``.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

# HF's video processor needs torchvision's Python code (a CUDA wheel whose C ops cannot load here): put it
# on the path before transformers looks for it, skipping only the registration of those C ops.
_ORACLE = os.environ.get("HP_HF_ORACLE_PATH", str(Path(__file__).resolve().parents[1] / ".venv" / "hf_oracle"))
if "--skip-videos" not in sys.argv and (Path(_ORACLE) / "torchvision").is_dir():
    sys.path.insert(0, _ORACLE)
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from hyper_parallel.data.vision_language.preprocess import ImageProcessor
from hyper_parallel.data.vision_language.video import VideoProcessor, encode_video

# (width, height, seconds, fps) of a mix of clips: a small webcam clip, SD, HD, a square social clip.
CLIPS = [(320, 240, 8, 30.0), (640, 360, 5, 24.0), (1280, 720, 3, 24.0), (480, 480, 6, 25.0)]

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


def clips(n: int) -> list[tuple[bytes, float, int]]:
    """``n`` mp4 clips (MPEG-4) of moving gradients with noise: ``(bytes, fps, frames)``."""
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        w, h, seconds, fps = CLIPS[i % len(CLIPS)]
        t = int(seconds * fps)
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        frames = np.empty((t, h, w, 3), np.uint8)
        for f in range(t):
            base = np.stack([127 + 100 * np.sin((x + 4 * f) / (17 + 5 * c) + y / (23 + 3 * c)) for c in range(3)], -1)
            frames[f] = np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)
        out.append((encode_video(frames, fps, quality=4), fps, t))
    return out


def video_section(args: argparse.Namespace) -> None:
    try:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
        from transformers.video_utils import load_video
        import torchvision  # noqa: F401 - the processor's resize
    except Exception as e:  # noqa: BLE001
        print(f"videos: skipped, HF's video processor cannot run here ({type(e).__name__}: {e}); "
              f"install torchvision's Python code: pip install --no-deps --target {_ORACLE} torchvision==0.28.0")
        return
    ours = VideoProcessor.Config().build(patch_size=16, temporal_patch_size=2, merge_size=2)
    c = ours.config
    hf = Qwen3VLVideoProcessor(size={"shortest_edge": c.min_pixels, "longest_edge": c.max_pixels}, fps=c.fps,
                               min_frames=c.min_frames, max_frames=c.max_frames)  # fmt: skip
    data = clips(args.videos)
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, (blob, _, _) in enumerate(data):
            paths.append(os.path.join(tmp, f"clip{i}.mp4"))
            Path(paths[-1]).write_bytes(blob)

        def run_hf():
            videos, metas = [], []
            for path in paths:
                v, meta = load_video(path, backend="pyav", sample_indices_fn=lambda metadata, **_: hf.sample_frames(metadata, fps=c.fps))
                videos.append(v)
                metas.append(meta)
            return hf(videos=videos, video_metadata=metas, do_sample_frames=False, cap_pixels_per_frame=False,
                      return_tensors="pt")  # fmt: skip

        blobs = [b for b, _, _ in data]
        got, ref = ours(blobs), run_hf()
        assert torch.equal(got.video_grid_thw, ref["video_grid_thw"])
        assert torch.equal(got.pixel_values_videos, ref["pixel_values_videos"]), "video outputs differ: fix before timing"
        frames = int(got.video_grid_thw[:, 0].sum()) * 2
        total = sum(t for _, _, t in data)
        print(f"{len(data)} videos ({total} frames, {frames} sampled at {c.fps:g} fps), "
              f"{got.pixel_values_videos.shape[0]} patches:")
        t_ours, t_hf = best_seconds([lambda: ours(blobs), run_hf], args.rounds)
        for who, t in (("ours", t_ours), ("HF  ", t_hf)):
            print(f"  {who} {len(data) / t:8.2f} videos/s  {frames / t:8.1f} sampled frames/s  ({t * 1e3:.0f} ms)")
        print(f"  ours / HF throughput (decode + preprocess): {t_hf / t_ours:.2f}x")
    debug_step_section(args)


def debug_step_section(args: argparse.Namespace) -> None:
    """Videos per second the qwen3_vl_moe_debug step consumes vs our decode + preprocess of its toy videos."""
    from hyper_parallel.models.qwen3_vl_moe_v2.config_registry import qwen3_vl_moe_debug

    cfg = qwen3_vl_moe_debug()
    model = cfg.model.build()
    model.init_weights()
    facts = {"vocab_size": cfg.model.vocab_size, "image_token_id": cfg.model.image_token_id,
             "vision_start_token_id": cfg.model.vision_start_token_id, "video_token_id": cfg.model.video_token_id,
             "vision_end_token_id": cfg.model.vision_end_token_id, "patch_size": cfg.model.visual.patch_size,
             "temporal_patch_size": cfg.model.visual.temporal_patch_size,
             "merge_size": cfg.model.visual.spatial_merge_size}  # fmt: skip
    with tempfile.TemporaryDirectory() as cache:
        cfg.data.cache_dir = cache
        loader = cfg.data.build(model_facts=facts)
        steps = [loader.next_step() for _ in range(3)]
        encoder = loader.encoder
        from hyper_parallel.data.vision_language import read_samples

        toy_videos = []
        for r in read_samples(loader.shards[0]):
            toy_videos += [r["files"][m] for m in r["files"] if m.endswith("mp4")]
    n_videos = sum(int(mb["video_grid_thw"].shape[0]) for s in steps for mb in s) / len(steps)
    keys = model.input_keys

    def train_step(step):
        for mb in step:
            logits = model(mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"],
                           max_seqlen=mb["max_seqlen"], **{k: mb[k] for k in keys if k in mb})  # fmt: skip
            logits = getattr(logits, "logits", logits)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100).backward()

    t_step = min(best_seconds([lambda s=s: train_step(s)], 1)[0] for s in steps)
    videos = toy_videos[:16]
    t_pre = best_seconds([lambda: encoder.videos.processor(videos)], args.rounds)[0]
    need, have = n_videos / t_step, len(videos) / t_pre
    print(f"qwen3_vl_moe_debug step: {n_videos:.1f} videos per step, forward+backward {t_step * 1e3:.0f} ms -> "
          f"consumes {need:.1f} videos/s; our decode + preprocess of its toy videos: {have:.0f} videos/s "
          f"({have / max(need, 1e-9):.0f}x what the step consumes)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--images", type=int, default=24)
    ap.add_argument("--videos", type=int, default=4)
    ap.add_argument("--skip-videos", action="store_true", help="images only")
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
    if not args.skip_videos:
        video_section(args)


if __name__ == "__main__":
    main()
