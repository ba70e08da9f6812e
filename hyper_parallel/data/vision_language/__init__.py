"""Vision-language data: images + text in webdataset shards (the ``vision_language`` source).

Format (:mod:`.sample`): per key, ``<key>.json`` with ``{"text": "... <image> ..."}`` or
``{"messages": [{"role", "content": "... <image> ..."}]}`` and its images ``<key>.jpg|jpeg|png|webp``
(one) or ``<key>.0.jpg``, ``<key>.1.png``, ... (several, in marker order). Each ``<image>`` becomes
``vision_start``, ``t*h*w / merge^2`` image tokens, ``vision_end``; pixels are preprocessed exactly
like HF's Qwen2-VL image processor (:mod:`.preprocess`); positions are M-RoPE (:mod:`.mrope`).

Python::

    encoder = make_encoder("/models/Qwen3-VL", ImageProcessor.Config(), model_facts)  # optional
    with VisionLanguageWriter("shards/", encoder=encoder, samples_per_shard=1000) as w:
        w.write([png_bytes], text="<image>A red circle on a blue background.")
        w.write([jpg0, jpg1], messages=[{"role": "user", "content": "<image><image>Compare."}, ...])

Command line::

    python -m hyper_parallel.data.vision_language write --input records.jsonl --output-dir shards \\
        [--image-root imgs] [--samples-per-shard 1000] [--prefix train] [facts: see below]
    python -m hyper_parallel.data.vision_language toy --output-dir shards [--num-samples 1024] [FACTS]
    python -m hyper_parallel.data.vision_language check --path 'shards/*.tar' --max-tokens 4096 FACTS
    python -m hyper_parallel.data.vision_language index --path 'shards/*.tar' FACTS

``FACTS``: ``--tokenizer`` (HF folder; empty = the toy tokenizer), ``--image-token-id``,
``--vision-start-token-id``, ``--vision-end-token-id`` (required by check/index; with them ``write``
and ``toy`` validate exactly as the loader and write each shard's index side file), ``--vocab-size``,
``--patch-size``/``--temporal-patch-size``/``--merge-size`` (16/2/2), ``--min-pixels``/
``--max-pixels``/``--max-input-pixels``. A ``.jsonl`` record is ``{"images": [paths], "text" |
"messages", "key"?, ...}``. Without an index side file (or with one for other facts) the loader
builds the index on first use under ``data.cache_dir``.

**Videos** (:mod:`.video`, :mod:`.media`): ``<key>.mp4`` (or ``<key>.0.mp4``, ``<key>.1.webm``, ...;
mp4/mov, webm/mkv, avi, ts) with ``<video>`` markers or ``{"type": "video"}`` content parts, for a model
with a ``video_token_id`` (``--video-token-id``, ``--video-fps``, ``--video-min-pixels``,
``--video-max-pixels`` on the command line; ``"videos": [paths]`` in a ``.jsonl`` record). Decoded with
PyAV, sampled and preprocessed exactly like HF's Qwen3-VL video processor into ``pixel_values_videos`` /
``video_grid_thw``; the prompt gets HF's per-frame-group timestamps. ``data.video.too_long`` says what
happens to a video longer than the packing budget.
"""

from hyper_parallel.data.vision_language.loader import VisionLanguageDataLoader
from hyper_parallel.data.vision_language.media import VIDEO_MARKER
from hyper_parallel.data.vision_language.mrope import mrope_position_ids
from hyper_parallel.data.vision_language.preprocess import ImageError, ImageProcessor, ProcessedImages, smart_resize
from hyper_parallel.data.vision_language.sample import (
    IMAGE_MARKER,
    VL_BAD_KINDS,
    VL_MODEL_FACTS,
    VisionLanguageCodec,
    VisionLanguageDocument,
    VisionLanguageEncoder,
    collate_vision_language,
    make_encoder,
)
from hyper_parallel.data.vision_language.toy import ToyVisionLanguageSpec, cached_toy_vision_language, make_toy_samples
from hyper_parallel.data.vision_language.video import (
    DecodedVideo,
    ProcessedVideos,
    VideoError,
    VideoProcessor,
    decode_video,
    encode_video,
    video_from_frames,
)
from hyper_parallel.data.vision_language.writer import VisionLanguageWriter, check_shards, read_samples, write_shards

__all__ = [
    "IMAGE_MARKER",
    "VL_BAD_KINDS",
    "VIDEO_MARKER",
    "VL_MODEL_FACTS",
    "DecodedVideo",
    "ImageError",
    "ImageProcessor",
    "ProcessedImages",
    "ProcessedVideos",
    "ToyVisionLanguageSpec",
    "VisionLanguageCodec",
    "VisionLanguageDataLoader",
    "VisionLanguageDocument",
    "VisionLanguageEncoder",
    "VideoError",
    "VideoProcessor",
    "VisionLanguageWriter",
    "cached_toy_vision_language",
    "check_shards",
    "collate_vision_language",
    "decode_video",
    "encode_video",
    "make_encoder",
    "make_toy_samples",
    "mrope_position_ids",
    "read_samples",
    "smart_resize",
    "video_from_frames",
    "write_shards",
]
