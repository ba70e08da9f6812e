"""Training data: DirectToken webdataset shards, preset batches, packing, dyn_bsz and its loss.

Entry points: :class:`DataConfig` (``= TokenDataLoader.Config``, the run config's ``data``
section) whose ``build(dp_rank=, dp_world_size=, lang_vocab_size=, codebook_size=,
placeholder_token_id=)`` returns a :class:`TokenDataLoader`; :func:`global_token_count` and
:func:`global_token_mean_ce` for the loss; :class:`DirectTokenWriter` / ``python -m
hyper_parallel.data.direct_token`` to write shards.
"""

from hyper_parallel.data.dataloader import DataConfig, TokenDataLoader
from hyper_parallel.data.direct_token import DirectTokenWriter, check_shards, read_samples, write_shards
from hyper_parallel.data.loss import global_token_count, global_token_mean_ce
from hyper_parallel.data.packing import batch_to_device, collate_packed
from hyper_parallel.data.preset import BATCH_KEYS, check_batch
from hyper_parallel.data.sample import BAD_SAMPLE_KINDS, IGNORE_INDEX, BadSampleError, Sample, SampleSpec, make_sample
from hyper_parallel.data.toy_corpus import ToyCorpusSpec, cached_toy_corpus, make_toy_samples, write_toy_corpus

__all__ = [
    "BAD_SAMPLE_KINDS",
    "BATCH_KEYS",
    "IGNORE_INDEX",
    "BadSampleError",
    "DataConfig",
    "DirectTokenWriter",
    "Sample",
    "SampleSpec",
    "TokenDataLoader",
    "ToyCorpusSpec",
    "batch_to_device",
    "cached_toy_corpus",
    "check_batch",
    "check_shards",
    "collate_packed",
    "global_token_count",
    "global_token_mean_ce",
    "make_sample",
    "make_toy_samples",
    "read_samples",
    "write_shards",
    "write_toy_corpus",
]
