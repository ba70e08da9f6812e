"""Every kind of bad sample under data.on_bad_sample=error and =skip."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import webdataset as wds

from hyper_parallel.data import DIRECT_TOKEN_BAD_KINDS, BadSampleError, DataConfig

V, C, P = 512, 256, 511
MAX_TOKENS = 64
MARK = 499  # only the bad sample carries this token id


def _good(i: int) -> dict:
    return {
        "__key__": f"good{i:03d}",
        "tokens.npy": np.array([100 + i, 7, P, P, 8], np.int32),
        "vq_codes.npy": np.array([1, 2], np.int32),
        "json": {"image_grids": [[1, 2]]},
    }


def _bad_record(kind: str) -> dict:
    rec = {"__key__": "bad", "tokens.npy": np.array([MARK, P, 8], np.int32),
           "vq_codes.npy": np.array([3], np.int32), "json": {"image_grids": [[1, 1]]}}
    if kind == "missing_tokens":
        del rec["tokens.npy"]
    elif kind == "missing_vq_codes":
        del rec["vq_codes.npy"]
    elif kind == "undecodable":
        rec["vq_codes.npy"] = b"\x93NUMPY garbage"
    elif kind == "bad_metadata":
        rec["json"] = {"image_grids": [[1, 1]], "loss_on": "text"}
    elif kind == "empty":
        rec["tokens.npy"], rec["vq_codes.npy"], rec["json"] = np.zeros(0, np.int32), np.zeros(0, np.int32), {"image_grids": []}
    elif kind == "too_long":
        rec["tokens.npy"] = np.array([MARK] * (MAX_TOKENS + 1) + [P], np.int32)
    elif kind == "token_out_of_range":
        rec["tokens.npy"] = np.array([MARK, P, V + 3], np.int32)
    elif kind == "count_mismatch":
        rec["tokens.npy"] = np.array([MARK, P, P, 8], np.int32)
        rec["json"] = {"image_grids": [[1, 2]]}
    elif kind == "grid_mismatch":
        rec["json"] = {"image_grids": [[2, 2]]}
    elif kind == "code_out_of_range":
        rec["vq_codes.npy"] = np.array([C], np.int32)
    else:
        raise AssertionError(kind)
    return rec


CASES = {
    # case -> the kind it must be reported as
    "missing_tokens": "missing_file",
    "missing_vq_codes": "missing_file",
    "undecodable": "undecodable",
    "bad_metadata": "bad_metadata",
    "empty": "empty",
    "too_long": "too_long",
    "token_out_of_range": "token_out_of_range",
    "count_mismatch": "count_mismatch",
    "grid_mismatch": "grid_mismatch",
    "code_out_of_range": "code_out_of_range",
    "garbage_tar": "unreadable_shard",
    "truncated_tar": "unreadable_shard",
}


def _write(path: str, records: list[dict]) -> None:
    with wds.TarWriter(path, mtime=0) as w:
        for r in records:
            w.write(r)


def _corpus(tmp_path, case: str) -> tuple[str, str]:
    """A good shard (good000..007) and a shard holding the bad case; returns (dir, bad shard)."""
    d = tmp_path / case
    d.mkdir()
    _write(str(d / "a-000000.tar"), [_good(i) for i in range(8)])
    bad = str(d / "a-000001.tar")
    if case == "garbage_tar":
        with open(bad, "wb") as f:
            f.write(os.urandom(3000))
    elif case == "truncated_tar":
        _write(bad, [_good(i) for i in range(8, 16)])
        data = open(bad, "rb").read()
        with open(bad, "wb") as f:
            f.write(data[: len(data) // 2 + 100])
    else:
        _write(bad, [_good(8), _good(9), _bad_record(case), _good(10), _good(11)])
    return str(d), bad


def _loader(path: str, policy: str, cache: str, workers: int = 0):
    cfg = DataConfig(path=path, cache_dir=cache, max_tokens_per_microbatch=MAX_TOKENS, shuffle_buffer=0,
                     packing_bins=1, num_workers=workers, on_bad_sample=policy)  # fmt: skip
    return cfg.build(model_facts=dict(vocab_size=V, codebook_size=C, placeholder_token_id=P))


def test_cases_cover_every_kind():
    assert set(CASES.values()) == set(DIRECT_TOKEN_BAD_KINDS)


@pytest.mark.parametrize("case", list(CASES))
def test_error_policy_names_shard_and_key(tmp_path, case):
    path, bad = _corpus(tmp_path, case)
    with pytest.raises(BadSampleError) as e:  # before training: the indexes say which records are bad
        _loader(path, "error", str(tmp_path / "cache"))
    msg = str(e.value)
    assert bad in msg and f"[{CASES[case]}]" in msg and "on_bad_sample skip" in msg
    if "tar" not in case:
        assert "key 'bad'" in msg


@pytest.mark.parametrize("case", list(CASES))
def test_skip_policy_drops_counts_and_logs(tmp_path, case, caplog):
    path, bad = _corpus(tmp_path, case)
    with caplog.at_level(logging.WARNING, logger="hyper_parallel.data"):
        loader = _loader(path, "skip", str(tmp_path / "cache"))
        steps = [loader.next_step() for _ in range(12)]
    ids = np.concatenate([mb["input_ids"].view(-1).numpy() for s in steps for mb in s])
    assert MARK not in ids  # never used
    first = set(ids.tolist())
    expect_good = range(8) if "tar" in case else range(12)
    assert all(100 + i in first for i in expect_good)  # nothing else lost
    counts = loader.bad_sample_counts
    assert set(counts) == {CASES[case]} and counts[CASES[case]] >= 1
    logged = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert logged and bad in logged[0] and f"[{CASES[case]}]" in logged[0]
    assert loader.metrics()["bad_samples_skipped"] == sum(counts.values())
    # The count survives a resume.
    again = _loader(path, "skip", str(tmp_path / "cache"))
    again.load_state_dict(loader.state_dict())
    assert again.bad_sample_counts == counts


def test_a_shard_changed_after_indexing_is_an_error_from_the_worker(tmp_path):
    """The index says a record is good but its bytes no longer are: an error naming shard and key, from a worker."""
    path, bad = _corpus(tmp_path, "code_out_of_range")
    good = os.path.join(path, "a-000000.tar")
    _loader(path, "skip", str(tmp_path / "cache")).close()  # indexes both shards into the cache
    data = bytearray(open(good, "rb").read())
    at = data.index(b"\x93NUMPY", data.index(b"good003.tokens.npy"))
    data[at : at + 6] = b"BROKEN"
    st = os.stat(good)
    open(good, "wb").write(bytes(data))
    os.utime(good, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: the index still looks current
    loader = _loader(path, "skip", str(tmp_path / "cache"), workers=1)
    with pytest.raises(BadSampleError, match=r"key 'good003'.*\[undecodable\].*index says otherwise"):
        for _ in range(12):
            loader.next_step()
    loader.close()
