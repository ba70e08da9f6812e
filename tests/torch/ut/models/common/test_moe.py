"""MoE: Router / GroupedExperts / token dispatch / MoE vs HF ``Glm4MoeLiteMoE`` (transformers, fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.grouped_mm import can_use_grouped_mm, grouped_linear
from hyper_parallel.models.common.moe import GroupedExperts, MoE, Router
from hyper_parallel.models.common.token_dispatcher import LocalTokenDispatcher

transformers = pytest.importorskip("transformers")
from transformers import Glm4MoeLiteConfig  # noqa: E402
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteMoE  # noqa: E402

DIM, HIDDEN = 64, 32

# (n_routed_experts, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
HF_CASES = [
    pytest.param((8, 4, 2, 3, True, 2.5), id="groups4of2-norm"),
    pytest.param((8, 4, 2, 3, False, 1.8), id="groups4of2-nonorm"),
    pytest.param((8, 2, 1, 2, True, 1.8), id="groups2of1-norm"),
    pytest.param((4, 1, 1, 2, True, 1.0), id="nogroups"),
]


def _hf_moe(num_experts, n_group, topk_group, top_k, norm, scale, *, impl="grouped_mm", seed=0):
    cfg = Glm4MoeLiteConfig(
        hidden_size=DIM, moe_intermediate_size=HIDDEN, n_routed_experts=num_experts, n_shared_experts=1,
        num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
        routed_scaling_factor=scale, hidden_act="silu",
    )
    cfg._experts_implementation = impl
    torch.manual_seed(seed)
    hf = Glm4MoeLiteMoE(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # A wide router spreads the choices; a bias of the same size changes many of them.
            p.normal_(0.0, 0.2 if name == "gate.weight" else 0.05)
        hf.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return hf


def _our_moe(num_experts, n_group, topk_group, top_k, norm, scale, *, impl="auto", score_func="sigmoid", bias=True):
    return MoE.Config(
        num_experts=num_experts,
        gate=Router.Config(
            top_k=top_k, score_func=score_func, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
            route_scale=scale, use_bias_correction=bias,
        ),
        experts=GroupedExperts.Config(hidden_dim=HIDDEN, grouped_mm_impl=impl),
        shared_experts=FeedForward.Config(hidden_dim=HIDDEN),
    ).build(dim=DIM)


def _x(*shape, seed=1, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _sorted_choice(idx_TK, w_TK):
    idx_sorted, order = idx_TK.sort(dim=-1)
    return idx_sorted, w_TK.gather(1, order)


def _max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------------------------------------
# MoE block and router vs HF
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hf_impl,our_impl", [("grouped_mm", "auto"), ("eager", "loop")])
@pytest.mark.parametrize("case", HF_CASES)
def test_moe_matches_hf_outputs_and_grads(case, hf_impl, our_impl):
    hf = _hf_moe(*case, impl=hf_impl)
    ours = _our_moe(*case, impl=our_impl)
    ours.load_state_dict(hf.state_dict(), strict=True)

    x = _x(2, 24, DIM)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_hf, out_ours = hf(x_hf), ours(x_ours)
    grad = _x(*out_hf.shape, seed=2)
    out_hf.backward(grad)
    out_ours.backward(grad)

    diffs = {"out": _max_diff(out_hf, out_ours), "x.grad": _max_diff(x_hf.grad, x_ours.grad)}
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, name
        diffs[name] = _max_diff(hf_params[name].grad, p.grad)
    assert set(hf_params) == {n for n, _ in ours.named_parameters()}
    assert max(diffs.values()) <= 1e-5, diffs


@pytest.mark.parametrize("case", HF_CASES)
def test_router_matches_hf(case):
    hf = _hf_moe(*case)
    ours = _our_moe(*case)
    ours.load_state_dict(hf.state_dict())
    x_TD = _x(64, DIM)
    _, w_hf, idx_hf = hf.gate(x_TD)
    idx, w, _ = ours.gate(x_TD)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == (64, case[3])
    idx_hf, w_hf = _sorted_choice(idx_hf, w_hf)
    idx, w = _sorted_choice(idx, w)
    assert torch.equal(idx, idx_hf)
    assert _max_diff(w, w_hf) <= 1e-7

    # The random bias (and, when active, the group limit) must actually change choices, else this
    # test would not cover them.
    with torch.no_grad():
        ours.gate.e_score_correction_bias.zero_()
    idx_nobias, _ = _sorted_choice(*ours.gate(x_TD)[:2])
    assert not torch.equal(idx_nobias, idx)


def test_group_limit_restricts_choices_to_topk_groups():
    num_experts, n_group, topk_group = 8, 4, 2
    router = Router.Config(top_k=3, n_group=n_group, topk_group=topk_group).build(dim=DIM, num_experts=num_experts)
    router.init_weights()
    with torch.no_grad():
        router.weight.normal_(0.0, 0.3)
    idx, _, _ = router(_x(256, DIM))
    groups_used = (idx // (num_experts // n_group)).sort(dim=-1).values
    distinct = 1 + (groups_used.diff(dim=-1) != 0).sum(-1)
    assert distinct.max() <= topk_group


# ---------------------------------------------------------------------------------------------------
# Dispatch and grouped matmul
# ---------------------------------------------------------------------------------------------------


def _naive_moe_routed(x_TD, idx_TK, w_TK, w_gate_up, w_down):
    """Per token, per choice: ``sum_k w_k * down_e(silu(gate_e x) * up_e x)``."""
    rows = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros(x_TD.shape[1], dtype=torch.float32)
        for k in range(idx_TK.shape[1]):
            e = int(idx_TK[t, k])
            gate, up = (w_gate_up[e] @ x_TD[t]).chunk(2)
            acc = acc + w_TK[t, k] * (w_down[e] @ (F.silu(gate) * up)).float()
        rows.append(acc.to(x_TD.dtype))
    return torch.stack(rows)


def _random_routing(num_tokens, num_experts, top_k, seed=3):
    g = torch.Generator().manual_seed(seed)
    idx_TK = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    w_TK = torch.rand(num_tokens, top_k, generator=g)
    return idx_TK, w_TK


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_dispatch_experts_combine_equals_naive_per_token(impl):
    num_tokens, num_experts, top_k = 40, 6, 2
    experts = GroupedExperts.Config(hidden_dim=HIDDEN, grouped_mm_impl=impl).build(dim=DIM, num_experts=num_experts)
    experts.init_weights()
    x_TD = _x(num_tokens, DIM)
    idx_TK, w_TK = _random_routing(num_tokens, num_experts, top_k)
    idx_TK[idx_TK == 5] = 4  # expert 5 gets no token: empty groups must work
    idx_TK[:, 1] = torch.where(idx_TK[:, 1] == idx_TK[:, 0], (idx_TK[:, 0] + 1) % 5, idx_TK[:, 1])

    dispatcher = LocalTokenDispatcher(num_experts)
    x_SD, counts_E, state = dispatcher.dispatch(x_TD, idx_TK, w_TK)
    assert torch.equal(counts_E, torch.bincount(idx_TK.flatten(), minlength=num_experts))
    assert counts_E[5] == 0
    # Rows are grouped by expert, tokens in order inside each group (stable sort).
    expect = torch.cat([x_TD[(idx_TK == e).any(-1)] for e in range(num_experts)])
    assert torch.equal(x_SD, expect)

    out_TD = dispatcher.combine(experts(x_SD, counts_E), state)
    ref_TD = _naive_moe_routed(x_TD, idx_TK, w_TK, experts.gate_up_proj.detach(), experts.down_proj.detach())
    assert _max_diff(out_TD, ref_TD) <= 1e-6


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_loop_fallback_equals_grouped_mm(dtype, tol):
    num_tokens, num_experts, top_k = 48, 8, 2
    x_TD = _x(num_tokens, DIM, dtype=dtype)
    idx_TK, w_TK = _random_routing(num_tokens, num_experts, top_k, seed=4)
    results = {}
    for impl in ("grouped_mm", "loop"):
        experts = GroupedExperts.Config(hidden_dim=HIDDEN, grouped_mm_impl=impl).build(
            dim=DIM, num_experts=num_experts, dtype=dtype
        )
        torch.manual_seed(0)
        experts.init_weights()
        x = x_TD.clone().requires_grad_()
        w = w_TK.clone().requires_grad_()
        dispatcher = LocalTokenDispatcher(num_experts)
        x_SD, counts_E, state = dispatcher.dispatch(x, idx_TK, w)
        out = dispatcher.combine(experts(x_SD, counts_E), state)
        assert out.dtype == dtype
        out.sum().backward()  # a stride-0 output gradient: grouped_mm's own backward rejects it
        results[impl] = [out, x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
    for a, b in zip(results["grouped_mm"], results["loop"]):
        assert _max_diff(a, b) <= tol


def test_grouped_linear_falls_back_when_unaligned():
    x_SI, w_EOI = _x(10, 6), _x(3, 5, 6, seed=2)  # 6 and 5 fp32 features: not 16-byte strides
    counts = torch.tensor([4, 0, 6])
    assert not can_use_grouped_mm(x_SI, w_EOI)
    assert can_use_grouped_mm(_x(10, 8), _x(3, 4, 8))
    ref = torch.cat([x_SI[:4] @ w_EOI[0].T, x_SI[4:] @ w_EOI[2].T])
    assert _max_diff(grouped_linear(x_SI, w_EOI, counts), ref) <= 1e-6
    with pytest.raises(ValueError, match="grouped_mm_impl"):
        grouped_linear(x_SI, w_EOI, counts, "grouped_mm")
    with pytest.raises(ValueError, match="3 experts"):
        grouped_linear(x_SI, w_EOI, torch.tensor([10]))


def test_experts_run_on_local_shard_of_dtensor_params():
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        experts = GroupedExperts.Config(hidden_dim=HIDDEN).build(dim=DIM, num_experts=4)
        experts.init_weights()
        plain = {n: p.detach().clone() for n, p in experts.named_parameters()}
        for name in ("gate_up_proj", "down_proj"):
            setattr(experts, name, torch.nn.Parameter(distribute_tensor(plain[name], mesh, [Shard(0)])))
        x_SD, counts = _x(12, DIM), torch.tensor([3, 3, 0, 6])
        y = experts(x_SD, counts)
        y.sum().backward()
        ref = GroupedExperts.Config(hidden_dim=HIDDEN).build(dim=DIM, num_experts=4)
        ref.load_state_dict(plain)
        assert _max_diff(y, ref(x_SD, counts)) <= 1e-6
        assert experts.gate_up_proj.grad.placements == (Shard(0),)
    finally:
        if created:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# Softmax routing (no HF oracle: a per-token reference)
# ---------------------------------------------------------------------------------------------------


def _reference_softmax_route(logits_TE, bias_E, top_k, n_group, topk_group, norm, scale):
    idx_rows, w_rows = [], []
    num_experts = logits_TE.shape[1]
    group_size = num_experts // n_group
    for logits in logits_TE:
        scores = torch.softmax(logits.double(), dim=0)
        choice = scores + bias_E.double()
        group_best = [max(choice[g * group_size:(g + 1) * group_size].tolist()) for g in range(n_group)]
        keep = sorted(range(n_group), key=lambda g: -group_best[g])[:topk_group]
        allowed = [e for e in range(num_experts) if e // group_size in keep]
        chosen = sorted(sorted(allowed, key=lambda e: -choice[e].item())[:top_k])
        w = scores[chosen]
        if norm:
            w = w / w.sum()
        idx_rows.append(torch.tensor(chosen))
        w_rows.append(w * scale)
    return torch.stack(idx_rows), torch.stack(w_rows)


@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, False), (4, 2, True), (8, 3, False)])
def test_softmax_routing_matches_reference(n_group, topk_group, norm):
    num_experts, top_k, scale = 8, 3, 1.5
    router = Router.Config(
        top_k=top_k, score_func="softmax", n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
        route_scale=scale,
    ).build(dim=DIM, num_experts=num_experts)
    with torch.no_grad():
        router.weight.copy_(_x(num_experts, DIM, seed=5) * 0.2)
        router.e_score_correction_bias.copy_(_x(num_experts, seed=6) * 0.02)
    x_TD = _x(32, DIM)
    idx, w = _sorted_choice(*router(x_TD)[:2])
    ref_idx, ref_w = _reference_softmax_route(
        F.linear(x_TD, router.weight), router.e_score_correction_bias, top_k, n_group, topk_group, norm, scale
    )
    assert torch.equal(idx, ref_idx)
    assert _max_diff(w, ref_w) <= 1e-6


# ---------------------------------------------------------------------------------------------------
# Build-time validation, dtype, init, load statistics
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_experts,kwargs,match",
    [
        (8, dict(top_k=2, n_group=3), "n_group=3"),
        (8, dict(top_k=2, n_group=2, topk_group=3), "topk_group=3"),
        (8, dict(top_k=2, n_group=2, topk_group=0), "topk_group=0"),
        (4, dict(top_k=1, n_group=4, topk_group=2), "num_experts/n_group"),
        (8, dict(top_k=5, n_group=4, topk_group=2), "top_k=5"),
        (8, dict(top_k=0), "top_k=0"),
        (8, dict(top_k=9), "top_k=9"),
    ],
)
def test_router_build_validation(num_experts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Router.Config(**kwargs).build(dim=DIM, num_experts=num_experts)


def test_router_validation_allows_singleton_groups_for_softmax():
    Router.Config(top_k=1, score_func="softmax", n_group=4, topk_group=2).build(dim=DIM, num_experts=4)


def test_build_rejects_num_experts_in_two_places():
    with pytest.raises(ValueError, match="num_experts"):
        MoE.Config(num_experts=4, gate=Router.Config(top_k=1), experts=GroupedExperts.Config(hidden_dim=8)).build(
            dim=DIM, num_experts=4
        )


def test_cast_keeps_router_fp32_and_bf16_matches_hf():
    case = (8, 4, 2, 3, True, 2.5)
    hf = _hf_moe(*case)
    ours = _our_moe(*case)
    ours.load_state_dict(hf.state_dict())
    ours.to(torch.bfloat16)
    assert ours.gate.weight.dtype == torch.float32
    assert ours.gate.e_score_correction_bias.dtype == torch.float32
    assert ours.experts.gate_up_proj.dtype == torch.bfloat16
    assert ours.shared_experts.down_proj.weight.dtype == torch.bfloat16
    assert ours.tokens_per_expert.dtype == torch.int64
    # fp32 values are kept exactly, not round-tripped through bf16.
    assert torch.equal(ours.gate.weight, hf.gate.weight)

    # HF's from_pretrained(dtype=bf16) keeps the gate fp32 the same way.
    hf.to(torch.bfloat16)
    hf.gate.float()
    hf.gate.load_state_dict({k: v for k, v in ours.gate.state_dict().items()})
    x = _x(2, 16, DIM, dtype=torch.bfloat16)
    out_ours, out_hf = ours(x), hf(x)
    assert out_ours.dtype == torch.bfloat16
    assert _max_diff(out_ours, out_hf) == 0.0

    plain = MoE.Config(
        num_experts=4, gate=Router.Config(top_k=1, keep_fp32=False), experts=GroupedExperts.Config(hidden_dim=8)
    ).build(dim=DIM)
    plain.to(torch.bfloat16)
    assert plain.gate.weight.dtype == torch.bfloat16


def test_init_weights():
    torch.manual_seed(0)
    moe = _our_moe(8, 1, 1, 2, True, 1.0)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.fill_(3.0)
        moe.tokens_per_expert.fill_(7)
    moe.init_weights()
    for p in (moe.gate.weight, moe.experts.gate_up_proj, moe.experts.down_proj):
        assert abs(p.std().item() - 0.02) < 0.002 and abs(p.mean().item()) < 0.002
    assert torch.count_nonzero(moe.gate.e_score_correction_bias) == 0
    assert torch.count_nonzero(moe.tokens_per_expert) == 0
    assert "tokens_per_expert" not in moe.state_dict()
    assert "gate.e_score_correction_bias" in moe.state_dict()


def test_load_statistics_and_bias_update():
    num_experts, top_k = 8, 2
    moe = _our_moe(num_experts, 1, 1, top_k, True, 1.0)
    moe.init_weights()
    x = _x(2, 10, DIM, seed=7)
    moe(x)
    moe(x[:1])
    counts = moe.tokens_per_expert.clone()
    idx, _, _ = moe.gate(x.reshape(-1, DIM))
    expect = 2 * torch.bincount(idx.flatten(), minlength=num_experts)
    expect -= torch.bincount(idx[10:].flatten(), minlength=num_experts)  # the second call saw x[:1] only
    assert torch.equal(counts, expect) and counts.sum() == 30 * top_k
    assert torch.equal(moe.pop_tokens_per_expert(), counts)
    assert torch.count_nonzero(moe.tokens_per_expert) == 0

    # Activation checkpointing recomputes the forward in backward: count once.
    checkpoint(moe, x.requires_grad_(), use_reentrant=False).sum().backward()
    assert moe.tokens_per_expert.sum() == 20 * top_k

    load = torch.tensor([10, 0, 4, 2, 2, 2, 4, 0])  # mean 3
    moe.update_bias_correction(load, rate=0.01)
    expect_bias = 0.01 * torch.tensor([-1.0, 1, -1, 1, 1, 1, -1, 1])
    assert torch.allclose(moe.gate.e_score_correction_bias, expect_bias)

    no_bias = _our_moe(num_experts, 1, 1, top_k, True, 1.0, bias=False)
    assert no_bias.gate.e_score_correction_bias is None
    with pytest.raises(ValueError, match="use_bias_correction"):
        no_bias.update_bias_correction(load, rate=0.01)


def test_compiled_bf16_moe_is_one_graph_and_matches_eager():
    moe = _our_moe(8, 4, 2, 3, True, 2.5)
    moe.init_weights()
    moe.to(torch.bfloat16)
    x = _x(2, 16, DIM, dtype=torch.bfloat16)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(moe)(x)
    assert explain.graph_count == 1 and not explain.break_reasons, explain.break_reasons
    torch._dynamo.reset()
    out = torch.compile(moe, backend="aot_eager")(x)
    assert _max_diff(out, moe(x)) == 0.0


def test_auto_fallback_to_the_loop_warns_once_per_reason(monkeypatch):
    """fp32 on CUDA (or any dtype the kernel lacks) used to fall back to the per-expert loop silently."""
    import types
    import warnings

    from hyper_parallel.models.common import grouped_mm as grouped_mm_module

    monkeypatch.setattr(grouped_mm_module, "_warned", set())
    # The CUDA rule, on a stand-in operand (no GPU here): the dtype is checked before anything else.
    cuda_fp32 = types.SimpleNamespace(dtype=torch.float32, device=torch.device("cuda", 0))
    assert grouped_mm_module.grouped_mm_blocker(cuda_fp32, cuda_fp32) == "grouped_mm takes bfloat16 only on CUDA, not float32"
    assert grouped_mm_module.grouped_mm_blocker(_x(10, 8), _x(3, 4, 8)) is None

    x_SI, w_EOI = _x(10, 8, dtype=torch.float64), _x(3, 4, 8, seed=2, dtype=torch.float64)
    counts = torch.tensor([4, 0, 6])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count our own once-only logic, not Python's de-duplication
        y = grouped_linear(x_SI, w_EOI, counts)
        grouped_linear(x_SI, w_EOI, counts)
        grouped_linear(x_SI, w_EOI, counts, "loop")  # chosen explicitly: no warning
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "takes bfloat16/float16/float32 only on CPU, not float64" in messages[0]
    assert "per-expert loop" in messages[0] and "grouped_mm_impl='loop'" in messages[0]
    assert _max_diff(y, torch.cat([x_SI[:4] @ w_EOI[0].T, x_SI[4:] @ w_EOI[2].T])) == 0.0


def test_expert_parallel_dispatch_syncs_with_the_host_once(monkeypatch):
    """One device->host copy per dispatch (the split sizes), none in combine; same result as local dispatch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from hyper_parallel.distributed.expert_parallel import AllToAllTokenDispatcher

    class ScalarReads(TorchDispatchMode):  # .item() / int() / bool() of a tensor
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    created = not torch.distributed.is_initialized()
    if created:
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        num_tokens, num_experts, top_k = 24, 4, 2
        ep = AllToAllTokenDispatcher(num_experts, init_device_mesh("cpu", (1,)))
        x_TD = _x(num_tokens, DIM)
        idx_TK, w_TK = _random_routing(num_tokens, num_experts, top_k)
        y_fn = lambda x_SD: x_SD * torch.arange(1, x_SD.shape[0] + 1, dtype=x_SD.dtype)[:, None]  # noqa: E731
        tolist_calls = []
        real_tolist = torch.Tensor.tolist
        monkeypatch.setattr(torch.Tensor, "tolist", lambda self: tolist_calls.append(1) or real_tolist(self))
        with ScalarReads() as reads:
            x_SD, counts_L, state = ep.dispatch(x_TD, idx_TK, w_TK)
            out_TD = ep.combine(y_fn(x_SD), state)
        assert len(tolist_calls) == 1 and reads.count == 0
        local = LocalTokenDispatcher(num_experts)
        x_ref, counts_ref, state_ref = local.dispatch(x_TD, idx_TK, w_TK)
        assert torch.equal(x_SD, x_ref) and torch.equal(counts_L, counts_ref)
        assert torch.equal(out_TD, local.combine(y_fn(x_ref), state_ref))
    finally:
        if created:
            torch.distributed.destroy_process_group()
