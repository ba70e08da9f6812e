"""The data order does not depend on the layout (docs/design.md section 8, issue 13).

- the concatenation over DP ranks of every step's micro-batches is the same for DP 1, 2, 4 and
  num_workers 0, 2;
- a state saved on 2 ranks resumes on 4 ranks and on 1 (with or without workers) exactly: the same
  batches as the uninterrupted run, and every document exactly once per epoch;
- jumping to step N reads nothing before it; skipped bad samples are counted the same everywhere;
- shard indexes: written with the shards, built on first use for shards without one, stale ones ignored.
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections import Counter

import numpy as np
import pytest
import webdataset as wds

from hyper_parallel.data import (
    DataConfig,
    ToyCorpusSpec,
    first_difference,
    global_batches,
    make_toy_samples,
    write_shards,
)
from hyper_parallel.data.direct_token.sample import direct_token_index_spec
from hyper_parallel.data.index import ensure_indexes, load_index
from hyper_parallel.data.plan import Planner
from hyper_parallel.data.sharded import MicroBatchReader

V, C, P = 4096, 256, 4095
FACTS = dict(vocab_size=V, codebook_size=C, placeholder_token_id=P)
DOC, BUDGET = 64, 256  # equal-length documents: every bin is 4 documents, exactly full
NUM_DOCS = 192  # 48 micro-batches = 12 steps of 4 per epoch
ID0 = 1000  # document i starts with token ID0 + i


def _doc(i: int, rng: np.random.Generator) -> dict:
    if i % 2:
        tokens = np.concatenate([[ID0 + i], rng.integers(10, 900, DOC - 8), [P] * 6, [2]])
        return {"key": f"d{i:04d}", "tokens": tokens, "vq_codes": rng.integers(0, C, 6), "image_grids": [[2, 3]]}
    return {"key": f"d{i:04d}", "tokens": np.concatenate([[ID0 + i], rng.integers(10, 900, DOC - 1)]), "vq_codes": []}


@pytest.fixture(scope="module")
def equal_corpus(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("equal")
    rng = np.random.default_rng(0)
    write_shards(str(out), [_doc(i, rng) for i in range(NUM_DOCS)], placeholder_token_id=P, samples_per_shard=40)
    return str(out)


@pytest.fixture(scope="module")
def toy_corpus(tmp_path_factory) -> str:
    """Variable-length toy documents (captions + 0-2 images) in 6 shards."""
    out = tmp_path_factory.mktemp("toy")
    spec = ToyCorpusSpec(lang_vocab_size=512, codebook_size=C, placeholder_token_id=511, num_samples=96, seed=2)
    write_shards(str(out), make_toy_samples(spec), placeholder_token_id=511, samples_per_shard=16)
    return str(out)


def _keys(step: list[dict]) -> list[int]:
    """The documents of a step's micro-batches (by their first token), in order."""
    out = []
    for mb in step:
        ids, cu = mb["input_ids"].view(-1), mb["cu_seqlens"].tolist()
        out += [int(ids[a]) - ID0 for a in cu[:-1]]
    return out


def _config(path: str, cache: str, **kw) -> DataConfig:
    return DataConfig(path=path, cache_dir=cache, max_tokens_per_microbatch=BUDGET, global_batch_tokens=4 * BUDGET,
                      shuffle_buffer=50, packing_bins=3, seed=11, **kw)  # fmt: skip


def test_global_batches_do_not_depend_on_dp_or_workers(toy_corpus, tmp_path):
    facts = dict(vocab_size=512, codebook_size=C, placeholder_token_id=511)
    cfg = lambda w: DataConfig(path=toy_corpus, cache_dir=str(tmp_path), max_tokens_per_microbatch=BUDGET,  # noqa: E731
                               global_batch_tokens=4 * BUDGET, shuffle_buffer=40, num_workers=w, seed=3)  # fmt: skip
    ref = global_batches(cfg(0), model_facts=facts, steps=8)  # crosses an epoch boundary (~4 steps per epoch)
    assert sum(len(_keys(s)) for s in ref) > 96
    for dp in (1, 2, 4):
        for workers in (0, 2):
            got = global_batches(cfg(workers), model_facts=facts, steps=8, dp_world_size=dp)
            assert first_difference(got, ref) is None, (dp, workers, first_difference(got, ref))
    # the same from any step on, without running the steps before
    later = global_batches(cfg(2), model_facts=facts, steps=3, first_step=5, dp_world_size=2)
    assert first_difference(later, ref[5:]) is None
    other = global_batches(DataConfig(path=toy_corpus, cache_dir=str(tmp_path), max_tokens_per_microbatch=BUDGET,
                                      global_batch_tokens=4 * BUDGET, shuffle_buffer=40, seed=4),
                           model_facts=facts, steps=2)  # fmt: skip
    assert first_difference(other, ref[:2]) is not None  # the seed matters (the test can see a difference)


