"""TokenDataLoader: rank x worker split, determinism, dyn_bsz steps, exact resume, preset_pt."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from hyper_parallel.data import DataConfig, SampleSpec, ToyCorpusSpec, make_toy_samples, write_shards
from hyper_parallel.data.reader import ShardReader
from hyper_parallel.data.shards import ShardPlan, resolve_shards
from hyper_parallel.data.stream import SampleStream

V, C, P = 512, 256, 511
FACTS = dict(lang_vocab_size=V, codebook_size=C, placeholder_token_id=P)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """96 toy documents in 6 shards of 16."""
    out = tmp_path_factory.mktemp("corpus")
    spec = ToyCorpusSpec(**FACTS, num_samples=96, seed=1)
    write_shards(str(out), make_toy_samples(spec), placeholder_token_id=P, samples_per_shard=16)
    return str(out)


def _keys_per_epoch(plan: ShardPlan, reader: int, epochs: int) -> list[list[str]]:
    r = ShardReader(plan, reader, SampleSpec(V, C, P, 256), skip_bad=False, chunk_samples=1)
    out: list[list[str]] = [[] for _ in range(epochs)]
    while True:
        chunk = r.next_chunk()
        if chunk.state["epoch"] >= epochs:
            return out
        out[chunk.state["epoch"]].append(chunk.samples[0].key)


@pytest.mark.parametrize("dp_world_size,workers,num_shards", [(2, 2, 6), (3, 2, 4), (1, 1, 6)])
def test_rank_worker_split_covers_every_sample_once_per_epoch(corpus, dp_world_size, workers, num_shards):
    shards = tuple(resolve_shards(corpus)[:num_shards])
    everything = sorted(f"toy{i:07d}" for i in range(16 * num_shards))
    plan = ShardPlan(shards, num_readers=dp_world_size * workers, seed=7)
    per_reader = [_keys_per_epoch(plan, r, epochs=2) for r in range(plan.num_readers)]
    for epoch in range(2):
        seen = [k for r in per_reader for k in r[epoch]]
        assert sorted(seen) == everything  # no overlap, no loss
    assert any(r[0] != r[1] for r in per_reader)  # a new order each epoch


def test_worker_stream_is_the_round_robin_of_its_readers(corpus):
    plan = ShardPlan(tuple(resolve_shards(corpus)), num_readers=4, seed=0)
    spec = SampleSpec(V, C, P, 256)
    stream = SampleStream(plan, dp_rank=1, num_workers=2, spec=spec, skip_bad=False)
    got = [stream.next().key for _ in range(200)]
    stream.close()
    readers = [ShardReader(plan, 2 + i, spec, skip_bad=False) for i in range(2)]
    want: list[str] = []
    while len(want) < 200:
        for r in readers:
            want += [s.key for s in r.next_chunk().samples]
    assert got == want[:200]


def _loader(corpus, **kw):
    facts = {k: kw.pop(k) for k in ("dp_rank", "dp_world_size") if k in kw}
    cfg = DataConfig(path=corpus, max_tokens_per_microbatch=256, shuffle_buffer=24, packing_bins=4, **kw)
    return cfg.build(**FACTS, **facts)


def _assert_same_steps(a, b):
    assert len(a) == len(b)
    for sa, sb in zip(a, b):
        assert len(sa) == len(sb)
        for ma, mb in zip(sa, sb):
            assert ma.keys() == mb.keys()
            for k in ma:
                if isinstance(ma[k], torch.Tensor):
                    assert torch.equal(ma[k], mb[k]), k
                else:
                    assert ma[k] == mb[k], k


def test_loader_is_deterministic_and_seeded(corpus):
    def run(seed: int) -> list:
        loader = _loader(corpus, seed=seed)
        return [loader.next_step() for _ in range(4)]

    _assert_same_steps(run(3), run(3))
    with pytest.raises(AssertionError):
        _assert_same_steps(run(3), run(4))


def test_dyn_bsz_steps_and_budget(corpus):
    loader = _loader(corpus, global_batch_tokens=4 * 256, dp_world_size=2, dp_rank=1, pad_to_multiple_of=8)
    assert loader.micro_batches_per_step == 2
    for step, _ in zip(loader, range(5)):
        assert len(step) == 2
        for mb in step:
            t = mb["input_ids"].shape[1]
            assert t <= 256 and t % 8 == 0 and int(mb["cu_seqlens"][-1]) == t
    with pytest.raises(ValueError, match="global_batch_tokens=1000 must be a positive multiple"):
        _loader(corpus, global_batch_tokens=1000)
    with pytest.raises(ValueError, match="pad_to_multiple_of=3"):
        _loader(corpus, pad_to_multiple_of=3)
    with pytest.raises(ValueError, match="pad_token_id"):
        _loader(corpus, pad_token_id=P)


@pytest.mark.parametrize("workers,dp", [(0, 1), (2, 1), (2, 2)])
def test_resume_yields_identical_batches(corpus, workers, dp):
    kw = dict(num_workers=workers, global_batch_tokens=2 * 256 * dp, dp_world_size=dp, dp_rank=dp - 1)
    ref, states, steps = _loader(corpus, **kw), {}, []
    for i in range(9):
        steps.append(ref.next_step())
        states[i + 1] = pickle.dumps(ref.state_dict())  # what a checkpoint stores
    ref.close()
    for k in (1, 4, 7):
        resumed = _loader(corpus, **kw)
        resumed.load_state_dict(pickle.loads(states[k]))
        _assert_same_steps([resumed.next_step() for _ in range(9 - k)], steps[k:])
        resumed.close()
    # One DataLoader worker is the same logical reader as none.
    if workers == 0:
        one = _loader(corpus, **{**kw, "num_workers": 1})
        _assert_same_steps([one.next_step() for _ in range(4)], steps[:4])
        one.close()


def test_resume_rejects_another_layout(corpus):
    state = _loader(corpus, num_workers=0).state_dict()
    with pytest.raises(ValueError, match="num_workers: saved 1, now 2"):
        _loader(corpus, num_workers=2).load_state_dict(state)


def test_embedded_toy_corpus_is_the_default(tmp_path):
    loader = DataConfig(cache_dir=str(tmp_path), max_tokens_per_microbatch=512).build(**FACTS)
    step = loader.next_step()
    assert len(step) == 1 and step[0]["input_ids"].shape[1] <= 512
    assert len(os.listdir(tmp_path)) == 1 and len(loader.shards) == 16


def test_preset_pt_replays_saved_batches(corpus, tmp_path):
    src = _loader(corpus, global_batch_tokens=2 * 256)
    saved = [mb for _ in range(3) for mb in src.next_step()]  # 6 micro-batches
    path = str(tmp_path / "batches.pt")
    torch.save(saved, path)
    cfg = DataConfig(source="preset_pt", path=path, max_tokens_per_microbatch=256, global_batch_tokens=4 * 256)
    r0, r1 = cfg.build(**FACTS, dp_rank=0, dp_world_size=2), cfg.build(**FACTS, dp_rank=1, dp_world_size=2)
    _assert_same_steps([r0.next_step(), r1.next_step()], [saved[0:2], saved[2:4]])
    state = r0.state_dict()
    _assert_same_steps([r0.next_step()], [[saved[4], saved[5]]])
    _assert_same_steps([r0.next_step()], [[saved[2], saved[3]]])  # the list repeats
    again = cfg.build(**FACTS, dp_rank=0, dp_world_size=2)
    again.load_state_dict(state)
    _assert_same_steps([again.next_step()], [[saved[4], saved[5]]])

    broken = [dict(mb) for mb in saved]
    broken[3]["vq_codes"] = broken[3]["vq_codes"] + C
    torch.save(broken, path)
    with pytest.raises(ValueError, match=r"batch 3: vq_codes must lie in \[0, codebook_size=256\)"):
        cfg.build(**FACTS)
    del broken[5]["cu_seqlens"]
    torch.save(broken[5:], path)
    with pytest.raises(ValueError, match=r"batch 0: is missing \['cu_seqlens'\]"):
        cfg.build(**FACTS)
