"""Videos in vision-language records: members, ``<video>`` markers, their tokens, the too-long policy, pixels.

A record's videos are ``<key>.mp4`` (one) or ``<key>.0.mp4``, ``<key>.1.webm``, ... (several,
numbered ``0..n-1`` among the videos, apart from the images' numbers); the j-th ``<video>`` marker
(or ``{"type": "video"}`` content part) is the j-th video. Extensions: :data:`~.video.VIDEO_EXTENSIONS`.

**Tokens** of a ``<video>`` marker (:meth:`VideoRecords.ids`): ``vision_start``, then per temporal
patch the timestamp text ``<t seconds>`` and ``vision_start``, its ``h*w/m^2`` video tokens,
``vision_end``; then ``vision_end`` -- exactly what HF's ``Qwen3VLProcessor`` writes for the chat
template's ``<|vision_start|><|video_pad|><|vision_end|>`` (``video.hf_vision_markers=False`` drops the
outer pair, as Qwen's original processor did). The frame count, the grid and the timestamps come from
the container header and a packet scan (:meth:`VideoRecords.plan`, no decoding), so the shard index
knows every document's length; the decoder later takes exactly the planned frames.

**Too long** (``video.too_long``): ``fewer_frames`` samples the document's videos more sparsely until
it fits ``data.max_tokens_per_microbatch`` (the index is then built for that budget); ``skip`` leaves
the document ``too_long``.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hyper_parallel.data.bad_samples import BadSample
from hyper_parallel.data.index import load_stats
from hyper_parallel.data.vision_language.video import (
    VIDEO_EXTENSIONS,
    VideoError,
    VideoProcessor,
    decode_video,
    encode_video,
    frame_timestamps,
    probe_video,
    video_placeholder_ids,
)

__all__ = [
    "MEDIA_MARKERS",
    "ModalityCounter",
    "VideoInput",
    "check_videos",
    "encode_video_member",
    "VIDEO_BAD_KINDS",
    "VIDEO_MARKER",
    "VideoPlan",
    "VideoRecords",
    "split_media",
    "video_members",
]

VIDEO_MARKER = "<video>"
"""Where a video goes in the text; the j-th marker is the record's j-th video."""

MEDIA_MARKERS = re.compile(r"(<image>|<video>)")
"""Splits a text at its image and video markers (keeping the markers)."""

VIDEO_BAD_KINDS = ("bad_video_names", "no_frames", "unsupported_codec", "frame_size_mismatch")
"""Bad-record kinds videos add: ``bad_video_names`` (videos not numbered ``0..n-1``), ``no_frames`` (no video
stream or no frame), ``unsupported_codec``, ``frame_size_mismatch``; a corrupt or truncated video is
``undecodable``, a marker count that differs from the videos ``count_mismatch`` (generic kinds)."""


VideoInput = bytes | tuple[np.ndarray, float]
"""A video for the shard writer: a file's bytes (kept as they are), or ``(uint8 frames [t, H, W, 3], fps)``
(encoded as MPEG-4 in mp4)."""

_CONTAINER_EXT = {"mov,mp4,m4a,3gp,3g2,mj2": "mp4", "avi": "avi", "mpegts": "ts"}


def encode_video_member(video: VideoInput) -> tuple[str, bytes]:
    """``(ext, bytes)`` of a video for a shard (raises ``ValueError`` for bytes that are no video we take)."""
    if isinstance(video, tuple):
        frames, fps = video
        return "mp4", encode_video(frames, fps)
    data = bytes(video)
    import av

    try:
        with av.open(io.BytesIO(data)) as c:
            fmt = c.format.name
            codec = c.streams.video[0].codec_context.name if c.streams.video else None
    except av.error.FFmpegError as e:
        raise ValueError(f"video bytes are not a readable video ({type(e).__name__}: {e})") from None
    if codec is None:
        raise ValueError(f"video bytes ({fmt}) hold no video stream")
    if fmt == "matroska,webm":
        return ("webm" if codec in ("vp8", "vp9", "av1") else "mkv"), data
    if fmt not in _CONTAINER_EXT:
        raise ValueError(f"videos must be MP4/MOV, WebM/MKV, AVI or MPEG-TS files, got container {fmt!r}")
    return _CONTAINER_EXT[fmt], data


