"""Qwen3.5 blocks vs HF transformers (fp32): zero-centred and gated norms, Gated DeltaNet (incl. packed
documents, compared with HF run per document), gated attention, interleaved M-RoPE, and the MoE with a
sigmoid-gated shared expert and the Switch aux loss."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_mod

from hyper_parallel.models.common.attention import AttentionMeta, VarlenAttention
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.gated_attention import GatedAttention
from hyper_parallel.models.common.gated_delta_rule import GatedDeltaRule, chunk_gated_delta_rule, document_bounds
from hyper_parallel.models.common.gated_deltanet import CausalConv1d, GatedDeltaNet
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.moe import GroupedExperts, MoE, Router
from hyper_parallel.models.common.qwen3_5_norm import GatedRMSNorm, Qwen3_5RMSNorm
from hyper_parallel.models.common.rope import RoPE
from tests.torch.ut.hf_utils import load_from_hf_, max_grad_diff, randomize_

TOL = 1e-5
H = 32  # hidden size of every tiny config


def _cfg(**kw) -> Qwen3_5MoeTextConfig:
    base = dict(
        vocab_size=64, hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20,
        rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25, mrope_section=[1, 1, 0]),
    )  # fmt: skip
    base.update(kw)
    cfg = Qwen3_5MoeTextConfig(**base)
    cfg._attn_implementation = "sdpa"
    return cfg


def _x(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, T, H, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def assert_backward_parity(out, out_hf, ours, hf, x, x_hf, tol: float = TOL) -> None:
    """Outputs, every parameter gradient and the input gradient agree after backpropagating one random
    output gradient scaled like a token-mean loss (1 / tokens), so gradients are O(1) as in training."""
    grad = torch.randn_like(out) / out.shape[:-1].numel()
    out_hf.backward(grad)
    out.backward(grad)
    assert (out - out_hf).abs().max().item() <= tol
    assert max_grad_diff(ours, hf) <= tol
    assert (x.grad - x_hf.grad).abs().max().item() <= tol


# ---- norms -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_bitwise_equal_hf(dtype):
    hf = randomize_(hf_mod.Qwen3_5MoeRMSNorm(24, eps=1e-6)).to(dtype)
    ours = Qwen3_5RMSNorm.Config(eps=1e-6).build(dim=24).to(dtype)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(3, 5, 24).to(dtype) * 3
    assert torch.equal(ours(x), hf(x))
    hf_g = randomize_(hf_mod.Qwen3_5MoeRMSNormGated(24, eps=1e-6)).to(dtype)
    ours_g = GatedRMSNorm.Config(eps=1e-6).build(dim=24).to(dtype)
    ours_g.load_state_dict(hf_g.state_dict())
    z = torch.randn(3, 5, 24).to(dtype)
    assert torch.equal(ours_g(x, z), hf_g(x, z))


def test_norm_inits_match_hf():
    n = Qwen3_5RMSNorm.Config().build(dim=8)
    n.init_weights()
    assert torch.equal(n.weight, torch.zeros(8))  # zero-centred: starts as the identity scale
    g = GatedRMSNorm.Config().build(dim=8)
    g.init_weights()
    assert torch.equal(g.weight, torch.ones(8))


# ---- Gated DeltaNet ----------------------------------------------------------------------------

GDN_VARIANTS = {
    "hv2hk_dk8_dv8": dict(),
    "hv_eq_hk_dk12_dv6": dict(linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=12,
                              linear_value_head_dim=6),
    "hv4hk_dk4_dv10_conv3": dict(linear_num_key_heads=1, linear_num_value_heads=4, linear_key_head_dim=4,
                                 linear_value_head_dim=10, linear_conv_kernel_dim=3),
    "hv3hk_dk16_dv4_conv2": dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
                                 linear_value_head_dim=4, linear_conv_kernel_dim=2),
}  # fmt: skip


def _gdn_pair(seed: int = 0, chunk_size: int = 64, **kw) -> tuple[hf_mod.Qwen3_5MoeGatedDeltaNet, GatedDeltaNet]:
    cfg = _cfg(layer_types=["linear_attention"], **kw)
    torch.manual_seed(seed)
    hf = randomize_(hf_mod.Qwen3_5MoeGatedDeltaNet(cfg, 0), seed)
    with torch.no_grad():  # HF-like ranges for the decay: dt_bias ~ 1, A = exp(A_log) in (0.01, 16)
        hf.dt_bias.add_(1.0)
        hf.A_log.copy_(torch.linspace(-2.0, 1.5, hf.A_log.numel()))
    ours = GatedDeltaNet.Config(
        num_k_heads=cfg.linear_num_key_heads, num_v_heads=cfg.linear_num_value_heads,
        head_k_dim=cfg.linear_key_head_dim, head_v_dim=cfg.linear_value_head_dim,
        conv1d=CausalConv1d.Config(kernel_size=cfg.linear_conv_kernel_dim),
        norm=GatedRMSNorm.Config(eps=cfg.rms_norm_eps),
        delta_rule=GatedDeltaRule.Config(chunk_size=chunk_size),
    ).build(dim=H)  # fmt: skip
    load_from_hf_(ours, hf)  # HF's [Q | K | V] rows -> our grouped order
    return hf, ours


@pytest.mark.parametrize("variant", list(GDN_VARIANTS))
def test_gated_deltanet_matches_hf(variant):
    hf, ours = _gdn_pair(**GDN_VARIANTS[variant])
    x_hf, x = _x(2, 150), _x(2, 150)  # 3 chunks of 64, the last one partial
    out_hf, out = hf(x_hf), ours(x)
    assert out.abs().max() > 0.1  # a live signal, not a vanishing one
    assert_backward_parity(out, out_hf, ours, hf, x, x_hf, TOL)


def test_gated_deltanet_chunk_size_is_numerics_only():
    """Chunk length changes only rounding (the token loop in HF is the oracle)."""
    hf, ours16 = _gdn_pair(chunk_size=16)
    x = _x(1, 70)
    with torch.no_grad():
        ref = hf(x)
        assert (ours16(x) - ref).abs().max().item() <= TOL
    B, T, Hk, Dk, Hv, Dv = 2, 37, 2, 8, 4, 8
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(B, T, Hk, Dk, generator=gen), torch.randn(B, T, Hk, Dk, generator=gen)
    v = torch.randn(B, T, Hv, Dv, generator=gen)
    g = -torch.rand(B, T, Hv, generator=gen)
    beta = torch.rand(B, T, Hv, generator=gen)
    want, _ = hf_mod.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    for chunk in (1, 8, 64):
        got = chunk_gated_delta_rule(q, k, v, g, beta, cu=document_bounds(None, B, T), chunk_size=chunk)
        assert (got - want).abs().max().item() <= 1e-5, chunk


PACKED_DOCS = [[40, 70, 3, 37], [150], [1, 64, 64, 21]]  # rows of 150 tokens; a 1-token doc, exact-chunk docs


@pytest.mark.parametrize("variant", ["hv2hk_dk8_dv8", "hv4hk_dk4_dv10_conv3"])
def test_gated_deltanet_packed_rows_equal_hf_per_document(variant):
    """Conv window and recurrent state restart at every cu_seqlens boundary: each packed document equals HF
    run on that document alone (HF's CPU path cannot keep packed documents apart)."""
    hf, ours = _gdn_pair(**GDN_VARIANTS[variant])
    B, T = len(PACKED_DOCS), 150
    lens = [n for row in PACKED_DOCS for n in row]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    x, x_hf = _x(B, T, seed=4), _x(B, T, seed=4)
    out = ours(x, meta=AttentionMeta(cu_seqlens=cu))
    flat = x_hf.view(1, B * T, H)
    out_hf = torch.cat([hf(flat[:, s:e]) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1).view(B, T, H)
    assert_backward_parity(out, out_hf, ours, hf, x, x_hf, TOL)
    # Without the restart (one document per row) the packed rows differ from the per-document oracle.
    with torch.no_grad():
        leaked = ours(x)
    assert (leaked - out_hf).abs().max().item() > 1e-3


def test_gated_deltanet_packed_position_ids_are_ignored_and_errors_name_the_fix():
    _, ours = _gdn_pair()
    x = _x(2, 8)
    with torch.no_grad():
        a = ours(x)
        b = ours(x, position_ids=torch.arange(8).expand(2, 8))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="row boundaries"):
        ours(x, meta=AttentionMeta(cu_seqlens=torch.tensor([0, 5, 16], dtype=torch.int32)))
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        GatedDeltaNet.Config(num_k_heads=3, num_v_heads=4, head_k_dim=4, head_v_dim=4).build(dim=8)


def test_gated_deltanet_init_matches_hf_ranges():
    _, ours = _gdn_pair()
    ours.init_weights()
    assert torch.equal(ours.dt_bias.detach(), torch.ones(4))
    a = ours.A_log.detach().exp()
    assert bool(((a >= 0.01) & (a <= 16)).all())
    assert torch.equal(ours.norm.weight.detach(), torch.ones(8))


def test_cp_takes_one_contiguous_block_of_grouped_conv_rows():
    Hk, Dk, Hv, Dv, K = 2, 3, 4, 2, 4
    G = 2 * Dk + Hv // Hk * Dv
    w = torch.arange(Hk * G * K, dtype=torch.float32).view(-1, K)
    rule = GatedDeltaRule.Config().build(head_k_dim=Dk, head_v_dim=Dv)
    qkv = torch.zeros(1, 5, Hk, G)
    part = rule.cp_local_kwargs((qkv,), {"conv_weight": w}, rank=1, world=2)["conv_weight"]
    assert torch.equal(part, w[G:])  # key-head group 1 = its q, k and both value heads' rows


@pytest.mark.parametrize("docs", [[9, 1, 2, 30, 3], [45]])
def test_causal_conv_is_exact_per_document_with_gradients(docs):
    """Packed stream == each document convolved alone by F.conv1d (HF's call), values and both gradients;
    another document's content never reaches a row (bitwise)."""
    import torch.nn.functional as F

    from hyper_parallel.models.common.gated_delta_rule import causal_conv1d_silu

    C, K = 6, 4
    cu = [0, *torch.tensor(docs).cumsum(0).tolist()]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, cu[-1], C, generator=gen, requires_grad=True)
    w = torch.randn(C, K, generator=gen, requires_grad=True)
    grad = torch.randn(1, cu[-1], C, generator=gen)
    y = causal_conv1d_silu(x, w, cu)
    y.backward(grad)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    parts = [
        F.silu(F.conv1d(x_ref[:, a:b].transpose(1, 2), w_ref.unsqueeze(1), padding=K - 1, groups=C)[..., : b - a])
        for a, b in zip(cu[:-1], cu[1:])
    ]
    ref = torch.cat(parts, dim=-1).transpose(1, 2)
    ref.backward(grad)
    assert (y - ref).abs().max().item() <= 1e-6
    assert (x.grad - x_ref.grad).abs().max().item() <= 1e-6
    assert (w.grad - w_ref.grad).abs().max().item() <= 1e-5
    if len(docs) > 1:  # change every other document: the third document's rows stay bit-identical
        x2 = x.detach().clone()
        a, b = cu[2], cu[3]
        x2[:, :a] = torch.randn(1, a, C, generator=gen)
        x2[:, b:] = torch.randn(1, cu[-1] - b, C, generator=gen)
        assert torch.equal(causal_conv1d_silu(x2, w.detach(), cu)[:, a:b], y.detach()[:, a:b])


