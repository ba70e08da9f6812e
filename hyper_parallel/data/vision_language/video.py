"""Video for Qwen3-VL / Qwen3.5 vision towers: decode, sample frames, preprocess, expand the prompt, exactly as HF.

**Decoding** uses PyAV (``av`` on PyPI): its wheels bundle FFmpeg (H.264, HEVC, VP8/9, AV1, MPEG-4, ...)
for every platform, so ``pip install`` is the whole set-up; it is maintained, and it is one of the two
decoders HF's video utilities call (``load_video(backend="pyav")``). torchcodec would need an FFmpeg
installed on the system and a torch of its own release line; decord is unmaintained. We read the
frames the way HF's PyAV backend does: ``total_num_frames`` is the stream's frame count and ``fps``
its average rate (:func:`probe_video`, header only, which is how the shard index counts a video's
tokens without decoding it), frames are decoded in order up to the last sampled index and only the
sampled ones are converted to RGB (``to_ndarray(format="rgb24")``).

**Sampling** (:meth:`VideoProcessor.sample_indices`) equals HF's ``Qwen3VLVideoProcessor.sample_frames``:
``fps`` frames per second of video (``int(total / video_fps * fps)``, clamped to ``[min_frames,
max_frames]`` and to the frame count), or exactly ``num_frames``; indices are ``linspace(0, total - 1,
n).round()``. A list of pre-extracted frames is a video too (:func:`video_from_frames`), sampled the same
way when ``sample_frames`` is set.

**Preprocessing** (:meth:`VideoProcessor.__call__`) equals HF's ``Qwen3VLVideoProcessor`` (torchvision backend,
the only one HF has for video) bit for bit:

1. the video's size is fitted with the *video* ``smart_resize``: ``(t, H, W)`` with H, W multiples of
   ``patch * merge`` and ``t * H * W`` inside ``[min_pixels, max_pixels]`` (a budget over all frames,
   HF ``size["shortest_edge"/"longest_edge"]``; optionally capped per frame, ``cap_pixels_per_frame``);
2. every frame is resized with torchvision's kernel: ``F.interpolate(bicubic, antialias=True)`` on uint8
   (native uint8 on CPU; float, clamp and round elsewhere, as torchvision does);
3. ``(x - mean / rescale) / (std / rescale)`` in float32 (HF's fused rescale + normalise), done as a table
   lookup per uint8 value, which gives the same float32 values;
4. the frame count is padded to a multiple of ``temporal_patch_size`` by repeating the last frame, and the
   patches are laid out like images: ``(t/T, H/p/m, W/p/m, m, m)`` rows of ``(C, T, p, p)`` values.

``video_grid_thw`` is ``(t/T, H/p, W/p)``. **The prompt** (:func:`video_placeholder_ids`) is HF's
``Qwen3VLProcessor.replace_video_token``: per temporal patch, the text ``<{t:.1f} seconds>`` (the mean
time of its first and last frame) then ``vision_start``, ``H*W/(p*m)^2`` video tokens, ``vision_end``.
"""

from __future__ import annotations

import fractions
import io
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from hyper_parallel.config.configurable import Configurable
from hyper_parallel.data.vision_language.preprocess import MediaError

__all__ = [
    "VIDEO_ERROR_KINDS",
    "VIDEO_EXTENSIONS",
    "DecodedVideo",
    "ProcessedVideos",
    "VideoError",
    "VideoMetadata",
    "VideoProcessor",
    "decode_video",
    "encode_video",
    "frame_timestamps",
    "probe_video",
    "video_from_frames",
    "video_placeholder_ids",
    "video_smart_resize",
]

VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "mov", "avi", "ts")
"""Member extensions that are videos (``<key>.mp4`` or ``<key>.<i>.mp4``)."""

VIDEO_ERROR_KINDS = (
    "undecodable",
    "no_frames",
    "unsupported_codec",
    "frame_size_mismatch",
    "too_many_pixels",
    "aspect_ratio",
)
"""Every way a video can be rejected (``VideoError.kind``): ``undecodable`` (corrupt or truncated),
``no_frames`` (no video stream, or zero decodable frames), ``unsupported_codec`` (the bundled FFmpeg has
no decoder for it), ``frame_size_mismatch`` (frames of different sizes), ``too_many_pixels`` (a frame
over ``max_input_pixels``), ``aspect_ratio`` (over 200, HF's limit)."""