def check_videos(key: str, files: Mapping[str, bytes], raw: str) -> None:
    """Validation without a tokenizer (the shard writer): video names, ``<video>`` markers in ``raw`` (the text,
    or the messages' contents with parts as markers) vs videos, and every frame of every video decodes at one
    size (raises ``BadSample``)."""
    names = video_members(files)
    if raw.count(VIDEO_MARKER) != len(names):
        raise BadSample("count_mismatch",
                        f"its text has {raw.count(VIDEO_MARKER)} {VIDEO_MARKER} marker(s) or video part(s) but "
                        f"{len(names)} video(s) {names}")  # fmt: skip
    for member in names:
        try:
            decode_video(files[member], f"{key}.{member}")
        except VideoError as e:
            raise BadSample(e.kind, f"video {key}.{member} {e.detail}") from None


def split_media(text: str) -> list[str]:
    """``[text, marker, text, marker, ..., text]`` (markers ``<image>`` / ``<video>`` at odd positions)."""
    return MEDIA_MARKERS.split(text)


def video_members(files: Mapping[str, bytes]) -> list[str]:
    """The member names (extensions) of the record's videos in order (raises ``BadSample``)."""
    single = sorted(e for e in files if e in VIDEO_EXTENSIONS)
    numbered: dict[int, list[str]] = {}
    for e in files:
        head, _, tail = e.partition(".")
        if tail in VIDEO_EXTENSIONS and head.isdigit():
            numbered.setdefault(int(head), []).append(e)
    names = sorted(single + [e for es in numbered.values() for e in es])
    if single and numbered or len(single) > 1:
        detail = f"videos {names}: use <key>.<ext> for one video or <key>.<i>.<ext>, i = 0..n-1"
        raise BadSample("bad_video_names", detail)
    if single:
        return single
    if any(len(es) > 1 for es in numbered.values()) or sorted(numbered) != list(range(len(numbered))):
        detail = f"videos {names} must be numbered 0..n-1 once each (<key>.0.mp4, <key>.1.webm)"
        raise BadSample("bad_video_names", detail)
    return [numbered[i][0] for i in range(len(numbered))]


@dataclass(frozen=True, slots=True)
class VideoPlan:
    """What a video becomes, known from its header: the frames to decode, the grid, the timestamps."""

    member: str
    total_frames: int
    fps: float | None
    indices: tuple[int, ...]
    grid: tuple[int, int, int]
    timestamps: tuple[float, ...]