def _fake_causal_conv1d_fn(x_BCT, weight_CK, bias, seq_idx, activation):
    """causal-conv1d's documented contract, by HF's own call per document: ``x [B, C, T]`` with channel-last
    memory (required with ``seq_idx``), taps never cross a change of ``seq_idx [B, T]``, optional SiLU."""
    assert bias is None and activation == "silu" and x_BCT.stride(1) == 1 and seq_idx.dtype == torch.int32
    out = torch.empty_like(x_BCT)
    for b in range(x_BCT.shape[0]):
        ids = seq_idx[b].tolist()
        starts = [t for t in range(len(ids)) if t == 0 or ids[t] != ids[t - 1]] + [len(ids)]
        for a, e in zip(starts[:-1], starts[1:]):
            out[b, :, a:e] = hf_mod.causal_conv1d_fn(x_BCT[b : b + 1, :, a:e], weight_CK, None, activation="silu")[0]
    return out


def _fake_fla_chunk_gated_delta_rule(q, k, v, g, beta, *, scale, use_qk_l2norm_in_kernel, cu_seqlens):
    """fla's documented contract, by HF's torch fallback per document: ``[1, N, H, D]`` inputs with one head
    count for q, k and v, the state restarting at every ``cu_seqlens`` boundary."""
    assert q.shape[0] == 1 and q.shape[2] == k.shape[2] == v.shape[2] == beta.shape[2] == g.shape[2]
    assert use_qk_l2norm_in_kernel and scale == q.shape[-1] ** -0.5 and cu_seqlens.dtype == torch.long
    cu = cu_seqlens.tolist()
    parts = [
        hf_mod.torch_chunk_gated_delta_rule(
            q[:, a:e], k[:, a:e], v[:, a:e], g=g[:, a:e], beta=beta[:, a:e], use_qk_l2norm_in_kernel=True
        )[0]
        for a, e in zip(cu[:-1], cu[1:])
    ]
    return torch.cat(parts, dim=1), None


