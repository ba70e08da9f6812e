"""The `text` source: pre-tokenised shards and raw jsonl/parquet files (tokenised once into a cache).

Resume gives identical batches on another layout; 2 ranks x 2 workers cover each record exactly once
per epoch; every bad input (empty, undecodable, missing column, over-long) is an error naming file
and row, or a counted skip; long documents can be split instead.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from hyper_parallel.data import (
    BadSampleError,
    DataConfig,
    HuggingFaceTextDataLoader,
    TextOptions,
    TextShardWriter,
    first_difference,
    global_batches,
)
from hyper_parallel.data.text import cached_toy_text
from hyper_parallel.data.tokenizer import HuggingFaceTokenizer

V = 4096
GENERIC = {"input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_host", "max_seqlen", "token_mask"}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return cached_toy_text(str(tmp_path_factory.mktemp("toy_text")))


def _text(cache, path="", **kw) -> DataConfig:
    return HuggingFaceTextDataLoader.Config(path=path, cache_dir=str(cache), max_tokens_per_microbatch=128,
                                            global_batch_tokens=4 * 128, shuffle_buffer=64, seed=1, **kw)  # fmt: skip


def test_toy_text_is_the_default_and_batches_are_generic(tmp_path, toy):
    loader = _text(tmp_path).build(model_facts={"vocab_size": 512})
    step = loader.next_step()
    tok = HuggingFaceTokenizer.from_folder(cached_toy_text(str(tmp_path)).tokenizer_dir)
    for mb in step:
        assert set(mb) == GENERIC
        ids, labels, cu = mb["input_ids"].view(-1), mb["labels"].view(-1), mb["cu_seqlens"].tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            assert int(ids[a]) == tok.bos_id and int(ids[b - 1]) == tok.eos_id  # whole documents
            assert labels[a : b - 1].tolist() == ids[a + 1 : b].tolist() and int(labels[b - 1]) == -100
    with pytest.raises(ValueError, match="produces ids up to 511, but the model's vocab_size is 300"):
        _text(tmp_path).build(model_facts={"vocab_size": 300})
    with pytest.raises(ValueError, match="needs the model fact 'vocab_size'"):
        _text(tmp_path).build(model_facts={})


@pytest.fixture(scope="module")
def id_shards(tmp_path_factory) -> str:
    """120 pre-tokenised documents of 32 tokens (4 per micro-batch, exactly full), document i starts with 1000 + i."""
    out = str(tmp_path_factory.mktemp("text_shards"))
    rng = np.random.default_rng(0)
    with TextShardWriter(out, prefix="t", docs_per_shard=25) as w:
        for i in range(120):
            w.write(f"doc{i:04d}", np.concatenate([[1000 + i], rng.integers(0, 900, 31)]))
    return out


def _keys(step):
    return [int(mb["input_ids"].view(-1)[a]) - 1000 for mb in step for a in mb["cu_seqlens"].tolist()[:-1]]


def test_two_ranks_two_workers_cover_each_record_once_per_epoch(id_shards, tmp_path):
    cfg = _text(tmp_path, id_shards, num_workers=2)
    ranks = [cfg.build(model_facts={"vocab_size": V}, dp_rank=r, dp_world_size=2) for r in range(2)]
    per_rank: list[list[int]] = [[], []]
    keys = []
    for _ in range(15):  # 30 micro-batches per epoch = 7.5 steps: two epochs are 15 steps
        for r, loader in enumerate(ranks):
            mine = _keys(loader.next_step())
            per_rank[r] += mine
            keys += mine
    for loader in ranks:
        loader.close()
    assert sorted(keys[:120]) == list(range(120)) and sorted(keys[120:]) == list(range(120))
    assert keys[:120] != keys[120:]
    assert len(per_rank[0]) == len(per_rank[1]) == 120  # each rank read its half


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")


def test_raw_files_resume_identically_on_another_layout(tmp_path, toy, monkeypatch):
    raw = tmp_path / "raw"
    raw.mkdir()
    _write_jsonl(raw / "a.jsonl", [{"text": f"the cat number {i} sees the red ball in the garden."} for i in range(150)])
    _write_jsonl(raw / "b.jsonl", [{"text": f"a dog finds {i} green apples near the river " * (1 + i % 3)} for i in range(90)])
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"my uncle builds {i} wooden boats by the sea." for i in range(40)]}), raw / "c.parquet")
    cfg = _text(tmp_path / "cache", str(raw), tokenizer=toy.tokenizer_dir)
    ref = global_batches(cfg, model_facts={"vocab_size": 512}, steps=10)
    first = cfg.build(model_facts={"vocab_size": 512})
    assert [t.documents for t in first.tokenized_files] == [150, 90, 40]
    head = [first.next_step() for _ in range(4)]
    state = pickle.loads(pickle.dumps(first.state_dict()))

    # the cache is reused: nothing is tokenised again
    import hyper_parallel.data.text as text_pkg

    monkeypatch.setattr(text_pkg, "iter_text_documents", lambda *a, **k: (_ for _ in ()).throw(AssertionError("re-tokenised")))
    resumed_cfg = _text(tmp_path / "cache", str(raw), tokenizer=toy.tokenizer_dir, num_workers=2)
    ranks = [resumed_cfg.build(model_facts={"vocab_size": 512}, dp_rank=r, dp_world_size=2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    tail = [[mb for r in ranks for mb in r.next_step()] for _ in range(6)]
    for r in ranks:
        r.close()
    assert first_difference(head + tail, ref) is None
    # a changed file is tokenised again (its size and mtime key the cache)
    monkeypatch.undo()
    _write_jsonl(raw / "b.jsonl", [{"text": "just one line"}])
    assert [t.documents for t in cfg.build(model_facts={"vocab_size": 512}).tokenized_files] == [150, 1, 40]


BAD_ROWS = {
    # case -> (the bad line, the kind it is reported as)
    "empty": ('{"text": ""}', "empty"),
    "undecodable": ('{"text": "unterminated', "undecodable"),
    "missing_column": ('{"body": "the text is in another column"}', "missing_column"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_records_error_or_skip(tmp_path, toy, case):
    line, kind = BAD_ROWS[case]
    path = tmp_path / "data.jsonl"
    _write_jsonl(path, [{"text": f"the baker sells {i} loaves of bread."} for i in range(6)] + [line] + [{"text": "the end."}])
    with pytest.raises(BadSampleError, match=rf"file '{path}', line 7.*\[{kind}\].*on_bad_sample skip"):
        _text(tmp_path / "cache", str(path), tokenizer=toy.tokenizer_dir).build(model_facts={"vocab_size": 512})
    loader = _text(tmp_path / "cache", str(path), tokenizer=toy.tokenizer_dir, on_bad_sample="skip").build(
        model_facts={"vocab_size": 512}
    )
    loader.next_step()
    assert loader.bad_sample_counts == {kind: 1} and loader.metrics() == {"bad_samples_skipped": 1.0}
    assert loader.tokenized_files[0].documents == 7


def test_over_long_documents_error_skip_or_split(tmp_path, toy):
    path = tmp_path / "long.jsonl"
    long_text = " ".join(f"the queen walks {i} miles by the sea." for i in range(40))  # far over 128 tokens
    _write_jsonl(path, [{"text": "short one."}, {"text": long_text}, {"text": "short two."}])
    facts = {"vocab_size": 512}
    with pytest.raises(BadSampleError, match=rf"exceed the packing budget.*file '{path}', line 2.*\[too_long\]"):
        _text(tmp_path / "cache", str(path), tokenizer=toy.tokenizer_dir).build(model_facts=facts)
    skip = _text(tmp_path / "cache", str(path), tokenizer=toy.tokenizer_dir, on_bad_sample="skip").build(model_facts=facts)
    ids = np.concatenate([mb["input_ids"].view(-1).numpy() for mb in skip.next_step()])
    assert skip.bad_sample_counts == {"too_long": 1} and len(ids) > 0
    split = _text(tmp_path / "cache", str(path), tokenizer=toy.tokenizer_dir, text=TextOptions(split_long_documents=True),
                  packing_bins=1).build(model_facts=facts)  # fmt: skip
    tok = HuggingFaceTokenizer.from_folder(toy.tokenizer_dir)
    want = tok.encode(long_text) + [tok.eos_id]
    assert len(want) > 2 * 128
    steps = [mb for _ in range(3) for mb in split.next_step()]
    pieces = [mb["input_ids"].view(-1)[a:b].tolist() for mb in steps for a, b in
              zip(mb["cu_seqlens"].tolist()[:-1], mb["cu_seqlens"].tolist()[1:])]  # fmt: skip
    assert split.bad_sample_counts == {}
    assert all(want[a : a + 128] in pieces for a in range(0, len(want), 128))  # every piece, within the budget