def test_every_document_once_per_epoch(equal_corpus, tmp_path):
    loader = _config(equal_corpus, str(tmp_path)).build(model_facts=FACTS)
    epochs = [[k for _ in range(12) for k in _keys(loader.next_step())] for _ in range(2)]
    for keys in epochs:
        assert sorted(keys) == list(range(NUM_DOCS))
    assert epochs[0] != epochs[1]  # a new order each epoch


@pytest.mark.parametrize("dp,workers", [(4, 0), (1, 0), (1, 2), (4, 2)])
def test_resume_from_two_ranks_on_another_layout(equal_corpus, tmp_path, dp, workers):
    cfg = _config(equal_corpus, str(tmp_path))
    one = cfg.build(model_facts=FACTS)
    reference = [one.next_step() for _ in range(16)]
    two = [cfg.build(model_facts=FACTS, dp_rank=r, dp_world_size=2) for r in range(2)]
    first = [[mb for loader in two for mb in loader.next_step()] for _ in range(4)]
    states = [pickle.loads(pickle.dumps(loader.state_dict())) for loader in two]
    assert states[0] == states[1]  # one state for all ranks: saved once, loaded anywhere
    resumed_cfg = _config(equal_corpus, str(tmp_path), num_workers=workers)
    ranks = [resumed_cfg.build(model_facts=FACTS, dp_rank=r, dp_world_size=dp) for r in range(dp)]
    for loader in ranks:
        loader.load_state_dict(states[0])
    rest = [[mb for loader in ranks for mb in loader.next_step()] for _ in range(12)]
    for loader in ranks:
        loader.close()
    assert first_difference(first + rest, reference) is None
    seen = [k for step in first + rest[:8] for k in _keys(step)]  # steps 0-11: one epoch
    assert sorted(seen) == list(range(NUM_DOCS))


def test_advance_reads_nothing_and_lands_on_the_same_step(equal_corpus, tmp_path, monkeypatch):
    cfg = _config(equal_corpus, str(tmp_path))
    ran = cfg.build(model_facts=FACTS)
    for _ in range(30):
        ran.next_step()
    jumped = cfg.build(model_facts=FACTS, dp_rank=1, dp_world_size=2)

    def no_reads(self, span):
        raise AssertionError(f"advance read {span.key}")

    with monkeypatch.context() as m:
        m.setattr(MicroBatchReader, "read_record", no_reads)
        jumped.advance(30)
    assert jumped.state_dict() == ran.state_dict()
    state = ran.state_dict()
    assert first_difference([jumped.next_step()], [ran.next_step()[2:]]) is None  # rank 1 of 2: the last half

    # Loading a state re-plans from the cursor it holds (one window), not from the start (10 windows).
    planned = []
    original = Planner._plan_next
    with monkeypatch.context() as m:
        m.setattr(Planner, "_plan_next", lambda self: planned.append(1) or original(self))
        resumed = cfg.build(model_facts=FACTS)
        resumed.load_state_dict(state)
        resumed.next_step()
    assert 1 <= len(planned) <= 2


def _bad_corpus(root: str) -> str:
    """The equal corpus's first 80 documents plus three bad ones (each a different kind)."""
    rng = np.random.default_rng(0)
    docs = [_doc(i, rng) for i in range(80)]
    docs.insert(5, {"key": "bad_range", "tokens": [ID0 + 500, V + 1] + [7] * (DOC - 2), "vq_codes": []})
    docs.insert(40, {"key": "bad_long", "tokens": [ID0 + 501] + [7] * (BUDGET + 1), "vq_codes": []})
    docs.insert(70, {"key": "bad_count", "tokens": [ID0 + 502, P] + [7] * (DOC - 2), "vq_codes": [], "image_grids": []})
    write_shards(root, docs, placeholder_token_id=P, samples_per_shard=30, validate=False)
    return root