def test_cuda_kernel_path_feeds_the_kernels_their_contract(monkeypatch):
    """backend='cuda_kernels' hands causal-conv1d and fla the layouts they document (grouped rows, channel-last
    conv with seq_idx, q/k repeated per value head, the flat stream with cu_seqlens): with stand-ins that
    implement those contracts by HF's torch fallbacks, output and every gradient equal our torch path on
    packed documents. CPU CI cannot run the real kernels: benchmarks/gpu_check.sh does (check G)."""
    from hyper_parallel.models.common import gated_delta_rule as gdr

    Hk, Hv, Dk, Dv, K, B, T = 2, 4, 8, 6, 4, 2, 40
    G = 2 * Dk + Hv // Hk * Dv
    gen = torch.Generator().manual_seed(3)
    inputs = [
        torch.randn(B, T, Hk, G, generator=gen),
        -torch.rand(B, T, Hv, generator=gen),
        torch.rand(B, T, Hv, generator=gen),
        torch.randn(Hk * G, K, generator=gen) * 0.5,
    ]
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, 7, 30, 40, 41, 80], dtype=torch.int32))
    grad = torch.randn(B, T, Hv, Dv, generator=gen)

    def run(backend: str):
        rule = GatedDeltaRule.Config(backend=backend).build(head_k_dim=Dk, head_v_dim=Dv)
        qkv, g, beta, w = (t.clone().requires_grad_() for t in inputs)
        out = rule(qkv, g, beta, conv_weight=w, meta=meta)
        out.backward(grad)
        return out, [t.grad for t in (qkv, g, beta, w)]

    with pytest.raises(RuntimeError, match=r"hyper-parallel\[gpu\].*backend='auto' or 'torch'"):
        run("cuda_kernels")  # CPU, fp32, no packages: the error says what is missing
    assert GatedDeltaRule.Config().build(head_k_dim=Dk, head_v_dim=Dv).kernel(inputs[0]) == "torch"
    ref, ref_grads = run("torch")
    monkeypatch.setattr(gdr, "causal_conv1d_fn", _fake_causal_conv1d_fn)
    monkeypatch.setattr(gdr, "fla_chunk_gated_delta_rule", _fake_fla_chunk_gated_delta_rule)
    monkeypatch.setattr(gdr, "cuda_kernels_can_run", lambda qkv: True)
    out, grads = run("cuda_kernels")
    assert (out - ref).abs().max().item() <= TOL
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max().item() <= TOL