MAX_ASPECT_RATIO = 200


class VideoError(MediaError):
    """A video that cannot be used; ``kind`` is one of ``VIDEO_ERROR_KINDS``."""

    noun = "video"
    kinds = VIDEO_ERROR_KINDS


@dataclass(slots=True)
class VideoMetadata:
    """What the sampler and the timestamps need (HF ``VideoMetadata``)."""

    total_num_frames: int
    """Frames in the video (the stream's count for a file, the list's length for frames)."""
    fps: float | None
    """Frames per second of the source (None: unknown; sampling and timestamps then assume 24, as HF)."""
    height: int
    width: int
    frames_indices: list[int] | None = None
    """Indices of the frames kept (set by the sampler)."""


@dataclass(slots=True)
class DecodedVideo:
    """uint8 RGB frames ``[t, H, W, 3]`` and the metadata they came with."""

    frames: np.ndarray
    metadata: VideoMetadata


@dataclass(frozen=True, slots=True)
class ProcessedVideos:
    """The vision tower's inputs for a list of videos (HF ``pixel_values_videos`` / ``video_grid_thw``)."""

    pixel_values_videos: torch.Tensor
    """float32 ``[sum t*h*w, C*T*p*p]``: every video's patches, video after video."""
    video_grid_thw: torch.Tensor
    """int64 ``[n_videos, 3]``: ``(t, h, w)`` in patches (``t`` temporal patches of T frames)."""
    timestamps: list[list[float]]
    """Per video, the time in seconds of each temporal patch (what the prompt shows)."""


# -- decoding (PyAV) --------------------------------------------------------------------------------
def _av():
    try:
        import av
    except ImportError as e:  # pragma: no cover - av is a dependency of the package
        raise ImportError("video decoding needs PyAV: pip install av") from e
    return av


def _open(data: bytes, name: str):
    av = _av()
    if not data:
        raise VideoError(name, "no_frames", "is an empty file (0 bytes)")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except av.error.FFmpegError as e:
        raise VideoError(name, "undecodable", f"cannot be opened ({type(e).__name__}: {e})") from None
    if not container.streams.video:
        container.close()
        raise VideoError(name, "no_frames", "has no video stream")
    stream = container.streams.video[0]
    codec = getattr(stream.codec_context, "codec", None)
    if codec is None or not getattr(codec, "is_decoder", True) or stream.codec_context.name in (None, "", "none"):
        tag = getattr(stream.codec_context, "codec_tag", "?")
        container.close()
        raise VideoError(name, "unsupported_codec", f"its codec (tag {tag!r}) has no decoder in the bundled FFmpeg")
    return container, stream


def probe_video(data: bytes, name: str = "video", *, count_packets: bool = False) -> VideoMetadata:
    """Header only: frame count (counted from the packets when the container does not state it), fps and size.

    ``count_packets`` also demuxes (no decoding) every packet of the stream: a file cut short holds
    fewer than its header says, an ``undecodable`` video (the shard index checks this)."""
    container, stream = _open(data, name)
    try:
        total = int(stream.frames or 0)
        packets = sum(1 for packet in container.demux(stream) if packet.size) if count_packets or not total else -1
        if total == 0:  # e.g. webm/mkv state no frame count: the packets say it (no decoding)
            total = packets
        elif 0 <= packets < total:
            detail = f"is truncated: its header says {total} frames but it holds {packets}"
            raise VideoError(name, "undecodable", detail)
        rate = stream.average_rate
        fps = float(rate) if rate else None
        height, width = int(stream.codec_context.height), int(stream.codec_context.width)
    except _av().error.FFmpegError as e:
        raise VideoError(name, "undecodable", f"cannot be read ({type(e).__name__}: {e})") from None
    finally:
        container.close()
    if total <= 0:
        raise VideoError(name, "no_frames", "its video stream holds no frame")
    if height <= 0 or width <= 0:
        raise VideoError(name, "no_frames", f"its video stream has size {width}x{height}")
    return VideoMetadata(total_num_frames=total, fps=fps, height=height, width=width)