def test_skipped_samples_are_counted_the_same_on_every_layout(tmp_path):
    path = _bad_corpus(str(tmp_path / "bad"))
    cfg = _config(path, str(tmp_path), on_bad_sample="skip")
    one = cfg.build(model_facts=FACTS)
    keys = [k for _ in range(5) for k in _keys(one.next_step())]  # 80 good documents = 5 steps
    assert sorted(keys) == list(range(80))
    want = {"token_out_of_range": 1, "too_long": 1, "count_mismatch": 1}
    assert one.bad_sample_counts == want and one.metrics() == {"bad_samples_skipped": 3.0}
    ranks = [cfg.build(model_facts=FACTS, dp_rank=r, dp_world_size=4) for r in range(4)]
    for _ in range(5):
        for r in ranks:
            r.next_step()
    assert all(r.bad_sample_counts == want for r in ranks)
    resumed = cfg.build(model_facts=FACTS, dp_rank=0, dp_world_size=2)
    resumed.load_state_dict(ranks[3].state_dict())
    assert resumed.bad_sample_counts == want
    with pytest.raises(Exception, match=r"key 'bad_range'.*token_out_of_range"):
        _config(path, str(tmp_path), on_bad_sample="error").build(model_facts=FACTS)


def test_index_written_with_shards_built_on_first_use_and_never_stale(equal_corpus, tmp_path):
    shards = sorted(os.path.join(equal_corpus, f) for f in os.listdir(equal_corpus) if f.endswith(".tar"))
    spec = direct_token_index_spec(P)
    indexed = ensure_indexes(shards, spec, cache_dir=str(tmp_path / "cache"))
    assert [s.index_path for s in indexed] == [s + ".idx.npz" for s in shards]  # the writer's side files
    assert not (tmp_path / "cache").exists()
    assert [s.num_records for s in indexed] == [40, 40, 40, 40, 32]
    # offsets point at the right bytes
    index = load_index(indexed[1].index_path, spec)
    offset, size, members = index.span(3)
    data = open(shards[1], "rb").read()[offset : offset + size]
    tokens = dict((ext, data[o : o + n]) for ext, o, n in members)["tokens.npy"]
    assert np.load(__import__("io").BytesIO(tokens))[0] == ID0 + 43 and index.key(3) == "d0043"
    assert index.stats["length"].tolist() == [DOC] * 40

    # a shard written without an index (another tool): built into the cache on first use
    bare = tmp_path / "bare"
    bare.mkdir()
    with wds.TarWriter(str(bare / "x-000000.tar"), mtime=0) as w:
        for i in range(5):
            w.write({"__key__": f"k{i}", "tokens.npy": np.arange(1, 4 + i, dtype=np.int32),
                     "vq_codes.npy": np.zeros(0, np.int32), "json": {"image_grids": []}})  # fmt: skip
    built = ensure_indexes([str(bare / "x-000000.tar")], spec, cache_dir=str(tmp_path / "cache"))[0]
    assert built.index_path.startswith(str(tmp_path / "cache")) and built.num_records == 5
    assert load_index(built.index_path, spec).stats["length"].tolist() == [3, 4, 5, 6, 7]
    # a stale side file (the shard changed) is ignored; another placeholder id needs another index
    copy = tmp_path / "copy"
    shutil.copytree(equal_corpus, copy)
    with open(copy / "train-000001.tar", "ab") as f:
        f.write(b"\0" * 1024)  # same records, other size: the side file no longer describes it
    again = ensure_indexes([str(copy / "train-000001.tar")], spec, cache_dir=str(tmp_path / "cache"))[0]
    assert again.index_path.startswith(str(tmp_path / "cache"))
    other = ensure_indexes(shards[:1], direct_token_index_spec(7), cache_dir=str(tmp_path / "cache"))[0]
    assert other.index_path.startswith(str(tmp_path / "cache"))
    assert Counter(f.endswith(".idx.npz") for f in os.listdir(tmp_path / "cache" / "shard_index"))[True] == 3