class VideoRecords:
    """The video half of :class:`~.sample.VisionLanguageEncoder` (picklable; runs in DataLoader workers)."""

    def __init__(
        self,
        processor: VideoProcessor,
        encode: Callable[[Sequence[str]], list[list[int]]],
        *,
        video_token_id: int,
        vision_start_token_id: int,
        vision_end_token_id: int,
        token_budget: int | None = None,
    ) -> None:
        self.processor, self.encode = processor, encode
        self.video_token_id = video_token_id
        self.vision_start_token_id, self.vision_end_token_id = vision_start_token_id, vision_end_token_id
        self.token_budget = token_budget if processor.config.too_long == "fewer_frames" else None

    def index_params(self) -> dict:
        c = self.processor.config
        return {
            "video_token_id": self.video_token_id,
            "video": [c.min_pixels, c.max_pixels, c.fps, c.num_frames, c.min_frames, c.max_frames, c.sample_frames,
                      c.cap_pixels_per_frame, c.max_video_tokens, c.max_input_pixels, c.hf_vision_markers],
            "video_token_budget": self.token_budget,
        }  # fmt: skip

    # -- headers ------------------------------------------------------------------------------
    def plan(self, key: str, member: str, data: bytes, num_frames: int | None = None) -> VideoPlan:
        """Header and packet scan only (raises ``BadSample`` naming the video)."""
        name = f"{key}.{member}"
        p = self.processor
        try:
            meta = probe_video(data, name, count_packets=True)
            indices = p.sample_indices(meta, num_frames)
            grid = p.grid_thw(len(indices), meta.height, meta.width, name)
        except VideoError as e:
            raise BadSample(e.kind, f"video {name!r} {e.detail}") from None
        stamps = frame_timestamps(indices, meta.fps, p.temporal_patch_size)
        return VideoPlan(member, meta.total_num_frames, meta.fps, tuple(indices), grid, tuple(stamps))

    def ids(self, plan: VideoPlan) -> list[int]:
        """The tokens a ``<video>`` marker becomes."""
        inner = video_placeholder_ids(
            plan.grid, plan.timestamps, encode=self.encode, vision_start_token_id=self.vision_start_token_id,
            vision_end_token_id=self.vision_end_token_id, video_token_id=self.video_token_id,
            merge_size=self.processor.merge_size,
        )  # fmt: skip
        if self.processor.config.hf_vision_markers:
            return [self.vision_start_token_id, *inner, self.vision_end_token_id]
        return inner

    def fit(self, key: str, files: Mapping[str, bytes], plans: list[VideoPlan], other_tokens: int) -> list[VideoPlan]:
        """``too_long=fewer_frames``: fewer frames (longest video first) until ``other_tokens`` + the videos fit."""
        if self.token_budget is None or not plans:
            return plans
        T = self.processor.temporal_patch_size
        lengths = [len(self.ids(p)) for p in plans]
        while other_tokens + sum(lengths) > self.token_budget:
            candidates = [i for i, p in enumerate(plans) if len(p.indices) > T]
            if not candidates:
                break  # at the fewest frames: the document stays too long
            i = max(candidates, key=lambda j: lengths[j])
            n = len(plans[i].indices)
            plans[i] = self.plan(key, plans[i].member, files[plans[i].member], num_frames=max(T, n - (n % T or T)))
            lengths[i] = len(self.ids(plans[i]))
        return plans

    # -- pixels -------------------------------------------------------------------------------
    def pixels(
        self, key: str, files: Mapping[str, bytes], plans: Sequence[VideoPlan]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values_videos, video_grid_thw)`` of the planned frames (raises ``BadSample``)."""
        p = self.processor
        rows, grids = [], []
        for plan in plans:
            name = f"{key}.{plan.member}"
            try:
                video = decode_video(files[plan.member], name, lambda _meta, plan=plan: list(plan.indices))
                r, grid, _ = p.process(video, name)
            except VideoError as e:
                raise BadSample(e.kind, f"video {name!r} {e.detail}") from None
            if grid != plan.grid:
                raise BadSample(
                    "frame_size_mismatch",
                    f"video {name!r} decodes to grid {grid} but its header says {plan.grid} (its frames are "
                    f"{video.frames.shape[2]}x{video.frames.shape[1]}, the header another size)",
                )
            rows.append(r)
            grids.append(grid)
        pixels = torch.cat(rows) if rows else torch.zeros(0, p.patch_dim)
        return pixels, torch.tensor(grids, dtype=torch.int64).view(-1, 3)


def empty_video_inputs(patch_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values_videos [0, P], video_grid_thw [0, 3])`` of a document without videos."""
    return torch.zeros(0, patch_dim), torch.zeros(0, 3, dtype=torch.int64)


def video_token_counts(grids: np.ndarray, merge_size: int) -> int:
    """Video tokens of ``video_grid_thw`` rows."""
    g = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    return int(g.prod(axis=1).sum()) // (merge_size * merge_size)


class ModalityCounter:
    """Text / image / video tokens of a whole global step, from the shard indexes (no communication).

    The plan is global, so every rank counts every micro-batch of the step the same way: the counts
    are the same on every rank and for every layout, like the bad-sample counts. Timestamps and
    vision markers count as text; padding is not counted.
    """

    def __init__(self, merge_size: int) -> None:
        self.m2 = merge_size * merge_size
        self._stats: dict[int, dict[str, np.ndarray]] = {}
        self.last: dict[str, float] = {}

    def _shard(self, table, shard: int) -> dict[str, np.ndarray]:  # noqa: ANN001 - a ShardTable
        stats = self._stats.get(shard)
        if stats is None:
            stats = load_stats(table.shards[shard].index_path, table.spec)
            self._stats[shard] = {k: stats[k] for k in ("length", "patches", "video_patches")}
            stats = self._stats[shard]
        return stats

    def count(self, table, bins: Sequence[Sequence[tuple[int, int, int]]]) -> dict[str, float]:  # noqa: ANN001
        """``tokens/text``, ``tokens/image``, ``tokens/video`` of the records in ``bins`` (a step's micro-batches)."""
        text = image = video = 0
        for refs in bins:
            for shard, record, _piece in refs:
                s = self._shard(table, shard)
                i, v = int(s["patches"][record]) // self.m2, int(s["video_patches"][record]) // self.m2
                image, video, text = image + i, video + v, text + int(s["length"][record]) - i - v
        self.last = {"tokens/text": float(text), "tokens/image": float(image), "tokens/video": float(video)}
        return self.last