def decode_video(
    data: bytes, name: str = "video", indices: Callable[[VideoMetadata], Sequence[int]] | None = None
) -> DecodedVideo:
    """Decode the frames ``indices(metadata)`` chooses (every frame without ``indices``), like HF's PyAV reader.

    Raises :class:`VideoError` naming ``name``: corrupt or truncated (fewer frames than the header
    says, as far as the sampled ones), no frames, an unsupported codec, frames of different sizes.
    """
    av = _av()
    metadata = probe_video(data, name)
    wanted = list(range(metadata.total_num_frames)) if indices is None else [int(i) for i in indices(metadata)]
    if not wanted:
        raise VideoError(name, "no_frames", "the sampler chose no frame")
    metadata.frames_indices = wanted
    need = set(wanted)
    last = max(wanted)
    kept: dict[int, np.ndarray] = {}
    container, stream = _open(data, name)
    # Frame/slice threads of FFmpeg's decoders are bit-exact: the same frames, decoded on every core.
    stream.codec_context.thread_type = "AUTO"
    decoded = 0
    size = None
    try:
        for i, frame in enumerate(container.decode(stream)):
            decoded = i + 1
            if size is None:
                size = (frame.height, frame.width)
            elif (frame.height, frame.width) != size:
                raise VideoError(
                    name, "frame_size_mismatch",
                    f"frame {i} is {frame.width}x{frame.height} but frame 0 is {size[1]}x{size[0]} (the stream changes "
                    "size); one video has one frame size",
                )  # fmt: skip
            if i in need:
                kept[i] = frame.to_ndarray(format="rgb24")
            if i >= last:
                break
    except av.error.FFmpegError as e:
        raise VideoError(
            name, "undecodable", f"is corrupt: decoding failed after {decoded} frame(s) ({type(e).__name__}: {e})"
        ) from None
    finally:
        container.close()
    if decoded == 0:
        raise VideoError(name, "no_frames", f"no frame decodes (the header says {metadata.total_num_frames})")
    if len(kept) < len(need):
        raise VideoError(
            name, "undecodable",
            f"is truncated: its header says {metadata.total_num_frames} frames but only {decoded} decode "
            f"(frame {last} was sampled)",
        )  # fmt: skip
    frames = [kept[i] for i in wanted]
    _check_same_size(frames, name, where="decoded frames")
    return DecodedVideo(np.stack(frames), metadata)


def encode_video(frames: np.ndarray | Sequence[np.ndarray], fps: float, *, codec: str = "mpeg4",
                 container_format: str = "mp4", quality: int = 2, faststart: bool = False) -> bytes:  # fmt: skip
    """Encode uint8 RGB frames ``[t, H, W, 3]`` (even H and W) as a video file's bytes (the toy corpus, tests).

    ``mpeg4`` is FFmpeg's own encoder, present in every PyAV build; ``quality`` is its ``qscale`` (2 = best).
    ``faststart`` writes an mp4's index before its data (web-streamable files).
    """
    av = _av()
    frames = [np.ascontiguousarray(f, dtype=np.uint8) for f in frames]
    if not frames:
        raise ValueError("encode_video: no frames")
    h, w = frames[0].shape[:2]
    if h % 2 or w % 2:
        raise ValueError(f"encode_video: frame size {w}x{h} must be even (yuv420p)")
    if faststart:  # the muxer rewrites the file to move the index first: it needs a real file
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"video.{container_format}")
            _mux(av, path, frames, fps, codec, container_format, quality, {"movflags": "faststart"})
            with open(path, "rb") as f:
                return f.read()
    buf = io.BytesIO()
    _mux(av, buf, frames, fps, codec, container_format, quality, {})
    return buf.getvalue()


def _mux(av, target, frames, fps, codec, container_format, quality, options) -> None:  # noqa: ANN001
    h, w = frames[0].shape[:2]
    with av.open(target, mode="w", format=container_format, options=options) as out:
        rate = fractions.Fraction(fps).limit_denominator(1001)
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        if codec == "mpeg4":
            stream.codec_context.qscale = quality
            stream.codec_context.flags |= av.codec.context.Flags.qscale
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def _check_same_size(frames: Sequence[np.ndarray], name: str, where: str) -> None:
    sizes = {f.shape[:2] for f in frames}
    if len(sizes) > 1:
        raise VideoError(
            name, "frame_size_mismatch",
            f"its {where} have different sizes {sorted(sizes)} (height, width); one video has one frame size",
        )  # fmt: skip


