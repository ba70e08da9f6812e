"""Context parallel's K/V all-gather attention computes its causal blocks without quadratic tensors.

One CP rank of four is simulated in one process (balanced order): its two query pieces attend to the
gathered K/V of a packed 32k-token row whose documents straddle the pieces, so every block kind occurs (a
piece starting inside a document: bottom-right causal with a key prefix; a document starting inside a
piece: square causal). Every tensor any op returns during forward AND backward is recorded (a
``TorchDispatchMode``): none has ``Lq * Lk`` elements (local queries x gathered keys), nor even
``piece_len ** 2`` (any mask or score matrix of one block would; the biggest real tensor is the gathered K/V,
linear in the length). Output and the q/k/v gradients equal per-document causal attention within 1e-5
(fp32). Small cases check every rank, GQA, MLA's smaller value head, both orders and the varlen stream
plan (flash-attn / torch ``varlen_attn``) against the same reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import hyper_parallel.models.common.attention as attention
from hyper_parallel.models.common.attention import AttentionMeta, CPShard, VarlenAttention, allgather_attention


class _Sizes(TorchDispatchMode):
    """Records the largest output (numel, op) of every op run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: tuple[int, str] = (0, "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor) and x.numel() > self.largest[0]:
                self.largest = (x.numel(), str(func))
        return out


def _reference(q, k, v, cu, T, scale):
    """Per-document causal SDPA over whole rows: ``[B, T, H, dv]`` (documents without wanted rows skipped)."""
    B, H = q.shape[:2]
    out = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    for s, e in zip(cu[:-1], cu[1:]):
        b, lo = divmod(s, T)
        hi = e - b * T
        o = F.scaled_dot_product_attention(
            q[b : b + 1, :, lo:hi], k[b : b + 1, :, lo:hi], v[b : b + 1, :, lo:hi],
            is_causal=True, scale=scale, enable_gqa=k.shape[1] != H,
        )  # fmt: skip
        out[b, lo:hi] = o[0].transpose(0, 1)
    return out


def _one_rank(rank, size, balanced, B, T, H, Hk, dqk, dv, cu, *, seed=0, kernel=None, record=False):
    """Rank ``rank``'s CP attention (fwd + bwd) and the per-document reference on the same leaves.

    Returns ``(max |out diff|, max |grad diff| over q, k, v, largest recorded (numel, op), Lq, Lk, piece)``."""
    torch.manual_seed(seed)
    scale = dqk**-0.5
    leaves = [torch.randn(B, h, T, d, requires_grad=True) for h, d in ((H, dqk), (Hk, dqk), (Hk, dv))]
    q, k, v = leaves
    t = T // size
    probe = CPShard(rank=rank, size=size, balanced=balanced)
    local = [torch.cat([torch.arange(lo, hi) for lo, hi in probe.ranges(t, r)]) for r in range(size)]
    kv_all = torch.cat([k, v], dim=-1)

    def gather(x: torch.Tensor) -> torch.Tensor:  # every other rank's K/V pieces, from the same leaves
        return torch.stack([x if r == rank else kv_all[:, :, local[r]] for r in range(size)])

    shard = CPShard(rank=rank, size=size, balanced=balanced, all_gather=gather)
    idx = local[rank]
    meta = AttentionMeta(cu_seqlens=torch.tensor(cu, dtype=torch.int32), cu_seqlens_host=cu)
    grad = torch.randn(B, t, H, dv)
    sizes = _Sizes()
    with sizes if record else torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x):
        args = (q[:, :, idx], k[:, :, idx], v[:, :, idx])
        if kernel is None:
            out = VarlenAttention.Config(backend="sdpa").build()(*args, scale=scale, meta=meta, cp=shard)
        else:
            out = allgather_attention(*args, scale=scale, meta=meta, cp=shard, kernel=kernel)
        got = torch.autograd.grad(out, leaves, grad)
    want_full = _reference(q, k, v, cu, T, scale)
    want = want_full[:, idx]
    ref = torch.autograd.grad(want, leaves, grad)
    out_diff = (out - want).abs().max().item()
    grad_diff = max((a - b).abs().max().item() for a, b in zip(got, ref))
    return out_diff, grad_diff, sizes.largest, t, T, probe.piece_len(t)


def test_cp4_allgather_32k_has_no_quadratic_tensor():
    # CP 4, balanced: rank 1 holds pieces 1 and 6 (4096 tokens each) of a 32768-token row. Documents:
    # [0, 3000) [3000, 12000) [12000, 12100) [12100, 24100) [24100, 32768): piece 1 starts inside document 1
    # (a 1096-key prefix), piece 6 holds the end of document 3 (a 12000-key document entered mid-way) and the
    # start of document 4 (square causal).
    cu = [0, 3000, 12000, 12100, 24100, 32768]
    out_diff, grad_diff, (numel, op), Lq, Lk, piece = _one_rank(1, 4, True, 1, 32768, 2, 1, 16, 16, cu, record=True)
    print(
        f"\nCP4 rank 1, 32k tokens: largest tensor {numel} elements ({op}); Lq*Lk = {Lq * Lk}, "
        f"piece^2 = {piece * piece}; max |out diff| {out_diff:.2e}, max |grad diff| {grad_diff:.2e}"
    )
    assert numel < Lq * Lk
    assert numel < piece * piece, f"a quadratic tensor: {numel} elements from {op}"
    assert out_diff <= 1e-5 and grad_diff <= 1e-5


