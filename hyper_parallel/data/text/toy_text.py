"""An embedded toy text corpus and a byte-level BPE tokenizer trained on it: the text path, offline.

:func:`cached_toy_text` writes, once per :class:`ToyTextSpec`, under ``cache_dir``:

- ``tokenizer/``: an HF-style tokenizer folder (``tokenizer.json`` + ``tokenizer_config.json`` with
  ``<s>`` bos (added by ``encode``, through tokenizer.json's post-processor), ``</s>`` eos, ``<pad>`` pad and a ChatML chat template), loadable
  by :class:`~hyper_parallel.data.tokenizer.HuggingFaceTokenizer` and by ``transformers.AutoTokenizer``;
- ``toy_text.jsonl``: ``{"id", "text"}`` documents;
- ``toy_chat.jsonl``: ``{"id", "messages"}`` conversations.

The documents are templated English sentences drawn from a seeded generator. They are learnable:
each subject prefers one verb, one object and one place, so a model that reads the subject does
better than one that only counts words.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from hyper_parallel.data.cache import cached_build, spec_digest

__all__ = ["TOY_CHAT_TEMPLATE", "ToyText", "ToyTextSpec", "cached_toy_text", "make_toy_chats", "make_toy_documents", "write_toy_text"]

TOY_TEXT_VERSION = 1
"""Bump when the generator or the tokenizer recipe changes, so stale caches are not reused."""

PAD, BOS, EOS, IM_START, IM_END = "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)
"""Ids 0..4 of the toy tokenizer, in this order."""

TOY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SUBJECTS = (
    "the cat", "a dog", "the old man", "my sister", "the teacher", "a small bird", "the farmer",
    "our neighbour", "the baker", "a young girl", "the captain", "my uncle", "the doctor", "a quiet boy",
    "the painter", "the queen",
)
_VERBS = ("sees", "likes", "finds", "paints", "carries", "follows", "builds", "watches", "cleans", "sells")
_OBJECTS = (
    "the red ball", "a green apple", "the big house", "a wooden boat", "the blue door", "a warm coat",
    "the long road", "a silver key", "the tall tree", "a paper kite", "the broken chair", "a loaf of bread",
)
_PLACES = (
    "in the garden", "near the river", "at the market", "under the bridge", "on the hill", "by the sea",
    "in the kitchen", "behind the school", "at the station",
)
_TIMES = ("every morning", "on sunday", "at night", "after lunch", "in winter", "before dinner")
_ADJECTIVES = ("happy", "tired", "busy", "careful", "hungry", "kind", "brave", "sleepy")
_SYSTEM = "You are a helpful assistant who answers in one sentence."


@dataclass(frozen=True, slots=True)
class ToyTextSpec:
    """Everything that determines the toy text corpus and its tokenizer (its hash names the cache folder)."""

    num_documents: int = 384
    num_chats: int = 128
    vocab_size: int = 512
    seed: int = 0

    def digest(self) -> str:
        return spec_digest(self, TOY_TEXT_VERSION)


@dataclass(frozen=True, slots=True)
class ToyText:
    """Paths of a written toy text corpus."""

    root: str
    tokenizer_dir: str
    text_file: str
    chat_file: str


def _pick(rng: np.random.Generator, items: tuple[str, ...], preferred: int, p: float = 0.75) -> str:
    return items[preferred % len(items)] if rng.random() < p else items[int(rng.integers(len(items)))]


def _sentence(rng: np.random.Generator, k: int) -> str:
    """One sentence about subject ``k`` (its preferences: verb k, object 3k, place 5k)."""
    s = _SUBJECTS[k]
    v, o, p = _pick(rng, _VERBS, k), _pick(rng, _OBJECTS, 3 * k), _pick(rng, _PLACES, 5 * k)
    form = int(rng.integers(4))
    if form == 0:
        text = f"{s} {v} {o} {p}."
    elif form == 1:
        text = f"{_TIMES[int(rng.integers(len(_TIMES)))]}, {s} {v} {o}."
    elif form == 2:
        text = f"{s} {v} {o} and {_pick(rng, _OBJECTS, 3 * k + 1)} {p}."
    else:
        text = f"{s} is {_ADJECTIVES[int(rng.integers(len(_ADJECTIVES)))]} {p}."
    return text[0].upper() + text[1:]


def make_toy_documents(spec: ToyTextSpec) -> list[dict[str, str]]:
    """``[{"id": "doc0000000", "text": ...}, ...]``: 1-5 sentences each, mostly about one subject."""
    docs = []
    for index in range(spec.num_documents):
        rng = np.random.default_rng([spec.seed, 0x7E47, index])
        k = int(rng.integers(len(_SUBJECTS)))
        n = int(rng.integers(1, 6))
        sentences = [_sentence(rng, k if rng.random() < 0.8 else int(rng.integers(len(_SUBJECTS)))) for _ in range(n)]
        docs.append({"id": f"doc{index:07d}", "text": " ".join(sentences)})
    return docs


def make_toy_chats(spec: ToyTextSpec) -> list[dict]:
    """``[{"id": "chat0000000", "messages": [...]}, ...]``: one or two question/answer turns."""
    chats = []
    for index in range(spec.num_chats):
        rng = np.random.default_rng([spec.seed, 0xC4A7, index])
        messages = [{"role": "system", "content": _SYSTEM}] if rng.random() < 0.3 else []
        for _ in range(int(rng.integers(1, 3))):
            k = int(rng.integers(len(_SUBJECTS)))
            messages.append({"role": "user", "content": f"Tell me about {_SUBJECTS[k]}."})
            messages.append({"role": "assistant", "content": _sentence(rng, k)})
        chats.append({"id": f"chat{index:07d}", "messages": messages})
    return chats


def _train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # encode(text) starts every document with bos (tokenizer.json's post-processor is the policy).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def _write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_toy_text(out_dir: str, spec: ToyTextSpec) -> ToyText:
    """Write the corpus files and the trained tokenizer folder into ``out_dir``."""
    docs, chats = make_toy_documents(spec), make_toy_chats(spec)
    tok_dir = os.path.join(out_dir, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    chat_texts = [m["content"] for c in chats for m in c["messages"]]
    tok = _train_tokenizer([d["text"] for d in docs] + chat_texts, spec.vocab_size)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "chat_template": TOY_CHAT_TEMPLATE,
    }
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    paths = ToyText(out_dir, tok_dir, os.path.join(out_dir, "toy_text.jsonl"), os.path.join(out_dir, "toy_chat.jsonl"))
    _write_jsonl(paths.text_file, docs)
    _write_jsonl(paths.chat_file, chats)
    return paths


def cached_toy_text(cache_dir: str = "~/.cache/hyper_parallel", spec: ToyTextSpec | None = None) -> ToyText:
    """The toy text corpus and tokenizer for ``spec`` under ``cache_dir``, written on first use.

    Safe when several ranks call it at once: each writes into its own temporary folder and the
    first atomic rename wins; the others discard theirs and use the winner's, so every rank reads
    the same files.
    """
    spec = spec or ToyTextSpec()
    final = cached_build(cache_dir, f"toy_text-{spec.digest()}", lambda tmp: write_toy_text(tmp, spec))
    return ToyText(final, os.path.join(final, "tokenizer"), os.path.join(final, "toy_text.jsonl"), os.path.join(final, "toy_chat.jsonl"))
