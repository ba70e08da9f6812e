"""HuggingFaceTokenizer against transformers.AutoTokenizer (the oracle) on the same folders.

The folders are the toy tokenizer (data/text/toy_text.py) and variants of it that exercise every
rule of the bos/eos policy, special-token lookup and chat-template lookup (see data/tokenizer.py).
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer, processors
from transformers import AutoTokenizer

from hyper_parallel.data.text.toy_text import TOY_CHAT_TEMPLATE, cached_toy_text, make_toy_chats, make_toy_documents, ToyTextSpec
from hyper_parallel.data.tokenizer import HuggingFaceTokenizer

SPEC = ToyTextSpec()

STRINGS = [
    "",
    " ",
    "Hello  world\n\ttabs",
    "naïve café — 東京 🚀",
    "text with <s> and </s> and <|im_start|> inside",
    "  leading spaces",
    "trailing   ",
    *[d["text"] for d in make_toy_documents(SPEC)[:24]],
]

RICH_TEMPLATE = """{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
{%- if m['role'] == 'system' and not loop.first -%}{{ raise_exception('the system message must come first') }}{%- endif -%}
{%- if m['role'] == 'tool' -%}{% continue %}{%- endif -%}
{%- set ns.n = ns.n + 1 -%}
<|im_start|>{{ m['role'] }} #{{ ns.n }}{% if m.name is defined %} ({{ m.name }}){% endif %}
{{ m['content'] }}{% if m.meta is defined %} {{ m.meta | tojson }}{% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
{{ eos_token }}"""

CHATS = [
    *[c["messages"] for c in make_toy_chats(SPEC)[:8]],
    [
        {"role": "system", "content": "Be brief.", "name": None},
        {"role": "user", "content": "Tool?", "name": "ann", "meta": {"q": "é<&>", "n": [1, 2]}},
        {"role": "tool", "content": "ignored"},
        {"role": "assistant", "content": "Yes."},
    ],
]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return cached_toy_text(str(tmp_path_factory.mktemp("cache")), SPEC)


def _variant(root: Path, toy_dir: str, name: str, *, config: dict, post_processor="keep", files: dict | None = None) -> str:
    """A copy of the toy tokenizer with ``config`` as tokenizer_config.json and a chosen post-processor."""
    folder = root / name
    folder.mkdir()
    tok = Tokenizer.from_file(str(Path(toy_dir) / "tokenizer.json"))
    if isinstance(post_processor, processors.PostProcessor):
        tok.post_processor = post_processor
    data = json.loads(tok.to_str())
    if post_processor is None:
        data["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    for fname, content in (files or {}).items():
        (folder / fname).write_text(content if isinstance(content, str) else json.dumps(content))
    return str(folder)


def _bos_pp(bos="<s>", bos_id=1):
    return processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)])


VARIANTS = {
    # name -> (tokenizer_config.json, post_processor of tokenizer.json, extra files, expected (adds_bos, adds_eos))
    "toy": None,
    "file_post_processor_decides": (
        {"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
                   "single_word": False, "special": True}, "eos_token": "</s>"}, _bos_pp(), {}, (True, False)),
    "config_flags_are_ignored": (
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "add_eos_token": True}, _bos_pp(), {}, (True, False)),
    "no_post_processor": (
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True}, None, {}, (False, False)),
    "eos_post_processor": (
        {"bos_token": "<s>", "eos_token": "</s>"},
        processors.TemplateProcessing(single="$A:0 </s>:0", pair="$A:0 $B:1 </s>:1", special_tokens=[("</s>", 2)]),
        {}, (False, True)),
    "bos_missing_from_vocab": ({"bos_token": "<|begin|>", "eos_token": "</s>"}, None, {}, (False, False)),
    "legacy_special_tokens_map": (
        {}, None, {"special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}},
        (False, False)),
    "jinja_file_wins": (
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TOY_CHAT_TEMPLATE}, "keep",
        {"chat_template.jinja": RICH_TEMPLATE}, (True, False)),
    "template_list": (
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": [
            {"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "default", "template": RICH_TEMPLATE}]},
        "keep", {}, (True, False)),
}


@pytest.fixture(scope="module")
def folders(toy, tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    out = {"toy": (toy.tokenizer_dir, (True, False))}
    for name, v in VARIANTS.items():
        if v is not None:
            config, pp, files, expect = v
            out[name] = (_variant(root, toy.tokenizer_dir, name, config=config, post_processor=pp, files=files), expect)
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_transformers(folders, name):
    folder, (adds_bos, adds_eos) = folders[name]
    ours = HuggingFaceTokenizer.from_folder(folder)
    hf = AutoTokenizer.from_pretrained(folder)
    assert ours.vocab_size == len(hf)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert (ours.adds_bos, ours.adds_eos) == (adds_bos, adds_eos)
    for text in STRINGS:
        assert ours.encode(text) == hf(text)["input_ids"], text
        plain = ours.encode(text, add_special_tokens=False)
        assert plain == hf(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(plain) == hf.decode(plain) == text, text
    assert ours.encode_batch(STRINGS) == [hf(t)["input_ids"] for t in STRINGS]
    with_special = ours.encode("a </s> b")
    assert ours.decode(with_special, skip_special_tokens=True) == hf.decode(with_special, skip_special_tokens=True)
    # the policy in words: adds_bos/adds_eos describe what encode() does
    ids = ours.encode("hello")
    assert (ids[0] == ours.bos_id) == adds_bos and (ids[-1] == ours.eos_id) == adds_eos


@pytest.mark.parametrize("name", ["toy", "jinja_file_wins", "template_list"])
def test_chat_template_matches_transformers(folders, name):
    folder, _ = folders[name]
    ours = HuggingFaceTokenizer.from_folder(folder)
    hf = AutoTokenizer.from_pretrained(folder)
    assert ours.chat_template == (TOY_CHAT_TEMPLATE if name == "toy" else RICH_TEMPLATE)
    for messages in CHATS:
        for gen in (False, True):
            rendered = ours.apply_chat_template(messages, add_generation_prompt=gen)
            assert rendered == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            tokens = hf.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=gen)
            assert ours.encode(rendered, add_special_tokens=False) == tokens
    # a tokenizer that has rendered still pickles (DataLoader workers) and renders the same after
    clone = pickle.loads(pickle.dumps(ours))
    assert clone.apply_chat_template(CHATS[-1]) == ours.apply_chat_template(CHATS[-1])
    assert clone.encode(STRINGS[3]) == ours.encode(STRINGS[3])
    if name != "toy":
        bad = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
        with pytest.raises(jinja2.TemplateError, match="must come first"):
            hf.apply_chat_template(bad, tokenize=False)
        with pytest.raises(jinja2.TemplateError, match="must come first"):
            ours.apply_chat_template(bad)


def test_special_ids_fall_back_to_generation_and_model_config(toy, tmp_path):
    folder = _variant(tmp_path, toy.tokenizer_dir, "ids_only", config={}, post_processor=None, files={
        "generation_config.json": {"eos_token_id": [2, 4]},
        "config.json": {"bos_token_id": 1, "eos_token_id": 3, "pad_token_id": 0},
    })
    tok = HuggingFaceTokenizer.from_folder(folder)
    # generation_config.json wins over config.json; a list names the first id; nothing is added by encode
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 0)
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_folder_without_tokenizer_json(toy, tmp_path):
    folder = tmp_path / "no_json"
    folder.mkdir()
    shutil.copy(Path(toy.tokenizer_dir) / "tokenizer_config.json", folder)
    with pytest.raises(FileNotFoundError) as e:
        HuggingFaceTokenizer.from_folder(folder)
    assert str(folder) in str(e.value) and "tokenizer.json" in str(e.value) and "tokenizer_config.json" in str(e.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HuggingFaceTokenizer.from_folder(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="path is empty"):
        HuggingFaceTokenizer.Config().build()


def test_template_list_without_default(toy, tmp_path):
    folder = _variant(tmp_path, toy.tokenizer_dir, "no_default", config={
        "chat_template": [{"name": "tool_use", "template": "x"}]})
    with pytest.raises(ValueError, match="none named 'default'"):
        HuggingFaceTokenizer.from_folder(folder)
