"""Tokenizers for raw text: :class:`BaseTokenizer` and the HF-folder :class:`HuggingFaceTokenizer`.

:class:`HuggingFaceTokenizer` reads an HF model (or tokenizer) folder with the ``tokenizers``
library only, never ``transformers``, and reproduces what ``transformers.AutoTokenizer`` does for
the same folder (the tests use it as the oracle):

- **Pipeline**: ``tokenizer.json`` (required). Special tokens that ``tokenizer_config.json`` names
  but ``tokenizer.json`` lacks are added as special tokens, as transformers does.
- **Special tokens**: ``bos_token`` / ``eos_token`` / ``pad_token`` (a string or an
  ``{"content": ...}`` object) from ``tokenizer_config.json``; when that file has no
  ``added_tokens_decoder``, the legacy ``special_tokens_map.json`` overrides it (transformers'
  rule). A token the tokenizer files leave unset falls back to the ``bos_token_id`` /
  ``eos_token_id`` / ``pad_token_id`` of ``generation_config.json``, then of ``config.json`` (the
  first id where it is a list). That fallback only names the id; it never makes ``encode`` add it.
- **bos/eos policy of** ``encode(text)``: ``tokenizer.json``'s post-processor decides (Llama-3
  style folders add ``<|begin_of_text|>`` there; Qwen and GLM folders add nothing; no
  post-processor adds nothing). ``add_bos_token`` / ``add_eos_token`` in ``tokenizer_config.json``
  are not consulted: transformers >= 5 drops them whenever ``tokenizer.json`` exists, so the
  oracle and this class agree. :attr:`~BaseTokenizer.adds_bos` / :attr:`~BaseTokenizer.adds_eos`
  report the outcome; a data source that wants every document to end with eos appends it itself.
- **Chat template**: ``chat_template.jinja`` in the folder, else ``tokenizer_config.json``'s
  ``chat_template`` (a string, or a list of ``{"name", "template"}`` whose ``default`` is used),
  rendered in a sandboxed jinja2 environment configured like transformers' (``trim_blocks``,
  ``lstrip_blocks``, ``loopcontrols``, ``tojson``, ``raise_exception``, ``strftime_now``) with the
  special-token strings (``bos_token``, ``eos_token``, ...) as variables.

Model-specific transformers classes (``tokenizer_class`` ``LlamaTokenizer``, ``GemmaTokenizer``,
``Qwen2Tokenizer``, ...) rebuild the pipeline from the vocabulary with class defaults the files do
not state (Llama's ``add_bos_token=True``); this class follows the files only, which is exact for
the generic ``PreTrainedTokenizerFast`` / ``TokenizersBackend`` folders (GLM, Llama-3, DeepSeek). Folders without ``tokenizer.json``
(sentencepiece-only ``tokenizer.model``) are not supported: save them once with transformers'
``save_pretrained``, which writes ``tokenizer.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from hyper_parallel.config.configurable import Configurable

__all__ = [
    "BaseTokenizer",
    "HuggingFaceTokenizer",
    "compile_chat_template",
    "has_tokenizer",
    "render_template",
    "tokenizer_differences",
    "tokenizer_fingerprint",
    "tokenizer_identity",
]

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""Named special tokens; their strings are variables of the chat template (as in transformers)."""

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def tokenizer_fingerprint(folder: str) -> str:
    """Digest of the files that decide how a tokenizer folder encodes (json and jinja files)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith((".json", ".jinja")):
            h.update(name.encode())
            with open(os.path.join(folder, name), "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""Matches transformers' ``{% generation %}`` tag (assistant spans marked by the template itself)."""


class _GenerationTracker:
    """Records the character spans of ``{% generation %}`` blocks while a template renders.

    Same rule as transformers' ``AssistantTracker``: a block starts at the length of everything the
    template has emitted so far (the render runs through ``Template.generate``, so output before the
    block has been yielded and counted) and spans the block's own output.
    """

    def __init__(self) -> None:
        self.blocks: list[str] | None = None
        self.spans: list[tuple[int, int]] | None = None

    def record(self, rendered: str) -> None:
        if self.blocks is not None and self.spans is not None:
            start = sum(len(b) for b in self.blocks)
            self.spans.append((start, start + len(rendered)))


