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

An empty ``data.path`` uses the embedded toy corpus (:mod:`.toy`) with the toy text tokenizer;
otherwise ``data.tokenizer`` must name the model's tokenizer folder.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from hyper_parallel.data.base import BaseDataLoader
from hyper_parallel.data.index import IndexSpec
from hyper_parallel.data.shards import resolve_shards
from hyper_parallel.data.sharded import ShardedDataLoader
from hyper_parallel.data.vision_language.preprocess import ImageProcessor
from hyper_parallel.data.vision_language.sample import (
    VL_BAD_KINDS,
    VL_MODEL_FACTS,
    VisionLanguageCodec,
    make_encoder,
    vl_classify,
)

__all__ = ["VisionLanguageDataLoader"]


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

    def _image_config(self) -> ImageProcessor.Config:
        # A plain data config with source=vision_language (e.g. --data.source on a recipe of another
        # source) has no `image` section: the Qwen3-VL defaults apply.
        return getattr(self.config, "image", None) or ImageProcessor.Config()

    def _prepare(self) -> None:
        c = self.config
        if c.split_long_documents:
            raise ValueError(
                "data.split_long_documents is for text: a vision-language document cannot be cut (an image would "
                "be split from its tokens); raise data.max_tokens_per_microbatch or lower image.max_pixels"
            )
        facts = {k: self.fact(k) for k in VL_MODEL_FACTS}
        self.encoder = make_encoder(self._tokenizer_folder(), self._image_config(), facts)
        self.vocab_size = int(facts["vocab_size"])
        self._check_pad_token(self.vocab_size, *self.encoder.reserved)

    def _tokenizer_folder(self) -> str:
        c = self.config
        if c.tokenizer:
            return c.tokenizer
        if c.path:
            raise ValueError(
                f"data.path={c.path!r} names vision-language shards: set data.tokenizer to the model's tokenizer "
                "folder (an HF folder with tokenizer.json). Only the embedded toy corpus (empty data.path) has a "
                "default tokenizer"
            )
        from hyper_parallel.data.text import cached_toy_text

        return cached_toy_text(c.cache_dir).tokenizer_dir

    def _resolve_shards(self) -> list[str]:
        if self.config.path:
            return resolve_shards(self.config.path)
        from hyper_parallel.data.vision_language.toy import cached_toy_vision_language

        return resolve_shards(cached_toy_vision_language(self.config.cache_dir))

    def _index_spec(self) -> IndexSpec:
        return self.encoder.index_spec()

    def _classify(self, stats: Mapping[str, np.ndarray]) -> np.ndarray:
        return vl_classify(stats, max_tokens=self.config.max_tokens_per_microbatch)

    def _codec(self) -> VisionLanguageCodec:
        return VisionLanguageCodec(self.encoder, self.config.max_tokens_per_microbatch)

    def _order(self) -> dict[str, Any]:
        # The index params (tokenizer, image ids, resize bounds) are part of the base order already.
        return {**super()._order(), "vocab_size": self.vocab_size}
