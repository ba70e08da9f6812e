"""Text records (jsonl/parquet/arrow via HF datasets) and the toy text corpus.

Tokens are checked against transformers.AutoTokenizer on the same folder (the oracle); every bad
record kind is checked under on_bad_sample=error (message names file and row) and =skip (counted).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from hyper_parallel.data.bad_samples import BadSampleError
from hyper_parallel.data.text import toy_text
from hyper_parallel.data.text import (
    TEXT_BAD_SAMPLE_KINDS,
    TextRecordSpec,
    ToyTextSpec,
    cached_toy_text,
    iter_text_documents,
    make_toy_chats,
    make_toy_documents,
    resolve_text_files,
    tokenize_text_files,
)
from hyper_parallel.data.tokenizer import HuggingFaceTokenizer

SPEC = ToyTextSpec()


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return cached_toy_text(str(tmp_path_factory.mktemp("cache")), SPEC)


@pytest.fixture(scope="module")
def tok(toy):
    return HuggingFaceTokenizer.from_folder(toy.tokenizer_dir)


@pytest.fixture(scope="module")
def hf(toy):
    return AutoTokenizer.from_pretrained(toy.tokenizer_dir)


def _lines(path: Path, rows: list) -> str:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return str(path)


# -- toy corpus -------------------------------------------------------------------------------


def test_toy_corpus_is_deterministic(tmp_path):
    assert make_toy_documents(SPEC) == make_toy_documents(ToyTextSpec())
    assert make_toy_chats(SPEC) == make_toy_chats(ToyTextSpec())
    assert make_toy_documents(ToyTextSpec(seed=1)) != make_toy_documents(SPEC)
    a, b = cached_toy_text(str(tmp_path / "a"), SPEC), cached_toy_text(str(tmp_path / "b"), SPEC)
    for rel in ("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "toy_text.jsonl", "toy_chat.jsonl"):
        assert (Path(a.root) / rel).read_bytes() == (Path(b.root) / rel).read_bytes(), rel
    docs = [json.loads(line) for line in open(a.text_file)]
    assert len(docs) == SPEC.num_documents and len({d["text"] for d in docs}) > 0.9 * len(docs)
    assert HuggingFaceTokenizer.from_folder(a.tokenizer_dir).vocab_size == SPEC.vocab_size


def _build(cache_dir: str, barrier, role: str) -> tuple[str, str]:
    if role == "slow":  # stays in the middle of writing its corpus files for a while
        write = toy_text._write_jsonl
        toy_text._write_jsonl = lambda path, rows: (time.sleep(0.5), write(path, rows))
    barrier.wait()
    if role == "late":  # starts while the slow builder is mid-write: must not see a half-written cache
        time.sleep(0.2)
    paths = cached_toy_text(cache_dir, SPEC)
    tok = HuggingFaceTokenizer.from_folder(paths.tokenizer_dir)
    n = sum(1 for _ in open(paths.text_file)) + sum(1 for _ in open(paths.chat_file))
    return paths.root, f"{tok.vocab_size}:{n}:{Path(paths.tokenizer_dir, 'tokenizer.json').read_text()}"


def test_toy_cache_is_safe_for_concurrent_builders(tmp_path, toy):
    cache = str(tmp_path / "shared")
    ctx = mp.get_context("fork")
    with ctx.Manager() as manager, ctx.Pool(2) as pool:
        barrier = manager.Barrier(2)
        results = pool.starmap(_build, [(cache, barrier, "slow"), (cache, barrier, "late")])
    assert results[0] == results[1]
    want = Path(toy.tokenizer_dir, "tokenizer.json").read_text()
    assert results[0][1] == f"{SPEC.vocab_size}:{SPEC.num_documents + SPEC.num_chats}:{want}"
    assert os.listdir(cache) == [os.path.basename(results[0][0])]  # the loser's temporary folder is gone


def test_toy_cache_losing_the_rename(tmp_path, monkeypatch):
    """Another process finishes first while this one is still writing: use its folder, drop ours."""
    cache = str(tmp_path / "c")
    real = toy_text.write_toy_text
    calls = []

    def write_then_lose(out_dir, spec):
        calls.append(out_dir)
        paths = real(out_dir, spec)
        if len(calls) == 1:
            cached_toy_text(cache, spec)  # the "other process" wins the rename meanwhile
        return paths

    monkeypatch.setattr(toy_text, "write_toy_text", write_then_lose)
    got = cached_toy_text(cache, SPEC)
    assert len(calls) == 2 and os.listdir(cache) == [os.path.basename(got.root)]
    assert HuggingFaceTokenizer.from_folder(got.tokenizer_dir).vocab_size == SPEC.vocab_size


# -- good records -----------------------------------------------------------------------------


def test_text_and_chat_match_transformers(toy, tok, hf):
    docs = tokenize_text_files([toy.text_file], toy.tokenizer_dir, TextRecordSpec(key_column="id"))
    rows = [json.loads(line) for line in open(toy.text_file)]
    assert not docs.bad_counts and [d.row for d in docs.documents] == list(range(len(rows)))
    for doc, row in zip(docs.documents, rows, strict=True):
        assert doc.source == toy.text_file and doc.key == row["id"] and doc.tokens.dtype == np.int32
        # the folder's policy adds bos; records append eos so documents end visibly
        assert doc.tokens.tolist() == hf(row["text"])["input_ids"] + [hf.eos_token_id]
    assert docs.documents[0].tokens[0] == tok.bos_id and tok.adds_bos and not tok.adds_eos

    chats = tokenize_text_files(toy.chat_file, tok, TextRecordSpec(chat_column="messages"))
    rows = [json.loads(line) for line in open(toy.chat_file)]
    for doc, row in zip(chats.documents, rows, strict=True):
        assert doc.key == str(doc.row)
        assert doc.tokens.tolist() == hf.apply_chat_template(row["messages"], tokenize=True, return_dict=False)


def test_parquet_and_arrow_match_jsonl(toy, tok, tmp_path):
    rows = make_toy_documents(SPEC)[:50]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=16)
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=16)
    jsonl = _lines(tmp_path / "d.jsonl", rows)
    want = [d.tokens.tolist() for d in iter_text_documents([jsonl], tok)]
    for name in ("d.parquet", "d.arrow"):
        got = list(iter_text_documents([str(tmp_path / name)], tok, TextRecordSpec(key_column="id")))
        assert [d.tokens.tolist() for d in got] == want and [d.key for d in got] == [r["id"] for r in rows]


def test_order_is_deterministic_and_sorted(toy, tok, tmp_path):
    rows = make_toy_documents(SPEC)[:30]
    (tmp_path / "sub").mkdir()
    for i, name in enumerate(["b.jsonl", "a.jsonl", "sub/c.jsonl"]):
        _lines(tmp_path / name, rows[10 * i : 10 * (i + 1)])
    (tmp_path / "notes.txt").write_text("ignored")
    files = resolve_text_files(str(tmp_path))
    assert files == sorted(str(tmp_path / n) for n in ["a.jsonl", "b.jsonl", "sub/c.jsonl"])
    assert resolve_text_files([str(tmp_path / "*.jsonl"), str(tmp_path / "a.jsonl")]) == files[:2]
    a, b = tokenize_text_files(str(tmp_path), tok), tokenize_text_files(list(reversed(files)), tok)
    assert [(d.source, d.row, d.tokens.tolist()) for d in a.documents] == [(d.source, d.row, d.tokens.tolist()) for d in b.documents]
    assert [d.source for d in a.documents] == [f for f in files for _ in range(10)]
    with pytest.raises(FileNotFoundError, match="no text data file"):
        resolve_text_files(str(tmp_path / "missing*.jsonl"))
    with pytest.raises(ValueError, match="unsupported text data file type"):
        resolve_text_files(str(tmp_path / "notes.txt"))


def test_reading_never_touches_the_network(toy, tok, monkeypatch, tmp_path):
    parquet = tmp_path / "toy.parquet"
    pq.write_table(pa.Table.from_pylist(make_toy_documents(SPEC)), parquet)
    attempts = []

    def no_network(*args, **kwargs):
        attempts.append(args[1:] if args and isinstance(args[0], socket.socket) else args)
        raise OSError("network disabled in this test")

    # name resolution comes first (and fails on an offline machine before any connect)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    docs = tokenize_text_files([toy.text_file, toy.chat_file, str(parquet)], tok, on_bad_sample="skip")
    assert len(docs.documents) == 2 * SPEC.num_documents and docs.bad_counts == {"missing_column": SPEC.num_chats}
    assert attempts == []


# -- bad records ------------------------------------------------------------------------------

GOOD = [{"text": f"The cat sees the red ball {i}."} for i in range(5)]
BAD_AT = 2

TEXT_CASES = {
    # case -> (bad line, kind)
    "not_json": (b'{"text": "unterminated', "undecodable"),
    "not_utf8": (b'{"text": "caf\xe9"}', "undecodable"),
    "lone_surrogate": (b'{"text": "a\\ud800b"}', "undecodable"),
    "not_an_object": (b'["text", "x"]', "bad_type"),
    "empty_text": ({"text": ""}, "empty"),
    "blank_text": ({"text": " \n\t "}, "empty"),
    "missing_column": ({"body": "hello"}, "missing_column"),
    "null_text": ({"text": None}, "missing_column"),
    "int_text": ({"text": 5}, "bad_type"),
    "dict_text": ({"text": {"a": "b"}}, "bad_type"),
}

CHAT_GOOD = [{"messages": [{"role": "user", "content": f"Tell me about the cat {i}."}]} for i in range(5)]
CHAT_CASES = {
    "chat_missing": ({"text": "no messages"}, "missing_column"),
    "chat_not_list": ({"messages": "hello"}, "bad_type"),
    "chat_no_role": ({"messages": [{"content": "hi"}]}, "bad_type"),
    "chat_empty": ({"messages": []}, "empty"),
    "chat_role_order": ({"messages": [{"role": "assistant", "content": "hi"}]}, "bad_conversation"),
    "chat_unknown_role": ({"messages": [{"role": "robot", "content": "beep"}]}, "bad_conversation"),
    "chat_part_not_string": ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "bad_conversation"),
}


def _bad_file(tmp_path: Path, case: str) -> tuple[str, str, TextRecordSpec]:
    if case in TEXT_CASES:
        line, kind = TEXT_CASES[case]
        good, spec = GOOD, TextRecordSpec()
    else:
        line, kind = CHAT_CASES[case]
        good, spec = CHAT_GOOD, TextRecordSpec(chat_column="messages")
    rows = [*good[:BAD_AT], line, *good[BAD_AT:]]
    return _lines(tmp_path / f"{case}.jsonl", rows), kind, spec


@pytest.mark.parametrize("case", [*TEXT_CASES, *CHAT_CASES])
def test_bad_record(case, tok, tmp_path):
    path, kind, spec = _bad_file(tmp_path, case)
    with pytest.raises(BadSampleError) as e:
        list(iter_text_documents([path], tok, spec))
    msg = str(e.value)
    assert path in msg and f"line {BAD_AT + 1}" in msg and f"[{kind}]" in msg and "on_bad_sample skip" in msg  # editor lines

    counts, skipped = {}, []
    docs = list(iter_text_documents([path], tok, spec, on_bad_sample="skip", bad_counts=counts, on_skip=skipped.append))
    assert counts == {kind: 1} and len(skipped) == 1 and f"line {BAD_AT + 1}" in skipped[0]
    assert [d.row for d in docs] == [0, 1, 3, 4, 5]  # rows keep their place in the file
    good = CHAT_GOOD if spec.chat_column else GOOD
    clean = list(iter_text_documents([_lines(tmp_path / "clean.jsonl", good)], tok, spec))
    assert [d.tokens.tolist() for d in docs] == [d.tokens.tolist() for d in clean]


def test_chat_template_rejects_record(toy, tmp_path):
    folder = tmp_path / "strict"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((Path(toy.tokenizer_dir) / name).read_bytes())
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['content'] == 'beep' %}"
        "{{ raise_exception('no robots: ' + m['content']) }}{% endif %}"
        "{% if m['content'] != 'mute' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    rows = [*CHAT_GOOD[:BAD_AT], {"messages": [{"role": "user", "content": "beep"}]}, *CHAT_GOOD[BAD_AT:],
            {"messages": [{"role": "user", "content": "mute"}]}]
    path = _lines(tmp_path / "chats.jsonl", rows)
    spec = TextRecordSpec(chat_column="messages")
    with pytest.raises(BadSampleError, match=r"line 3.*no robots: beep.*\[undecodable\]"):
        list(iter_text_documents([path], str(folder), spec))
    counts = {}
    docs = list(iter_text_documents([path], str(folder), spec, on_bad_sample="skip", bad_counts=counts))
    assert counts == {"undecodable": 1, "empty": 1} and [d.row for d in docs] == [0, 1, 3, 4, 5]


def test_json_types_are_kept_exactly(tok, tmp_path):
    """Far-apart non-string texts are bad_type, and the good rows around them stay byte-exact.

    (HF datasets' json builder would re-encode a mixed-type block of a big file as JSON text:
    good rows would become '"text"' with quotes, and 5 would become '5'.)
    """
    rows = [{"text": f"The dog finds a green apple number {i}."} for i in range(40)]
    # blank lines are not rows
    lines = [*rows[:10], b"", b" \t", *rows[10:30], {"text": 5}, *rows[30:35], {"text": {"content": "nested"}}, *rows[35:], b""]
    path = _lines(tmp_path / "long.jsonl", lines)
    counts = {}
    docs = list(iter_text_documents([path], tok, on_bad_sample="skip", bad_counts=counts))
    assert counts == {"bad_type": 2}
    assert [d.row for d in docs] == [*range(30), *range(31, 36), *range(37, 42)]
    assert [d.tokens.tolist() for d in docs] == [tok.encode(r["text"]) + [tok.eos_id] for r in rows]
    with pytest.raises(BadSampleError, match="line 33.*must be a string, got int"):
        list(iter_text_documents([path], tok))


def test_json_array_file(tok, tmp_path):
    rows = [*GOOD[:2], ["not", "an", "object"], *GOOD[2:]]
    path = tmp_path / "a.json"
    path.write_text("\n" + json.dumps(rows, indent=1))
    counts = {}
    docs = list(iter_text_documents([str(path)], tok, on_bad_sample="skip", bad_counts=counts))
    assert counts == {"bad_type": 1} and [d.row for d in docs] == [0, 1, 3, 4, 5]
    assert [d.tokens.tolist() for d in docs] == [tok.encode(r["text"]) + [tok.eos_id] for r in GOOD]


def test_parquet_bad_rows(tok, tmp_path):
    table = pa.table({"text": [g["text"] for g in GOOD[:2]] + [None] + [g["text"] for g in GOOD[2:]]})
    pq.write_table(table, tmp_path / "n.parquet", row_group_size=2)
    with pytest.raises(BadSampleError, match=r"n\.parquet', row 2: no 'text' value.*\[missing_column\]"):
        list(iter_text_documents([str(tmp_path / "n.parquet")], tok))
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "i.parquet")
    counts = {}
    assert list(iter_text_documents([str(tmp_path / "i.parquet")], tok, on_bad_sample="skip", bad_counts=counts)) == []
    assert counts == {"bad_type": 3}


def test_unreadable_file(tok, tmp_path):
    good = _lines(tmp_path / "a.jsonl", GOOD)
    broken = tmp_path / "b.parquet"
    broken.write_bytes(b"PAR1 this is not a parquet file")
    with pytest.raises(BadSampleError, match=r"b\.parquet.*cannot be read.*\[unreadable_shard\]"):
        list(iter_text_documents([good, str(broken)], tok))
    counts = {}
    docs = list(iter_text_documents([good, str(broken)], tok, on_bad_sample="skip", bad_counts=counts))
    assert counts == {"unreadable_shard": 1} and len(docs) == len(GOOD)


def test_bad_configuration(toy, tok, tmp_path):
    path = _lines(tmp_path / "a.jsonl", GOOD)
    no_json = tmp_path / "tok"
    no_json.mkdir()
    with pytest.raises(FileNotFoundError, match=rf"{no_json}.*no tokenizer\.json"):
        list(iter_text_documents([path], str(no_json)))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((Path(toy.tokenizer_dir) / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="needs a chat template"):
        list(iter_text_documents([path], str(plain), TextRecordSpec(chat_column="messages")))
    with pytest.raises(ValueError, match="on_bad_sample"):
        list(iter_text_documents([path], tok, on_bad_sample="ignore"))
    assert set(TEXT_BAD_SAMPLE_KINDS) == {k for _, k in [*TEXT_CASES.values(), *CHAT_CASES.values()]} | {"unreadable_shard"}
