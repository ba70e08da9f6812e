"""Videos in the `vision_language` source: shards with video members, expansion, packing, policies, bad input.

The batches' pixels equal HF's decode + VideoProcessor (itself equal to HF's processor, tests/torch/ut/data/test_vl_video.py),
positions equal HF's ``get_rope_index``; packing counts video tokens; a video too long for the budget gets
fewer frames or is skipped and counted; every bad video is an error naming shard and key, or a counted
skip; the writer CLI takes video files; the toy corpus has videos; per-modality token counts are logged.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from hyper_parallel.data import BadSampleError, first_difference, global_batches
from hyper_parallel.data.text import cached_toy_text
from hyper_parallel.data.vision_language import VisionLanguageDataLoader, VisionLanguageWriter, check_shards, make_encoder
from hyper_parallel.data.vision_language.cli import main as vl_cli
from hyper_parallel.data.vision_language.preprocess import ImageProcessor
from hyper_parallel.data.vision_language.video import VideoProcessor, decode_video, encode_video
from tests.torch.ut.data.test_vl_video import _moving_square, _no_frames, _size_change, _unsupported_codec

IMG, VS, VE, VID = 512, 513, 514, 515
FACTS = dict(vocab_size=520, image_token_id=IMG, vision_start_token_id=VS, vision_end_token_id=VE, video_token_id=VID,
             patch_size=16, temporal_patch_size=2, merge_size=2)  # fmt: skip
IMAGE = ImageProcessor.Config(min_pixels=32 * 32, max_pixels=128 * 128)
VIDEO = VideoProcessor.Config(min_pixels=4 * 32 * 32, max_pixels=8 * 64 * 64)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("vlv_cache"))


def _png(w: int, h: int, seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _mp4(t: int, h: int, w: int, seed: int, fps: float = 4.0) -> bytes:
    return encode_video(_moving_square(t, h, w, seed), fps)


def _cfg(cache, path="", **kw) -> VisionLanguageDataLoader.Config:
    kw = {"max_tokens_per_microbatch": 256, "global_batch_tokens": 4 * 256, "shuffle_buffer": 16, "seed": 1,
          "image": IMAGE, "video": VIDEO, **kw}  # fmt: skip
    tokenizer = cached_toy_text(cache).tokenizer_dir if path else ""
    return VisionLanguageDataLoader.Config(path=path, cache_dir=cache, tokenizer=tokenizer, **kw)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, cache) -> str:
    """24 records: videos, images + videos, text; plain text and chats with video content parts."""
    out = str(tmp_path_factory.mktemp("vlv_mixed"))
    with VisionLanguageWriter(out, samples_per_shard=8) as w:
        for i in range(24):
            videos = [_mp4(6 + i % 5, 32 + 16 * (i % 2), 48, seed=i)] if i % 3 else []
            images = [_png(40, 30, seed=i)] if i % 4 == 1 else []
            if i % 6 == 5:
                user = [{"type": "video"} for _ in videos] + [{"type": "image"} for _ in images]
                user.append({"type": "text", "text": f"item {i}"})
                w.write(images, videos=videos, messages=[{"role": "user", "content": user},
                                                          {"role": "assistant", "content": "Moving."}])  # fmt: skip
            else:
                w.write(images, videos=videos, text="<video>" * len(videos) + "<image>" * len(images) + f" item {i} here.")
    return out


def _hf_rope_positions(ids: np.ndarray, image_grids, video_grids) -> np.ndarray:
    from tests.torch.ut.data.test_vision_language import _hf_rope_model

    model = _hf_rope_model()
    input_ids = torch.from_numpy(np.asarray(ids, dtype=np.int64)).view(1, -1)
    types = (input_ids == IMG).int() + 2 * (input_ids == VID).int()
    img = torch.tensor(image_grids, dtype=torch.int64).view(-1, 3) if len(image_grids) else None
    vid = torch.tensor(video_grids, dtype=torch.int64).view(-1, 3) if len(video_grids) else None
    pos, _ = model.get_rope_index(input_ids, types, image_grid_thw=img, video_grid_thw=vid)
    return pos[:, 0].numpy()


def test_batches_hold_videos_equal_to_the_processor_and_hf_positions(mixed, cache):
    loader = _cfg(cache, mixed).build(model_facts=FACTS)
    processor = VIDEO.build(patch_size=16, temporal_patch_size=2, merge_size=2)
    encoder = loader.encoder
    from hyper_parallel.data.vision_language import read_samples

    files = {r["key"]: r["files"] for r in read_samples(mixed)}
    seen_videos = 0
    for mb in loader.next_step() + loader.next_step():
        assert {"pixel_values_videos", "video_grid_thw"} <= set(mb)
        ids_all = mb["input_ids"].view(-1).numpy()
        assert int((ids_all == VID).sum()) == int(mb["video_grid_thw"].prod(1).sum()) // 4
        cu = mb["cu_seqlens"].tolist()
        img_grids, vid_grids = mb["image_grid_thw"].tolist(), mb["video_grid_thw"].tolist()
        img_rows = vid_rows = 0
        for lo, hi in zip(cu[:-1], cu[1:]):
            ids = ids_all[lo:hi]
            key = next((k for k in files if encoder.parse(k, files[k]).input_ids.tolist() == ids.tolist()), None)
            if key is None:  # the padding run
                continue
            record = encoder.parse(key, files[key])
            n_img, n_vid = len(record.grids), len(record.videos)
            mine_img, mine_vid = img_grids[:n_img], vid_grids[:n_vid]
            img_grids, vid_grids = img_grids[n_img:], vid_grids[n_vid:]
            np.testing.assert_array_equal(mb["position_ids"][:, 0, lo:hi].numpy(),
                                          _hf_rope_positions(ids, mine_img, mine_vid))  # fmt: skip
            for plan, grid in zip(record.videos, mine_vid):  # pixels: HF's PyAV decode + the processor
                decoded = decode_video(files[key][plan.member], indices=lambda m, p=plan: list(p.indices))
                rows, g, _ = processor.process(decoded)
                assert list(g) == grid
                assert torch.equal(mb["pixel_values_videos"][vid_rows : vid_rows + rows.shape[0]], rows)
                vid_rows += rows.shape[0]
                seen_videos += 1
            img_rows += sum(t * h * w for t, h, w in mine_img)
        assert vid_rows == mb["pixel_values_videos"].shape[0] and img_rows == mb["pixel_values"].shape[0]
    assert seen_videos >= 4


def test_layout_independent_and_modality_counts(mixed, cache):
    ref = global_batches(_cfg(cache, mixed), model_facts=FACTS, steps=2)
    got = global_batches(_cfg(cache, mixed, num_workers=2), model_facts=FACTS, steps=2, dp_world_size=2)
    assert first_difference(got, ref) is None
    loader = _cfg(cache, mixed).build(model_facts=FACTS)
    for step in ref:
        mine = loader.next_step()
        assert first_difference([mine], [step]) is None
        m = loader.metrics()
        video = sum(int((mb["input_ids"] == VID).sum()) for mb in step)
        image = sum(int((mb["input_ids"] == IMG).sum()) for mb in step)
        docs = sum(int(mb["cu_seqlens"][-1]) for mb in step)
        pad = sum(int(mb["cu_seqlens"][-1] - mb["cu_seqlens"][-2]) for mb in step if int((mb["labels"][0, mb["cu_seqlens"][-2]:] != -100).sum()) == 0)  # noqa: E501
        assert m["tokens/video"] == video > 0 and m["tokens/image"] == image
        assert m["tokens/text"] + m["tokens/image"] + m["tokens/video"] in (docs, docs - pad)
    ranks = [_cfg(cache, mixed).build(model_facts=FACTS, dp_rank=r, dp_world_size=2) for r in range(2)]
    for r in ranks:
        r.next_step()
    assert ranks[0].metrics() == ranks[1].metrics()  # global counts, the same on every rank


def _long_video_corpus(tmp_path, frames: int) -> str:
    out = str(tmp_path / "long")
    with VisionLanguageWriter(out, samples_per_shard=8, validate=False) as w:
        for i in range(3):
            w.write(videos=[_mp4(6, 32, 32, seed=i)], text=f"<video>short {i}.")
        w.write_files({"json": json.dumps({"text": "<video>long one."}).encode(), "mp4": _mp4(frames, 64, 64, 9, fps=8.0)},
                      key="longkey")  # fmt: skip
    return out


def test_too_long_video_gets_fewer_frames_or_is_skipped(tmp_path, cache):
    path = _long_video_corpus(tmp_path, 64)
    video = VideoProcessor.Config(min_pixels=4 * 32 * 32, max_pixels=64 * 64 * 64, fps=4.0, max_frames=64)
    budget = 96
    kw = dict(max_tokens_per_microbatch=budget, global_batch_tokens=0, video=video)
    alone = make_encoder(cached_toy_text(cache).tokenizer_dir, IMAGE, FACTS, video=video)  # no budget: full video
    from hyper_parallel.data.vision_language import read_samples

    rec = next(r for r in read_samples(path) if r["key"] == "longkey")
    full = alone.parse("longkey", rec["files"])
    assert len(full) > budget and len(full.videos[0].indices) == 32
    loader = _cfg(cache, path, **kw).build(model_facts=FACTS)
    fitted = loader.encoder.parse("longkey", rec["files"])
    assert len(fitted) <= budget < len(full) and 2 <= len(fitted.videos[0].indices) < 32
    steps = [loader.next_step() for _ in range(2)]
    assert loader.bad_sample_counts == {}
    n_frames = [int(mb["video_grid_thw"][:, 0].sum()) for s in steps for mb in s]
    assert sum(n_frames) > 0
    doc = loader.encoder.document("longkey", "s", rec["files"], fitted)
    assert doc.video_grid_thw.tolist() == [list(fitted.videos[0].grid)]  # decoded as planned
    skip = VideoProcessor.Config(min_pixels=4 * 32 * 32, max_pixels=64 * 64 * 64, fps=4.0, max_frames=64, too_long="skip")
    with pytest.raises(BadSampleError, match=r"key 'longkey'.*\[too_long\]"):
        _cfg(cache, path, **{**kw, "video": skip}).build(model_facts=FACTS)
    loader = _cfg(cache, path, on_bad_sample="skip", **{**kw, "video": skip}).build(model_facts=FACTS)
    loader.next_step()
    assert loader.bad_sample_counts == {"too_long": 1}


BAD = {  # kind: (members, json); each found from the index alone
    "undecodable": ({"mp4": b"not a video" * 30}, {"text": "<video>bad"}),
    "cut_short": ({"mp4": None}, {"text": "<video>bad"}),  # an mp4 whose index (at its end) is cut off
    "truncated": ({"mp4": None}, {"text": "<video>bad"}),
    "no_frames": ({"mp4": None}, {"text": "<video>bad"}),
    "unsupported_codec": ({"avi": None}, {"text": "<video>bad"}),
    "count_mismatch": ({"mp4": None}, {"text": "<video><video>bad"}),
    "bad_video_names": ({"0.mp4": None, "2.mp4": None}, {"text": "<video><video>bad"}),
}


def _members(kind: str, members: dict) -> dict:
    good = _mp4(6, 32, 32, seed=5)
    streamable = encode_video(_moving_square(6, 32, 32, 5), 4.0, faststart=True)  # index first: the header survives
    make = {"truncated": lambda: streamable[: len(streamable) * 2 // 3], "cut_short": lambda: good[: len(good) * 2 // 3],
            "no_frames": _no_frames,
            "unsupported_codec": lambda: _unsupported_codec(_moving_square(6, 32, 32))}  # fmt: skip
    return {k: (v if v is not None else make.get(kind, lambda: good)()) for k, v in members.items()}


def _corpus_with(tmp_path, members: dict, meta: dict) -> str:
    out = str(tmp_path / "shards")
    with VisionLanguageWriter(out, samples_per_shard=8, validate=False) as w:
        for i in range(3):
            w.write(videos=[_mp4(6, 32, 32, seed=20 + i)], text=f"<video>good {i}.")
        w.write_files({"json": json.dumps(meta).encode(), **members}, key="badkey")
    return out


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_video_is_an_error_naming_shard_and_key_or_a_counted_skip(tmp_path, cache, kind):
    members, meta = BAD[kind]
    path = _corpus_with(tmp_path, _members(kind, members), meta)
    want = "undecodable" if kind in ("truncated", "cut_short") else kind
    kw = dict(max_tokens_per_microbatch=256, global_batch_tokens=0)
    with pytest.raises(BadSampleError, match=rf"shard '.*train-000000\.tar', key 'badkey': .*\[{want}\]"):
        _cfg(cache, path, **kw).build(model_facts=FACTS)
    loader = _cfg(cache, path, on_bad_sample="skip", **kw).build(model_facts=FACTS)
    loader.next_step()
    assert loader.bad_sample_counts == {want: 1} and loader.metrics()["bad_samples_skipped"] == 1.0
    encoder = make_encoder(cached_toy_text(cache).tokenizer_dir, IMAGE, FACTS, video=VIDEO)
    report = check_shards(path, encoder, max_tokens=256)
    assert report["bad"] == {want: 1} and report["samples"] == 3 and report["videos"] == 3


def test_frame_size_change_is_found_when_decoded_under_both_policies(tmp_path, cache):
    """The header cannot show a stream that changes size: decoding stops the run naming shard, key and kind
    (under ``skip`` too, like a broken image body: the global plan is already made), and ``check`` counts it."""
    path = _corpus_with(tmp_path, {"ts": _size_change()}, {"text": "<video>bad"})
    for policy in ("error", "skip"):
        loader = _cfg(cache, path, on_bad_sample=policy, global_batch_tokens=0).build(model_facts=FACTS)
        with pytest.raises(BadSampleError, match=r"key 'badkey': video 'badkey\.ts' frame \d+ is 32x32.*"
                                                 r"\[frame_size_mismatch\].*check --path"):  # fmt: skip
            for _ in range(3):
                loader.next_step()
    report = check_shards(path, make_encoder(cached_toy_text(cache).tokenizer_dir, IMAGE, FACTS, video=VIDEO),
                          max_tokens=256)  # fmt: skip
    assert report["bad"] == {"frame_size_mismatch": 1} and report["samples"] == 3


def test_a_model_without_video_refuses_video_records(tmp_path, cache):
    path = _corpus_with(tmp_path, {"mp4": _mp4(6, 32, 32, 1)}, {"text": "<video>fine"})
    facts = {k: v for k, v in FACTS.items() if k != "video_token_id"}
    with pytest.raises(BadSampleError, match=r"takes no video"):
        _cfg(cache, path, global_batch_tokens=0).build(model_facts=facts)


def test_writer_cli_takes_video_files_and_the_toy_corpus_has_videos(tmp_path, cache):
    folder = cached_toy_text(cache).tokenizer_dir
    (tmp_path / "a.mp4").write_bytes(_mp4(8, 32, 48, 1))
    (tmp_path / "b.png").write_bytes(_png(40, 40, 2))
    rows = [{"videos": ["a.mp4"], "text": "<video>a square moves."},
            {"videos": ["a.mp4"], "images": ["b.png"],
             "messages": [{"role": "user", "content": [{"type": "video"}, {"type": "image"}, {"type": "text", "text": "?"}]},
                          {"role": "assistant", "content": "A square."}]}]  # fmt: skip
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ["--tokenizer", folder, "--image-token-id", "512", "--vision-start-token-id", "513",
             "--vision-end-token-id", "514", "--video-token-id", "515", "--vocab-size", "520",
             "--min-pixels", str(32 * 32), "--max-pixels", str(128 * 128),
             "--video-min-pixels", str(VIDEO.min_pixels), "--video-max-pixels", str(VIDEO.max_pixels)]  # fmt: skip
    out = str(tmp_path / "written")
    assert vl_cli(["write", "--input", str(tmp_path / "in.jsonl"), "--output-dir", out, *flags]) == 0
    assert vl_cli(["check", "--path", out, "--max-tokens", "512", *flags]) == 0
    (tmp_path / "bad.jsonl").write_text(json.dumps({"videos": ["a.mp4"], "text": "no marker"}) + "\n")
    assert vl_cli(["write", "--input", str(tmp_path / "bad.jsonl"), "--output-dir", str(tmp_path / "bad"), *flags]) == 2
    loader = _cfg(cache, out, global_batch_tokens=0, max_tokens_per_microbatch=512).build(model_facts=FACTS)
    mb = loader.next_step()[0]  # the two records, repeated over epochs: every image comes with a video
    n_videos, n_images = mb["video_grid_thw"].shape[0], mb["image_grid_thw"].shape[0]
    assert 0 < n_images < n_videos
    # the embedded toy corpus: videos when the model has a video path; their captions say where the shape moves
    toy = _cfg(cache, max_tokens_per_microbatch=512, global_batch_tokens=1024).build(model_facts=FACTS)
    steps = [toy.next_step() for _ in range(2)]
    assert sum(int(mb["video_grid_thw"].shape[0]) for s in steps for mb in s) > 0
    assert toy.metrics()["tokens/video"] > 0


def test_saved_video_batches_replay_and_are_checked(mixed, cache, tmp_path):
    from hyper_parallel.data import PresetDataLoader

    batches = _cfg(cache, mixed).build(model_facts=FACTS).next_step()
    assert any(mb["video_grid_thw"].numel() for mb in batches)
    torch.save(batches, tmp_path / "v.pt")
    replay = PresetDataLoader.Config(source="preset_pt", path=str(tmp_path / "v.pt")).build(model_facts=FACTS)
    assert first_difference([replay.next_step()], [batches[:1]]) is None
    mb = next(mb for mb in batches if mb["video_grid_thw"].numel())
    torch.save([dict(mb, video_grid_thw=mb["video_grid_thw"] * 2)], tmp_path / "broken.pt")
    with pytest.raises(ValueError, match="pixel_values_videos has .* rows but video_grid_thw covers"):
        PresetDataLoader.Config(source="preset_pt", path=str(tmp_path / "broken.pt")).build(model_facts=FACTS)
