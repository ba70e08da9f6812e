"""Training data: sources, layout-independent order, packing, dyn_bsz steps, exact resume.

Entry point: :class:`DataConfig` (``= BaseDataLoader.Config``, the run config's ``data`` section)
whose ``build(dp_rank=, dp_world_size=, seq_multiple=, model_facts=)`` returns the loader of
``data.source``:

- ``direct_token`` (:class:`TokenDataLoader`): VQ image + text webdataset shards;
- ``text`` (:class:`HuggingFaceTextDataLoader`): pre-tokenised shards, or raw jsonl/parquet/arrow
  files tokenised once into a cache;
- ``vision_language`` (:class:`VisionLanguageDataLoader`): images + text webdataset shards;
- ``preset_pt`` (:class:`PresetDataLoader`): saved micro-batches;
- ``dummy`` (:class:`DummyDataLoader`): random tokens;
- ``data.sources`` set (:class:`MixtureDataLoader`): several of the shard-backed sources above, each a
  :class:`SourceConfig` with a name and a weight, mixed by tokens (:mod:`.mixture`).

The ``data`` section holds what every source reads, plus one section per option group only some sources
read (:mod:`.source_config`): ``data.text`` (:class:`TextOptions`), ``data.chat`` (:class:`ChatOptions`, text and
vision_language) and ``data.direct_token`` (:class:`DirectTokenOptions`); a mixture entry carries the same sections.

Every loader implements :class:`BaseDataLoader`: ``next_step()`` (this DP rank's micro-batches),
``state_dict()`` / ``load_state_dict()`` (the same state on every rank; resumes on any DP degree
and worker count), ``metrics()`` (``bad_samples_skipped``). The sequence of global batches depends
only on the data config and the seed (:mod:`.base`, :mod:`.plan`). Shards are written with
:class:`DirectTokenWriter` / ``python -m hyper_parallel.data.direct_token`` or
:class:`TextShardWriter`, each shard with its index (:mod:`.index`).
"""

from hyper_parallel.data.bad_samples import BAD_SAMPLE_KINDS, IGNORE_INDEX, BadSampleError
from hyper_parallel.data.base import DATA_SOURCES, BaseDataLoader, DataConfig, DataStateMismatch
from hyper_parallel.data.direct_token import (
    DIRECT_TOKEN_BAD_KINDS,
    DirectTokenWriter,
    Sample,
    SampleSpec,
    TokenDataLoader,
    check_shards,
    collate_direct_token,
    make_sample,
    read_samples,
    write_shards,
)
from hyper_parallel.data.dummy import DummyDataLoader
from hyper_parallel.data.layout_check import first_difference, global_batches
from hyper_parallel.data.mixture import MixtureDataLoader
from hyper_parallel.data.packing import TokenDocument, batch_to_device, collate_packed
from hyper_parallel.data.preset import BATCH_KEYS, PresetDataLoader, check_batch
from hyper_parallel.data.source_config import ChatOptions, DirectTokenOptions, SourceConfig, TextOptions
from hyper_parallel.data.text.loader import HuggingFaceTextDataLoader, TextShardWriter
from hyper_parallel.data.direct_token.toy_corpus import ToyCorpusSpec, cached_toy_corpus, make_toy_samples, write_toy_corpus
from hyper_parallel.data.vision_language import VisionLanguageDataLoader

__all__ = [
    "BAD_SAMPLE_KINDS",
    "BATCH_KEYS",
    "DATA_SOURCES",
    "DIRECT_TOKEN_BAD_KINDS",
    "IGNORE_INDEX",
    "BadSampleError",
    "ChatOptions",
    "BaseDataLoader",
    "DataConfig",
    "DataStateMismatch",
    "DirectTokenOptions",
    "DirectTokenWriter",
    "DummyDataLoader",
    "HuggingFaceTextDataLoader",
    "MixtureDataLoader",
    "PresetDataLoader",
    "Sample",
    "SampleSpec",
    "SourceConfig",
    "TextOptions",
    "TextShardWriter",
    "TokenDataLoader",
    "VisionLanguageDataLoader",
    "TokenDocument",
    "ToyCorpusSpec",
    "batch_to_device",
    "cached_toy_corpus",
    "check_batch",
    "check_shards",
    "collate_direct_token",
    "collate_packed",
    "first_difference",
    "global_batches",
    "make_sample",
    "make_toy_samples",
    "read_samples",
    "write_shards",
    "write_toy_corpus",
]
