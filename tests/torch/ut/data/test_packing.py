"""Packing collate (the batch contract) and the first-fit packer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hyper_parallel.data import (
    IGNORE_INDEX,
    SampleSpec,
    TokenDocument,
    ToyCorpusSpec,
    batch_to_device,
    collate_direct_token,
    collate_packed,
    make_sample,
    make_toy_samples,
)
from hyper_parallel.data.packing import FirstFitPacker, shift_labels

V, C, P = 512, 256, 511
SPEC = SampleSpec(V, C, P, 128)


def _sample(tokens, codes=(), grids=(), loss_on="all", key="k"):
    meta = {"image_grids": [list(g) for g in grids], "loss_on": loss_on}
    return make_sample(key, "shard", np.array(tokens), np.array(codes, dtype=np.int64), meta, SPEC)


def test_collate_matches_hand_written_contract():
    docs = [
        _sample([10, P, P, 11], [3, 4], [(1, 2)]),
        _sample([12, 13], loss_on="image"),
        _sample([14, P, 15], [7], [(1, 1)], loss_on="image"),
    ]
    b = collate_direct_token(docs, pad_token_id=0, pad_to_multiple_of=4)
    assert b["input_ids"].tolist() == [[10, P, P, 11, 12, 13, 14, P, 15, 0, 0, 0]]
    x = IGNORE_INDEX
    assert b["labels"].tolist() == [[3 + V, 4 + V, 11, x, x, x, 7 + V, x, x, x, x, x]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 0, 1, 2]]
    assert b["cu_seqlens"].tolist() == [0, 4, 6, 9, 12] and b["cu_seqlens"].dtype == torch.int32
    assert b["max_seqlen"] == 4
    assert b["visual_indices"].tolist() == [1, 2, 7] and b["vq_codes"].tolist() == [3, 4, 7]
    assert set(b) == {"input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_host", "max_seqlen", "token_mask",
                      "visual_indices", "vq_codes"}  # fmt: skip
    for k in ("input_ids", "labels", "position_ids", "visual_indices", "vq_codes"):
        assert b[k].dtype == torch.int64, k
    moved = batch_to_device(b, "cpu")
    assert moved["max_seqlen"] == 4 and torch.equal(moved["labels"], b["labels"])
    # no padding needed -> no padding segment
    b = collate_direct_token(docs[:2])
    assert b["cu_seqlens"].tolist() == [0, 4, 6] and b["input_ids"].shape == (1, 6)


def test_collate_on_toy_documents_follows_the_label_rule():
    raw = make_toy_samples(ToyCorpusSpec(lang_vocab_size=V, codebook_size=C, placeholder_token_id=P, num_samples=12))
    docs = [_sample(s["tokens"], s["vq_codes"], s["image_grids"], key=s["key"]) for s in raw]
    b = collate_direct_token(docs, pad_to_multiple_of=64)
    ids, labels = b["input_ids"].view(-1).tolist(), b["labels"].view(-1).tolist()
    code_at = dict(zip(b["visual_indices"].tolist(), b["vq_codes"].tolist()))
    assert sorted(code_at) == [t for t, i in enumerate(ids) if i == P]
    cu = b["cu_seqlens"].tolist()
    ends = set(e - 1 for e in cu[1:])
    n_real = cu[-2]
    for t in range(len(ids)):
        if t in ends or t >= n_real:
            assert labels[t] == IGNORE_INDEX  # never across a document boundary, never on padding
        else:
            nxt = ids[t + 1]
            assert labels[t] == (code_at[t + 1] + V if nxt == P else nxt)
    pos = b["position_ids"].view(-1).tolist()
    assert all(pos[s] == 0 for s in cu[:-1])
    assert b["max_seqlen"] == max(np.diff(cu))


def test_generic_collate_knows_no_model_input():
    docs = [TokenDocument(f"t{i}", "s", np.array(t), shift_labels(np.array(t))) for i, t in enumerate([[5, 6, 7], [8, 9]])]
    b = collate_packed(docs, pad_token_id=0, pad_to_multiple_of=8)
    assert set(b) == {"input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_host", "max_seqlen", "token_mask"}
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert b["labels"].tolist() == [[6, 7, -100, 9, -100, -100, -100, -100]]
    assert b["cu_seqlens"].tolist() == [0, 3, 5, 8] and b["max_seqlen"] == 3


def _drain(lengths: list[int], open_bins: int) -> list[list[str]]:
    packer: FirstFitPacker[str] = FirstFitPacker(10, open_bins)
    out = []
    for i, n in enumerate(lengths):
        out += [[ref for _, ref in b] for b in packer.add(n, f"{i}:{n}")]
    return out


def test_first_fit_packer_order():
    lengths = [6, 6, 3, 4, 5, 2, 7, 3]
    assert _drain(lengths, 2)[:3] == [["1:6", "3:4"], ["0:6", "2:3"], ["4:5", "5:2", "7:3"]]
    assert _drain(lengths, 1)[:4] == [["0:6"], ["1:6", "2:3"], ["3:4", "4:5"], ["5:2", "6:7"]]
    with pytest.raises(ValueError, match="max_tokens"):
        FirstFitPacker(10, 2).add(11, "big")
    # the open bins are the packer's whole state
    a: FirstFitPacker[str] = FirstFitPacker(10, 2)
    a.add(6, "x")
    a.add(5, "y")
    b: FirstFitPacker[str] = FirstFitPacker(10, 2, a.bins)
    assert a.add(4, "z") == b.add(4, "z") == [[(6, "x"), (4, "z")]]


def test_collate_gives_attention_the_boundaries_on_the_host():
    """``cu_seqlens_host`` lists the very boundaries of ``cu_seqlens``, so no layer copies them off the device."""
    from hyper_parallel.data import TokenDocument, collate_packed

    docs = [TokenDocument(f"d{i}", "mem", np.arange(n), np.arange(n)) for i, n in enumerate((5, 3, 6))]
    batch = collate_packed(docs, pad_to_multiple_of=8)
    assert isinstance(batch["cu_seqlens_host"], list)
    assert batch["cu_seqlens_host"] == batch["cu_seqlens"].tolist() == [0, 5, 8, 14, 16]
