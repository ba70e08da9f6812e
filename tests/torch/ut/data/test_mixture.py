"""Weighted data mixtures (``data.sources``, issue 16) and the per-source loss reduction.

- realised token shares follow the weights (0.6/0.3/0.1 within 2 points over > 2,000 samples); a
  small source repeats (its epoch counter grows), a large one streams;
- the same global batches on 1 and 2 DP ranks, with and without workers;
- resume from the (pickled, global) state continues batches and per-source counters exactly, on
  another DP degree; new weights on resume warn and apply from the next step; adding or removing
  a source is an error naming the fix;
- bad input names the source; a one-source mixture is the plain loader plus ``source_ids``;
- the per-source loss helper: token-weighted mean of per-source losses == global loss (<= 1e-6).
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hyper_parallel.components.source_metrics import SourceLossMeter, source_loss_sums
from hyper_parallel.config.manager import apply_overrides, load_run_file
from hyper_parallel.data import DataConfig, DataStateMismatch, first_difference, global_batches, write_shards
from hyper_parallel.data.plan import Planner
from hyper_parallel.data.source_config import ChatOptions, DirectTokenOptions, SourceConfig, TextOptions

V, C, P = 4096, 256, 4095
FACTS = dict(vocab_size=V, codebook_size=C, placeholder_token_id=P)
BUDGET = 256
WEIGHTS = {"big": 0.6, "mid": 0.3, "small": 0.1}


def _corpus(root: str, n: int, lo: int, hi: int, seed: int, *, images: bool = False) -> str:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        tokens = rng.integers(10, 900, int(rng.integers(lo, hi)))
        doc = {"key": f"s{seed}-{i:05d}", "tokens": tokens, "vq_codes": []}
        if images and i % 2:
            doc = {**doc, "tokens": np.concatenate([tokens, [P] * 4, [2]]), "vq_codes": rng.integers(0, C, 4),
                   "image_grids": [[2, 2]]}  # fmt: skip
        docs.append(doc)
    write_shards(root, docs, placeholder_token_id=P, samples_per_shard=64)
    return root


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mix")
    return {
        "big": _corpus(str(root / "big"), 1500, 20, 60, 1),
        "mid": _corpus(str(root / "mid"), 400, 30, 90, 2, images=True),
        "small": _corpus(str(root / "small"), 60, 10, 40, 3),
    }


def _config(corpora, tmp_path, *, weights=WEIGHTS, steps_tokens=4 * BUDGET, **kw) -> DataConfig:
    sources = [{"name": n, "path": corpora[n], "weight": w} for n, w in weights.items()]
    return DataConfig(
        max_tokens_per_microbatch=BUDGET,
        global_batch_tokens=steps_tokens,
        cache_dir=str(tmp_path / "cache"),
        sources=sources,
        **kw,
    )


@dataclass
class _Wrap:
    """A run config with only a ``data`` section (what a run file's ``[data]`` overrides)."""

    data: DataConfig = field(default_factory=DataConfig)


def _docs(batch) -> int:
    return len(batch["cu_seqlens"]) - 1


def test_token_shares_follow_the_weights_and_small_sources_repeat(corpora, tmp_path):
    loader = _config(corpora, tmp_path).build(model_facts=FACTS)
    assert loader.source_names == ("big", "mid", "small")
    tokens = np.zeros(3)
    samples = 0
    while samples < 2000:
        for mb in loader.next_step():
            ids = mb["source_ids"]
            assert ids.shape == mb["input_ids"].shape and ids.dtype == torch.int64
            assert (ids == ids[0, 0]).all()  # a micro-batch is one source's
            tokens[int(ids[0, 0])] += ids.numel()  # pad_to_multiple_of 1: every position is a document token
            samples += _docs(mb)
    share = tokens / tokens.sum()
    for s, w in enumerate(WEIGHTS.values()):
        assert abs(share[s] - w) <= 0.02, (share, WEIGHTS)
    m = loader.metrics()
    assert [m[f"data/{n}/tokens"] for n in WEIGHTS] == tokens.tolist()
    assert m["data/small/epoch"] >= 2 and m["data/big/epoch"] == 0  # the small source repeats, the big one streams
    assert sum(m[f"data/{n}/share"] for n in WEIGHTS) == pytest.approx(1.0)
    assert m["bad_samples_skipped"] == 0


def test_same_global_batches_on_one_and_two_ranks(corpora, tmp_path):
    cfg = _config(corpora, tmp_path)
    one = global_batches(cfg, model_facts=FACTS, steps=4, first_step=3)
    two = global_batches(cfg, model_facts=FACTS, steps=4, first_step=3, dp_world_size=2)
    workers = global_batches(_config(corpora, tmp_path, num_workers=2), model_facts=FACTS, steps=4, first_step=3,
                             dp_world_size=2)  # fmt: skip
    assert first_difference(one, two) is None
    assert first_difference(one, workers) is None
    assert len({int(mb["source_ids"][0, 0]) for step in one for mb in step}) == 3


def _run(loader, steps):
    out = []
    for _ in range(steps):
        batches = loader.next_step()
        out.append((batches, loader.metrics()))
    return out


@pytest.mark.parametrize("dp", [1, 2])
def test_resume_continues_batches_and_counters_exactly(corpora, tmp_path, dp, monkeypatch):
    cfg = _config(corpora, tmp_path, shuffle_buffer=8)  # small windows: the resume point lies past window 0
    straight = [cfg.build(model_facts=FACTS, dp_rank=r, dp_world_size=2) for r in range(2)]
    full = [_run(loader, 12) for loader in straight]
    # interrupted: 5 steps on 2 ranks, then (after a "kill -9": only the pickled state survives) on `dp` ranks
    first = [cfg.build(model_facts=FACTS, dp_rank=r, dp_world_size=2) for r in range(2)]
    for loader in first:
        _run(loader, 5)
    state = pickle.loads(pickle.dumps(first[1].state_dict()))
    assert state == first[0].state_dict()  # global: the same on every rank
    resumed = [cfg.build(model_facts=FACTS, dp_rank=r, dp_world_size=dp) for r in range(dp)]
    planned = []
    plan_next = Planner._plan_next
    monkeypatch.setattr(Planner, "_plan_next", lambda self: (planned.append(self), plan_next(self))[1])
    for loader in resumed:
        loader.load_state_dict(state)
    # no replay: each source re-plans only the window of its saved cursor (not every window since its start)
    assert len(planned) == 3 * dp, len(planned)
    assert all(child._planner._planned[0].first_bin > 0 for loader in resumed for child in loader.children)
    rest = [_run(loader, 7) for loader in resumed]
    for i in range(7):
        want = [mb for r in range(2) for mb in full[r][5 + i][0]]
        got = [mb for r in range(dp) for mb in rest[r][i][0]]
        assert first_difference([want], [got]) is None, f"step {6 + i}"
        assert rest[0][i][1] == full[0][5 + i][1], f"metrics of step {6 + i}"


def test_new_weights_on_resume_warn_and_apply_from_the_next_step(corpora, tmp_path, caplog):
    old = _config(corpora, tmp_path).build(model_facts=FACTS)
    _run(old, 6)
    state = old.state_dict()
    tokens_before = [old.metrics()[f"data/{n}/tokens"] for n in WEIGHTS]
    new_weights = {"big": 0.2, "mid": 0.2, "small": 0.6}
    new = _config(corpora, tmp_path, weights=new_weights).build(model_facts=FACTS)
    with caplog.at_level(logging.WARNING, logger="hyper_parallel.data"):
        new.load_state_dict(state)
    assert "weights changed on resume" in caplog.text
    assert [new.metrics()[f"data/{n}/tokens"] for n in WEIGHTS] == tokens_before  # counters continue
    steps = _run(new, 40)
    after = np.array([steps[-1][1][f"data/{n}/tokens"] for n in WEIGHTS]) - np.array(tokens_before)
    assert np.abs(after / after.sum() - np.array(list(new_weights.values()))).max() <= 0.02
    # the step right after the resume already follows the new weights (the old ones would give `big` first)
    assert int(steps[0][0][0]["source_ids"][0, 0]) == 2


@pytest.mark.parametrize("change", ["add", "remove"])
def test_adding_or_removing_a_source_on_resume_is_an_error(corpora, tmp_path, change):
    loader = _config(corpora, tmp_path).build(model_facts=FACTS)
    _run(loader, 2)
    weights = {**WEIGHTS, "extra": 0.1} if change == "add" else {"big": 0.6, "mid": 0.4}
    if change == "add":
        corpora = {**corpora, "extra": corpora["small"]}
    other = _config(corpora, tmp_path, weights=weights).build(model_facts=FACTS)
    name = "extra" if change == "add" else "small"
    verb = "added" if change == "add" else "removed"
    with pytest.raises(DataStateMismatch, match=rf"{verb} \['{name}'\].*--checkpoint\.restart_data_stream"):
        other.load_state_dict(loader.state_dict())


def test_a_plain_loader_state_does_not_load_into_a_mixture(corpora, tmp_path):
    plain = DataConfig(path=corpora["big"], max_tokens_per_microbatch=BUDGET, cache_dir=str(tmp_path / "c"))
    state = plain.build(model_facts=FACTS).state_dict()
    with pytest.raises(DataStateMismatch, match="other data"):
        _config(corpora, tmp_path).build(model_facts=FACTS).load_state_dict(state)


def test_one_source_mixture_is_the_plain_loader(corpora, tmp_path):
    plain = DataConfig(path=corpora["mid"], max_tokens_per_microbatch=BUDGET, global_batch_tokens=4 * BUDGET,
                       cache_dir=str(tmp_path / "c"))  # fmt: skip
    mix = _config(corpora, tmp_path, weights={"mid": 1.0})
    a = global_batches(plain, model_facts=FACTS, steps=5, first_step=2)
    b = global_batches(mix, model_facts=FACTS, steps=5, first_step=2)
    for step in b:
        for mb in step:
            assert (mb.pop("source_ids") == 0).all()
    assert first_difference(a, b) is None


def test_loss_on_image_keeps_only_image_targets(corpora, tmp_path):
    cfg = DataConfig(max_tokens_per_microbatch=BUDGET, cache_dir=str(tmp_path / "c"), sources=[
        {"name": "gen", "path": corpora["mid"], "direct_token": {"loss_on": "image"}},
        {"name": "txt", "path": corpora["mid"], "direct_token": {"loss_on": "text"}},
    ])  # fmt: skip
    loader = cfg.build(model_facts=FACTS)
    seen = set()
    for _ in range(6):
        for mb in loader.next_step():
            s, lab = int(mb["source_ids"][0, 0]), mb["labels"][mb["labels"] != -100]
            assert lab.numel() > 0 and ((lab >= V).all() if s == 0 else (lab < V).all())
            seen.add(s)
    assert seen == {0, 1}


def test_direct_token_loss_on_is_the_sources_own_section(corpora, tmp_path):
    """``data.direct_token.loss_on`` acts on a single DirectToken source as on a mixture entry (the same labels),
    and a mixture takes each source's own sections: one left in the data section, or one of another source type,
    is an error naming the field."""
    common = dict(max_tokens_per_microbatch=BUDGET, cache_dir=str(tmp_path / "c"))
    single = {m: DataConfig(path=corpora["mid"], direct_token=DirectTokenOptions(loss_on=m), **common).build(
        model_facts=FACTS) for m in ("image", "text")}  # fmt: skip
    entry = SourceConfig(name="gen", path=corpora["mid"], direct_token=DirectTokenOptions(loss_on="image"))
    mixed = DataConfig(sources=[entry], **common).build(model_facts=FACTS)
    plain = DataConfig(path=corpora["mid"], **common).build(model_facts=FACTS)
    for _ in range(3):
        (img,), (txt,), (mix,), (raw,) = (single["image"].next_step(), single["text"].next_step(), mixed.next_step(),
                                          plain.next_step())  # fmt: skip
        assert torch.equal(img["labels"], mix["labels"]) and torch.equal(img["input_ids"], raw["input_ids"])
        kept = raw["labels"] != -100
        assert torch.equal(img["labels"] != -100, kept & (raw["labels"] >= V)) and bool((img["labels"] >= V).any())
        assert torch.equal(txt["labels"] != -100, kept & (raw["labels"] < V))
    with pytest.raises(ValueError, match=r"^data.chat.loss_on='assistant' and data.sources are both set"):
        DataConfig(cache_dir=str(tmp_path), chat=ChatOptions(loss_on="assistant"),
                   sources=[SourceConfig(name="t", source="text")]).build(model_facts=FACTS)  # fmt: skip
    with pytest.raises(ValueError, match=r"data source 'g': chat_column='m' \(text.chat_column\) is an option of text"):
        DataConfig(cache_dir=str(tmp_path), sources=[
            SourceConfig(name="g", text=TextOptions(chat_column="m"))]).build(model_facts=FACTS)  # fmt: skip


def test_run_file_sources_are_read_once_into_sections(tmp_path):
    """A run file's ``[[data.sources]]`` tables (sections as nested tables) become SourceConfig when the file is
    read; a key of a section given flat, or a value of the wrong kind, is one line naming the entry and key."""
    from hyper_parallel.config import ConfigError

    def read(body: str) -> DataConfig:
        (tmp_path / "run.toml").write_text(body)
        return apply_overrides(_Wrap(), load_run_file(tmp_path / "run.toml"), source="run.toml").data

    data = read('[[data.sources]]\nname = "c"\nsource = "text"\nweight = 2\ntext = { chat_column = "messages" }\n'
                '[data.sources.chat]\nloss_on = "assistant"\n')  # fmt: skip
    (entry,) = data.sources
    assert entry == SourceConfig(name="c", source="text", weight=2.0, text=TextOptions(chat_column="messages"),
                                 chat=ChatOptions(loss_on="assistant"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"^run.toml: data.sources\[0\] \('c'\): unknown key 'chat_column'; it is a "
                                          r"field of the entry's text section \(text.chat_column\)$"):
        read('[[data.sources]]\nname = "c"\nchat_column = "messages"\n')
    with pytest.raises(ConfigError, match=r"^run.toml: data.sources\[0\] \('c'\).chat: loss_on=1 must be a string$"):
        read('[[data.sources]]\nname = "c"\nchat = { loss_on = 1 }\n')


def test_bad_samples_are_counted_per_source(corpora, tmp_path):
    rng = np.random.default_rng(5)
    docs = [{"key": f"b{i}", "tokens": rng.integers(10, 900, 30), "vq_codes": []} for i in range(40)]
    docs.insert(3, {"key": "bad_range", "tokens": [V + 5] * 10, "vq_codes": []})
    bad_dir = str(tmp_path / "bad")
    write_shards(bad_dir, docs, placeholder_token_id=P, samples_per_shard=64, validate=False)
    cfg = DataConfig(max_tokens_per_microbatch=BUDGET, cache_dir=str(tmp_path / "c"), sources=[
        {"name": "good", "path": corpora["small"]},
        {"name": "dirty", "path": bad_dir, "on_bad_sample": "skip"},
    ])  # fmt: skip
    loader = cfg.build(model_facts=FACTS)
    _run(loader, 12)
    m = loader.metrics()
    assert m["data/dirty/bad_samples_skipped"] == 1 and m["data/good/bad_samples_skipped"] == 0
    assert m["bad_samples_skipped"] == 1
    with pytest.raises(ValueError, match=r"data source 'dirty'.*key 'bad_range'"):
        DataConfig(max_tokens_per_microbatch=BUDGET, cache_dir=str(tmp_path / "c"),
                   sources=[{"name": "dirty", "path": bad_dir}]).build(model_facts=FACTS)  # fmt: skip


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ([{"name": "a", "weight": 0}], r"data source 'a': weight=0 must be a number > 0"),
        ([{"name": "a", "weight": -1.5}], r"data source 'a': weight=-1.5"),
        ([{"name": "a", "source": "images"}], r"data source 'a': source='images' is not a source type"),
        ([{"name": "a"}, {"name": "b"}, {"name": "a"}], r"two data.sources are named 'a' \(entries 0 and 2\)"),
        ([{"name": "a", "wieght": 2}], r"data.sources\[0\] \('a'\): unknown key 'wieght'; did you mean 'weight'"),
        ([{"weight": 2}], r"data.sources\[0\] needs a `name`"),
        ([{"name": "t", "source": "text", "chat": {"loss_on": "image"}}], r"data source 't': loss_on='image'"),
    ],
)
def test_bad_mixture_configs_name_the_source(tmp_path, sources, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(cache_dir=str(tmp_path), sources=sources).build(model_facts=FACTS)


def test_sources_without_a_readable_sample_are_named(corpora, tmp_path):
    bad_dir = str(tmp_path / "allbad")
    write_shards(bad_dir, [{"key": f"x{i}", "tokens": [V + 1] * 8, "vq_codes": []} for i in range(5)],
                 placeholder_token_id=P, validate=False)  # fmt: skip
    sources = [{"name": "ok", "path": corpora["small"]}, {"name": "junk", "path": bad_dir, "on_bad_sample": "skip"}]
    with pytest.raises(ValueError, match=r"data source 'junk'.*no readable sample"):
        DataConfig(max_tokens_per_microbatch=BUDGET, cache_dir=str(tmp_path), sources=sources).build(model_facts=FACTS)
    missing = [{"name": "ok", "path": corpora["small"]}, {"name": "gone", "path": str(tmp_path / "nope")}]
    with pytest.raises((ValueError, OSError), match=r"data source 'gone'"):
        DataConfig(max_tokens_per_microbatch=BUDGET, cache_dir=str(tmp_path), sources=missing).build(model_facts=FACTS)
    with pytest.raises(ValueError, match=r"data.path=.* and data.sources are both set"):
        DataConfig(path=corpora["small"], sources=[{"name": "a"}], cache_dir=str(tmp_path)).build(model_facts=FACTS)


def test_three_source_run_file(corpora, tmp_path):
    """The README example shape: toml `[[data.sources]]` and yaml lists give the same loader."""
    toml = tmp_path / "run.toml"
    toml.write_text(
        "[data]\nmax_tokens_per_microbatch = 256\nglobal_batch_tokens = 1024\n"
        + "".join(
            f'\n[[data.sources]]\nname = "{n}"\nsource = "direct_token"\npath = "{corpora[n]}"\nweight = {w}\n'
            for n, w in WEIGHTS.items()
        )
        + 'on_bad_sample = "skip"\n'
    )
    yaml = tmp_path / "run.yaml"
    yaml.write_text(
        "data:\n  max_tokens_per_microbatch: 256\n  global_batch_tokens: 1024\n  sources:\n"
        + "".join(
            f"    - {{name: {n}, source: direct_token, path: '{corpora[n]}', weight: {w}}}\n" for n, w in WEIGHTS.items()
        )
    )
    base = DataConfig(cache_dir=str(tmp_path / "cache"))
    a = apply_overrides(_Wrap(data=base), load_run_file(toml)).data
    b = apply_overrides(_Wrap(data=base), load_run_file(yaml)).data
    assert a.source_types() == ("direct_token",)
    la, lb = a.build(model_facts=FACTS), b.build(model_facts=FACTS)
    assert la.sources[2].on_bad_sample == "skip" and lb.sources[2].on_bad_sample == ""
    assert first_difference(_run_batches(la, 3), _run_batches(lb, 3)) is None
    assert isinstance(la.sources[0], SourceConfig)


def _run_batches(loader, steps):
    return [loader.next_step() for _ in range(steps)]


# -- the per-source loss reduction --------------------------------------------------------------
def test_per_source_losses_average_to_the_global_loss():
    g = torch.Generator().manual_seed(0)
    S, Vocab = 3, 97
    meter_logits, meter_fast = SourceLossMeter(["a", "b", "c"]), SourceLossMeter(["a", "b", "c"])
    all_ce, total_tokens = [], 0
    micro_batches = []
    for i in range(5):
        T = 40 + 7 * i
        logits = torch.randn(1, T, Vocab, generator=g) * 3
        labels = torch.randint(0, Vocab, (1, T), generator=g)
        labels[torch.rand(1, T, generator=g) < 0.2] = -100
        micro_batches.append((logits, labels))
        total_tokens += int((labels != -100).sum())
    global_loss = torch.zeros((), dtype=torch.float32)
    mixed = SourceLossMeter(["a", "b", "c"])
    for i, (logits, labels) in enumerate(micro_batches):
        # the trainer's loss: sum of per-token CE / the step's labelled tokens, summed over micro-batches
        loss = F.cross_entropy(logits.view(-1, Vocab), labels.view(-1), reduction="sum") / total_tokens
        global_loss += loss
        single = torch.full_like(labels, i % S)
        meter_fast.add(labels, single, token_loss_sum=loss * total_tokens)
        meter_logits.add(labels, single, logits=logits)
        mixed.add(labels, torch.randint(0, S, labels.shape, generator=g), logits=logits)
        ce = F.cross_entropy(logits.view(-1, Vocab), labels.view(-1), reduction="none")
        all_ce.append(ce[labels.view(-1) != -100])
    counts = {}
    for i, (_, labels) in enumerate(micro_batches):
        counts["abc"[i % S]] = counts.get("abc"[i % S], 0) + int((labels != -100).sum())
    fast, slow = meter_fast.reduce(), meter_logits.reduce()
    for name in "abc":
        assert abs(fast[f"loss/{name}"] - slow[f"loss/{name}"]) <= 1e-5
    weighted = sum(fast[f"loss/{n}"] * counts[n] for n in "abc") / total_tokens
    assert abs(weighted - float(global_loss)) <= 1e-6
    mixed_losses = mixed.reduce(lambda t: t.clone())  # the all-reduce hook is applied to the [2, S] sums
    assert set(mixed_losses) == {"loss/a", "loss/b", "loss/c"}
    ref = float(torch.cat(all_ce).mean())
    sums, cnts = source_loss_sums(
        torch.cat([lg for lg, _ in micro_batches], 1), torch.cat([lb for _, lb in micro_batches], 1),
        torch.zeros(1, sum(lb.shape[1] for _, lb in micro_batches), dtype=torch.int64), 2, chunk_tokens=17,
    )  # fmt: skip
    assert cnts.tolist() == [total_tokens, 0] and abs(float(sums[0]) / total_tokens - ref) <= 1e-6
    assert abs(ref - float(global_loss)) <= 1e-6
    with pytest.raises(ValueError, match="must match labels"):
        SourceLossMeter(["a", "b"]).add(labels, torch.zeros(1, 3, dtype=torch.int64), token_loss_sum=1.0)


def test_console_line_and_jsonl_show_each_source(tmp_path, caplog):
    import json

    from hyper_parallel.components.metrics import MetricsProcessor

    metrics = MetricsProcessor.Config(plot_loss=False).build(dump_folder=tmp_path)
    extra = {"bad_samples_skipped": 0.0, "data/a/share": 0.6, "data/a/tokens": 60.0, "loss/a": 2.5, "data/b/share": 0.4}
    with caplog.at_level(logging.INFO, logger="hyper_parallel.components.metrics"):
        metrics.log(1, loss=2.0, extra=extra)
    metrics.close()
    assert "| src a 60% 2.500, b 40%" in caplog.text
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert {k: record[k] for k in extra} == extra


def test_sources_of_different_types_keep_their_own_collate(corpora, tmp_path):
    cfg = DataConfig(max_tokens_per_microbatch=BUDGET, global_batch_tokens=4 * BUDGET, cache_dir=str(tmp_path / "c"),
                     sources=[{"name": "img", "path": corpora["mid"]}, {"name": "txt", "source": "text"}])  # fmt: skip
    assert cfg.source_types() == ("direct_token", "text") and DataConfig(source="text").source_types() == ("text",)
    loader = cfg.build(model_facts=FACTS)
    seen = {}
    for _ in range(3):
        for mb in loader.next_step():
            seen[int(mb["source_ids"][0, 0])] = "vq_codes" in mb
    assert seen == {0: True, 1: False}  # DirectToken micro-batches carry VQ inputs, text ones only the contract
