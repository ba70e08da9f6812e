"""Conversations: checking them, rendering them with the chat template, and assistant-only loss masks.

A conversation is a list of ``{"role", "content", ...}`` messages (transformers' form): roles
``system`` (first only), ``user``, ``assistant``, ``tool``; ``content`` a string, or a list of parts
``{"type": "text", "text": str}`` / ``{"type": "image"}`` (vision-language), or None for an
assistant turn that only calls tools. Extra fields (``reasoning_content``, ``tool_calls``, ``name``)
go to the template unchanged.

**Which tokens train** (``loss_on: assistant``): every assistant turn as the template renders it
in the whole conversation (so a template that drops the reasoning of earlier turns trains them
without it): its reasoning block, content, tool calls and the special token that ends it
(``<|im_end|>``; GLM's next role token). Never system, user or tool turns, nor the header before
each assistant turn. How the spans are found, with no per-model rule:

- a template with ``{% generation %}`` blocks marks them itself: the mask is transformers'
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``: every token whose character offsets
  overlap a block (so all byte tokens of a multi-byte character at either end of a block train);
- otherwise from the rendered text. For assistant message ``i``: (1) its *region*: the conversation
  is rendered twice more with that message's content replaced by two different sentinels (its
  reasoning and tool calls removed); the characters where those renderings differ from the real one
  are the message's own text. (2) its *header*: what the template's generation prompt writes
  (``render(messages[:i], add_generation_prompt=True)`` minus ``render(messages[:i])``), matched
  token by token at the last occurrence of its first token before the region, as far as the
  rendering agrees with it. The tokens the generation prompt writes at inference (``<|im_start|>
  assistant\\n<think>\\n`` for Qwen3.5) are never targets; the ones the model must produce are.
  (3) its *end*: the region's last token, plus a special token that directly follows it (only
  whitespace between): the token the model emits to end its turn. The span is header end .. end.
  Anything that does not fit (a generation prompt that does not extend the rendering, no header
  before the region, spans that overlap) raises :class:`ChatTemplateError` naming the tokenizer.

**Template options** (:func:`template_options`): the chat-template variables ``reasoning_effort`` and
``preserve_thinking`` (Qwen3.6 / Qwen3.8 templates) come from the record (a field beside its messages) or the
data config's default, and reach every rendering of the conversation, the probes above included. The mask
rules stay the same: under ``preserve_thinking`` the template keeps earlier assistant turns' reasoning in the
rendering, so it lies in those turns' regions and trains with them; without it, what the template drops is
not there to train.

Vision-language: every ``{"type": "image"}`` part becomes the ``<image>`` marker in the text the
template sees, so every template renders images the same way and the encoder expands each marker
into the model's image tokens (which never carry loss).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.data.bad_samples import BadSample
from hyper_parallel.data.tokenizer import BaseTokenizer

__all__ = [
    "CHAT_BAD_KINDS",
    "CHAT_ROLES",
    "ChatEncoding",
    "ChatTemplateError",
    "LOSS_ON_CHOICES",
    "TEMPLATE_OPTIONS",
    "check_conversation",
    "encode_chat",
    "resolve_loss_on",
    "template_options",
]

CHAT_ROLES = ("system", "user", "assistant", "tool")
"""Roles a conversation may hold."""

CHAT_BAD_KINDS = ("bad_conversation", "no_assistant")
"""``bad_conversation``: not a list of messages, an unknown role, roles in a wrong order (system
not first, an assistant or tool turn before any user turn, a tool turn not after an assistant or
tool turn, two user or two assistant turns in a row), a content part that is not text or image or
whose text is not a string; ``no_assistant``: nothing to train on (``loss_on: assistant`` and no
assistant turn)."""

LOSS_ON_CHOICES = ("document", "assistant", "all")
"""``data.chat.loss_on`` for text and vision-language data: ``document`` = ``assistant`` for a
conversation, every token for plain text; ``assistant`` = assistant turns only (plain text has none:
a ``no_assistant`` bad sample); ``all`` = every token (image tokens never train)."""

IMAGE_MARKER = "<image>"

TEMPLATE_OPTIONS: dict[str, type] = {"reasoning_effort": str, "preserve_thinking": bool}
"""Chat-template variables a record may set for its conversation (a field of that name beside its messages),
else ``data.chat.reasoning_effort`` / ``data.chat.preserve_thinking``; unset, the template's own default applies (the
Qwen3.8 template: ``reasoning_effort`` ``xhigh``, earlier turns' reasoning kept)."""

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_SENTINELS = ("\ue000", "\ue001\ue002")
"""Private-use characters: no template writes them, and the two differ in first and last character, so
the region where a rendering differs cannot grow by a coincidence with the real text."""


class ChatTemplateError(ValueError):
    """The assistant spans of a chat template cannot be found exactly (names the tokenizer)."""


