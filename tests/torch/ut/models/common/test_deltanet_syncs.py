"""Gated DeltaNet on the GPU's terms, checked on CPU: no device-to-host sync in a packed layer's forward and
backward (torch path, fla/causal-conv1d path, context-parallel state passing), plans made from host ints and
device bounds that equal the host construction, and one opaque custom op per layer under ``torch.compile``
(fullgraph, no recompile per packing, the eager numbers bit for bit).

The fla / causal-conv1d stand-ins implement those kernels' documented contracts (fla >= 0.5: grouped values,
``cu_seqlens`` plus its host copy ``cu_seqlens_cpu``; causal-conv1d: ``seq_idx``) with sync-free torch ops, so
the counter sees only our glue around them.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from hyper_parallel.models.common import deltanet_plan
from hyper_parallel.models.common import gated_delta_rule as gdr
from hyper_parallel.models.common.attention import AttentionMeta, CPShard
from hyper_parallel.models.common.gated_deltanet import GatedDeltaNet
from tests.torch.sync_counter import SyncCounter

Hk, Hv, Dk, Dv, DIM = 2, 4, 8, 6, 32
G = 2 * Dk + Hv // Hk * Dv
B, T = 2, 40
DOCS = [7, 23, 10, 1, 3, 36]  # two rows of 40: a 1-token document, documents shorter than the conv window


def _cu(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _meta(lengths: list[int]) -> AttentionMeta:
    cu = _cu(lengths)
    return AttentionMeta(cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=max(lengths), cu_seqlens_host=cu)


def _layer(seed: int = 0, backend: str = "torch") -> GatedDeltaNet:
    torch.manual_seed(seed)
    cfg = GatedDeltaNet.Config(num_k_heads=Hk, num_v_heads=Hv, head_k_dim=Dk, head_v_dim=Dv)
    cfg.delta_rule.backend = backend
    layer = cfg.build(dim=DIM)
    layer.init_weights()
    return layer


def _fwd_bwd(layer: GatedDeltaNet, meta: AttentionMeta | None, seed: int = 1) -> tuple[torch.Tensor, list]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, DIM, generator=gen, requires_grad=True)
    out = layer(x, meta=meta)
    out.backward(torch.randn(out.shape, generator=gen))
    return out.detach(), [x.grad, *(p.grad for p in layer.parameters())]


# ---- plans: device-built from host ints + device bounds == the host construction -------------------------------


def _reference_chunk_plan(cu: list[int], L: int) -> tuple[list[list[int]], list[int]]:
    """Step-major chunk slots (token or N = padding) and each token's slot, built on the host."""
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    n_chunks = [-(-n // L) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda d: -n_chunks[d])
    gather = [
        [t if t < cu[d + 1] else cu[-1] for t in range(cu[d] + j * L, cu[d] + (j + 1) * L)]
        for j in range(n_chunks[order[0]])
        for d in order
        if n_chunks[d] > j
    ]
    slot = [0] * cu[-1]
    for c, row in enumerate(gather):
        for i, t in enumerate(row):
            if t < cu[-1]:
                slot[t] = c * L + i
    return gather, slot


def _own_taps(cu: list[int], K: int, ahead: bool, t: int) -> list[bool]:
    """Per tap of row ``t``'s window (read back, or ahead for the input gradient): in ``t``'s own document."""
    d = max(i for i in range(len(cu) - 1) if cu[i] <= t)
    src = [t + (K - 1 - j) if ahead else t - (K - 1 - j) for j in range(K)]
    return [cu[d] <= s < cu[d + 1] for s in src]


def _crossing(cu: list[int], K: int, ahead: bool) -> set[int]:
    """Rows whose window reaches a row of the stream outside their own document (the stream pass gets them wrong)."""
    N = cu[-1]
    return {
        t
        for t in range(N)
        for j, own in enumerate(_own_taps(cu, K, ahead, t))
        if not own and 0 <= (t + (K - 1 - j) if ahead else t - (K - 1 - j)) < N
    }


@pytest.mark.parametrize("trial", range(6))
def test_plans_equal_the_host_construction(trial):
    rng = random.Random(trial)
    lengths = [rng.choice([1, 2, 3, 5, 16, 17, 40]) for _ in range(rng.randint(1, 9))]
    cu, like = _cu(lengths), torch.empty(0)
    cu_dev = torch.tensor(cu, dtype=torch.int32)
    for L in (1, 4, 16):
        plan = deltanet_plan.chunk_plan(cu, cu_dev, L, like)
        gather, slot = _reference_chunk_plan(cu, L)
        assert plan.gather_NL.tolist() == gather and plan.slot_of_token.tolist() == slot
    for K in (1, 2, 4):
        plan = deltanet_plan.conv_plan(cu, cu_dev, K, like)
        for ahead, (rows, src, valid) in ((False, plan.forward), (True, plan.backward)):
            got = {}
            for r, v in zip(rows.tolist(), valid.tolist()):
                assert v == _own_taps(cu, K, ahead, r)  # recomputed from its own document's taps only
                got[r] = v
            assert _crossing(cu, K, ahead) <= set(got)  # every row the stream pass gets wrong is recomputed
            t = rows[:, None] + (K - 1 - torch.arange(K)) * (1 if ahead else -1)
            assert torch.equal(src, t.clamp(0, cu[-1] - 1))
        for s in range(1, K):  # weight gradient: the product rows u = t - s that pair two documents
            rows = set(plan.crossing[s - 1].tolist()) - {cu[-1] - s}
            want = {t - s for d in range(1, len(cu) - 1) for t in range(cu[d], min(cu[d] + s, cu[d + 1])) if t >= s}
            assert rows == want


def test_plans_are_made_once_per_micro_batch():
    cu, like = _cu(DOCS), torch.empty(0)
    a = deltanet_plan.chunk_plan(cu, torch.tensor(cu, dtype=torch.int32), 16, like)
    b = deltanet_plan.chunk_plan(list(cu), torch.tensor(cu, dtype=torch.int32), 16, like)  # another layer, same batch
    assert a is b
    assert deltanet_plan.chunk_plan(_cu([40, 40]), None, 16, like) is not a


# ---- no syncs --------------------------------------------------------------------------------------------------


def test_packed_layer_forward_and_backward_make_no_sync():
    """Torch path: a packed layer's forward + backward (plans built inside, first layer of the micro-batch) and a
    second layer on the same meta make no sync: the meta's device ``cu_seqlens`` and host ints are all they use."""
    deltanet_plan._CACHE.clear()
    layers, meta = [_layer(0), _layer(1)], _meta(DOCS)
    with SyncCounter() as syncs:
        syncs.mark_device(meta.cu_seqlens)  # the trainer copies the batch's bounds to the device
        for layer in layers:
            _fwd_bwd(layer, meta)
    assert syncs.total == 0, syncs.report()
    with SyncCounter() as syncs:  # unpacked rows: bounds from arange
        _fwd_bwd(layers[0], None)
    assert syncs.total == 0, syncs.report()


def test_sync_counter_sees_a_tolist_in_the_layer(monkeypatch):
    """The guard can fail: the old per-layer read of the device bounds is counted."""
    real = gdr.causal_conv1d_silu

    def reads_bounds(x, w, cu, cu_dev=None):
        cu_dev.tolist()  # what document_bounds(meta.cu_seqlens) used to do in every layer
        return real(x, w, cu, cu_dev)

    monkeypatch.setattr(gdr, "causal_conv1d_silu", reads_bounds)
    layer, meta = _layer(), _meta(DOCS)
    with SyncCounter() as syncs:
        syncs.mark_device(meta.cu_seqlens)
        _fwd_bwd(layer, meta)
    assert syncs.by_kind == {"tolist": 1}, syncs.report()


def _conv_standin(x_BCT, weight_CK, bias, seq_idx, activation):
    """causal-conv1d's contract with ``seq_idx``: taps never cross a change of ``seq_idx [B, T]``, optional SiLU
    (channel-last ``[B, C, T]``), by shifted multiply-adds masked where the tap's document differs."""
    assert bias is None and activation == "silu" and x_BCT.stride(1) == 1 and seq_idx.dtype == torch.int32
    K, n = weight_CK.shape[-1], x_BCT.shape[-1]
    y = torch.zeros_like(x_BCT)
    for j in range(K):
        s = K - 1 - j
        same = F.pad(seq_idx, (s, 0), value=-1)[..., :n] == seq_idx
        y = y + F.pad(x_BCT, (s, 0))[..., :n] * weight_CK[:, j, None] * same[:, None, :]
    return F.silu(y)


FLA_CALLS: list[tuple] = []


def _fla_standin(q, k, v, g, beta, *, scale, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu):
    """fla >= 0.5's contract (GVA): q/k ``[1, N, H, Dk]``, v ``[1, N, HV, Dv]`` with value head ``h`` reading key
    head ``h // (HV / H)``, ``g``/``beta [1, N, HV]``, the state restarting at every ``cu_seqlens`` bound (its host
    copy ``cu_seqlens_cpu``); the exact recurrence token by token (no chunks), without a sync."""
    FLA_CALLS.append((q.shape, k.shape, cu_seqlens, cu_seqlens_cpu))
    assert use_qk_l2norm_in_kernel and scale == q.shape[-1] ** -0.5 and cu_seqlens.dtype == torch.long
    r = v.shape[2] // q.shape[2]
    norm = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    q = (norm(q[0].float()) * scale).repeat_interleave(r, dim=1)
    k = norm(k[0].float()).repeat_interleave(r, dim=1)
    v, g, beta = v[0].float(), g[0].float(), beta[0].float()
    keep = torch.ones(q.shape[0], device=q.device).index_fill_(0, cu_seqlens[:-1], 0.0)  # 0 where a document starts
    S = q.new_zeros(q.shape[1], q.shape[2], v.shape[2])
    outs = []
    for t in range(q.shape[0]):
        S = S * (keep[t] * g[t].exp())[:, None, None]
        S = S + k[t][:, :, None] * (beta[t][:, None] * (v[t] - (S * k[t][:, :, None]).sum(1)))[:, None, :]
        outs.append((S * q[t][:, :, None]).sum(1))
    return torch.stack(outs)[None].to(v.dtype), None


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.setattr(gdr, "causal_conv1d_fn", _conv_standin)
    monkeypatch.setattr(gdr, "fla_chunk_gated_delta_rule", _fla_standin)
    monkeypatch.setattr(gdr, "cuda_kernels_can_run", lambda qkv: True)
    FLA_CALLS.clear()


def test_kernel_path_makes_no_sync_and_feeds_fla_its_contract(kernels):
    """fla/causal-conv1d path: no sync in two layers' forward + backward; fla gets grouped q/k (no repeat per value
    head), the SAME device bounds tensor in every layer (its per-tensor caches hit) and their host copy; the result
    equals the torch path."""
    meta = _meta(DOCS)
    layers = [_layer(0, "cuda_kernels"), _layer(1, "cuda_kernels")]
    with SyncCounter() as syncs:
        syncs.mark_device(meta.cu_seqlens)
        got = [_fwd_bwd(layer, meta) for layer in layers]
    assert syncs.total == 0, syncs.report()
    (q_shape, k_shape, cu_a, cpu_a), (_, _, cu_b, _) = FLA_CALLS[:2]
    assert q_shape[2] == k_shape[2] == Hk  # grouped values: fla maps value heads to key heads itself
    assert cu_a is cu_b and cu_a.tolist() == _cu(DOCS)
    assert cpu_a.device.type == "cpu" and cpu_a.dtype == torch.long and cpu_a.tolist() == _cu(DOCS)
    for layer, (out, grads) in zip((_layer(0), _layer(1)), got):
        want, want_grads = _fwd_bwd(layer, meta)
        assert (out - want).abs().max().item() <= 1e-5
        for a, b in zip(grads, want_grads):
            assert (a - b).abs().max().item() <= 1e-5


def test_state_passing_makes_no_sync_after_the_first_layer():
    """Context-parallel state passing (two pieces per row passing their state, one process): its derived bounds
    reach the device once per micro-batch (the first layer: one copy per derived list), never again."""
    deltanet_plan._CACHE.clear()
    meta = _meta(DOCS)
    shard = CPShard(rank=0, size=1, balanced=True, all_gather=lambda x: x[None])
    rule = gdr.GatedDeltaRule.Config(chunk_size=8, backend="torch").build(head_k_dim=Dk, head_v_dim=Dv)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(B, T, Hk, G, generator=gen), -torch.rand(B, T, Hv, generator=gen),
              torch.rand(B, T, Hv, generator=gen), torch.randn(Hk * G, 4, generator=gen) * 0.5]  # fmt: skip

    def layer() -> torch.Tensor:
        qkv, g, beta, w = (t.clone().requires_grad_() for t in inputs)
        out = rule(qkv, g, beta, conv_weight=w, meta=meta, cp=shard)
        out.sum().backward()
        return out.detach()

    with SyncCounter() as first:
        first.mark_device(meta.cu_seqlens)
        got = layer()
    assert first.total <= 3 and set(first.by_kind) == {"host->device copy"}, first.report()
    with SyncCounter() as later:
        layer()
    assert later.total == 0, later.report()
    with torch.no_grad():
        want = rule(*inputs[:3], conv_weight=inputs[3], meta=meta)
    assert (got - want).abs().max().item() <= 1e-5


# ---- torch.compile: one custom op per layer ----------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["torch", "cuda_kernels"])
def test_custom_op_equals_the_eager_path_bitwise(kernel, request):
    """``hyper_parallel::gated_delta_rule`` (what compiled code calls) gives the eager path's output and
    gradients to the bit, on both paths (fla / causal-conv1d by their stand-ins): its backward recomputes the same
    forward under autograd."""
    if kernel == "cuda_kernels":
        request.getfixturevalue("kernels")
    rule = gdr.GatedDeltaRule.Config(chunk_size=16, backend=kernel).build(head_k_dim=Dk, head_v_dim=Dv)
    meta = _meta(DOCS)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(B, T, Hk, G, generator=gen), -torch.rand(B, T, Hv, generator=gen),
              torch.rand(B, T, Hv, generator=gen), torch.randn(Hk * G, 4, generator=gen) * 0.5]  # fmt: skip
    grad = torch.randn(B, T, Hv, Dv, generator=gen)
    results = []
    for via_op in (False, True):
        leaves = [t.clone().requires_grad_() for t in inputs]
        if via_op:
            out = gdr.gated_delta_rule_op(*leaves, meta.cu_seqlens, meta.host_bounds(), Dk, Dv, 16, kernel)
        else:
            out = rule(*leaves[:3], conv_weight=leaves[3], meta=meta)
        out.backward(grad)
        results.append([out.detach(), *(t.grad for t in leaves)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_compiled_layer_is_one_graph_and_new_packings_do_not_recompile():
    """``torch.compile(fullgraph=True)`` of a DeltaNet layer traces whole (the core is one opaque op) and three
    more packings (other document counts and lengths) reuse the first graph; outputs and input gradients equal
    eager's."""
    layer = _layer()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    for docs in (DOCS, [5, 35, 20, 20], [40, 1, 2, 3, 34], [3, 37, 40]):
        meta = _meta(docs)
        out, grads = _fwd_bwd(compiled, meta)
        want, want_grads = _fwd_bwd(layer, meta)
        assert (out - want).abs().max().item() <= 1e-6
        assert (grads[0] - want_grads[0]).abs().max().item() <= 1e-6
    # AttentionMeta marks both bound tensors' lengths dynamic: no recompile at all (else one, on the first change)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 4 packings"


def _fla_conv_standin(x, weight, *, activation, cu_seqlens, cu_seqlens_cpu):
    """fla's ``causal_conv1d`` contract: ``x [1, N, C]`` flat over the packed stream, the window restarting at every
    ``cu_seqlens`` bound (host copy ``cu_seqlens_cpu``); returns ``(y, final_state)``. Computed by our own conv."""
    FLA_CALLS.append(("conv", x.shape, cu_seqlens_cpu))
    assert x.shape[0] == 1 and activation == "silu" and cu_seqlens.dtype == torch.long
    return gdr.causal_conv1d_silu(x, weight, _cu(DOCS)), None  # the test's bounds (checked against the host copy)


def test_kernel_path_without_causal_conv1d_uses_flas_triton_conv(kernels, monkeypatch):
    """No compiled causal-conv1d (the GPU image's wheels carry only fla): fla's own conv runs on the flat stream,
    with no sync, and the layer equals the torch path."""
    monkeypatch.setattr(gdr, "causal_conv1d_fn", None)
    monkeypatch.setattr(gdr, "fla_causal_conv1d", _fla_conv_standin)
    meta = _meta(DOCS)
    with SyncCounter() as syncs:
        syncs.mark_device(meta.cu_seqlens)
        out, grads = _fwd_bwd(_layer(0, "cuda_kernels"), meta)
    assert syncs.total == 0, syncs.report()
    kind, shape, host = FLA_CALLS[0]
    assert (kind, shape) == ("conv", (1, B * T, Hk * G)) and host.device.type == "cpu" and host.tolist() == _cu(DOCS)
    want, want_grads = _fwd_bwd(_layer(0), meta)
    assert (out - want).abs().max().item() <= 1e-5
    for a, b in zip(grads, want_grads):
        assert (a - b).abs().max().item() <= 1e-5