# ---- gated attention + M-RoPE --------------------------------------------------------------------

ATTN_VARIANTS = {
    "gqa2_d16_partial025": (dict(), (1, 1, 0)),
    "mha_d8_partial05": (dict(num_key_value_heads=4, head_dim=8,
                              rope_parameters=dict(rope_type="default", rope_theta=500.0, partial_rotary_factor=0.5,
                                                   mrope_section=[1, 1, 0])), (1, 1, 0)),
    "gqa4_d16_full_rotary": (dict(num_key_value_heads=1,
                                  rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=1.0,
                                                       mrope_section=[4, 2, 2])), (4, 2, 2)),
    "gqa2_d32_partial025_bias": (dict(head_dim=32, attention_bias=True,
                                      rope_parameters=dict(rope_type="default", rope_theta=1e7,
                                                           partial_rotary_factor=0.25, mrope_section=[2, 1, 1])),
                                 (2, 1, 1)),
}  # fmt: skip


def _attn_pair(variant: str):
    kw, section = ATTN_VARIANTS[variant]
    cfg = _cfg(layer_types=["full_attention"], **kw)
    torch.manual_seed(0)
    hf = randomize_(hf_mod.Qwen3_5MoeAttention(cfg, 0))
    rotary = hf_mod.Qwen3_5MoeTextRotaryEmbedding(cfg)
    rp = cfg.rope_parameters
    bias = cfg.attention_bias
    ours = GatedAttention.Config(
        n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        q_proj=Linear.Config(bias=bias), k_proj=Linear.Config(bias=bias), v_proj=Linear.Config(bias=bias),
        o_proj=Linear.Config(bias=bias),
        q_norm=Qwen3_5RMSNorm.Config(eps=cfg.rms_norm_eps), k_norm=Qwen3_5RMSNorm.Config(eps=cfg.rms_norm_eps),
        rope=RoPE.Config(theta=rp["rope_theta"], layout="half", partial_rotary_factor=rp["partial_rotary_factor"],
                         mrope_section=section),
        inner_attention=VarlenAttention.Config(backend="sdpa"),
    ).build(dim=H)  # fmt: skip
    ours.load_state_dict(hf.state_dict())
    return hf, rotary, ours