def video_from_frames(
    frames: Sequence[Image.Image | np.ndarray], *, fps: float | None = None, name: str = "video"
) -> DecodedVideo:
    """A video given as pre-extracted frames (PIL images or ``[H, W, 3]`` uint8 arrays), in order.

    ``fps`` is the rate of the frames as given (None: unknown, HF then assumes 24 for timestamps).
    """
    if not len(frames):
        raise VideoError(name, "no_frames", "is an empty list of frames")
    arrays = []
    for i, f in enumerate(frames):
        if isinstance(f, Image.Image):
            f = np.asarray(f.convert("RGB"))
        f = np.asarray(f)
        if f.dtype != np.uint8 or f.ndim != 3 or f.shape[2] != 3:
            raise VideoError(
                name, "undecodable", f"frame {i} must be RGB uint8 [H, W, 3], got {f.dtype} {tuple(f.shape)}"
            )
        arrays.append(f)
    _check_same_size(arrays, name, where="frames")
    h, w = arrays[0].shape[:2]
    meta = VideoMetadata(total_num_frames=len(arrays), fps=fps, height=h, width=w,
                         frames_indices=list(range(len(arrays))))  # fmt: skip
    return DecodedVideo(np.stack(arrays), meta)


# -- sizes ------------------------------------------------------------------------------------------
def video_smart_resize(num_frames: int, height: int, width: int, *, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int, name: str = "video") -> tuple[int, int]:  # fmt: skip
    """HF's video ``smart_resize``: ``(H, W)`` multiples of ``factor`` with ``t * H * W`` in ``[min, max]_pixels``."""
    if num_frames < temporal_factor:  # HF raises; a caller pads the frames first (see VideoProcessor)
        raise ValueError(f"{name}: {num_frames} frame(s) < temporal patch size {temporal_factor}")
    if height <= 0 or width <= 0:
        raise VideoError(name, "no_frames", f"has frames of size {width}x{height}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise VideoError(
            name, "aspect_ratio",
            f"frame size {width}x{height} has aspect ratio {max(height, width) / min(height, width):.1f} > "
            f"{MAX_ASPECT_RATIO} (HF's limit)",
        )  # fmt: skip
    # Python's round() and HF's float order of operations, so the sizes agree exactly.
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_timestamps(indices: Sequence[int], fps: float | None, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame's time (HF ``_calculate_timestamps``)."""
    fps = 24.0 if fps is None else fps
    idx = [int(i) for i in indices]
    if len(idx) % temporal_patch_size:
        idx += [idx[-1]] * (temporal_patch_size - len(idx) % temporal_patch_size)
    times = [i / fps for i in idx]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def video_placeholder_ids(
    grid_thw: Sequence[int], timestamps: Sequence[float], *, encode: Callable[[Sequence[str]], list[list[int]]],
    vision_start_token_id: int, vision_end_token_id: int, video_token_id: int, merge_size: int,
) -> list[int]:  # fmt: skip
    """Token ids of one video in the prompt: per temporal patch ``<{t:.1f} seconds>`` (tokenised by
    ``encode``, a batch tokeniser without special tokens), ``vision_start``, its video tokens, ``vision_end``."""
    t, h, w = (int(v) for v in grid_thw)
    if len(timestamps) != t:
        raise ValueError(f"{len(timestamps)} timestamps for a video grid of {t} temporal patches")
    per_frame = h * w // (merge_size * merge_size)
    texts = encode([f"<{ts:.1f} seconds>" for ts in timestamps])
    ids: list[int] = []
    for text in texts:
        ids += text
        ids.append(vision_start_token_id)
        ids += [video_token_id] * per_frame
        ids.append(vision_end_token_id)
    return ids


# -- the processor ----------------------------------------------------------------------------------
class VideoProcessor(Configurable):
    """Sample, resize, normalise and patchify videos exactly like HF's ``Qwen3VLVideoProcessor``.

    ``build(patch_size=, temporal_patch_size=, merge_size=)`` with the vision tower's sizes.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        min_pixels: int = 128 * 32 * 32
        """Smallest resized ``frames x H x W`` (HF video ``size["shortest_edge"]``; its class default)."""
        max_pixels: int = 768 * 32 * 32
        """Largest resized ``frames x H x W``: the budget of the whole clip (HF video ``size["longest_edge"]``)."""
        fps: float = 2.0
        """Frames sampled per second of video (HF ``fps``); 0 = use ``num_frames``."""
        num_frames: int = 0
        """Sample exactly this many frames (HF ``num_frames``; needs ``fps=0``); 0 = sample by ``fps``."""
        min_frames: int = 4
        """Fewest frames sampled by ``fps`` (HF ``min_frames``)."""
        max_frames: int = 768
        """Most frames sampled by ``fps`` (HF ``max_frames``)."""
        sample_frames: bool = True
        """Sample frames (HF ``do_sample_frames``); False keeps every decoded frame / every given frame."""
        cap_pixels_per_frame: bool = False
        """HF ``cap_pixels_per_frame`` (qwen-vl-utils' per-frame cap, see ``max_video_tokens``)."""
        max_video_tokens: int = 768
        """Per-frame token ceiling of ``cap_pixels_per_frame`` (HF ``max_video_tokens``)."""
        image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
        """Per-channel mean (HF video ``image_mean``)."""
        image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
        """Per-channel std (HF video ``image_std``)."""
        rescale_factor: float = 1 / 255
        """Multiplies uint8 values (fused into mean/std as HF does)."""
        resample: Literal["bicubic", "bilinear"] = "bicubic"
        """Interpolation of torchvision's antialiased resize (HF: bicubic)."""
        max_input_pixels: int = 89_478_485
        """Reject videos whose frames are larger than this many pixels (before decoding them)."""
        too_long: Literal["fewer_frames", "skip"] = "fewer_frames"
        """A document longer than ``data.max_tokens_per_microbatch`` because of its videos: ``fewer_frames``
        samples its videos more sparsely (``temporal_patch_size`` frames less per try, longest video first)
        until it fits; ``skip`` leaves it ``too_long`` (skipped and counted, or an error, per
        ``data.on_bad_sample``). A document that does not fit even at the fewest frames is ``too_long``."""
        hf_vision_markers: bool = True
        """Keep ``vision_start``/``vision_end`` around the frame groups of a ``<video>`` marker, as HF transformers
        5.x's ``Qwen3VLProcessor`` writes the Qwen3-VL chat template's ``<|vision_start|><|video_pad|>
        <|vision_end|>``; False writes only the frame groups, as Qwen's original processor (transformers 4.57,
        qwen-vl-utils) replaced the three tokens."""

    def __init__(self, config: Config, *, patch_size: int, temporal_patch_size: int, merge_size: int) -> None:
        super().__init__(config)
        c = config
        if len(c.image_mean) != 3 or len(c.image_std) != 3:
            raise ValueError(
                f"VideoProcessor.Config.image_mean/image_std need 3 values, got {c.image_mean} / {c.image_std}"
            )
        if not 0 < c.min_pixels <= c.max_pixels:
            raise ValueError(
                f"VideoProcessor.Config: need 0 < min_pixels ({c.min_pixels}) <= max_pixels ({c.max_pixels})"
            )
        if (c.fps > 0) == (c.num_frames > 0) and c.sample_frames:
            raise ValueError(
                f"VideoProcessor.Config: set exactly one of fps ({c.fps}) and num_frames ({c.num_frames}) to sample by"
            )
        if not 1 <= c.min_frames <= c.max_frames:
            raise ValueError(
                f"VideoProcessor.Config: need 1 <= min_frames ({c.min_frames}) <= max_frames ({c.max_frames})"
            )
        self.patch_size, self.temporal_patch_size, self.merge_size = patch_size, temporal_patch_size, merge_size
        self.factor = patch_size * merge_size
        self.patch_dim = 3 * temporal_patch_size * patch_size * patch_size
        # HF fuses rescale into normalise: mean' = tensor(mean) * (1 / rescale), std' likewise, then
        # (x.float() - mean') / std' in float32. Every uint8 value through the same ops = the same float32.
        mean = torch.tensor(c.image_mean) * (1.0 / c.rescale_factor)
        std = torch.tensor(c.image_std) * (1.0 / c.rescale_factor)
        values = torch.arange(256, dtype=torch.float32)
        self._lut = ((values[None, :] - mean[:, None]) / std[:, None]).numpy()  # [3, 256] float32

    # --- sampling and sizes (no pixels) ---------------------------------------------------------------
    def sample_indices(self, metadata: VideoMetadata, num_frames: int | None = None) -> list[int]:
        """Frame indices to keep (HF ``sample_frames``); every frame when ``sample_frames`` is off.

        ``num_frames`` overrides the settings (at most the frame count): the packing policy
        ``too_long=fewer_frames`` samples a long video more sparsely this way."""
        c = self.config
        total = metadata.total_num_frames
        if num_frames is not None:
            return np.linspace(0, total - 1, min(num_frames, total)).round().astype(int).tolist()
        if not c.sample_frames:
            return list(range(total))
        if c.num_frames > 0:
            n = c.num_frames
        else:
            video_fps = metadata.fps if metadata.fps is not None else 24.0
            n = int(total / video_fps * c.fps)
            n = min(max(n, c.min_frames), c.max_frames, total)
        return np.linspace(0, total - 1, n).round().astype(int).tolist()

    def _max_pixels(self, num_frames: int) -> int:
        c = self.config
        if not c.cap_pixels_per_frame:
            return c.max_pixels
        per_frame = max(min(c.max_video_tokens * self.factor * self.factor, c.max_pixels // num_frames),
                        int(c.min_pixels * 1.05))  # fmt: skip
        return per_frame * num_frames

    def target_size(self, num_frames: int, height: int, width: int, name: str = "video") -> tuple[int, int]:
        """Resized ``(H, W)`` of ``num_frames`` sampled frames of ``height x width`` pixels."""
        if height * width > self.config.max_input_pixels:
            raise VideoError(
                name, "too_many_pixels",
                f"has {width}x{height} = {width * height} pixels per frame > VideoProcessor.Config.max_input_pixels="
                f"{self.config.max_input_pixels}",
            )  # fmt: skip
        if num_frames < self.temporal_patch_size:
            raise VideoError(
                name, "no_frames",
                f"has {num_frames} sampled frame(s), fewer than the temporal patch size {self.temporal_patch_size} "
                "(HF refuses it too); sample more frames (fps / num_frames / min_frames)",
            )  # fmt: skip
        c = self.config
        return video_smart_resize(num_frames, height, width, temporal_factor=self.temporal_patch_size,
                                  factor=self.factor, min_pixels=c.min_pixels,
                                  max_pixels=self._max_pixels(num_frames), name=name)  # fmt: skip

    def grid_thw(self, num_frames: int, height: int, width: int, name: str = "video") -> tuple[int, int, int]:
        """``(t, h, w)`` patch grid of ``num_frames`` sampled frames (``t`` = frames padded to ``T``, over ``T``)."""
        h, w = self.target_size(num_frames, height, width, name)
        t = -(-num_frames // self.temporal_patch_size)
        return t, h // self.patch_size, w // self.patch_size

    def plan(self, metadata: VideoMetadata, name: str = "video") -> tuple[list[int], tuple[int, int, int]]:
        """``(sampled indices, grid)`` from the metadata alone (what the shard index counts)."""
        indices = self.sample_indices(metadata)
        return indices, self.grid_thw(len(indices), metadata.height, metadata.width, name)

    def num_tokens(self, grid: Sequence[int]) -> int:
        """Video tokens of a grid (``t*h*w / m^2``; the timestamps and markers come on top)."""
        t, h, w = grid
        return t * h * w // (self.merge_size * self.merge_size)

    # --- pixels ----------------------------------------------------------------------------------------
    def decode(self, data: bytes, name: str = "video") -> DecodedVideo:
        """Decode only the frames the sampler keeps (raises :class:`VideoError`)."""
        meta = probe_video(data, name)
        if meta.height * meta.width > self.config.max_input_pixels:
            self.target_size(self.temporal_patch_size, meta.height, meta.width, name)  # raises too_many_pixels
        return decode_video(data, name, self.sample_indices)

    def select(self, video: DecodedVideo) -> DecodedVideo:
        """Sample a video given as all its frames (pre-extracted frames): HF samples arrays the same way."""
        indices = self.sample_indices(video.metadata)
        meta = VideoMetadata(video.metadata.total_num_frames, video.metadata.fps, video.metadata.height,
                             video.metadata.width, frames_indices=indices)  # fmt: skip
        return DecodedVideo(video.frames[indices], meta)

    def resize(self, frames: np.ndarray, name: str = "video") -> torch.Tensor:
        """uint8 ``[t, H, W, 3]`` -> uint8 ``[t, 3, H', W']`` with torchvision's antialiased resize."""
        t, height, width, _ = frames.shape
        h, w = self.target_size(t, height, width, name)
        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
        if (h, w) == (height, width):
            return x
        mode = self.config.resample
        if x.device.type == "cpu":  # torchvision resizes uint8 natively on CPU (bicubic/bilinear AA kernels)
            return F.interpolate(x, size=[h, w], mode=mode, align_corners=False, antialias=True)
        y = F.interpolate(x.float(), size=[h, w], mode=mode, align_corners=False, antialias=True)
        return y.clamp_(0, 255).round_().to(torch.uint8)

    def patchify(
        self, resized: torch.Tensor, out: np.ndarray | None = None
    ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """uint8 ``[t, 3, H, W]`` -> float32 ``[t/T * H/p * W/p, 3*T*p*p]`` (the last frame repeated up to a
        multiple of T) and the grid ``(t/T, H/p, W/p)``."""
        p, m, T = self.patch_size, self.merge_size, self.temporal_patch_size
        x = resized.numpy()
        if pad := -x.shape[0] % T:
            x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
        t, C, H, W = x.shape
        gt, gh, gw = t // T, H // p, W // p
        # [gt, T, C, gh/m, m, p, gw/m, m, p] -> [gt, gh/m, gw/m, m, m, C, T, p, p]: HF's patch order, still uint8
        blocks = x.reshape(gt, T, C, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        blocks = np.ascontiguousarray(blocks).reshape(gt * gh * gw, C, T * p * p)
        n = blocks.shape[0]
        if out is None:
            out = np.empty((n, self.patch_dim), dtype=np.float32)
        rows = out.reshape(n, C, T * p * p)
        for c in range(C):
            np.take(self._lut[c], blocks[:, c], out=rows[:, c], mode="clip")
        return torch.from_numpy(out), (gt, gh, gw)

    def process(
        self, video: DecodedVideo, name: str = "video"
    ) -> tuple[torch.Tensor, tuple[int, int, int], list[float]]:
        """One decoded (already sampled) video -> ``(pixel rows, (t, h, w), timestamps)``."""
        rows, grid = self.patchify(self.resize(video.frames, name))
        meta = video.metadata
        indices = meta.frames_indices if meta.frames_indices is not None else list(range(len(video.frames)))
        return rows, grid, frame_timestamps(indices, meta.fps, self.temporal_patch_size)

    def __call__(self, videos: Sequence[DecodedVideo | bytes], names: Sequence[str] | None = None) -> ProcessedVideos:
        """Videos (encoded bytes, decoded and sampled here, or :class:`DecodedVideo` as given) -> HF's outputs."""
        if names is not None and len(names) != len(videos):
            raise ValueError(f"got {len(videos)} videos but {len(names)} names")
        rows, grids, stamps = [], [], []
        for i, v in enumerate(videos):
            name = names[i] if names is not None else f"#{i}"
            if isinstance(v, (bytes, bytearray, memoryview)):
                v = self.decode(bytes(v), name)
            r, g, ts = self.process(v, name)
            rows.append(r)
            grids.append(g)
            stamps.append(ts)
        pixels = torch.cat(rows) if rows else torch.zeros(0, self.patch_dim)
        return ProcessedVideos(pixels, torch.tensor(grids, dtype=torch.int64).view(-1, 3), stamps)