@pytest.mark.parametrize(
    "size,balanced,B,H,Hk,dqk,dv",
    [(4, True, 2, 4, 1, 8, 8), (4, False, 2, 4, 2, 12, 8), (2, True, 1, 2, 2, 8, 8), (8, True, 1, 4, 1, 16, 8)],
    ids=["cp4-balanced-gqa", "cp4-contiguous-mla", "cp2-mha", "cp8-mla-gqa"],
)
def test_every_rank_matches_per_document_attention(size, balanced, B, H, Hk, dqk, dv):
    T = 96
    cu = [0, 5, 6, 40, 96] if B == 1 else [0, 5, 6, 40, 96, 96 + 17, 96 + 70, 192]
    for rank in range(size):
        out_diff, grad_diff, *_ = _one_rank(rank, size, balanced, B, T, H, Hk, dqk, dv, cu, seed=rank)
        assert out_diff <= 1e-5 and grad_diff <= 1e-5, (rank, out_diff, grad_diff)


def _fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa=False):
    """Flash varlen semantics at tiny sizes: per stream, causal aligned bottom-right (test-only dense mask)."""
    assert window_size == (-1, 0)
    outs = []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    assert max_q == max(b - a for a, b in zip(cq[:-1], cq[1:])) and max_k == max(b - a for a, b in zip(ck[:-1], ck[1:]))
    for (qa, qb), (ka, kb) in zip(zip(cq[:-1], cq[1:]), zip(ck[:-1], ck[1:])):
        Lq, Lk = qb - qa, kb - ka
        mask = torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
        o = F.scaled_dot_product_attention(
            q[qa:qb].transpose(0, 1), k[ka:kb].transpose(0, 1), v[ka:kb].transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=enable_gqa,
        )  # fmt: skip
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "contiguous"])
def test_varlen_stream_plan(monkeypatch, balanced):
    """The one-call path (flash-attn / torch varlen_attn): queries as they are, each block's key span
    gathered into a stream, separate cu_seqlens for queries and keys, bottom-right causal per stream."""
    monkeypatch.setattr(attention, "varlen_attn", _fake_varlen_attn)
    monkeypatch.setattr(attention.torch_features, "has", lambda name: True)
    cu = [0, 5, 6, 40, 96, 96 + 17, 96 + 70, 192]
    for rank in range(4):
        out_diff, grad_diff, *_ = _one_rank(rank, 4, balanced, 2, 96, 4, 2, 12, 8, cu, seed=rank, kernel="varlen")
        assert out_diff <= 1e-5 and grad_diff <= 1e-5, (rank, out_diff, grad_diff)


def test_plan_is_made_once_per_micro_batch():
    """Layers share the meta of their forward: the host block plan is made by the first layer only."""
    cu = [0, 5, 6, 40, 96]
    meta = AttentionMeta(cu_seqlens=torch.tensor(cu, dtype=torch.int32), cu_seqlens_host=cu)
    shard = CPShard(rank=1, size=4, balanced=True)
    first = attention._cp_blocks(meta, shard, 1, 24)
    assert attention._cp_blocks(meta, shard, 1, 24) is first
    assert sum(hi - lo for _, _, lo, hi, _ in first) == 24


def test_no_host_device_traffic_per_layer():
    """Three layers share one forward's meta: the SDPA path makes no sync and no host->device copy at all
    (block plan from host ints, natural order by slicing), forward and backward (``SyncCounter``)."""
    from tests.torch.sync_counter import SyncCounter

    size, rank, T, d = 4, 1, 96, 8
    cu = [0, 5, 6, 40, 96]
    q, k, v = (torch.randn(1, h, T, d, requires_grad=True) for h in (4, 1, 1))
    probe = CPShard(rank=rank, size=size, balanced=True)
    local = [torch.cat([torch.arange(lo, hi) for lo, hi in probe.ranges(T // size, r)]) for r in range(size)]
    kv_all = torch.cat([k, v], dim=-1)
    shard = CPShard(
        rank=rank, size=size, balanced=True,
        all_gather=lambda x: torch.stack([x if r == rank else kv_all[:, :, local[r]] for r in range(size)]),
    )  # fmt: skip
    attn = VarlenAttention.Config(backend="sdpa").build()
    with SyncCounter() as syncs:
        meta = AttentionMeta(cu_seqlens=torch.tensor(cu, dtype=torch.int32), cu_seqlens_host=cu)
        mine = [x[:, :, local[rank]] for x in (q, k, v)]
        for _ in range(3):
            attn(*mine, scale=d**-0.5, meta=meta, cp=shard).sum().backward(retain_graph=True)
    assert syncs.total == 0, syncs.report()