def _mrope_positions(B: int, T: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, 50, (3, B, T), generator=gen)


@pytest.mark.parametrize("variant", list(ATTN_VARIANTS))
@pytest.mark.parametrize("mrope", [False, True])
def test_gated_attention_matches_hf(variant, mrope):
    hf, rotary, ours = _attn_pair(variant)
    B, T = 2, 11
    pos = _mrope_positions(B, T) if mrope else torch.arange(T).expand(B, T)
    x, x_hf = _x(B, T), _x(B, T)
    out_hf, _ = hf(x_hf, position_embeddings=rotary(x_hf, pos), attention_mask=None)
    out = ours(x, position_ids=pos)
    assert_backward_parity(out, out_hf, ours, hf, x, x_hf, TOL)


def test_gated_attention_packed_equals_hf_per_document():
    hf, rotary, ours = _attn_pair("gqa2_d16_partial025")
    lens = [5, 9, 2]
    x = _x(1, 16)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    with torch.no_grad():
        out = ours(x, position_ids=pos, meta=AttentionMeta(cu_seqlens=cu))
        ref = []
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            piece = x[:, s:e]
            ref.append(hf(piece, position_embeddings=rotary(piece, pos[:, s:e]), attention_mask=None)[0])
    assert (out - torch.cat(ref, 1)).abs().max().item() <= TOL


@pytest.mark.parametrize("section,partial", [((11, 11, 10), 0.25), ((24, 20, 20), 1.0), ((2, 1, 1), 0.25)])
def test_mrope_tables_bitwise_equal_hf(section, partial):
    head_dim = 256 if section[0] == 11 else (128 if section[0] == 24 else 32)
    cfg = _cfg(head_dim=head_dim, rope_parameters=dict(rope_type="default", rope_theta=1e7,
                                                       partial_rotary_factor=partial, mrope_section=list(section)))
    hf = hf_mod.Qwen3_5MoeTextRotaryEmbedding(cfg)
    ours = RoPE.Config(theta=1e7, layout="half", partial_rotary_factor=partial, mrope_section=section).build(
        head_dim=head_dim
    )
    pos = _mrope_positions(2, 9)
    dummy = torch.zeros(1, dtype=torch.float32)
    cos_hf, sin_hf = hf(dummy, pos)
    cos, sin = ours.cos_sin(pos, torch.float32)
    assert torch.equal(cos, cos_hf) and torch.equal(sin, sin_hf)
    # text-only: [B, T] positions equal three identical rows (and HF's broadcast of them)
    flat = torch.arange(9).expand(2, 9)
    assert torch.equal(ours.cos_sin(flat, torch.float32)[0], ours.cos_sin(flat.expand(3, 2, 9), torch.float32)[0])
    assert torch.equal(ours.cos_sin(flat, torch.float32)[0], hf(dummy, flat)[0])


