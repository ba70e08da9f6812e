"""Chat fine-tuning data end to end: assistant-only labels from the text and vision-language loaders, bad
conversations, long-conversation policies, and the trainer's loss on assistant-only data against a hand
computation (one process; the FSDP2 layout is tests/torch/st/test_chat_sft_layouts.py)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import hyper_parallel.data  # noqa: F401 - registers the sources
from hyper_parallel.data.bad_samples import BadSampleError
from hyper_parallel.data.base import DataConfig
from hyper_parallel.data.source_config import ChatOptions, TextOptions
from hyper_parallel.data.tokenizer import HuggingFaceTokenizer
from tests.torch.ut.data.test_chat_masks import FAMILIES, TEMPLATES, hand_mask, make_folder
from tests.torch.helpers import write_jsonl

U, A_THINK = "<|im_start|>user\n", "<|im_start|>assistant\n<think>\n"
CHATS = [
    {"id": "a", "messages": [{"role": "user", "content": "What is the weather?"}, {"role": "assistant", "content": "It is sunny."}]},
    {"id": "b", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                             {"role": "assistant", "content": "Hello there.", "reasoning_content": "Greet."}]},
]  # fmt: skip
# hand-written: what the Qwen3.5 template renders for CHATS, and which pieces train
HAND = [
    [(U + "What is the weather?<|im_end|>\n" + A_THINK, 0), ("\n</think>\n\nIt is sunny.<|im_end|>", 1), ("\n", 0)],
    [("<|im_start|>system\nBe brief.<|im_end|>\n" + U + "Hello<|im_end|>\n" + A_THINK, 0),
     ("Greet.\n</think>\n\nHello there.<|im_end|>", 1), ("\n", 0)],
]  # fmt: skip


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("qwen") / "tok", (TEMPLATES / "qwen3_5.jinja").read_text(), *FAMILIES["qwen3_5"])


def _documents(mb: dict) -> list[tuple[list[int], list[int]]]:
    cu = mb["cu_seqlens"].tolist()
    ids, labels = mb["input_ids"][0].tolist(), mb["labels"][0].tolist()
    return [(ids[a:b], labels[a:b]) for a, b in zip(cu[:-1], cu[1:])]


def _text_loader(path: str, tok: str, cache: Path, **kw) -> object:
    chat = ChatOptions(**{k: kw.pop(k) for k in list(kw) if k in ChatOptions.__dataclass_fields__})
    cfg = DataConfig(source="text", path=path, tokenizer=tok, text=TextOptions(chat_column="messages"),
                     cache_dir=str(cache), max_tokens_per_microbatch=kw.pop("max_tokens", 256), shuffle_buffer=1,
                     packing_bins=1, chat=chat, **kw)  # fmt: skip
    return cfg.build(model_facts={"vocab_size": 512})


def _expected_labels(tok: HuggingFaceTokenizer, pieces, *, assistant: bool = True) -> list[int]:
    _, ids, mask = hand_mask(tok, pieces)
    targets = [i if (m or not assistant) else -100 for i, m in zip(ids, mask)]
    return targets[1:] + [-100]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_text_loader_trains_assistant_turns_only(qwen_folder, tmp_path, fmt):
    tok = HuggingFaceTokenizer.from_folder(qwen_folder)
    path = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = str(tmp_path / "chats.parquet")
        # reasoning_content is null in row a: parquet gives every row every column
        pq.write_table(pa.Table.from_pylist(CHATS), path)
    for loss_on, assistant in (("document", True), ("assistant", True), ("all", False)):
        loader = _text_loader(path, str(qwen_folder), tmp_path / f"cache_{loss_on}", loss_on=loss_on)
        docs = _documents(loader.next_step()[0])  # a, b, a, b, ... (the corpus repeats; no shuffle)
        for (ids, labels), pieces in zip(docs[:2], HAND, strict=True):
            assert ids == hand_mask(tok, pieces)[1]
            assert labels == _expected_labels(tok, pieces, assistant=assistant), loss_on


def test_default_system_prompt_in_loader(qwen_folder, tmp_path):
    tok = HuggingFaceTokenizer.from_folder(qwen_folder)
    path = write_jsonl(tmp_path / "c.jsonl", CHATS[:1])
    loader = _text_loader(path, str(qwen_folder), tmp_path / "cache", system_prompt="Be brief.")
    ids, labels = _documents(loader.next_step()[0])[0]
    pieces = [("<|im_start|>system\nBe brief.<|im_end|>\n" + HAND[0][0][0], 0), *HAND[0][1:]]
    assert ids == hand_mask(tok, pieces)[1] and labels == _expected_labels(tok, pieces)


BAD_ROWS = {
    "wrong_order": ({"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]}, "bad_conversation"),
    "no_assistant": ({"messages": [{"role": "user", "content": "Hello"}]}, "no_assistant"),
    "non_string_part": ({"messages": [{"role": "user", "content": [{"type": "text", "text": ["x"]}]},
                                      {"role": "assistant", "content": "ok"}]}, "bad_conversation"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_conversations_named_or_skipped_and_counted(qwen_folder, tmp_path, case):
    row, kind = BAD_ROWS[case]
    path = write_jsonl(tmp_path / "c.jsonl", [CHATS[0], row, CHATS[1]])
    with pytest.raises(BadSampleError) as e:
        _text_loader(path, str(qwen_folder), tmp_path / "cache")
    assert f"[{kind}]" in str(e.value) and "c.jsonl" in str(e.value) and "line 2" in str(e.value)
    loader = _text_loader(path, str(qwen_folder), tmp_path / "cache", on_bad_sample="skip")
    tok = HuggingFaceTokenizer.from_folder(qwen_folder)
    docs = _documents(loader.next_step()[0])
    assert [d[0] for d in docs[:2]] == [hand_mask(tok, pieces)[1] for pieces in HAND]  # the good rows, in order
    assert loader.bad_sample_counts == {kind: 1} and loader.metrics()["bad_samples_skipped"] == 1.0


def test_long_conversations_drop_or_cut(qwen_folder, tmp_path):
    tok = HuggingFaceTokenizer.from_folder(qwen_folder)
    turns = [{"role": "user", "content": "What is the weather?"}, {"role": "assistant", "content": "It is sunny."},
             {"role": "user", "content": "And in Paris?"}, {"role": "assistant", "content": "It is warm and sunny today."}]  # fmt: skip
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ok"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [short, {"messages": turns}])
    # the first turn, by hand: up to and including the first <|im_end|> it trains ("\n" after it does not)
    first = [(U + "What is the weather?<|im_end|>\n<|im_start|>assistant\n", 0), ("It is sunny.<|im_end|>", 1)]
    n_first = len(hand_mask(tok, first)[1])
    n_all = len(tok.encode(tok.apply_chat_template(turns), add_special_tokens=False))
    budget = n_first + 4
    assert n_first < budget < n_all
    with pytest.raises(BadSampleError, match=r"line 2.*\[too_long\]"):
        _text_loader(path, str(qwen_folder), tmp_path / "cache", max_tokens=budget)
    drop = _text_loader(path, str(qwen_folder), tmp_path / "cache", max_tokens=budget, on_bad_sample="skip")
    drop.next_step()
    assert drop.metrics()["data/too_long_skipped"] == 1.0 and drop.metrics()["data/conversations_cut"] == 0.0
    cut = _text_loader(path, str(qwen_folder), tmp_path / "cache", max_tokens=budget, long_conversations="cut")
    seen = [d for _ in range(2) for d in _documents(cut.next_step()[0])]
    assert cut.metrics()["data/conversations_cut"] == 1.0 and cut.bad_sample_counts == {}
    ids, labels = next(d for d in seen if len(d[0]) == n_first)  # the cut conversation: its first turn only
    assert ids == hand_mask(tok, first)[1] and labels == _expected_labels(tok, first)


# -- vision-language ---------------------------------------------------------------------------------------
VL_FACTS = dict(vocab_size=520, image_token_id=512, vision_start_token_id=513, vision_end_token_id=514,
                patch_size=16, temporal_patch_size=2, merge_size=2)  # fmt: skip


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_vl_content_list_two_images(tmp_path):
    from hyper_parallel.data.text import cached_toy_text
    from hyper_parallel.data.vision_language import ImageProcessor, VisionLanguageWriter, make_encoder
    from hyper_parallel.data.vision_language.writer import read_samples

    toy = cached_toy_text(str(tmp_path / "cache"))
    tok = HuggingFaceTokenizer.from_folder(toy.tokenizer_dir)
    encoder = make_encoder(toy.tokenizer_dir, ImageProcessor.Config(min_pixels=32 * 32, max_pixels=64 * 64), VL_FACTS)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare "},
                                             {"type": "image"}, {"type": "text", "text": "these."}]},
                {"role": "assistant", "content": "The cat sees a red ball."}]  # fmt: skip
    with VisionLanguageWriter(str(tmp_path / "shards"), encoder=encoder) as w:
        w.write([_png(32, 32), _png(64, 32)], messages=messages, key="two")
        with pytest.raises(ValueError, match=r"2 <image> marker\(s\) or image part\(s\) but the record has 1 image"):
            w.write([_png(32, 32)], messages=messages, key="mismatch")
        bad_part = [{"role": "user", "content": [{"type": "text", "text": 7}]}, messages[1]]
        with pytest.raises(ValueError, match=r"part 0: 'text' must be a string.*\[bad_conversation\]"):
            w.write([], messages=bad_part, key="bad")
    (rec,) = list(read_samples(str(tmp_path / "shards")))
    doc = encoder.document(rec["key"], rec["shard"], rec["files"])
    ids, labels = doc.input_ids.tolist(), doc.labels.tolist()
    # by hand: the toy ChatML template, each image = vision_start, (h/32)*(w/32) image tokens, vision_end
    img = lambda n: [513, *[512] * n, 514]  # noqa: E731
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prompt = ["<s><|im_start|>user\n", img(1), "Compare ", img(2), "these.<|im_end|>\n<|im_start|>assistant\n"]
    answer = "The cat sees a red ball.<|im_end|>"
    expect_ids, trained = [], []
    for part in prompt:
        part_ids = enc(part) if isinstance(part, str) else part
        expect_ids += part_ids
        trained += [False] * len(part_ids)
    expect_ids += enc(answer) + enc("\n")
    trained += [True] * len(enc(answer)) + [False] * len(enc("\n"))
    assert ids == expect_ids
    assert labels == [t if m else -100 for t, m in zip(expect_ids[1:], trained[1:])] + [-100]
    assert doc.image_grid_thw.tolist() == [[1, 2, 2], [1, 2, 4]]
    all_labels = encoder.document(rec["key"], rec["shard"], rec["files"], loss_on="all").labels.tolist()
    assert all(lab not in (512, 513, 514) for lab in all_labels)  # image tokens never carry loss


# -- the loss on assistant-only data -------------------------------------------------------------------------
ASSISTANT = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.S)


def hand_loss(tok: HuggingFaceTokenizer, micro_batches: list[dict], logits: list[torch.Tensor]) -> tuple[float, int, int]:
    """Mean cross-entropy over the tokens of assistant turns (found with a regex on the toy ChatML text), the
    number of such targets, and the number of positions."""
    total, count, positions = 0.0, 0, 0
    for mb, lg in zip(micro_batches, logits):
        cu = mb["cu_seqlens"].tolist()
        ids = mb["input_ids"][0].tolist()
        positions += len(ids)
        logp = torch.log_softmax(lg[0].double(), dim=-1)
        for a, b in zip(cu[:-1], cu[1:]):
            doc = ids[a:b]
            if len(doc) <= 1 or doc[0] == 0:  # the padding run
                continue
            text = tok.decode(doc)
            enc = tok._tok.encode(text, add_special_tokens=False)
            assert enc.ids == doc
            spans = [m.span(1) for m in ASSISTANT.finditer(text)]
            for t in range(1, len(doc)):
                if any(s <= enc.offsets[t][0] < e for s, e in spans):
                    total -= logp[a + t - 1, doc[t]].item()
                    count += 1
    return total / count, count, positions


def test_trainer_loss_equals_hand_computation(tmp_path):
    from hyper_parallel.config import ConfigManager
    from hyper_parallel.data.text import cached_toy_text
    from hyper_parallel.protocols.model import split_output

    cfg = ConfigManager().parse_args([
        "--module", "qwen3_5_moe", "--config", "qwen3_5_moe_sft_debug", "--dump_folder", str(tmp_path),
        "--training.steps", "1", "--checkpoint.no_enable", "--checkpoint.no_export_hf", "--debug.deterministic",
        "--data.cache_dir", str(tmp_path / "cache"), "--data.max_tokens_per_microbatch", "128",
        "--data.global_batch_tokens", "256",
    ])  # fmt: skip
    trainer = cfg.build()
    try:
        step = trainer.data.next_step()
        assert len(step) == 2  # two micro-batches
        with torch.no_grad():
            logits = [
                split_output(trainer.model(mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"],
                                           max_seqlen=mb["max_seqlen"], cu_seqlens_host=mb["cu_seqlens_host"]))[0]
                for mb in step
            ]  # fmt: skip
        trainer.data.next_step = lambda: step
        stats = trainer.train_step()
    finally:
        trainer.close()
    tok = HuggingFaceTokenizer.from_folder(cached_toy_text(str(tmp_path / "cache")).tokenizer_dir)
    expected, count, positions = hand_loss(tok, step, logits)
    got = stats["loss"] - stats["extra"].get("aux_loss", 0.0)
    print(f"assistant-only loss {got:.7f} vs hand {expected:.7f} over {count} of {positions} tokens")
    assert count > 20 and abs(got - expected) <= 1e-6
    assert stats["extra"]["tokens/trained"] == pytest.approx(count / positions, abs=1e-12)


# -- the SFT debug recipes ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("module", "recipe"), [("qwen3_5_moe", "qwen3_5_moe_sft_debug"), ("qwen3_vl_moe", "qwen3_vl_moe_sft_debug")])
def test_sft_recipe_trains_offline_and_loss_falls(tmp_path, module, recipe):
    from hyper_parallel.config import ConfigManager

    steps = 6
    cfg = ConfigManager().parse_args([
        "--module", module, "--config", recipe, "--dump_folder", str(tmp_path), "--training.steps", str(steps),
        "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--checkpoint.no_enable",
        "--checkpoint.no_export_hf", "--data.cache_dir", str(tmp_path / "cache"),
        "--data.max_tokens_per_microbatch", "256", "--data.global_batch_tokens", "256",
    ])  # fmt: skip
    assert cfg.data.path == "" and cfg.data.chat.loss_on == "assistant", "the recipe trains on its embedded chat corpus"
    trainer = cfg.build()
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    print(f"{recipe}: losses {[round(r['loss'], 4) for r in rows]}, trained share {rows[0]['tokens/trained']:.3f}")
    assert all(0.02 < r["tokens/trained"] < 0.8 for r in rows)  # assistant turns only
    assert rows[0]["bad_samples_skipped"] == 0.0
    assert summary["last_loss"] < summary["first_loss"] - 0.3, summary


def test_vl_writer_and_loader_agree_on_the_tokenizer(tmp_path, qwen_folder):
    from hyper_parallel.data.vision_language import VisionLanguageDataLoader
    from hyper_parallel.data.vision_language.cli import main as vl_cli

    (tmp_path / "a.png").write_bytes(_png(32, 32))
    row = {"images": ["a.png"], "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
                                            {"role": "assistant", "content": "A red square."}]}  # fmt: skip
    (tmp_path / "data.jsonl").write_text(json.dumps(row) + "\n")
    shards = str(tmp_path / "shards")
    # as a new user does it: no tokenizer named on either side -> both use the toy tokenizer
    assert vl_cli(["write", "--input", str(tmp_path / "data.jsonl"), "--output-dir", shards]) == 0
    recorded = json.loads((tmp_path / "shards" / "vl_dataset.json").read_text())
    assert recorded["tokenizer"] == "toy"
    from hyper_parallel.data.vision_language import ImageProcessor

    small = dict(cache_dir=str(tmp_path / "cache"), max_tokens_per_microbatch=64,
                 image=ImageProcessor.Config(min_pixels=32 * 32, max_pixels=64 * 64))  # fmt: skip
    cfg = VisionLanguageDataLoader.Config(path=shards, **small)
    mb = cfg.build(model_facts=VL_FACTS).next_step()[0]
    assert int((mb["labels"] != -100).sum()) > 0 and mb["image_grid_thw"].tolist() == [[1, 2, 2]]
    # the model's tokenizer given at load, but the shards were written with another one: a named error
    wrong = VisionLanguageDataLoader.Config(path=shards, tokenizer=str(qwen_folder), **small)
    with pytest.raises(ValueError, match=r"is not the tokenizer the shards .* were written with: 'toy'.*vl_dataset.json"):
        wrong.build(model_facts=VL_FACTS)
    # written with a tokenizer folder: the loader takes it from the record
    other = str(tmp_path / "other")
    assert vl_cli(["write", "--input", str(tmp_path / "data.jsonl"), "--output-dir", other, "--tokenizer", str(qwen_folder)]) == 0
    assert json.loads((tmp_path / "other" / "vl_dataset.json").read_text())["tokenizer"] == str(qwen_folder)
    loader = VisionLanguageDataLoader.Config(path=other, **small).build(model_facts=VL_FACTS)
    assert loader.encoder.tokenizer.folder == str(qwen_folder)


def test_loss_on_per_source_in_a_mixture(qwen_folder, tmp_path):
    tok = HuggingFaceTokenizer.from_folder(qwen_folder)
    path = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    common = {"source": "text", "path": path, "tokenizer": str(qwen_folder), "text": {"chat_column": "messages"}}
    cfg = DataConfig(
        sources=[{"name": "sft", **common}, {"name": "lm", **common, "chat": {"loss_on": "all"}}],
        cache_dir=str(tmp_path / "cache"), max_tokens_per_microbatch=256, global_batch_tokens=512,
        shuffle_buffer=1, packing_bins=1,
    )  # fmt: skip
    loader = cfg.build(model_facts={"vocab_size": 512})
    seen = set()
    for _ in range(2):
        for mb in loader.next_step():
            name = loader.source_names[int(mb["source_ids"][0, 0])]
            by_ids = {tuple(hand_mask(tok, pieces)[1]): pieces for pieces in HAND}
            docs = [d for d in _documents(mb) if tuple(d[0]) in by_ids]
            assert len(docs) >= len(_documents(mb)) - 2  # every whole conversation (a cut piece or padding aside)
            for ids, labels in docs:
                assert labels == _expected_labels(tok, by_ids[tuple(ids)], assistant=name == "sft"), name
            seen.add(name)
    assert seen == {"sft", "lm"}
