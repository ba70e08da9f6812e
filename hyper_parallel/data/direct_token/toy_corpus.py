"""The embedded toy DirectToken corpus: small, deterministic, and learnable.

Used when ``data.path`` is empty (the debug recipe), written once into ``data.cache_dir``.

Structure (the caption decides the image): each sample draws a class ``c`` out of ``num_classes``.
Its caption is a few random filler words with the class word of ``c`` somewhere among them. Each
image (0, 1 or 2 of them; grid drawn from ``image_grids``) is ``image_start, dim(h), dim(w)``,
then ``h*w`` placeholders, then ``image_end``; its code at row ``i``, column ``j`` is
``palette_c[(i * shift_c + j) % len(palette_c)]``, replaced by a uniform random code with
probability ``noise``. The sample ends with the class's three description words and ``eos``.
A model that reads the class word can predict the image codes and the description; the filler
words and the noise are what it cannot learn.

Reserved token ids: 0 pad, 1 bos, 2 eos, 3 image_start, 4 image_end, ``5 + d`` = "dimension d"
(d < 32); class, description and filler words come from the ids above 36, skipping
``placeholder_token_id`` (which may lie inside or outside the text vocabulary; the debug recipe
uses ``lang_vocab_size - 1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hyper_parallel.data.cache import cached_build, spec_digest
from hyper_parallel.data.direct_token.writer import DirectTokenWriter

__all__ = ["ToyCorpusSpec", "cached_toy_corpus", "make_toy_samples", "write_toy_corpus"]

TOY_CORPUS_VERSION = 1
"""Bump when the generator changes, so stale caches are not reused."""

PAD, BOS, EOS, IMAGE_START, IMAGE_END = 0, 1, 2, 3, 4
_DIM_BASE, _MAX_DIM = 5, 32
_FIRST_WORD = _DIM_BASE + _MAX_DIM
_DESC_WORDS = 3


@dataclass(frozen=True, slots=True)
class ToyCorpusSpec:
    """Everything that determines the toy corpus (its hash names the cache folder)."""

    lang_vocab_size: int
    codebook_size: int
    placeholder_token_id: int
    image_grids: tuple[tuple[int, int], ...] = ((4, 4), (4, 6), (6, 6))
    num_samples: int = 4096
    samples_per_shard: int = 256
    num_classes: int = 16
    palette_size: int = 6
    noise: float = 0.1
    text_only_fraction: float = 0.1
    two_image_fraction: float = 0.15
    seed: int = 0

    def digest(self) -> str:
        return spec_digest(self, TOY_CORPUS_VERSION)


def _vocabulary(spec: ToyCorpusSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Class words, description words ``[K, 3]``, filler words, palettes ``[K, P]``, row shifts ``[K]``."""
    if spec.placeholder_token_id < _FIRST_WORD:
        raise ValueError(
            f"the toy corpus reserves token ids < {_FIRST_WORD}; placeholder_token_id="
            f"{spec.placeholder_token_id} collides (use e.g. lang_vocab_size - 1)"
        )
    if any(not (0 < h < _MAX_DIM and 0 < w < _MAX_DIM) for h, w in spec.image_grids):
        raise ValueError(f"toy image grids must have sides in [1, {_MAX_DIM}), got {spec.image_grids}")
    k = spec.num_classes
    words = np.array([t for t in range(_FIRST_WORD, spec.lang_vocab_size) if t != spec.placeholder_token_id])
    if len(words) < k * (1 + _DESC_WORDS) + 8:
        raise ValueError(
            f"lang_vocab_size={spec.lang_vocab_size} is too small for a toy corpus with {k} classes: "
            f"need at least {_FIRST_WORD + k * (1 + _DESC_WORDS) + 9} ids"
        )
    if spec.codebook_size < 2 * k:
        raise ValueError(f"codebook_size={spec.codebook_size} is too small for {k} toy classes (need >= {2 * k})")
    rng = np.random.default_rng([spec.seed, 0x70E])
    words = rng.permutation(words)
    class_words = words[:k]
    desc_words = words[k : k * (1 + _DESC_WORDS)].reshape(k, _DESC_WORDS)
    filler = words[k * (1 + _DESC_WORDS) :]
    palette_size = min(spec.palette_size, spec.codebook_size // k)
    palettes = rng.permutation(spec.codebook_size)[: k * palette_size].reshape(k, palette_size)
    shifts = rng.integers(1, palette_size, size=k) if palette_size > 1 else np.zeros(k, np.int64)
    return class_words, desc_words, filler, palettes, shifts


def make_toy_samples(spec: ToyCorpusSpec) -> list[dict]:
    """The corpus as a list of ``{"key", "tokens", "vq_codes", "image_grids"}`` dicts."""
    class_words, desc_words, filler, palettes, shifts = _vocabulary(spec)
    samples = []
    for index in range(spec.num_samples):
        rng = np.random.default_rng([spec.seed, index])
        c = int(rng.integers(spec.num_classes))
        caption = list(rng.choice(filler, size=int(rng.integers(2, 7))))
        caption.insert(int(rng.integers(len(caption) + 1)), class_words[c])
        u = rng.random()
        num_images = 0 if u < spec.text_only_fraction else 2 if u < spec.text_only_fraction + spec.two_image_fraction else 1
        tokens: list[int] = [BOS, *caption]
        codes: list[np.ndarray] = []
        grids: list[list[int]] = []
        for _ in range(num_images):
            h, w = spec.image_grids[int(rng.integers(len(spec.image_grids)))]
            rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
            img = palettes[c][(rows * shifts[c] + cols).reshape(-1) % palettes.shape[1]]
            noisy = rng.random(h * w) < spec.noise
            img = np.where(noisy, rng.integers(spec.codebook_size, size=h * w), img)
            tokens += [IMAGE_START, _DIM_BASE + h, _DIM_BASE + w, *[spec.placeholder_token_id] * (h * w), IMAGE_END]
            codes.append(img)
            grids.append([h, w])
        tokens += [*desc_words[c], EOS]
        samples.append(
            {
                "key": f"toy{index:07d}",
                "tokens": np.array(tokens, dtype=np.int32),
                "vq_codes": np.concatenate(codes).astype(np.int32) if codes else np.zeros(0, np.int32),
                "image_grids": grids,
            }
        )
    return samples


def write_toy_corpus(out_dir: str, spec: ToyCorpusSpec) -> list[str]:
    """Write the toy corpus as DirectToken shards into ``out_dir``; returns the shard paths."""
    with DirectTokenWriter(
        out_dir,
        placeholder_token_id=spec.placeholder_token_id,
        lang_vocab_size=spec.lang_vocab_size,
        codebook_size=spec.codebook_size,
        samples_per_shard=spec.samples_per_shard,
        prefix="toy",
    ) as writer:
        for s in make_toy_samples(spec):
            writer.write(s["tokens"], s["vq_codes"], s["image_grids"], key=s["key"])
    return writer.shards


def cached_toy_corpus(cache_dir: str, spec: ToyCorpusSpec) -> str:
    """The folder of the toy corpus for ``spec`` under ``cache_dir``, written on first use.

    Safe when several ranks call it at once: each writes into its own temporary folder and the
    first atomic rename wins (the contents are identical).
    """
    return cached_build(cache_dir, f"toy_direct_token-{spec.digest()}", lambda tmp: write_toy_corpus(tmp, spec))
