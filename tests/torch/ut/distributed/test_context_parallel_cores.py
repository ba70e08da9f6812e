"""The context-parallel cores beyond the head counts, simulated in one process.

Each simulated CP rank is a thread holding its pieces of every row (``CPShard``, balanced or contiguous);
``all_gather`` is a barrier over the threads. The state-passing Gated DeltaNet core (``gated_delta_rule_cp``)
must equal the single-sequence core on long inputs (T = 16k, CP 4, fp32, within 1e-5), and the K/V all-gather
attention must equal whole-sequence attention, on packed rows whose documents straddle the pieces.
Multi-rank gradients are checked by ``tests/torch/st/test_context_parallel.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from hyper_parallel.distributed.context_parallel import split_batch_for_cp
from hyper_parallel.models.common.attention import AttentionMeta, CPShard, VarlenAttention
from hyper_parallel.models.common.gated_delta_rule import GatedDeltaRule


def _simulate(size: int, balanced: bool, T: int, fn: Callable[[CPShard, torch.Tensor], torch.Tensor]) -> list:
    """Run ``fn(shard, local_positions)`` on ``size`` threads that all-gather through a barrier."""
    slots, outs, errors = [None] * size, [None] * size, []
    barrier = threading.Barrier(size)

    def worker(rank: int) -> None:
        def gather(x: torch.Tensor) -> torch.Tensor:
            slots[rank] = x
            barrier.wait()
            out = torch.stack(list(slots))
            barrier.wait()
            return out

        shard = CPShard(rank=rank, size=size, balanced=balanced, all_gather=gather)
        idx = torch.cat([torch.arange(lo, hi) for lo, hi in shard.ranges(T // size)])
        try:
            with torch.no_grad():
                outs[rank] = (idx, fn(shard, idx))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return outs


def _meta(cu: list[int]) -> AttentionMeta:
    return AttentionMeta(cu_seqlens=torch.tensor(cu, dtype=torch.int32), cu_seqlens_host=cu)


def test_pieces_and_balanced_split():
    shard = CPShard(rank=1, size=4, balanced=True)
    assert shard.ranges(8) == [(4, 8), (24, 28)]  # pieces 1 and 6 of 8 pieces of 4 tokens
    nat = CPShard(rank=0, size=2, balanced=True).natural_index(4)
    # rank-major gathered order: rank 0 holds pieces 0 and 3, rank 1 pieces 1 and 2
    assert nat.tolist() == [0, 1, 4, 5, 6, 7, 2, 3]
    batch = {"input_ids": torch.arange(16).view(1, 16), "labels": torch.arange(16).view(1, 16),
             "position_ids": torch.arange(16).view(1, 16), "cu_seqlens": torch.tensor([0, 16])}  # fmt: skip
    part = split_batch_for_cp(batch, 1, 4, balanced=True)
    assert part["input_ids"].tolist() == [[2, 3, 12, 13]] and part["cu_seqlens"].tolist() == [0, 16]
    with pytest.raises(ValueError, match="multiple of 8"):
        split_batch_for_cp({**batch, "input_ids": torch.zeros(1, 12)}, 0, 4, balanced=True)


@pytest.mark.parametrize(
    ("T", "B", "cu", "balanced", "chunk"),
    [
        # one 16k-token document over 4 ranks (8 pieces of 2048: every piece passes its state on)
        (16384, 1, [0, 16384], True, 64),
        # packed: documents start inside pieces, a 1-token document, a document crossing three pieces whole
        (16384, 1, [0, 1000, 1001, 2049, 9000, 16384], True, 64),
        # two rows, contiguous order, small chunks (several per piece)
        (256, 2, [0, 5, 70, 71, 200, 256, 300, 512], False, 16),
        # short pieces (32 tokens): the transition M of a piece one document crosses whole is far from 0 (over
        # 2048 tokens the delta rule's contractions make it vanish, so the 16k cases barely test it)
        (256, 1, [0, 256], True, 16),
    ],
    ids=["16k-one-doc", "16k-packed", "rows-contiguous", "short-pieces"],
)
def test_state_passing_core_equals_single_sequence_core(T, B, cu, balanced, chunk):
    torch.manual_seed(0)
    Hk, Hv, Dk, Dv, K, size = 2, 4, 16, 16, 4, 4
    G = 2 * Dk + Hv // Hk * Dv
    qkv = torch.randn(B, T, Hk, G)
    g = -torch.rand(B, T, Hv) * 0.05  # slow decay: the state carries far across pieces
    beta = torch.rand(B, T, Hv)
    w = torch.randn(Hk * G, K) * 0.5
    core = GatedDeltaRule.Config(chunk_size=chunk, backend="torch").build(head_k_dim=Dk, head_v_dim=Dv)
    with torch.no_grad():
        want = core(qkv, g, beta, conv_weight=w, meta=_meta(cu))

    def rank_fn(shard: CPShard, idx: torch.Tensor) -> torch.Tensor:
        return core(qkv[:, idx], g[:, idx], beta[:, idx], conv_weight=w, meta=_meta(cu), cp=shard)

    got = torch.empty_like(want)
    for idx, out in _simulate(size, balanced, T, rank_fn):
        got[:, idx] = out
    diff = (got - want).abs().max().item()
    print(f"\nstate passing T={T} CP {size}: max |diff| {diff:.2e} (outputs up to {want.abs().max().item():.2f})")
    assert diff <= 1e-5


@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "contiguous"])
def test_allgather_attention_equals_whole_sequence(balanced):
    torch.manual_seed(0)
    B, H, Hkv, T, d, size = 2, 4, 1, 64, 8, 4
    q, k, v = torch.randn(B, H, T, d), torch.randn(B, Hkv, T, d), torch.randn(B, Hkv, T, d)
    cu = [0, 3, 4, 30, 64, 64 + 17, 128]
    attn = VarlenAttention.Config(backend="sdpa").build()
    with torch.no_grad():
        want = attn(q, k, v, scale=d**-0.5, meta=_meta(cu))

    def rank_fn(shard: CPShard, idx: torch.Tensor) -> torch.Tensor:
        return attn(q[:, :, idx], k[:, :, idx], v[:, :, idx], scale=d**-0.5, meta=_meta(cu), cp=shard)

    got = torch.empty_like(want)
    for idx, out in _simulate(size, balanced, T, rank_fn):
        got[:, idx] = out
    assert (got - want).abs().max().item() <= 1e-6