def resolve_loss_on(loss_on: str, *, is_chat: bool) -> str:
    """``document`` -> ``assistant`` for a conversation, ``all`` for plain text; others unchanged."""
    if loss_on not in LOSS_ON_CHOICES:
        raise ValueError(f"loss_on={loss_on!r} must be one of {', '.join(LOSS_ON_CHOICES)}")
    if loss_on == "document":
        return "assistant" if is_chat else "all"
    return loss_on


def _bad(detail: str) -> BadSample:
    return BadSample("bad_conversation", detail)


def template_options(
    record: Mapping[str, Any] | None = None, *, reasoning_effort: str = "", preserve_thinking: bool | None = None
) -> dict[str, Any]:
    """The template variables of one conversation (:data:`TEMPLATE_OPTIONS`): the record's own fields, else the
    defaults given (``""`` / None: not passed, the template's default applies). A field of the wrong type is a
    ``bad_conversation`` bad sample."""
    out: dict[str, Any] = {}
    if reasoning_effort:
        out["reasoning_effort"] = reasoning_effort
    if preserve_thinking is not None:
        out["preserve_thinking"] = preserve_thinking
    for key, kind in TEMPLATE_OPTIONS.items():
        value = (record or {}).get(key)
        if value is None:
            continue
        if not isinstance(value, kind):
            raise _bad(f"field {key!r} must be a {kind.__name__} (a chat-template variable), got {value!r:.80}")
        out[key] = value
    return out


def _content_text(content: Any, where: str, *, images: bool) -> tuple[Any, int]:
    """The content the template gets (parts joined, images as markers) and its image count."""
    if content is None or isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        raise _bad(f"{where}: content must be a string or a list of parts, got {type(content).__name__}")
    out, n = [], 0
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise _bad(f"{where}, part {j}: a content part must be an object, got {type(part).__name__}")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"{where}, part {j}: 'text' must be a string, got {type(text).__name__}")
            out.append(text)
        elif kind == "image":
            if not images:
                raise _bad(f"{where}, part {j}: an image part in a text-only source (use the vision_language source)")
            out.append(IMAGE_MARKER)
            n += 1
        elif kind == "video" and images:  # the vision-language source expands it (data/vision_language/media.py)
            out.append("<video>")
        else:
            raise _bad(f"{where}, part {j}: type must be 'text', 'image' or 'video', got {kind!r}")
    return "".join(out), n