def compile_chat_template(source: str) -> Any:
    """Compile a chat template in a sandbox set up like transformers' (so renders match exactly).

    The compiled template carries ``generation_tracker`` (see :func:`render_template`)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tracker = _GenerationTracker()

    class _Generation(jinja2.ext.Extension):
        # transformers' {% generation %} marks assistant spans for masks; the text is unchanged.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            rendered = caller()
            tracker.record(rendered)
            return rendered

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        # jinja's own tojson escapes HTML characters, which changes the rendered text.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    template = env.from_string(source)
    template.generation_tracker = tracker
    return template


def render_template(template: Any, **variables: Any) -> tuple[str, list[tuple[int, int]]]:
    """Render a :func:`compile_chat_template` template; returns the text and its ``{% generation %}`` spans."""
    tracker: _GenerationTracker = template.generation_tracker
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    tracker.blocks, tracker.spans = blocks, spans
    try:
        for block in template.generate(**variables):
            blocks.append(block)
    finally:
        tracker.blocks = tracker.spans = None
    return "".join(blocks), spans


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What transformers hands a template: keys with a None value dropped, reasoning under both names."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"a chat message must be a mapping, got {type(message).__name__}: {message!r}")
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class BaseTokenizer(ABC, Configurable):
    """Text <-> token ids, the special ids a data source needs, and an optional chat template."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        pass

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included): every id is below it."""

    @property
    @abstractmethod
    def bos_id(self) -> int | None: ...

    @property
    @abstractmethod
    def eos_id(self) -> int | None: ...

    @property
    @abstractmethod
    def pad_id(self) -> int | None: ...

    @abstractmethod
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the folder's bos/eos policy applies."""

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """``[encode(t) for t in texts]`` (subclasses may parallelise; results are identical)."""
        return [self.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    @abstractmethod
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    @property
    def adds_bos(self) -> bool:
        """Whether ``encode(text)`` starts with ``bos_id``."""
        probe = self.encode("a")
        return self.bos_id is not None and probe[:1] == [self.bos_id]

    @property
    def adds_eos(self) -> bool:
        """Whether ``encode(text)`` ends with ``eos_id``."""
        probe = self.encode("a")
        return self.eos_id is not None and probe[-1:] == [self.eos_id]

    @property
    def chat_template(self) -> str | None:
        """The jinja source of the chat template, or None when the tokenizer has none."""
        return None

    def special_token_strings(self) -> dict[str, str]:
        """``{"bos_token": "<s>", ...}`` for the set named special tokens (chat-template variables)."""
        return {}

    def __getstate__(self) -> dict[str, Any]:
        # The compiled template holds closures; DataLoader workers recompile it on first use.
        state = dict(self.__dict__)
        state.pop("_compiled_chat_template", None)
        return state

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False, **kwargs: Any) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) to the chat string.

        Encode the result with ``add_special_tokens=False``: the template writes its own special
        tokens (this is what ``transformers``' ``apply_chat_template(tokenize=True)`` does).
        """
        return self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)[0]

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False, **kwargs: Any
    ) -> tuple[str, list[tuple[int, int]]]:
        """:meth:`apply_chat_template` plus the character spans of the template's ``{% generation %}``
        blocks (empty when it has none). ``kwargs`` are template variables (``tools``, ``enable_thinking``)."""
        if self.chat_template is None:
            raise ValueError(f"{self!r} has no chat template: render chats elsewhere or use plain text")
        compiled = getattr(self, "_compiled_chat_template", None)
        if compiled is None:
            compiled = compile_chat_template(self.chat_template)
            self._compiled_chat_template = compiled
        variables = {"tools": None, "documents": None, **self.special_token_strings(), **kwargs}
        return render_template(
            compiled, messages=_normalize_messages(messages), add_generation_prompt=add_generation_prompt, **variables
        )

    @property
    def has_generation_marks(self) -> bool:
        """Whether the chat template marks assistant text with ``{% generation %}`` (transformers' masks)."""
        return self.chat_template is not None and GENERATION_TAG.search(self.chat_template) is not None

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` without special tokens added, and each token's ``(start, end)`` characters in it."""
        raise NotImplementedError(f"{type(self).__name__} gives no token offsets")

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens (control tokens such as ``<|im_end|>``; never ordinary text)."""
        return frozenset()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first_id(*configs: Mapping[str, Any], key: str) -> int | None:
    for cfg in configs:
        value = cfg.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class HuggingFaceTokenizer(BaseTokenizer):
    """The tokenizer of an HF model folder, read with the ``tokenizers`` library (see the module doc).

    ``HuggingFaceTokenizer.Config(path="/models/GLM-4.7-Flash").build()``, or
    ``HuggingFaceTokenizer.from_folder(path)``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        path: str = ""
        """HF model or tokenizer folder holding tokenizer.json (and optionally tokenizer_config.json,
        chat_template.jinja, generation_config.json, config.json)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if not config.path:
            raise ValueError("HuggingFaceTokenizer.Config.path is empty: set it to an HF model folder holding tokenizer.json")
        folder = Path(os.path.expanduser(config.path))
        if not folder.is_dir():
            raise FileNotFoundError(f"tokenizer folder {str(folder)!r} does not exist (set the tokenizer path to an HF model folder)")
        tokenizer_json = folder / "tokenizer.json"
        if not tokenizer_json.is_file():
            has = sorted(p.name for p in folder.iterdir())
            raise FileNotFoundError(
                f"tokenizer folder {str(folder)!r} has no tokenizer.json (it has: {has or 'nothing'}). Point the "
                "tokenizer path at an HF folder with tokenizer.json; a sentencepiece-only folder can be converted "
                "once with transformers' AutoTokenizer.from_pretrained(folder).save_pretrained(folder)"
            )
        self.folder = str(folder)
        self._tok = Tokenizer.from_file(str(tokenizer_json))
        tcfg = _read_json(folder / "tokenizer_config.json")
        if "added_tokens_decoder" not in tcfg:
            # transformers' legacy rule: special_tokens_map.json only counts without added_tokens_decoder.
            tcfg = {**tcfg, **_read_json(folder / "special_tokens_map.json")}
        self._add_missing_tokens(tcfg)
        self._special = {name: s for name in SPECIAL_TOKEN_NAMES if (s := _token_content(tcfg.get(name))) is not None}
        model_cfgs = (_read_json(folder / "generation_config.json"), _read_json(folder / "config.json"))
        self._bos_id = self._special_id("bos_token", model_cfgs)
        self._eos_id = self._special_id("eos_token", model_cfgs)
        self._pad_id = self._special_id("pad_token", model_cfgs)
        self._chat_template = self._find_chat_template(folder, tcfg)

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> HuggingFaceTokenizer:
        return cls.Config(path=os.fspath(path)).build()

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer({self.folder!r})"

    # -- loading ------------------------------------------------------------------------------

    def _add_missing_tokens(self, tcfg: Mapping[str, Any]) -> None:
        """Add special tokens the config names but tokenizer.json lacks (transformers does the same)."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        missing: list[AddedToken] = []
        decoder = tcfg.get("added_tokens_decoder") or {}
        for _, spec in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            if isinstance(spec, Mapping) and isinstance(spec.get("content"), str) and spec["content"] not in vocab:
                fields = {k: spec[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in spec}
                missing.append(AddedToken(spec["content"], **fields))
        for name in SPECIAL_TOKEN_NAMES:
            s = _token_content(tcfg.get(name))
            if s is not None and s not in vocab and all(t.content != s for t in missing):
                missing.append(AddedToken(s, special=True, normalized=False))
        if missing:
            self._tok.add_special_tokens(missing)

    def _special_id(self, name: str, model_cfgs: tuple[dict[str, Any], ...]) -> int | None:
        if name in self._special:
            return self._tok.token_to_id(self._special[name])
        return _first_id(*model_cfgs, key=f"{name}_id")

    @staticmethod
    def _find_chat_template(folder: Path, tcfg: Mapping[str, Any]) -> str | None:
        jinja_file = folder / CHAT_TEMPLATE_FILE
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        template = tcfg.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            if "default" not in named:
                raise ValueError(
                    f"{folder / 'tokenizer_config.json'} has chat templates {sorted(map(str, named))} but none named "
                    "'default': add a chat_template.jinja to the folder"
                )
            template = named["default"]
        return template if isinstance(template, str) else None

    # -- BaseTokenizer ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def special_token_strings(self) -> dict[str, str]:
        return dict(self._special)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, [tuple(o) for o in encoding.offsets]

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)


# -- which tokenizer: the one the model folder ships, or another ------------------------------------------------


def has_tokenizer(folder: str | os.PathLike | None) -> bool:
    """Whether ``folder`` holds a tokenizer this package reads (``tokenizer.json``)."""
    return bool(folder) and (Path(os.path.expanduser(folder)) / "tokenizer.json").is_file()


def tokenizer_identity(folder: str | os.PathLike) -> dict[str, str]:
    """What decides how a tokenizer folder trains a model, in three parts compared one by one:
    ``vocabulary`` (tokenizer.json's model and its added tokens), ``special tokens`` (bos/eos/pad and every
    special added token, by string and id) and ``chat template`` (the template text, or ``none``)."""
    tok = HuggingFaceTokenizer.from_folder(folder)

    def digest(value: Any) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:12]

    pipeline = _read_json(Path(tok.folder) / "tokenizer.json")
    vocab = tok._tok.get_vocab(with_added_tokens=True)
    specials = {name: f"{s}={tok._tok.token_to_id(s)}" for name, s in sorted(tok.special_token_strings().items())}
    decoder = tok._tok.get_added_tokens_decoder()
    special_ids = {str(i): decoder[i].content for i in sorted(tok.special_ids)}
    ids = {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}
    template = tok.chat_template
    return {
        "vocabulary": f"{len(vocab)} tokens #{digest([pipeline.get('model'), sorted(vocab.items())])}",
        "special tokens": f"{len(special_ids)} special #{digest([specials, special_ids, ids])}",
        "chat template": "none" if template is None else f"{len(template)} chars #{digest(template)}",
    }


def tokenizer_differences(model_folder: str | os.PathLike, other: str | os.PathLike) -> list[str]:
    """The parts (:func:`tokenizer_identity`) in which tokenizer ``other`` differs from ``model_folder``'s."""
    a, b = tokenizer_identity(model_folder), tokenizer_identity(other)
    return [f"{k} ({b[k]} vs the model's {a[k]})" for k in a if a[k] != b[k]]
