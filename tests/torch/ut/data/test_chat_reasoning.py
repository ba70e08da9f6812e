"""The chat path with a Qwen3.8-form template (``data/chat_templates/qwen3_8_small.jinja``): ``preserve_thinking``
and ``reasoning_effort`` reach the rendering, from a record's own field or the data config's default, and the
assistant-mask rules stay those of the SFT feature (hand-written masks, token by token):

- under ``preserve_thinking`` (the Qwen3.8 default) an earlier assistant turn's reasoning is in the rendering and
  trains with its turn; ``preserve_thinking: false`` drops it (the last turn keeps its block, as the template says);
- ``reasoning_effort`` defaults to the template's ``xhigh`` (its instruction opens the system turn), a data default
  or a record field changes it (``medium``: no instruction); a value the template refuses is a bad record;
- the same through the text records reader, the text loader (its token cache keyed by them) and the
  vision-language encoder, and ``--data.*`` on the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.data.chat import check_conversation, encode_chat, template_options
from hyper_parallel.data.text.records import TextRecordSpec, iter_text_documents
from hyper_parallel.data.tokenizer import HuggingFaceTokenizer
from tests.torch.ut.data.test_chat_masks import QWEN_ADDED, QWEN_SPECIAL, hand_mask, make_folder
from tests.torch.helpers import write_jsonl

TEMPLATE = Path(__file__).parents[1] / "data" / "chat_templates" / "qwen3_8_small.jinja"
XHIGH = ("Reasoning effort is set to xhigh. Please think carefully through the task, validate key assumptions, "
         "consider plausible alternatives, and prioritize correctness, consistency, and clarity in the final "
         "answer.")  # fmt: skip
LOW = ("Reasoning effort is set to low. Keep your thinking brief and focused, moving directly to the conclusion "
       "without unnecessary elaboration.")  # fmt: skip

CHAT = [
    {"role": "user", "content": "What is the weather?"},
    {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Let me think."},
    {"role": "user", "content": "And in Paris?"},
    {"role": "assistant", "content": "It is warm.", "reasoning_content": "Paris today."},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("qwen3_8_tok"), TEMPLATE.read_text(), QWEN_SPECIAL, QWEN_ADDED,
                       "<|im_end|>")  # fmt: skip


@pytest.fixture(scope="module")
def tok(folder) -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer.from_folder(folder)


def _system(effort: str | None) -> list[tuple[str, int]]:
    return [(f"<|im_start|>system\n{effort}<|im_end|>\n", 0)] if effort else []


def _expected(*, preserve: bool, effort: str | None = XHIGH) -> list[tuple[str, int]]:
    first = "<think>\nLet me think.\n</think>\n\nIt is sunny.<|im_end|>" if preserve else "It is sunny.<|im_end|>"
    return [
        *_system(effort),
        ("<|im_start|>user\nWhat is the weather?<|im_end|>\n<|im_start|>assistant\n", 0),
        # the generation prompt writes "<think>\n" at inference: never a target, here as for Qwen3.5 (test_chat_masks)
        *([("<think>\n", 0), ("Let me think.\n</think>\n\nIt is sunny.<|im_end|>", 1)] if preserve else [(first, 1)]),
        ("\n<|im_start|>user\nAnd in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n", 0),
        ("Paris today.\n</think>\n\nIt is warm.<|im_end|>", 1),
        ("\n", 0),
    ]


def _check(tok, got, pieces) -> None:
    text, ids, mask = hand_mask(tok, pieces)
    assert got.text == text
    assert got.ids == ids == tok.encode(text, add_special_tokens=False)
    assert got.assistant_mask.tolist() == mask.tolist(), [
        (tok.decode([i]), bool(m), bool(e)) for i, m, e in zip(ids, got.assistant_mask, mask) if m != e
    ]


def _trained(tok, got) -> str:
    return tok.decode([i for i, m in zip(got.ids, got.assistant_mask) if m])


@pytest.mark.parametrize("preserve", [None, True, False], ids=["template_default", "true", "false"])
def test_preserve_thinking_keeps_and_trains_earlier_reasoning(tok, preserve):
    messages = check_conversation(CHAT)[0]
    got = encode_chat(tok, messages, **template_options(preserve_thinking=preserve))
    kept = preserve is not False  # Qwen3.8: undefined counts as true
    _check(tok, got, _expected(preserve=kept))
    assert ("Let me think." in _trained(tok, got)) == kept  # the earlier turn's reasoning trains with its turn
    assert "Paris today." in _trained(tok, got)  # the last turn keeps its block either way


@pytest.mark.parametrize(
    ("default", "record", "instruction"),
    [("", None, XHIGH), ("low", None, LOW), ("low", "medium", None), ("", "low", LOW), ("medium", "xhigh", XHIGH)],
    ids=["template_default", "data_default", "record_over_default", "record", "record_xhigh"],
)
def test_reasoning_effort_reaches_the_rendering(tok, default, record, instruction):
    messages = check_conversation(CHAT)[0]
    options = template_options({"reasoning_effort": record} if record else {}, reasoning_effort=default)
    got = encode_chat(tok, messages, **options)
    _check(tok, got, _expected(preserve=True, effort=instruction))  # masks as always: the system turn never trains
    system = check_conversation(CHAT, system_prompt="Be brief.")[0]  # the instruction goes before a system message
    text = encode_chat(tok, system, **options).text
    assert text.startswith("<|im_start|>system\n" + (f"{instruction}\n\nBe brief." if instruction else "Be brief."))


def test_text_records_take_the_record_field_or_the_default(tmp_path, tok):
    rows = [{"messages": CHAT}, {"messages": CHAT, "reasoning_effort": "medium"},
            {"messages": CHAT, "reasoning_effort": "high"},  # the template refuses it: a bad record, named
            {"messages": CHAT, "preserve_thinking": "yes"}]  # fmt: skip
    spec = TextRecordSpec(chat_column="messages", reasoning_effort="low", preserve_thinking=False)
    counts: dict[str, int] = {}
    skipped: list[str] = []
    docs = list(iter_text_documents([write_jsonl(tmp_path / "chats.jsonl", rows)], tok, spec, on_bad_sample="skip",
                                    bad_counts=counts, on_skip=skipped.append))  # fmt: skip
    assert [d.row for d in docs] == [0, 1]
    assert counts == {"undecodable": 1, "bad_conversation": 1}, skipped
    assert "Unexpected reasoning effort high" in skipped[0] and "'preserve_thinking' must be a bool" in skipped[1]
    texts = [tok.decode(d.tokens.tolist()) for d in docs]
    assert texts[0].startswith(f"<|im_start|>system\n{LOW}<|im_end|>") and "Let me think." not in texts[0]
    assert texts[1].startswith("<|im_start|>user\n")  # medium: no instruction
    for d in docs:  # the data defaults went through the same mask rules
        _, _, mask = hand_mask(tok, _expected(preserve=False, effort=LOW if d.row == 0 else None))
        assert d.assistant_mask.tolist() == mask.tolist()


def test_vision_language_encoder_and_the_cli_pass_them(folder):
    from hyper_parallel.config import ConfigManager
    from hyper_parallel.data.vision_language.preprocess import ImageProcessor
    from hyper_parallel.data.vision_language.sample import make_encoder

    facts = dict(vocab_size=520, image_token_id=512, vision_start_token_id=513, vision_end_token_id=514,
                 patch_size=16, temporal_patch_size=2, merge_size=2)  # fmt: skip
    image = ImageProcessor.Config(min_pixels=32 * 32, max_pixels=64 * 64)
    encoder = make_encoder(str(folder), image, facts, reasoning_effort="low", preserve_thinking=False)
    files = {"json": json.dumps({"messages": CHAT}).encode()}
    record = encoder.parse("k", files)
    tok = encoder.tokenizer
    _, ids, mask = hand_mask(tok, _expected(preserve=False, effort=LOW))
    assert record.input_ids.tolist() == ids and np.asarray(record.assistant_mask).tolist() == mask.tolist()
    own = encoder.parse("k", {"json": json.dumps({"messages": CHAT, "reasoning_effort": "xhigh"}).encode()})
    assert tok.decode(own.input_ids.tolist()).startswith(f"<|im_start|>system\n{XHIGH}")
    assert encoder.index_params()["template_defaults"] == {"reasoning_effort": "low", "preserve_thinking": False}

    cfg = ConfigManager().parse_args(["--module", "qwen3_vl_moe", "--config", "qwen3_5_vl_debug",
                                      "--data.chat.reasoning_effort", "medium",
                                      "--data.chat.preserve_thinking", "False"])  # fmt: skip
    assert (cfg.data.chat.reasoning_effort, cfg.data.chat.preserve_thinking) == ("medium", False)


@pytest.mark.parametrize("preserve", [False, True])
def test_text_loader_passes_the_data_defaults(folder, tok, tmp_path, preserve):
    """``--data.chat.reasoning_effort`` / ``--data.chat.preserve_thinking`` through the text loader (its token cache is keyed
    by them: one cache folder, two settings, two renderings), labels as the hand-written mask says."""
    import hyper_parallel.data  # noqa: F401 - registers the sources
    from hyper_parallel.data.base import DataConfig
    from hyper_parallel.data.source_config import ChatOptions, TextOptions

    shared = tmp_path.parent / "shared"  # both parameters' runs read the same file through the same cache
    shared.mkdir(exist_ok=True)
    path = str(shared / "chats.jsonl")
    if not Path(path).exists():
        write_jsonl(Path(path), [{"messages": CHAT}])
    cache = shared / "cache"
    cfg = DataConfig(source="text", path=path, tokenizer=str(folder), text=TextOptions(chat_column="messages"),
                     cache_dir=str(cache), max_tokens_per_microbatch=256, shuffle_buffer=1, packing_bins=1,
                     chat=ChatOptions(reasoning_effort="low", preserve_thinking=preserve))  # fmt: skip
    mb = cfg.build(model_facts={"vocab_size": 512}).next_step()[0]
    _, ids, mask = hand_mask(tok, _expected(preserve=preserve, effort=LOW))
    n = len(ids)
    assert mb["input_ids"][0, :n].tolist() == ids
    want = [i if m else -100 for i, m in zip(ids, mask)][1:] + [-100]
    assert mb["labels"][0, :n].tolist() == want
