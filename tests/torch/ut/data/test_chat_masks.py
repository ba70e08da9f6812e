"""Assistant-only loss masks (hyper_parallel/data/chat.py) on the real chat templates, token by token.

Templates (tests/torch/ut/data/chat_templates/, see SOURCES.md there): Qwen3.5, Qwen3-VL (Thinking) and
GLM-4.7. The tokenizers are small byte-level BPEs with the special and added tokens each family's real
tokenizer has (the masks depend on the template and on which tokens are special, not on the merges).

Every expected mask is written by hand: the rendered string cut into pieces, each marked trained (1) or
not (0). A piece is tokenised on its own; the test first checks that the pieces' tokens concatenate to
the tokens of the whole rendering (so a hand boundary never splits a token).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from hyper_parallel.data.bad_samples import BadSample
from hyper_parallel.data.chat import ChatTemplateError, check_conversation, encode_chat
from hyper_parallel.data.tokenizer import HuggingFaceTokenizer

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"

QWEN_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
GLM_SPECIAL = ["[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|system|>", "<|observation|>", "<|endoftext|>"]
GLM_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
             "</arg_value>", "<tool_response>", "</tool_response>"]  # fmt: skip
FAMILIES = {
    "qwen3_5": (QWEN_SPECIAL, QWEN_ADDED, "<|im_end|>"),
    "qwen3_vl_thinking": (QWEN_SPECIAL, QWEN_ADDED, "<|im_end|>"),
    "glm4_7": (GLM_SPECIAL, GLM_ADDED, "<|endoftext|>"),
}
CORPUS = ["What is the weather in Paris today? It is sunny and warm. Let me think about it.",
          "Hello there, call get_weather with city. assistant user system tool"]  # fmt: skip


def make_folder(out: Path, template: str, special: list[str], added: list[str], eos: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos})
    )
    (out / "chat_template.jinja").write_text(template)
    return out


@pytest.fixture(scope="module")
def tokenizers_(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tok")
    return {
        name: HuggingFaceTokenizer.from_folder(make_folder(root / name, (TEMPLATES / f"{name}.jinja").read_text(), *spec))
        for name, spec in FAMILIES.items()
    }


CASES = {
    "single": [{"role": "user", "content": "What is the weather?"}, {"role": "assistant", "content": "It is sunny."}],
    "multi_reasoning": [
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Let me think."},
        {"role": "user", "content": "And in Paris?"},
        {"role": "assistant", "content": "It is warm.", "reasoning_content": "Paris today."},
    ],
    "system": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello there."},
    ],
    "tool_calls": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ],  # fmt: skip
    "two_images": [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What is the weather?"}]},
        {"role": "assistant", "content": "It is sunny."},
    ],
    "empty_reply": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": ""}],
}

# -- the hand-written masks: (piece of the rendered string, trained) -----------------------------------
U = "<|im_start|>user\n"
A = "<|im_start|>assistant\n"
A_THINK = "<|im_start|>assistant\n<think>\n"  # what the Qwen templates' generation prompt writes

QWEN3_5 = {
    "single": [(U + "What is the weather?<|im_end|>\n" + A_THINK, 0), ("\n</think>\n\nIt is sunny.<|im_end|>", 1), ("\n", 0)],
    # the first turn is before the last user query: the template drops its reasoning (and its <think>)
    "multi_reasoning": [
        (U + "What is the weather?<|im_end|>\n" + A, 0), ("It is sunny.<|im_end|>", 1),
        ("\n" + U + "And in Paris?<|im_end|>\n" + A_THINK, 0), ("Paris today.\n</think>\n\nIt is warm.<|im_end|>", 1),
        ("\n", 0),
    ],
    "system": [
        ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + U + "Hello<|im_end|>\n" + A_THINK, 0),
        ("\n</think>\n\nHello there.<|im_end|>", 1), ("\n", 0),
    ],
    "tool_calls": [
        (U + "Weather in Paris?<|im_end|>\n" + A_THINK, 0),
        ("\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
         "</tool_call><|im_end|>", 1),
        ("\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" + A_THINK, 0),
        ("\n</think>\n\nIt is sunny.<|im_end|>", 1), ("\n", 0),
    ],
    "two_images": [
        (U + "<image><image>What is the weather?<|im_end|>\n" + A_THINK, 0),
        ("\n</think>\n\nIt is sunny.<|im_end|>", 1), ("\n", 0),
    ],
    "empty_reply": [(U + "Hello<|im_end|>\n" + A_THINK, 0), ("\n</think>\n\n<|im_end|>", 1), ("\n", 0)],
}  # fmt: skip

QWEN3_VL = {
    **QWEN3_5,
    # Qwen3-VL renders tool calls as JSON, and an empty reasoning turn that is not the last without <think>
    "tool_calls": [
        (U + "Weather in Paris?<|im_end|>\n" + A, 0),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>', 1),
        ("\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" + A_THINK, 0),
        ("\n</think>\n\nIt is sunny.<|im_end|>", 1), ("\n", 0),
    ],
}  # fmt: skip

GLM4_7 = {
    # GLM writes no end-of-turn token: the model ends a turn with the next role token (<|user|>,
    # <|observation|>); the last turn of a conversation has none in the rendering.
    "single": [("[gMASK]<sop><|user|>What is the weather?<|assistant|>", 0), ("</think>It is sunny.", 1)],
    "multi_reasoning": [
        ("[gMASK]<sop><|user|>What is the weather?<|assistant|>", 0), ("</think>It is sunny.<|user|>", 1),
        ("And in Paris?<|assistant|><think>", 0), ("Paris today.</think>It is warm.", 1),
    ],
    "system": [("[gMASK]<sop><|system|>You are a helpful assistant.<|user|>Hello<|assistant|>", 0), ("</think>Hello there.", 1)],
    "tool_calls": [
        ("[gMASK]<sop><|user|>Weather in Paris?<|assistant|>", 0),
        ("</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call><|observation|>", 1),
        ("<tool_response>sunny</tool_response><|assistant|>", 0), ("</think>It is sunny.", 1),
    ],
    "two_images": [("[gMASK]<sop><|user|><image><image>What is the weather?<|assistant|>", 0), ("</think>It is sunny.", 1)],
    "empty_reply": [("[gMASK]<sop><|user|>Hello<|assistant|>", 0), ("</think>", 1)],
}  # fmt: skip

EXPECTED = {"qwen3_5": QWEN3_5, "qwen3_vl_thinking": QWEN3_VL, "glm4_7": GLM4_7}


def hand_mask(tok: HuggingFaceTokenizer, pieces: list[tuple[str, int]]) -> tuple[str, list[int], np.ndarray]:
    ids: list[int] = []
    mask: list[bool] = []
    for text, trained in pieces:
        piece_ids = tok.encode(text, add_special_tokens=False)
        ids += piece_ids
        mask += [bool(trained)] * len(piece_ids)
    return "".join(t for t, _ in pieces), ids, np.array(mask)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("case", list(CASES))
def test_mask_matches_hand_written(tokenizers_, family, case):
    tok = tokenizers_[family]
    messages, n_images = check_conversation(CASES[case], images=True)
    assert n_images == (2 if case == "two_images" else 0)
    got = encode_chat(tok, messages)
    text, ids, mask = hand_mask(tok, EXPECTED[family][case])
    assert got.text == text
    assert got.ids == ids == tok.encode(text, add_special_tokens=False)
    assert got.assistant_mask.tolist() == mask.tolist(), [
        (tok.decode([i]), bool(m), bool(e)) for i, m, e in zip(ids, got.assistant_mask, mask) if m != e
    ]
    assert got.assistant_turns == sum(m["role"] == "assistant" for m in CASES[case])


def test_default_system_prompt(tokenizers_):
    tok = tokenizers_["qwen3_5"]
    with_default, _ = check_conversation(CASES["single"], system_prompt="Be brief.")
    assert with_default[0] == {"role": "system", "content": "Be brief."}
    text = encode_chat(tok, with_default).text
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    own, _ = check_conversation(CASES["system"], system_prompt="Be brief.")
    assert own == CASES["system"]  # a conversation's own system message wins


@pytest.mark.parametrize(
    "messages, detail",
    [
        ("not a list", "must be a list"),
        ([{"role": "assistant", "content": "hi"}], "cannot come at the start"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "wrong role order"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "wrong role order"),
        ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "wrong role order"),
        ([{"role": "bot", "content": "a"}], "has role 'bot'"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "part 0: 'text' must be a string"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "type must be 'text'"),
        ([{"role": "user", "content": None}], "has no content"),
    ],
)
def test_bad_conversations_are_named(messages, detail):
    with pytest.raises(BadSample) as e:
        check_conversation(messages, images=True)
    assert e.value.kind == "bad_conversation" and detail in e.value.detail


def test_image_part_in_text_source():
    with pytest.raises(BadSample, match="image part in a text-only source"):
        check_conversation(CASES["two_images"], images=False)


GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_generation_marks_match_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hyper_parallel.data.text import cached_toy_text

    toy = cached_toy_text(str(tmp_path / "cache"))
    folder = tmp_path / "gen"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((Path(toy.tokenizer_dir) / name).read_bytes())
    (folder / "chat_template.jinja").write_text(GENERATION_TEMPLATE)
    ours = HuggingFaceTokenizer.from_folder(folder)
    assert ours.has_generation_marks
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    chats = [
        CASES["single"], CASES["system"], CASES["empty_reply"],
        [{"role": "user", "content": "Tell me about the cat."}, {"role": "assistant", "content": "The cat sees a red ball."},
         {"role": "user", "content": "And the dog?"}, {"role": "assistant", "content": "A dog likes the big house."}],
    ]  # fmt: skip
    trained = 0
    for chat in chats:
        messages, _ = check_conversation(chat)
        got = encode_chat(ours, messages)
        out = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert got.ids == list(out["input_ids"])
        assert got.assistant_mask.astype(int).tolist() == list(out["assistant_masks"])
        trained += int(got.assistant_mask.sum())
    assert trained > 0


def test_template_whose_spans_cannot_be_found(tmp_path, tokenizers_):
    # A generation prompt that is not what the assistant turns start with: no header before the text.
    bad = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}[A]{% else %}[U]{% endif %}{{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    folder = make_folder(tmp_path / "bad", bad, *FAMILIES["qwen3_5"])
    tok = HuggingFaceTokenizer.from_folder(folder)
    messages, _ = check_conversation(CASES["single"])
    with pytest.raises(ChatTemplateError, match=f"tokenizer folder {str(folder)!r}"):
        encode_chat(tok, messages)


def test_pickled_tokenizer_still_tracks_generation(tmp_path):
    import pickle

    folder = make_folder(tmp_path / "g", GENERATION_TEMPLATE.replace("{{ bos_token }}", ""), *FAMILIES["qwen3_5"])
    tok = pickle.loads(pickle.dumps(HuggingFaceTokenizer.from_folder(folder)))
    messages, _ = check_conversation(CASES["single"])
    got = encode_chat(tok, messages)
    # trim_blocks eats the newline after {% endif %}: turns follow each other directly
    text, ids, mask = hand_mask(tok, [(U + "What is the weather?<|im_end|>" + A, 0), ("It is sunny.<|im_end|>", 1)])
    assert got.text == text and got.ids == ids
    assert got.assistant_mask.tolist() == mask.tolist()
    assert os.fspath(folder) in repr(tok)
