"""Video: decoding, frame sampling, preprocessing and prompt expansion vs HF's Qwen3-VL video processor / processor.

Decoding is compared with HF's PyAV reader (``transformers.video_utils.read_video_pyav``) and sampling
with ``Qwen3VLVideoProcessor.sample_frames`` in this process; pixels, grids and expanded token ids
with HF's ``Qwen3VLVideoProcessor`` / ``Qwen3VLProcessor`` run by ``hf_video_oracle`` (a child
process beside torchvision's Python code; see there why). Every comparison is exact.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from hyper_parallel.data.text import cached_toy_text
from hyper_parallel.data.tokenizer import HuggingFaceTokenizer
from hyper_parallel.data.vision_language.preprocess import ImageProcessor
from hyper_parallel.data.vision_language.video import (
    DecodedVideo,
    VideoError,
    VideoMetadata,
    VideoProcessor,
    decode_video,
    encode_video,
    probe_video,
    video_from_frames,
    video_placeholder_ids,
)
from tests.torch.ut.hf_video_oracle import oracle_missing, run_oracle

SIZES = dict(patch_size=16, temporal_patch_size=2, merge_size=2)
IMG, VS, VE, VID = 512, 513, 514, 515


def _moving_square(t: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """A noisy background with a square moving left to right (compressible, and every frame differs)."""
    rng = np.random.default_rng(seed)
    frames = np.repeat(rng.integers(0, 256, (1, h, w, 3), dtype=np.uint8), t, axis=0)
    side = max(4, min(h, w) // 3)
    for i in range(t):
        x = (i * 3) % max(1, w - side)
        frames[i, h // 3 : h // 3 + side, x : x + side] = (255, 40 * (i % 6), 0)
    return frames


def _ours(**config) -> VideoProcessor:
    return VideoProcessor.Config(**config).build(**SIZES)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """The toy text tokenizer plus Qwen's four vision tokens as special tokens (ids 512..515)."""
    from tokenizers import AddedToken, Tokenizer

    cache = str(tmp_path_factory.mktemp("video_cache"))
    dst = tmp_path_factory.mktemp("video_tok") / "tok"
    shutil.copytree(cached_toy_text(cache).tokenizer_dir, dst)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    names = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    assert [tok.token_to_id(n) for n in names] == [IMG, VS, VE, VID]
    tok.save(str(dst / "tokenizer.json"))
    return str(dst)


# -- decoding and sampling (in process) ---------------------------------------------------------
@pytest.mark.parametrize("fps,total", [(6.0, 12), (30.0, 75), (2.5, 9)])
def test_decoding_and_sampling_equal_hf(fps, total):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata as HFMeta
    from transformers.video_utils import read_video_pyav

    data = encode_video(_moving_square(total, 48, 64), fps)
    for settings in [dict(fps=2.0), dict(fps=1.0, min_frames=2), dict(fps=0, num_frames=5), dict(fps=4.0, max_frames=6)]:
        ours = _ours(**settings)
        hf = Qwen3VLVideoProcessor(min_frames=settings.get("min_frames", 4), max_frames=settings.get("max_frames", 768))
        kw = {"num_frames": settings["num_frames"]} if settings.get("num_frames") else {"fps": settings["fps"]}
        with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
            f.write(data)
            f.flush()
            ref, ref_meta = read_video_pyav(f.name, sample_indices_fn=lambda metadata, **_: hf.sample_frames(metadata, **kw))
        got = ours.decode(data, "clip")
        assert got.metadata.total_num_frames == ref_meta.total_num_frames == total
        assert got.metadata.fps == ref_meta.fps
        assert got.metadata.frames_indices == list(ref_meta.frames_indices), settings
        assert np.array_equal(got.frames, ref)
        # sampling from the metadata alone (what the shard index counts) is the same
        meta = VideoMetadata(total, fps, 48, 64)
        assert ours.sample_indices(meta) == hf.sample_frames(HFMeta(total_num_frames=total, fps=fps), **kw).tolist()
    # an unknown rate samples as 24 fps, as HF
    hf = Qwen3VLVideoProcessor()
    assert _ours().sample_indices(VideoMetadata(100, None, 8, 8)) == hf.sample_frames(HFMeta(total_num_frames=100)).tolist()