def check_conversation(
    messages: Any, *, system_prompt: str = "", images: bool = False
) -> tuple[list[dict[str, Any]], int]:
    """Validate a conversation (raises ``BadSample`` ``bad_conversation``/``empty``) and return it as
    the template gets it: content lists joined (images as ``<image>`` markers), ``system_prompt``
    prepended when it has no system message. Also returns the number of image parts."""
    if not isinstance(messages, list):
        raise _bad(f"a conversation must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise BadSample("empty", "the conversation has no messages")
    out: list[dict[str, Any]] = []
    n_images = 0
    previous = None
    for i, m in enumerate(messages):
        where = f"message {i}"
        if not isinstance(m, Mapping):
            raise _bad(f"{where} must be an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"{where} has role {role!r}; roles are {', '.join(CHAT_ROLES)}")
        allowed = {
            "system": (None,),
            "user": (None, "system", "assistant", "tool"),
            "assistant": ("user", "tool"),
            "tool": ("assistant", "tool"),
        }[role]
        if previous not in allowed:
            after = "at the start" if previous is None else f"after a {previous!r} message"
            raise _bad(f"{where}: a {role!r} message cannot come {after} (wrong role order)")
        content, n = _content_text(m.get("content"), where, images=images)
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            raise _bad(f"{where} ({role}) has no content")
        n_images += n
        out.append({**m, "content": content if content is not None else ""})
        previous = role
    if system_prompt and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    return out, n_images


@dataclass(slots=True)
class ChatEncoding:
    """A rendered conversation: its text, token ids and which of them are assistant tokens."""

    text: str
    ids: list[int]
    offsets: list[tuple[int, int]]
    assistant_mask: np.ndarray
    """bool ``[L]``: True where the token belongs to an assistant span (an input-side mask: the label
    of position ``t`` trains when ``assistant_mask[t + 1]``)."""
    assistant_turns: int


Encoder = Callable[[str], tuple[list[int], list[tuple[int, int]]]]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _region(text: str, variants: Sequence[str]) -> tuple[int, int]:
    """Characters of ``text`` where any variant differs from it (common prefix / suffix per variant)."""
    lo, hi = len(text), 0
    for v in variants:
        p = _common_prefix(text, v)
        room = min(len(text), len(v)) - p
        s = 0
        while s < room and text[len(text) - 1 - s] == v[len(v) - 1 - s]:
            s += 1
        lo, hi = min(lo, p), max(hi, len(text) - s)
    return lo, max(lo, hi)


def _first_token_at(offsets: Sequence[tuple[int, int]], char: int) -> int:
    """Index of the first token that ends after ``char`` (the token holding it, or the next one)."""
    for t, (_, end) in enumerate(offsets):
        if end > char:
            return t
    return len(offsets)


def _generation_mask(n: int, offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """transformers' ``return_assistant_tokens_mask``: every token whose offsets overlap a span.

    Byte-level BPE gives each byte token of a multi-byte character that character's offsets, so a span
    ending (or starting) in such a character holds all of its byte tokens, not only the first one (which
    is what "the token holding the span's last character" would give). Spans and offsets are in order:
    one pass, as transformers does it (same loop, same tie-breaks at span edges).
    """
    mask = np.zeros(n, dtype=bool)
    k = 0
    for t, (token_start, token_end) in enumerate(offsets):
        while k < len(spans) and token_start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if token_end > spans[k][0]:
            mask[t] = True
    return mask


def _name(tokenizer: BaseTokenizer) -> str:
    folder = getattr(tokenizer, "folder", None)
    return f"tokenizer folder {os.fspath(folder)!r}" if folder else repr(tokenizer)


def _derived_mask(
    tokenizer: BaseTokenizer,
    messages: list[dict[str, Any]],
    text: str,
    ids: list[int],
    offsets: list[tuple[int, int]],
    encode: Encoder,
    render: Callable[..., str],
) -> np.ndarray:
    mask = np.zeros(len(ids), dtype=bool)
    special = tokenizer.special_ids
    done = 0  # tokens before this belong to earlier turns

    def fail(i: int, why: str) -> ChatTemplateError:
        return ChatTemplateError(
            f"cannot find the assistant tokens of message {i} exactly with the chat template of {_name(tokenizer)}: "
            f"{why}. Mark the assistant text in the template with {{% generation %}} ... {{% endgeneration %}} "
            "(transformers' convention), or train on every token with loss_on all"
        )

    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        variants = []
        for sentinel in _SENTINELS:
            changed = {k: v for k, v in m.items() if k not in _REASONING_FIELDS and k != "tool_calls"}
            changed["content"] = sentinel
            try:
                variants.append(render([*messages[:i], changed, *messages[i + 1 :]]))
            except Exception as e:  # noqa: BLE001 - a template that rejects the probe
                raise fail(i, f"rendering it with other content fails ({type(e).__name__}: {e})") from None
        lo, hi = _region(text, variants)
        try:
            before, prompted = render(messages[:i]), render(messages[:i], add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001
            raise fail(i, f"rendering the messages before it fails ({type(e).__name__}: {e})") from None
        if not prompted.startswith(before) or len(prompted) == len(before):
            raise fail(i, "its generation prompt does not extend the rendering of the messages before it")
        header = encode(prompted[len(before) :])[0]
        first = _first_token_at(offsets, lo)
        # exclusive end of the region's tokens: the first token that starts at or after its end (an
        # empty region, e.g. an empty reply, holds no token unless it lies inside one)
        last = next((t for t in range(first, len(ids)) if offsets[t][0] >= hi), len(ids))
        if hi == lo and first < len(ids) and offsets[first][0] < lo:
            last = first + 1
        q = next((t for t in range(first - 1, done - 1, -1) if ids[t] == header[0]), None)
        if q is None:
            raise fail(i, f"the header its generation prompt writes ({tokenizer.decode(header)!r}) is not before it")
        n = 0
        while q + n < len(ids) and n < len(header) and ids[q + n] == header[n]:
            n += 1
        start = q + n
        end = last
        k = end
        while k < len(ids) and ids[k] not in special and not text[offsets[k][0] : offsets[k][1]].strip():
            k += 1
        if k < len(ids) and ids[k] in special:
            end = k + 1
        if start > end:
            raise fail(i, "its header runs past its text")
        mask[start:end] = True
        done = end
    return mask


def encode_chat(
    tokenizer: BaseTokenizer,
    messages: list[dict[str, Any]],
    *,
    encode: Encoder | None = None,
    **template_kwargs: Any,
) -> ChatEncoding:
    """Render checked ``messages`` (:func:`check_conversation`) and find the assistant tokens.

    ``encode(text) -> (ids, offsets)`` tokenises the rendered text (default: the tokenizer without
    special tokens added); the vision-language encoder passes one that expands image markers.
    """
    encode = encode or tokenizer.encode_with_offsets

    def render(msgs: list[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
        return tokenizer.render_chat(msgs, add_generation_prompt=add_generation_prompt, **template_kwargs)[0]

    text, spans = tokenizer.render_chat(messages, **template_kwargs)
    ids, offsets = encode(text)
    turns = sum(m["role"] == "assistant" for m in messages)
    if tokenizer.has_generation_marks:
        mask = _generation_mask(len(ids), offsets, spans)
    else:
        mask = _derived_mask(tokenizer, messages, text, ids, offsets, encode, render)
    return ChatEncoding(text, list(ids), list(offsets), mask, turns)
