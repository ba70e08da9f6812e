"""DirectToken format: writer round trip, CLI, shard path forms, the toy corpus."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from hyper_parallel.data import (
    DirectTokenWriter,
    SampleSpec,
    ToyCorpusSpec,
    cached_toy_corpus,
    check_shards,
    make_toy_samples,
    read_samples,
    write_shards,
)
from hyper_parallel.data.direct_token.cli import main as cli_main
from hyper_parallel.data.shards import resolve_shards

V, C, P = 512, 256, 511


def _random_samples(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        grids = [[int(rng.integers(1, 4)), int(rng.integers(1, 4))] for _ in range(int(rng.integers(0, 3)))]
        n_codes = sum(h * w for h, w in grids)
        text = rng.integers(0, V - 1, size=int(rng.integers(1, 20)))
        tokens = np.concatenate([text, np.full(n_codes, P)]).astype(np.int32)
        rng.shuffle(tokens)
        s = {"key": f"s{i:04d}", "tokens": tokens, "vq_codes": rng.integers(0, C, n_codes).astype(np.int32), "image_grids": grids}
        if i % 3 == 0:
            s["loss_on"] = "image"
        out.append(s)
    return out


def test_writer_round_trip_is_identical(tmp_path):
    samples = _random_samples(23)
    shards = write_shards(str(tmp_path), samples, placeholder_token_id=P, lang_vocab_size=V, codebook_size=C, samples_per_shard=5)
    assert [os.path.basename(s) for s in shards] == [f"train-{i:06d}.tar" for i in range(5)]
    back = list(read_samples(str(tmp_path)))
    assert len(back) == len(samples)
    for want, got in zip(samples, back):
        assert got["key"] == want["key"]
        assert got["tokens"].dtype == np.int32 and np.array_equal(got["tokens"], want["tokens"])
        assert got["vq_codes"].dtype == np.int32 and np.array_equal(got["vq_codes"], want["vq_codes"])
        assert got["image_grids"] == want["image_grids"]
        assert got.get("loss_on") == want.get("loss_on")
    report = check_shards(str(tmp_path), SampleSpec(V, C, P, 64))
    assert report["samples"] == 23 and report["bad"] == {}
    # Same input -> byte-identical shards (fixed mtime).
    again = write_shards(str(tmp_path / "again"), samples, placeholder_token_id=P, samples_per_shard=5)
    assert all(open(a, "rb").read() == open(b, "rb").read() for a, b in zip(shards, again))


def test_writer_refuses_malformed_samples(tmp_path):
    with DirectTokenWriter(str(tmp_path), placeholder_token_id=P, codebook_size=C) as w:
        with pytest.raises(ValueError, match="count_mismatch"):
            w.write([1, P, P], [3], [[1, 1]])
        with pytest.raises(ValueError, match="grid_mismatch"):
            w.write([1, P, P], [3, 4], [[1, 1]])
        with pytest.raises(ValueError, match="code_out_of_range"):
            w.write([1, P], [C], [[1, 1]])
        with pytest.raises(ValueError, match="empty"):
            w.write([], [], [])
        with pytest.raises(ValueError, match="must be non-empty without"):
            w.write([1], key="a.b")
        w.write([1, 2], key="ok")
        with pytest.raises(ValueError, match="already in shard"):
            w.write([1, 2], key="ok")
    assert w.num_samples == 1


def test_resolve_directory_glob_and_brace(tmp_path):
    write_shards(str(tmp_path), _random_samples(12), placeholder_token_id=P, samples_per_shard=3)
    every = [str(tmp_path / f"train-{i:06d}.tar") for i in range(4)]
    assert resolve_shards(str(tmp_path)) == every
    assert resolve_shards(str(tmp_path / "train-*.tar")) == every
    assert resolve_shards(str(tmp_path / "train-*")) == every  # index side files are never shards
    assert resolve_shards(str(tmp_path / "train-{000001..000002}.tar")) == every[1:3]
    with pytest.raises(FileNotFoundError, match="do not exist"):
        resolve_shards(str(tmp_path / "train-{000003..000004}.tar"))
    with pytest.raises(FileNotFoundError, match="matches no shard"):
        resolve_shards(str(tmp_path / "nope-*.tar"))


def test_cli_write_and_check(tmp_path, capsys):
    samples = _random_samples(7)
    jsonl = tmp_path / "in.jsonl"
    with open(jsonl, "w") as f:
        for s in samples:
            f.write(json.dumps({**s, "tokens": s["tokens"].tolist(), "vq_codes": s["vq_codes"].tolist()}) + "\n")
    out = tmp_path / "shards"
    assert cli_main(["write", "--input", str(jsonl), "--output-dir", str(out), "--placeholder-token-id", str(P),
                     "--samples-per-shard", "4", "--prefix", "x"]) == 0
    assert sorted(os.listdir(out)) == ["x-000000.tar", "x-000000.tar.idx.npz", "x-000001.tar", "x-000001.tar.idx.npz"]
    back = list(read_samples(str(out / "x-{000000..000001}.tar")))
    assert [b["key"] for b in back] == [s["key"] for s in samples]
    assert all(np.array_equal(b["tokens"], s["tokens"]) for b, s in zip(back, samples))

    # Directory-of-npy input.
    npy = tmp_path / "npy"
    npy.mkdir()
    np.save(npy / "k1.tokens.npy", np.array([1, P, P, 2], np.int32))
    np.save(npy / "k1.vq_codes.npy", np.array([5, 6], np.int32))
    (npy / "k1.json").write_text(json.dumps({"image_grids": [[1, 2]]}))
    np.save(npy / "k2.tokens.npy", np.array([7, 8], np.int32))
    assert cli_main(["write", "--input", str(npy), "--output-dir", str(tmp_path / "o2"), "--placeholder-token-id", str(P)]) == 0
    back = list(read_samples(str(tmp_path / "o2")))
    assert [b["key"] for b in back] == ["k1", "k2"] and back[1]["image_grids"] == []

    capsys.readouterr()
    rc = cli_main(["check", "--path", str(out), "--placeholder-token-id", str(P), "--lang-vocab-size", str(V),
                   "--codebook-size", str(C), "--max-tokens", "8"])
    printed = capsys.readouterr().out
    assert rc == 1 and "too_long" in printed  # some samples exceed 8 tokens
    assert cli_main(["check", "--path", str(out), "--placeholder-token-id", str(P), "--lang-vocab-size", str(V),
                     "--codebook-size", str(C), "--max-tokens", "64"]) == 0

    # `index` (re)writes the side files of shards written by other tools
    for f in os.listdir(out):
        if f.endswith(".idx.npz"):
            os.remove(out / f)
    assert cli_main(["index", "--path", str(out / "x-*.tar"), "--placeholder-token-id", str(P)]) == 0
    assert "indexed 2 shard(s)" in capsys.readouterr().out
    assert sorted(f for f in os.listdir(out) if f.endswith(".idx.npz")) == ["x-000000.tar.idx.npz", "x-000001.tar.idx.npz"]


def test_toy_corpus_is_learnable_and_cached(tmp_path):
    spec = ToyCorpusSpec(lang_vocab_size=V, codebook_size=C, placeholder_token_id=P, num_samples=200, samples_per_shard=64)
    a, b = make_toy_samples(spec), make_toy_samples(spec)
    assert all(np.array_equal(x["tokens"], y["tokens"]) and np.array_equal(x["vq_codes"], y["vq_codes"]) for x, y in zip(a, b))
    grids = {tuple(g) for s in a for g in s["image_grids"]}
    assert grids == {(4, 4), (4, 6), (6, 6)}
    assert any(not s["image_grids"] for s in a) and any(len(s["image_grids"]) == 2 for s in a)
    # Learnable: the caption's class word determines the image codes up to the noise. A predictor
    # that knows the class (the most common code per (class word, grid cell)) gets ~90% right.
    from hyper_parallel.data.direct_token.toy_corpus import _vocabulary

    class_words = list(_vocabulary(spec)[0])
    table: dict = {}
    for s in a:
        c = next(int(t) for t in s["tokens"] if int(t) in class_words)
        off = 0
        for h, w in s["image_grids"]:
            for k, code in enumerate(s["vq_codes"][off : off + h * w]):
                table.setdefault((c, w, k), []).append(int(code))
            off += h * w
    hits = sum(max(np.bincount(v)) for v in table.values())
    total = sum(len(v) for v in table.values())
    assert 0.85 < hits / total < 0.97  # structure with noise (noise=0.1), not a constant
    folder = cached_toy_corpus(str(tmp_path), spec)
    assert len(resolve_shards(folder)) == 4
    mtime = os.path.getmtime(folder)
    assert cached_toy_corpus(str(tmp_path), spec) == folder and os.path.getmtime(folder) == mtime
    assert check_shards(folder, SampleSpec(V, C, P, 128))["bad"] == {}


def test_module_entry_point_writes_the_toy_corpus(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "toy"
    cmd = [sys.executable, "-m", "hyper_parallel.data.direct_token", "toy", "--output-dir", str(out),
           "--lang-vocab-size", str(V), "--codebook-size", str(C), "--placeholder-token-id", str(P), "--num-samples", "300"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "wrote 2 toy shard(s)" in done.stdout and "RuntimeWarning" not in done.stderr
    assert sum(1 for _ in read_samples(str(out))) == 300
