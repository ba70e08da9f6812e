"""SFT masks at a multi-byte character: every token whose offsets overlap an assistant span trains, exactly as
transformers' ``return_assistant_tokens_mask`` (the oracle), marked and derived spans alike (issue 36).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hyper_parallel.data.chat import check_conversation, encode_chat
from hyper_parallel.data.tokenizer import HuggingFaceTokenizer
from tests.torch.ut.data.test_chat_masks import FAMILIES, make_folder


USER = "{% if m['role'] == 'user' %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n"
PROMPT = "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


# the issue's minimal template: the generation block holds the reply only, <|im_end|> follows it
ISSUE_TEMPLATE = (
    "{% for m in messages %}" + USER + "{% else %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}{% endgeneration %}<|im_end|>\n{% endif %}" + PROMPT
)


def _template(marked: bool, *, end_token: bool) -> str:
    """An assistant turn ``<|im_start|>assistant\\n`` + reply (+ ``<|im_end|>``) + ``\\n``; ``marked`` wraps
    exactly the span the derived path finds (the reply and the end token after it) in a generation block."""
    end = "<|im_end|>" if end_token else ""
    body = "{{ m['content'] }}" + end
    if marked:
        body = "{% generation %}" + body + "{% endgeneration %}"
    # the newline as an expression: trim_blocks (transformers' jinja setting) eats one right after a block tag
    turn = "{% else %}<|im_start|>assistant\n" + body + "{{ '\\n' }}{% endif %}"
    return "{% for m in messages %}" + USER + turn + PROMPT


def _chat(reply: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": reply}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Byte-level BPEs with no merge for the CJK / accented characters below (their bytes are separate tokens)."""
    root = tmp_path_factory.mktemp("defect_tok")
    templates = {"issue": ISSUE_TEMPLATE}
    for end_token in (True, False):
        for marked in (True, False):
            templates[f"{'marked' if marked else 'derived'}_{'end' if end_token else 'noend'}"] = _template(
                marked, end_token=end_token
            )
    return {name: make_folder(root / name, t, *FAMILIES["qwen3_5"]) for name, t in templates.items()}


def _oracle(folder: Path, chat: list[dict[str, str]]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    out = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"]), list(out.encodings[0].offsets)


def _ours(folder: Path, chat: list[dict[str, str]]):
    tok = HuggingFaceTokenizer.from_folder(folder)
    messages, _ = check_conversation(chat)
    return tok, encode_chat(tok, messages)


def _byte_tokens(offsets: list[tuple[int, int]], text: str, char: str) -> list[int]:
    """Tokens that hold (a byte of) the last occurrence of ``char`` (several share its offsets)."""
    at = text.rindex(char)
    return [t for t, (a, b) in enumerate(offsets) if a <= at < b]


def test_issue_case_reply_ending_in_a_multibyte_character(folders):
    """``"Thanks 。"`` in the issue's template: all three byte tokens of 。 train (before the fix: 1, 0, 0)."""
    chat = _chat("Thanks 。")
    ids, want, offsets = _oracle(folders["issue"], chat)
    tok, got = _ours(folders["issue"], chat)
    assert tok.has_generation_marks and got.ids == ids
    cjk = _byte_tokens(offsets, got.text, "。")
    assert len(cjk) == 3, "the test tokenizer must split 。 into its three bytes"
    assert [want[t] for t in cjk] == [1, 1, 1]
    assert got.assistant_mask.astype(int).tolist() == want


@pytest.mark.parametrize("reply", ["Thanks 。", "。Thanks", "é", "。 sunny é"])
@pytest.mark.parametrize("end_token", [True, False], ids=["end_token", "no_end_token"])
def test_marked_and_derived_spans_at_multibyte_edges(folders, reply, end_token):
    """A reply ending in, starting with, or being multi-byte characters: the marked path equals transformers'
    mask on the marked template, and the derived path (the same template without marks) equals it too."""
    suffix = "end" if end_token else "noend"
    chat = _chat(reply)
    ids, want, offsets = _oracle(folders[f"marked_{suffix}"], chat)
    tok, marked = _ours(folders[f"marked_{suffix}"], chat)
    assert tok.has_generation_marks and marked.ids == ids
    lo = marked.text.rindex(reply)
    reply_tokens = [t for t, (a, b) in enumerate(offsets) if a < lo + len(reply) and b > lo]
    assert reply_tokens and all(want[t] for t in reply_tokens)  # the oracle trains every byte token of the reply
    assert marked.assistant_mask.astype(int).tolist() == want
    tok, derived = _ours(folders[f"derived_{suffix}"], chat)
    assert not tok.has_generation_marks and derived.ids == ids
    assert derived.assistant_mask.astype(int).tolist() == want