# -- preprocessing and prompt (HF oracle in a child process) -------------------------------------
@pytest.fixture(scope="module")
def oracle_dir(tmp_path_factory) -> Path:
    why = oracle_missing()
    if why:
        pytest.skip(why)
    return tmp_path_factory.mktemp("oracle")


def _case(ours_cfg: dict, videos: list[np.ndarray], metas: list[dict] | None, *, sample: bool = True, **hf_video):
    """Our settings -> HF's (size dict, fps xor num_frames, cap flag)."""
    c = VideoProcessor.Config(**ours_cfg)
    video = dict(size={"shortest_edge": c.min_pixels, "longest_edge": c.max_pixels}, min_frames=c.min_frames,
                 max_frames=c.max_frames, image_mean=list(c.image_mean), image_std=list(c.image_std),
                 max_video_tokens=c.max_video_tokens, **hf_video)  # fmt: skip
    call = dict(do_sample_frames=sample, cap_pixels_per_frame=c.cap_pixels_per_frame, return_metadata=True)
    call.update({"fps": None, "num_frames": c.num_frames} if c.num_frames else {"fps": c.fps})
    return dict(videos=videos, metadata=metas, video=video, call=call)


PIXEL_CASES = [
    # (our config, [(t, H, W, fps)], sample)
    (dict(min_pixels=4096, max_pixels=64 * 64 * 8), [(10, 48, 64, 4.0)], True),  # odd sample count (5): padded
    (dict(min_pixels=4096, max_pixels=32 * 32 * 6), [(16, 90, 120, 8.0)], True),  # budget over all frames: shrink
    (dict(min_pixels=4096, max_pixels=64 * 64 * 8), [(15, 96, 128, 6.0)], True),  # 5 frames (odd) over budget
    (dict(min_pixels=64 * 64 * 3, max_pixels=10**6), [(15, 34, 50, 6.0)], True),  # 5 frames (odd) under min
    (dict(min_pixels=64 * 64 * 8, max_pixels=128 * 128 * 8), [(8, 40, 30, 8.0)], True),  # below min: grow
    (dict(min_pixels=4096, max_pixels=10**6), [(6, 20, 70, 3.0)], True),  # a side under patch*merge
    (dict(min_pixels=4096, max_pixels=64 * 64 * 8, fps=0, num_frames=6), [(9, 50, 66, 30.0)], True),
    (dict(min_pixels=4096, max_pixels=96 * 96 * 8, cap_pixels_per_frame=True, max_video_tokens=4), [(12, 64, 96, 6.0)], True),
    (dict(min_pixels=4096, max_pixels=64 * 64 * 8, sample_frames=False), [(7, 40, 56, 5.0)], False),
    (dict(min_pixels=4096, max_pixels=64 * 64 * 8, image_mean=(0.48145466, 0.4578275, 0.40821073),
          image_std=(0.26862954, 0.26130258, 0.27577711)), [(8, 48, 48, 4.0), (12, 30, 90, 6.0)], True),
]  # fmt: skip


