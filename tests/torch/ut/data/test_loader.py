"""DirectToken loader: determinism, dyn_bsz steps, exact resume, other data refused, toy default, preset_pt, dummy."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from hyper_parallel.data import (
    DataConfig,
    DataStateMismatch,
    DummyDataLoader,
    TextOptions,
    ToyCorpusSpec,
    first_difference,
    make_toy_samples,
    write_shards,
)

V, C, P = 512, 256, 511
FACTS = dict(vocab_size=V, codebook_size=C, placeholder_token_id=P)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """96 toy documents in 6 shards of 16."""
    out = tmp_path_factory.mktemp("corpus")
    spec = ToyCorpusSpec(lang_vocab_size=V, codebook_size=C, placeholder_token_id=P, num_samples=96, seed=1)
    write_shards(str(out), make_toy_samples(spec), placeholder_token_id=P, samples_per_shard=16)
    return str(out)


def _loader(corpus, **kw):
    layout = {k: kw.pop(k) for k in ("dp_rank", "dp_world_size") if k in kw}
    cfg = DataConfig(path=corpus, max_tokens_per_microbatch=256, shuffle_buffer=24, packing_bins=4, **kw)
    return cfg.build(model_facts=FACTS, **layout)


def test_loader_is_deterministic_and_seeded(corpus):
    def run(seed: int) -> list:
        loader = _loader(corpus, seed=seed)
        return [loader.next_step() for _ in range(4)]

    assert first_difference(run(3), run(3)) is None
    assert first_difference(run(3), run(4)) is not None


def test_dyn_bsz_steps_and_budget(corpus):
    loader = _loader(corpus, global_batch_tokens=4 * 256, dp_world_size=2, dp_rank=1, pad_to_multiple_of=8)
    assert loader.micro_batches_per_step == 2 and loader.global_micro_batches == 4
    for step, _ in zip(loader, range(5)):
        assert len(step) == 2
        for mb in step:
            t = mb["input_ids"].shape[1]
            assert t <= 256 and t % 8 == 0 and int(mb["cu_seqlens"][-1]) == t
            assert set(mb) == {"input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_host", "max_seqlen", "token_mask",
                               "visual_indices", "vq_codes"}  # fmt: skip
    with pytest.raises(ValueError, match="global_batch_tokens=1000 must be a positive multiple"):
        _loader(corpus, global_batch_tokens=1000)
    with pytest.raises(ValueError, match="pad_to_multiple_of=3"):
        _loader(corpus, pad_to_multiple_of=3)
    with pytest.raises(ValueError, match="pad_token_id"):
        _loader(corpus, pad_token_id=P)
    with pytest.raises(ValueError, match="split_long_documents is for text"):
        _loader(corpus, text=TextOptions(split_long_documents=True))


def test_model_facts_are_required_by_name(corpus):
    cfg = DataConfig(path=corpus, max_tokens_per_microbatch=256)
    with pytest.raises(ValueError, match=r"needs the model fact 'codebook_size', but the model gives only \['vocab_size'\]"):
        cfg.build(model_facts={"vocab_size": V})


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
        assert first_difference([resumed.next_step() for _ in range(9 - k)], steps[k:]) is None
        resumed.close()


def test_resume_refuses_other_data_but_not_another_layout(corpus):
    state = _loader(corpus, num_workers=0).state_dict()
    with pytest.raises(DataStateMismatch, match="seed: saved 0, now 1"):
        _loader(corpus, seed=1).load_state_dict(state)
    with pytest.raises(DataStateMismatch, match="max_tokens_per_microbatch: saved 256, now 128"):
        DataConfig(path=corpus, max_tokens_per_microbatch=128, shuffle_buffer=24, packing_bins=4).build(
            model_facts=FACTS
        ).load_state_dict(state)
    with pytest.raises(DataStateMismatch, match="version"):
        _loader(corpus).load_state_dict({**state, "version": 1})
    _loader(corpus, num_workers=2, dp_world_size=2, dp_rank=1, global_batch_tokens=512).load_state_dict(state)


def test_embedded_toy_corpus_is_the_default(tmp_path):
    loader = DataConfig(cache_dir=str(tmp_path), max_tokens_per_microbatch=512).build(model_facts=FACTS)
    step = loader.next_step()
    assert len(step) == 1 and step[0]["input_ids"].shape[1] <= 512
    assert sorted(os.listdir(tmp_path)) == [n for n in os.listdir(tmp_path) if n.startswith("toy_direct_token-")]
    assert len(loader.shards) == 16
    assert all(os.path.isfile(s + ".idx.npz") for s in loader.shards)  # written with the corpus, nothing cached


def test_preset_pt_replays_saved_batches(corpus, tmp_path):
    src = _loader(corpus, global_batch_tokens=2 * 256)
    saved = [mb for _ in range(3) for mb in src.next_step()]  # 6 micro-batches
    path = str(tmp_path / "batches.pt")
    torch.save(saved, path)
    cfg = DataConfig(source="preset_pt", path=path, max_tokens_per_microbatch=256, global_batch_tokens=4 * 256)
    r0, r1 = cfg.build(model_facts=FACTS, dp_rank=0, dp_world_size=2), cfg.build(model_facts=FACTS, dp_rank=1, dp_world_size=2)
    assert first_difference([r0.next_step(), r1.next_step()], [saved[0:2], saved[2:4]]) is None
    state = r0.state_dict()
    assert first_difference([r0.next_step()], [[saved[4], saved[5]]]) is None
    assert first_difference([r0.next_step()], [[saved[2], saved[3]]]) is None  # the list repeats
    one = cfg.build(model_facts=FACTS)  # resumed on one rank: the whole global step
    one.load_state_dict(state)
    assert first_difference([one.next_step()], [[saved[4], saved[5], saved[0], saved[1]]]) is None

    broken = [dict(mb) for mb in saved]
    broken[3]["vq_codes"] = broken[3]["vq_codes"] + C
    torch.save(broken, path)
    with pytest.raises(ValueError, match=r"batch 3: vq_codes must lie in \[0, codebook_size=256\)"):
        cfg.build(model_facts=FACTS)
    with pytest.raises(ValueError, match=r"batch 0: holds vq_codes, but the model gives no \['codebook_size'"):
        cfg.build(model_facts={"vocab_size": V})
    del broken[5]["cu_seqlens"]
    torch.save(broken[5:], path)
    with pytest.raises(ValueError, match=r"batch 0: is missing \['cu_seqlens'\]"):
        cfg.build(model_facts=FACTS)


def test_dummy_source_is_layout_independent_and_resumable():
    cfg = DummyDataLoader.Config(max_tokens_per_microbatch=64, global_batch_tokens=4 * 64, seed=5)
    one = cfg.build(model_facts={"vocab_size": 100})
    assert isinstance(one, DummyDataLoader)
    ref = [one.next_step() for _ in range(3)]
    ranks = [cfg.build(model_facts={"vocab_size": 100}, dp_rank=r, dp_world_size=2) for r in range(2)]
    assert first_difference([[mb for r in ranks for mb in r.next_step()] for _ in range(3)], ref) is None
    for mb in ref[0]:
        assert set(mb) == {"input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_host", "max_seqlen", "token_mask"}
        assert mb["input_ids"].shape == (1, 64) and int(mb["input_ids"].max()) < 100
        labelled = mb["labels"][0, :-1] != -100
        assert torch.equal(mb["labels"][0, :-1][labelled], mb["input_ids"][0, 1:][labelled])
    again = cfg.build(model_facts={"vocab_size": 100})
    again.load_state_dict(ranks[0].state_dict())
    assert first_difference([again.next_step()], [one.next_step()]) is None
    with pytest.raises(ValueError, match="needs the model fact 'vocab_size'"):
        cfg.build(model_facts={})
