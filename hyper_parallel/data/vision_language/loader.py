"""``VisionLanguageDataLoader``: the ``vision_language`` source (images + text in webdataset shards).

Model facts (:data:`~.sample.VL_MODEL_FACTS`): ``vocab_size``, ``image_token_id``,
``vision_start_token_id``, ``vision_end_token_id`` and the vision tower's ``patch_size``,
``temporal_patch_size``, ``merge_size``; a missing one is an error naming it.

Everything else is the shared shard machinery (:mod:`hyper_parallel.data.sharded`): the index of
each shard holds every record's length with its images expanded (from the image headers, see
:mod:`.sample`), so the global plan, and with it the data order, the packing and the resume, is
the same for every DP degree and worker count. Images are decoded and preprocessed (exactly HF's
Qwen2-VL processor, :mod:`.preprocess`) by the rank that reads the record, in its DataLoader
workers when ``data.num_workers > 0``.

**Budget.** ``max_tokens_per_microbatch`` counts the expanded tokens, image tokens included.
That also bounds the vision tower's work: a micro-batch holds at most ``merge_size^2 x
max_tokens_per_microbatch`` patches (every image token is ``merge_size^2`` patches), so there is no
separate pixel budget; ``image.max_pixels`` caps a single image (larger ones are resized down, as
HF does), and a document whose images alone exceed the budget is a ``too_long`` bad sample.

An empty ``data.path`` uses the embedded toy corpus (:mod:`.toy`; with ``data.chat.loss_on=assistant`` its
all-conversation variant, in transformers' content-list form) with the toy text tokenizer;
otherwise ``data.tokenizer`` must name the model's tokenizer folder.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import numpy as np

from hyper_parallel.data.base import BaseDataLoader
from hyper_parallel.data.index import IndexSpec
from hyper_parallel.data.shards import resolve_shards
from hyper_parallel.data.sharded import ShardedDataLoader
from hyper_parallel.data.vision_language.media import ModalityCounter
from hyper_parallel.data.vision_language.preprocess import ImageProcessor
from hyper_parallel.data.vision_language.sample import (
    VL_BAD_KINDS,
    VL_MODEL_FACTS,
    VisionLanguageCodec,
    make_encoder,
    vl_classify,
)
from hyper_parallel.data.vision_language.video import VideoProcessor

__all__ = ["VisionLanguageDataLoader"]

TOY_VIDEO_FRACTION = 0.2
"""Share of toy samples that are videos when the model has a video path."""


class VisionLanguageDataLoader(ShardedDataLoader):
    """Vision-language shards (or the embedded toy corpus when ``data.path`` is empty) for one DP rank.

    Micro-batches: ``input_ids``, ``labels`` ``[1, T]``, ``position_ids`` ``[3, 1, T]`` (M-RoPE),
    ``cu_seqlens``, ``max_seqlen``, ``pixel_values`` float32 ``[N_patches, 3*T*p*p]`` and
    ``image_grid_thw`` int64 ``[n_images, 3]`` (both empty when no document has an image).
    """

    source: ClassVar[str] = "vision_language"
    bad_kinds = VL_BAD_KINDS

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        source: Literal["direct_token", "text", "vision_language", "preset_pt", "dummy"] = "vision_language"
        """`direct_token`: VQ image+text webdataset shards (docs/design.md section 5); `text`: pre-tokenised shards or raw jsonl/parquet/arrow files; `vision_language`: images + text webdataset shards; `preset_pt`: replay a torch.save'd list of micro-batches; `dummy`: random tokens (smoke runs, benchmarks)."""
        image: ImageProcessor.Config = field(default_factory=ImageProcessor.Config)
        """vision_language: image preprocessing (HF Qwen2-VL processor settings: min/max pixels, mean/std, resampling); patch, temporal patch and merge sizes come from the model."""
        video: VideoProcessor.Config = field(default_factory=VideoProcessor.Config)
        """vision_language: video sampling and preprocessing (HF Qwen3-VL video processor settings: fps or frame count, min/max frames, the clip's pixel budget) and the policy for a video too long for the packing budget."""

    def _image_config(self) -> ImageProcessor.Config:
        # A plain data config with source=vision_language (e.g. --data.source on a recipe of another
        # source) has no `image` section: the Qwen3-VL defaults apply.
        return getattr(self.config, "image", None) or ImageProcessor.Config()

    def _prepare(self) -> None:
        c = self.config
        if c.text.split_long_documents:
            raise ValueError(
                "data.text.split_long_documents is for text: a vision-language document cannot be cut (an image would "
                "be split from its tokens); raise data.max_tokens_per_microbatch or lower image.max_pixels"
            )
        facts = {k: self.fact(k) for k in VL_MODEL_FACTS}
        if int(self.model_facts.get("video_token_id", -1)) >= 0:  # the model has a video path
            facts["video_token_id"] = int(self.model_facts["video_token_id"])
        video = getattr(c, "video", None) or VideoProcessor.Config()
        self.encoder = make_encoder(
            self._tokenizer_folder(), self._image_config(), facts, system_prompt=c.chat.system_prompt,
            video=video, token_budget=c.max_tokens_per_microbatch,
            reasoning_effort=c.chat.reasoning_effort, preserve_thinking=c.chat.preserve_thinking,
        )  # fmt: skip
        if c.chat.long_conversations == "cut":
            raise ValueError(
                "data.chat.long_conversations=cut is for text conversations: a vision-language conversation is not cut "
                "(its images would have to be cut with it); use drop, or raise data.max_tokens_per_microbatch"
            )
        self.vocab_size = int(facts["vocab_size"])
        self._modalities = ModalityCounter(int(facts["merge_size"]))
        self._check_pad_token(self.vocab_size, *self.encoder.reserved)

    def _tokenizer_folder(self) -> str:
        """data.tokenizer, else the one the shards were written with (``vl_dataset.json``), else (toy corpus)
        the toy tokenizer; a data.tokenizer other than the recorded one is an error naming both."""
        from hyper_parallel.data.tokenizer import tokenizer_fingerprint
        from hyper_parallel.data.vision_language.writer import TOY_TOKENIZER, read_dataset_tokenizer, toy_tokenizer_folder

        c = self.config
        if not c.path:
            return c.tokenizer or toy_tokenizer_folder(c.cache_dir)
        try:
            recorded = read_dataset_tokenizer(resolve_shards(c.path))
        except FileNotFoundError as e:
            if not c.tokenizer:
                raise ValueError(
                    f"{e}: no shards, so no record of their tokenizer either; fix data.path and set data.tokenizer "
                    "to the model's tokenizer folder"
                ) from None
            recorded = None  # no shards: resolving them later names the path
        if recorded is None:
            if c.tokenizer:
                return c.tokenizer
            raise ValueError(
                f"data.path={c.path!r} names vision-language shards written without a record of their tokenizer "
                "(no vl_dataset.json next to them): set data.tokenizer to the model's tokenizer folder (an HF folder "
                "with tokenizer.json)"
            )
        where, meta = recorded
        written = toy_tokenizer_folder(c.cache_dir) if meta["tokenizer"] == TOY_TOKENIZER else meta["tokenizer"]
        folder = c.tokenizer or written
        if not os.path.isdir(os.path.expanduser(folder)):
            raise FileNotFoundError(
                f"the shards of data.path={c.path!r} were written with the tokenizer {written!r} ({where}), which does "
                "not exist here: set data.tokenizer to that tokenizer's folder"
            )
        got = tokenizer_fingerprint(os.path.expanduser(folder))
        if got != meta["tokenizer_fingerprint"]:
            raise ValueError(
                f"data.tokenizer={folder!r} (fingerprint {got}) is not the tokenizer the shards of data.path="
                f"{c.path!r} were written with: {meta['tokenizer']!r} (fingerprint {meta['tokenizer_fingerprint']}, "
                f"recorded in {where}). Use that tokenizer, or rewrite the shards with this one"
            )
        return folder

    def _resolve_shards(self) -> list[str]:
        if self.config.path:
            return resolve_shards(self.config.path)
        from hyper_parallel.data.vision_language.toy import ToyVisionLanguageSpec, cached_toy_vision_language

        # loss_on assistant trains conversations only: the toy corpus's chat variant (content-list messages)
        chats = self.config.chat.loss_on == "assistant"
        spec = ToyVisionLanguageSpec(chat_fraction=1.0, content_parts=True) if chats else ToyVisionLanguageSpec()
        if self.encoder.videos is not None:  # a model with a video path trains on toy videos too
            spec = replace(spec, video_fraction=TOY_VIDEO_FRACTION)
        return resolve_shards(cached_toy_vision_language(self.config.cache_dir, spec))

    def _index_spec(self) -> IndexSpec:
        return self.encoder.index_spec()

    def _classify(self, stats: Mapping[str, np.ndarray]) -> np.ndarray:
        return vl_classify(stats, max_tokens=self.config.max_tokens_per_microbatch, loss_on=self.config.chat.loss_on)

    def _codec(self) -> VisionLanguageCodec:
        return VisionLanguageCodec(self.encoder, self.config.max_tokens_per_microbatch, self.config.chat.loss_on)

    def _micro_batches(self, gs: range) -> list[dict[str, Any]]:
        # Per-modality tokens of the whole global step (from the plan and the indexes, before the
        # planner releases the step's windows), then this rank's micro-batches.
        first = gs[0] - self.dp_rank * self.micro_batches_per_step
        bins = [self._planner.bin(g) for g in range(first, first + self.global_micro_batches)]
        self._modalities.count(self.table, bins)
        return super()._micro_batches(gs)

    def metrics(self) -> dict[str, float]:
        """``bad_samples_skipped`` and the last step's ``tokens/text``, ``tokens/image``, ``tokens/video``."""
        return {**super().metrics(), **self._modalities.last}

    def _order(self) -> dict[str, Any]:
        # The index params (tokenizer, image ids, resize bounds) are part of the base order already.
        return {**super()._order(), "vocab_size": self.vocab_size}
