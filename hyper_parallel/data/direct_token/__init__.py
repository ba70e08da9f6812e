"""DirectToken shards: write them, read them back, check them; and the command line.

Format (docs/design.md section 5): webdataset tars with, per sample key, ``<key>.tokens.npy`` (int32
``[L]``, image positions hold ``placeholder_token_id``), ``<key>.vq_codes.npy`` (int32 ``[N]``) and
``<key>.json`` (``{"image_grids": [[h, w], ...], "loss_on": "all" | "image", ...}``).

Python::

    with DirectTokenWriter("shards/", placeholder_token_id=511, samples_per_shard=1000) as w:
        w.write(tokens, vq_codes, image_grids=[[4, 4]])
    # -> shards/train-000000.tar, ...; read with --data.path 'shards/train-{000000..000009}.tar'

Command line::

    python -m hyper_parallel.data.direct_token write --input samples.jsonl --output-dir shards \\
        --placeholder-token-id 511 [--samples-per-shard 1000] [--prefix train]
    python -m hyper_parallel.data.direct_token toy --output-dir shards \\
        --lang-vocab-size 512 --codebook-size 256 --placeholder-token-id 511
    python -m hyper_parallel.data.direct_token check --path 'shards/*.tar' \\
        --lang-vocab-size 512 --codebook-size 256 --placeholder-token-id 511 --max-tokens 4096
    python -m hyper_parallel.data.direct_token index --path 'shards/*.tar' --placeholder-token-id 511

``write`` reads either a JSON-lines file (one object per sample: ``tokens``, ``vq_codes``,
``image_grids``, optional ``key``, ``loss_on`` and other JSON fields) or a directory of
``<key>.tokens.npy`` files with optional ``<key>.vq_codes.npy`` / ``<key>.json`` beside them.
``write`` and ``toy`` also write each shard's index side file (``<shard>.idx.npz``, see
:mod:`hyper_parallel.data.index`); ``index`` adds it to shards written by other tools (a loader
otherwise builds it on first use under ``data.cache_dir``).
"""

from hyper_parallel.data.direct_token.loader import TokenDataLoader
from hyper_parallel.data.direct_token.reading import check_shards, read_samples
from hyper_parallel.data.direct_token.sample import (
    DIRECT_TOKEN_BAD_KINDS,
    DirectTokenCodec,
    Sample,
    SampleSpec,
    collate_direct_token,
    decode_sample,
    make_sample,
)
from hyper_parallel.data.direct_token.writer import DirectTokenWriter, write_shards

__all__ = [
    "DIRECT_TOKEN_BAD_KINDS",
    "DirectTokenCodec",
    "DirectTokenWriter",
    "Sample",
    "SampleSpec",
    "TokenDataLoader",
    "check_shards",
    "collate_direct_token",
    "decode_sample",
    "make_sample",
    "read_samples",
    "write_shards",
]