def test_mrope_errors_name_the_fix():
    with pytest.raises(ValueError, match="mrope_section"):
        RoPE.Config(partial_rotary_factor=0.25, mrope_section=(11, 11, 11)).build(head_dim=256)
    rope = RoPE.Config(layout="half").build(head_dim=8)
    with pytest.raises(ValueError, match="mrope_section"):
        rope.cos_sin(torch.zeros(3, 1, 4, dtype=torch.long), torch.float32)


# ---- MoE --------------------------------------------------------------------------------------

MOE_VARIANTS = {
    "e8_k2_shared20": dict(),
    "e4_k1_shared8": dict(num_experts=4, num_experts_per_tok=1, shared_expert_intermediate_size=8),
    "e16_k4_shared40": dict(num_experts=16, num_experts_per_tok=4, shared_expert_intermediate_size=40,
                            moe_intermediate_size=8),
}  # fmt: skip


def qwen3_5_moe_block_config(cfg: Qwen3_5MoeTextConfig, aux_coef: float = 0.0) -> MoE.Config:
    return MoE.Config(
        num_experts=cfg.num_experts,
        gate=Router.Config(top_k=cfg.num_experts_per_tok, score_func="softmax", use_bias_correction=False),
        experts=GroupedExperts.Config(hidden_dim=cfg.moe_intermediate_size),
        shared_experts=FeedForward.Config(hidden_dim=cfg.shared_expert_intermediate_size),
        shared_expert_gate=Linear.Config(),
        router_aux_loss_coef=aux_coef,
    )


def _hf_to_ours_moe(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.replace("shared_expert.", "shared_experts."): v for k, v in sd.items()}


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_moe_with_gated_shared_expert_matches_hf(variant):
    cfg = _cfg(**MOE_VARIANTS[variant])
    torch.manual_seed(0)
    hf = randomize_(hf_mod.Qwen3_5MoeSparseMoeBlock(cfg))
    ours = qwen3_5_moe_block_config(cfg, aux_coef=0.01).build(dim=H)
    ours.load_state_dict(_hf_to_ours_moe(hf.state_dict()))
    x, x_hf = _x(2, 9), _x(2, 9)
    out_hf, out = hf(x_hf), ours(x)
    grad = torch.randn_like(out) / out.shape[:-1].numel()
    out_hf.backward(grad)
    out.backward(grad)
    assert (out - out_hf).abs().max().item() <= TOL
    hf_grads = _hf_to_ours_moe({n: p.grad for n, p in hf.named_parameters()})
    for name, p in ours.named_parameters():
        assert (p.grad - hf_grads[name]).abs().max().item() <= TOL, name
    assert (x.grad - x_hf.grad).abs().max().item() <= TOL


def test_moe_aux_loss_equals_hf_switch_loss_and_has_router_gradient():
    cfg = _cfg()
    torch.manual_seed(0)
    hf = randomize_(hf_mod.Qwen3_5MoeSparseMoeBlock(cfg))
    ours = qwen3_5_moe_block_config(cfg, aux_coef=0.25).build(dim=H)
    ours.load_state_dict(_hf_to_ours_moe(hf.state_dict()))
    x = _x(2, 9)
    ours(x)
    logits, _, _ = hf.gate(x.reshape(-1, H))
    want = hf_mod.load_balancing_loss_func((logits,), cfg.num_experts, cfg.num_experts_per_tok)
    aux = ours.aux_loss.loss()  # one layer's router statistics -> its Switch loss
    assert aux.dim() == 0
    assert abs(aux.item() - 0.25 * want.item()) <= 1e-6
    aux.backward()
    assert ours.gate.weight.grad.abs().max() > 0  # the loss trains the router
    none = qwen3_5_moe_block_config(cfg).build(dim=H)
    none.load_state_dict(ours.state_dict())
    none(x)
    assert none.aux_loss is None


def test_softmax_router_keeps_the_aux_free_bias_update():
    cfg = _cfg()
    moe_cfg = qwen3_5_moe_block_config(cfg)
    moe_cfg.gate.use_bias_correction = True
    moe = moe_cfg.build(dim=H)
    moe.init_weights()
    with torch.no_grad():
        moe(_x(2, 9))
    counts = moe.pop_tokens_per_expert()
    assert counts.sum().item() == 2 * 9 * cfg.num_experts_per_tok
    moe.update_bias_correction(counts, rate=0.1)
    assert moe.gate.e_score_correction_bias.abs().sum() > 0