def test_pixels_grids_and_indices_equal_hf_video_processor(oracle_dir):
    cases, ours_out = [], []
    for i, (cfg, shapes, sample) in enumerate(PIXEL_CASES):
        ours = _ours(**cfg)
        videos = [_moving_square(t, h, w, seed=10 * i + j) for j, (t, h, w, _) in enumerate(shapes)]
        metas = [dict(total_num_frames=t, fps=fps) for t, _, _, fps in shapes]
        decoded = [video_from_frames(list(v), fps=fps) for v, (_, _, _, fps) in zip(videos, shapes)]
        ours_out.append(ours([ours.select(d) for d in decoded]))
        cases.append(_case(cfg, videos, metas, sample=sample))
    for i, (ref, got) in enumerate(zip(run_oracle(cases, oracle_dir), ours_out)):
        assert "error" not in ref, (i, ref)
        assert torch.equal(got.video_grid_thw, ref["video_grid_thw"]), (i, got.video_grid_thw, ref["video_grid_thw"])
        assert got.pixel_values_videos.dtype == ref["pixel_values_videos"].dtype == torch.float32
        diff = (got.pixel_values_videos - ref["pixel_values_videos"]).abs().max().item()
        assert torch.equal(got.pixel_values_videos, ref["pixel_values_videos"]), (i, diff)


def test_prompt_expansion_and_mixed_inputs_equal_hf_processor(oracle_dir, tokenizer_dir):
    """A record with text, an image and two videos (mp4 members) through our encoder, and the same decoded
    frames through HF's Qwen3VLProcessor: the same token ids, pixels and grids, images and videos."""
    from PIL import Image

    from hyper_parallel.data.vision_language.sample import make_encoder

    facts = dict(vocab_size=520, image_token_id=IMG, vision_start_token_id=VS, vision_end_token_id=VE,
                 video_token_id=VID, **SIZES)  # fmt: skip
    video_cfg = VideoProcessor.Config(min_pixels=4096, max_pixels=64 * 64 * 8)
    image_cfg = ImageProcessor.Config(min_pixels=32 * 32, max_pixels=64 * 64)
    encoder = make_encoder(tokenizer_dir, image_cfg, facts, video=video_cfg)
    clips = [encode_video(_moving_square(20, 48, 64, seed=1), 5.0), encode_video(_moving_square(9, 36, 50, seed=2), 3.0)]
    picture = np.random.default_rng(3).integers(0, 256, (40, 52, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(picture).save(png, format="PNG")
    text = "Watch <video> and the picture <image> then <video>. Same?"
    files = {"json": json.dumps({"text": text}).encode(), "0.mp4": clips[0], "1.mp4": clips[1], "png": png.getvalue()}
    record = encoder.parse("k", files)
    doc = encoder.document("k", "shard", files, record)

    decoded = [decode_video(c) for c in clips]  # every frame, and the metadata HF's PyAV reader reports
    slot = "<|vision_start|><|{}_pad|><|vision_end|>"
    hf_text = text.replace("<video>", slot.format("video")).replace("<image>", slot.format("image"))
    case = _case(dict(min_pixels=4096, max_pixels=64 * 64 * 8), [d.frames for d in decoded],
                 [dict(total_num_frames=d.metadata.total_num_frames, fps=d.metadata.fps) for d in decoded])
    case.update(text=hf_text, tokenizer=tokenizer_dir, images=[picture],
                image=dict(min_pixels=32 * 32, max_pixels=64 * 64, image_mean=[0.5] * 3, image_std=[0.5] * 3, patch_size=16,
                           temporal_patch_size=2, merge_size=2))  # fmt: skip
    ref = run_oracle([case], oracle_dir)[0]
    assert "error" not in ref, ref
    bos, eos = encoder.bos, encoder.eos  # plain text: the text source's bos/eos policy around HF's ids
    assert record.input_ids.tolist() == bos + ref["input_ids"][0].tolist() + eos
    assert torch.equal(doc.pixel_values_videos, ref["pixel_values_videos"])
    assert torch.equal(doc.video_grid_thw, ref["video_grid_thw"])
    assert torch.equal(doc.pixel_values, ref["pixel_values"])
    assert torch.equal(doc.image_grid_thw, ref["image_grid_thw"])
    # 20 frames at 5 fps sampled at 2 fps: 8 frames, 4 temporal patches, each stamped with its frames' mean time
    assert record.videos[0].grid[0] == 4 and list(record.videos[0].timestamps) == pytest.approx([0.3, 1.3, 2.5, 3.5])


# -- bad videos -----------------------------------------------------------------------------------
def _truncated(data: bytes) -> bytes:
    return data[: len(data) * 2 // 3]


def _unsupported_codec(frames: np.ndarray) -> bytes:
    """An AVI whose codec tag no decoder knows (FFmpeg demuxes it, then has nothing to decode it with)."""
    data = encode_video(frames, 5.0, container_format="avi")
    tags = [b"FMP4", b"XVID", b"DIVX", b"DX50", b"fmp4", b"xvid"]
    assert any(t in data for t in tags)
    for t in tags:
        data = data.replace(t, b"QQQQ")
    return data


def _no_frames() -> bytes:
    """An mp4 whose video stream holds no frame."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=5)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def _size_change() -> bytes:
    """Two MPEG-TS segments of different frame sizes, joined (what concatenating broadcast segments gives)."""
    a = encode_video(_moving_square(6, 48, 64), 5.0, container_format="mpegts", codec="mpeg2video")
    b = encode_video(_moving_square(6, 32, 32), 5.0, container_format="mpegts", codec="mpeg2video")
    return a + b


def test_bad_videos_are_named_errors():
    frames = _moving_square(12, 32, 48)
    good = encode_video(frames, 6.0)
    ours = _ours(fps=6.0)
    cases = {
        "undecodable": [b"not a video at all" * 20, good[:200]],
        "no_frames": [b"", _no_frames()],
        "unsupported_codec": [_unsupported_codec(frames)],
    }
    for kind, blobs in cases.items():
        for blob in blobs:
            with pytest.raises(VideoError, match=r"video 'k\.mp4'.*\[" + kind + "]") as e:
                ours.decode(blob, "k.mp4")
            assert e.value.kind == kind
    with pytest.raises(VideoError, match="truncated|corrupt|undecodable"):
        decode_video(_truncated(good), "k.mp4")
    # a web-streamable mp4 (index first) cut short: the header survives, the packets say it is short
    streamable = encode_video(frames, 6.0, faststart=True)
    cut = _truncated(streamable)
    assert probe_video(cut, "k.mp4").total_num_frames == 12
    with pytest.raises(VideoError, match=r"is truncated: its header says 12 frames but it holds \d+ \[undecodable]"):
        probe_video(cut, "k.mp4", count_packets=True)
    with pytest.raises(VideoError, match=r"is truncated: its header says 12 frames but only \d+ decode"):
        _ours(fps=0, num_frames=12).decode(cut, "k.mp4")
    # a stream that changes size mid-way (MPEG-TS segments joined)
    with pytest.raises(VideoError, match=r"frame \d+ is 32x32 but frame 0 is 64x48.*\[frame_size_mismatch]"):
        decode_video(_size_change(), "k.ts")
    with pytest.raises(VideoError, match=r"frame_size_mismatch"):
        video_from_frames([frames[0], frames[1][:16]], fps=2.0, name="k")
    with pytest.raises(VideoError, match=r"no_frames"):
        video_from_frames([], name="k")
    with pytest.raises(VideoError, match=r"aspect_ratio"):
        _ours().target_size(4, 2, 500, "k")
    with pytest.raises(VideoError, match=r"too_many_pixels"):
        _ours(max_input_pixels=100).decode(good, "k")
    with pytest.raises(ValueError, match="exactly one of fps"):
        _ours(fps=2.0, num_frames=4)


def test_decoded_video_from_frames_keeps_indices_and_rate():
    frames = _moving_square(10, 32, 32)
    v = _ours(fps=2.0).select(video_from_frames(list(frames), fps=5.0))
    assert isinstance(v, DecodedVideo) and v.metadata.frames_indices == [0, 3, 6, 9]
    assert np.array_equal(v.frames, frames[[0, 3, 6, 9]])
