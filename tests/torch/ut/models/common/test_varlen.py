"""Packed documents (``cu_seqlens``): a packed row equals its documents run one by one, and equals HF's
block-diagonal attention (restarting ``position_ids``, no mask, no cache). fp32, max abs diff <= 1e-5.
Packed rows run SDPA's fused kernel, read the host boundaries once, and reach the flash kernels (mocked:
only a GPU runs them) with the right arguments."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import Qwen3Config
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import (
    Glm4MoeLiteAttention,
    Glm4MoeLiteForCausalLM,
    Glm4MoeLiteRotaryEmbedding,
)
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3RotaryEmbedding,
)

from hyper_parallel.models.common import attention as attention_module
from hyper_parallel.models.common.attention import AttentionMeta, VarlenAttention
from hyper_parallel.models.common.gqa import GQAttention
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.models.common.rope import RoPE
from tests.torch.ut.hf_utils import (
    assert_backward_parity,
    decoder_config_from_hf,
    load_from_hf_,
    max_grad_diff,
    mla_config_from_hf,
    randomize_,
    tiny_lite_config,
)

TOL = 1e-5
DOCS = [5, 7, 4]  # one packed row of 3 documents, T = 16


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _mla():
    cfg = tiny_lite_config()
    return randomize_(mla_config_from_hf(cfg).build(dim=cfg.hidden_size), seed=11)


def _gqa():
    attn = GQAttention.Config(
        n_heads=4, n_kv_heads=2, head_dim=16, q_norm=RMSNorm.Config(eps=1e-6), k_norm=RMSNorm.Config(eps=1e-6),
        q_proj=Linear.Config(bias=True), k_proj=Linear.Config(bias=True), v_proj=Linear.Config(bias=True),
        rope=RoPE.Config(layout="half"),
    ).build(dim=64)  # fmt: skip
    return randomize_(attn, seed=12)


@pytest.mark.parametrize("make", [_mla, _gqa], ids=["mla", "gqa"])
def test_packed_row_equals_documents_run_separately(make):
    packed_attn = make()
    single_attn = copy.deepcopy(packed_attn)
    T = sum(DOCS)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, T, 64, generator=gen)
    grad_out = torch.randn(1, T, 64, generator=gen)

    meta = AttentionMeta(cu_seqlens=_cu(DOCS), max_seqlen=max(DOCS))
    pos = meta.position_ids(1, T)
    x_packed = x.clone().requires_grad_()
    out_packed = packed_attn(x_packed, position_ids=pos, meta=meta)
    out_packed.backward(grad_out)

    x_single = x.clone().requires_grad_()
    outs, start = [], 0
    for length in DOCS:
        sl = slice(start, start + length)
        doc_pos = torch.arange(length)[None]
        out = single_attn(x_single[:, sl], position_ids=doc_pos)  # plain causal, no meta
        out.backward(grad_out[:, sl])
        outs.append(out.detach())
        start += length
    assert (out_packed - torch.cat(outs, dim=1)).abs().max().item() <= TOL
    assert max_grad_diff(packed_attn, single_attn) <= TOL
    assert (x_packed.grad - x_single.grad).abs().max().item() <= TOL
    # and packing must matter: ignoring the boundaries gives another answer
    plain = packed_attn(x, position_ids=pos)
    assert (plain - out_packed).abs().max().item() > 1e-3


def _block_causal_mask(pos_BT: torch.Tensor) -> torch.Tensor:
    """bool ``[B, 1, T, T]``: HF's packed-sequence rule (a new document wherever the position does not step by 1)."""
    doc = (torch.diff(pos_BT, prepend=pos_BT[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    T = pos_BT.shape[1]
    same = doc[:, :, None] == doc[:, None, :]
    return (same & torch.ones(T, T, dtype=torch.bool).tril())[:, None]


def test_mla_packed_batch_matches_hf_block_mask():
    """Two rows with different packings (documents never cross rows) vs HF attention + block-diagonal mask."""
    cfg = tiny_lite_config()
    hf = randomize_(Glm4MoeLiteAttention(cfg, 0), seed=13)
    ours = load_from_hf_(mla_config_from_hf(cfg).build(dim=cfg.hidden_size), hf)
    rows = [[6, 6, 4], [3, 13]]
    B, T = 2, 16
    cu = _cu([n for row in rows for n in row])
    meta = AttentionMeta(cu_seqlens=cu)
    pos = meta.position_ids(B, T)
    assert pos[1].tolist() == list(range(3)) + list(range(13))
    x = torch.randn(B, T, 64, generator=torch.Generator().manual_seed(4))
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    hf_cos_sin = Glm4MoeLiteRotaryEmbedding(cfg)(x, pos)
    out_hf, _ = hf(x_hf, position_embeddings=hf_cos_sin, attention_mask=_block_causal_mask(pos))
    out = ours(x_ours, position_ids=pos, meta=meta)
    assert_backward_parity(out, out_hf, ours, hf, x_ours, x_hf, TOL)


def test_gqa_packed_row_matches_hf_block_mask():
    qcfg = Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    qcfg._attn_implementation = "sdpa"
    hf = randomize_(Qwen3Attention(qcfg, 0), seed=14)
    ours = GQAttention.Config(
        n_heads=4, n_kv_heads=2, head_dim=16, q_norm=RMSNorm.Config(eps=1e-6), k_norm=RMSNorm.Config(eps=1e-6),
        rope=RoPE.Config(layout="half"),
    ).build(dim=64)
    load_from_hf_(ours, hf)
    meta = AttentionMeta(cu_seqlens=_cu(DOCS))
    pos = meta.position_ids(1, sum(DOCS))
    x = torch.randn(1, sum(DOCS), 64, generator=torch.Generator().manual_seed(5))
    out_hf, _ = hf(x, position_embeddings=Qwen3RotaryEmbedding(qcfg)(x, pos), attention_mask=_block_causal_mask(pos))
    out = ours(x, position_ids=pos, meta=meta)
    assert (out - out_hf).abs().max().item() <= TOL


def test_decoder_packed_batch_matches_hf_restarting_positions():
    """Whole decoder (dense + MoE layers): HF detects packing from restarting position_ids (mask None, no cache)."""
    cfg = tiny_lite_config()
    torch.manual_seed(0)
    hf = randomize_(Glm4MoeLiteForCausalLM(cfg), seed=15)
    ours = load_from_hf_(decoder_config_from_hf(cfg).build(), hf, strip="model.")
    rows = [[5, 7, 4], [9, 7]]
    cu = _cu([n for row in rows for n in row])
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(6))
    pos = AttentionMeta(cu_seqlens=cu).position_ids(2, 16)
    logits_hf = hf(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits
    logits = ours(ids, cu_seqlens=cu, max_seqlen=9)  # position_ids derived from cu_seqlens
    assert (logits - logits_hf).abs().max().item() <= TOL
    # a document run alone gives the same logits as inside the pack
    alone = ours(ids[1:, 9:])
    assert (alone - logits[1:, 9:]).abs().max().item() <= TOL


def test_attention_meta_from_position_ids_round_trip():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])  # row 2 starts mid-document: a row start splits
    meta = AttentionMeta.from_position_ids(pos)
    assert meta.cu_seqlens.dtype == torch.int32
    assert meta.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 12] and meta.max_seqlen == 4
    restarted = AttentionMeta(cu_seqlens=meta.cu_seqlens).position_ids(2, 6)
    assert restarted.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]
    assert AttentionMeta().position_ids(2, 3).tolist() == [[0, 1, 2], [0, 1, 2]]


def test_varlen_rejects_a_document_crossing_rows():
    attn = VarlenAttention.Config(backend="sdpa").build()
    q = torch.randn(2, 2, 4, 8)
    with pytest.raises(ValueError, match="must not cross a row"):
        attn(q, q, q, scale=0.3, meta=AttentionMeta(cu_seqlens=_cu([2, 3, 3])))
    with pytest.raises(ValueError, match="B\\*T=8"):
        attn(q, q, q, scale=0.3, meta=AttentionMeta(cu_seqlens=_cu([4, 3])))


def test_varlen_one_document_per_row_equals_unpacked():
    """cu_seqlens holding only the row boundaries means plain causal attention per row (GQA, dv != dqk)."""
    attn = VarlenAttention.Config(backend="sdpa").build()
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 4, 32, 8, generator=gen)
    k, v = torch.randn(3, 2, 32, 8, generator=gen), torch.randn(3, 2, 32, 6, generator=gen)
    out = attn(q, k, v, scale=0.25, meta=AttentionMeta(cu_seqlens=_cu([32, 32, 32])))
    assert out.shape == (3, 32, 4, 6)
    torch.testing.assert_close(out, attn(q, k, v, scale=0.25), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------
# Kernels: fused SDPA on packed rows, host boundaries read once, flash/varlen plumbing (mocked)
# ---------------------------------------------------------------------------------------------------

ROWS = [[5, 7, 4], [3, 13]]  # two rows of T = 16, documents never cross a row


def _qkv(B=2, H=4, Hk=2, T=16, dqk=8, dv=6, seed=8):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(*shape, generator=gen).requires_grad_()
        for shape in ((B, H, T, dqk), (B, Hk, T, dqk), (B, Hk, T, dv))
    ]


def _per_document_reference(q, k, v, rows, scale):
    """``[B, T, H, dv]`` from one plain (math-kernel) SDPA call per document, GQA by repeating k/v heads."""
    rep = q.shape[1] // k.shape[1]
    out_rows = []
    for b, row in enumerate(rows):
        outs, s = [], 0
        for n in row:
            kk, vv = (x[b : b + 1, :, s : s + n].repeat_interleave(rep, dim=1) for x in (k, v))
            with sdpa_kernel([SDPBackend.MATH]):
                o = F.scaled_dot_product_attention(q[b : b + 1, :, s : s + n], kk, vv, is_causal=True, scale=scale)
            outs.append(o.transpose(1, 2))
            s += n
        out_rows.append(torch.cat(outs, dim=1))
    return torch.cat(out_rows)


def test_packed_rows_run_the_fused_sdpa_kernel():
    """Packed documents go to SDPA as 4-D views: the flash kernel accepts them (it rejects 3-D inputs)."""
    attn = VarlenAttention.Config(backend="sdpa").build()
    q, k, v = _qkv()
    meta = AttentionMeta(cu_seqlens=_cu([n for row in ROWS for n in row]))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # no fallback: a non-fused call raises
        out = attn(q, k, v, scale=0.3, meta=meta)
        out.backward(torch.ones_like(out))
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    ref = _per_document_reference(q, k, v, ROWS, 0.3)
    ref.backward(torch.ones_like(ref))
    assert out.shape == (2, 16, 4, 6)
    assert (out - ref).abs().max().item() <= TOL
    assert max((g - x.grad).abs().max().item() for g, x in zip(grads, (q, k, v))) <= TOL


def test_host_boundaries_are_read_once_per_micro_batch(monkeypatch):
    """With the collate's host boundaries no layer reads ``cu_seqlens`` back; without them, one copy in all."""
    attn = VarlenAttention.Config(backend="sdpa").build()
    q, k, v = _qkv()
    lengths = [n for row in ROWS for n in row]
    host = _cu(lengths).tolist()
    # The device tensor lives on `meta`: any read of its values would raise.
    on_device = torch.empty(len(host), dtype=torch.int32, device="meta")
    meta = AttentionMeta(cu_seqlens=on_device, max_seqlen=13, cu_seqlens_host=host)
    out = attn(q, k, v, scale=0.3, meta=meta)
    assert (out - attn(q, k, v, scale=0.3, meta=AttentionMeta(cu_seqlens=_cu(lengths)))).abs().max().item() == 0

    calls = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(1) or real_tolist(self))
    meta = AttentionMeta(cu_seqlens=_cu(lengths))
    for _ in range(4):  # four layers share one meta
        attn(q, k, v, scale=0.3, meta=meta)
    assert len(calls) == 1 and meta.cu_seqlens_host == host


def test_host_boundaries_must_match_the_device_ones():
    attn = VarlenAttention.Config(backend="sdpa").build()
    q, k, v = _qkv()
    meta = AttentionMeta(cu_seqlens=_cu([5, 11, 16]), cu_seqlens_host=[0, 16, 32])
    with pytest.raises(ValueError, match="disagree"):
        attn(q, k, v, scale=0.3, meta=meta)


def _fake_varlen(calls, name):
    """A stand-in for a flash varlen kernel on ``[N, heads, d]`` (per-document math SDPA), recording its arguments."""

    def fake(q, k, v, *args, **kwargs):
        calls.append((name, q, k, v, args, kwargs))
        cu = (args[0] if args else kwargs["cu_seqlens_q"]).tolist()
        rep = q.shape[1] // k.shape[1]
        scale = kwargs.get("softmax_scale", kwargs.get("scale"))
        outs = []
        for s, e in zip(cu[:-1], cu[1:]):
            qq, kk, vv = (x[s:e].transpose(0, 1)[None] for x in (q, k, v))
            kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
            outs.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale)[0].transpose(0, 1))
        return torch.cat(outs)

    return fake


@pytest.mark.parametrize("backend", ["flash", "varlen"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_kernels_get_boundaries_padding_and_determinism(monkeypatch, backend, deterministic):
    """The flash kernels (mocked; only a GPU runs them): flattened stream, device boundaries, padded v,
    max_seqlen from the batch, causal, and the deterministic flag under torch.use_deterministic_algorithms."""
    calls = []
    monkeypatch.setattr(attention_module, "_gpu_half", lambda q: True)
    monkeypatch.setattr(attention_module, "flash_attn_varlen_func", _fake_varlen(calls, "flash"))
    monkeypatch.setattr(attention_module, "varlen_attn", _fake_varlen(calls, "varlen"))
    attn = VarlenAttention.Config(backend=backend).build()
    q, k, v = _qkv()
    lengths = [n for row in ROWS for n in row]
    meta = AttentionMeta(cu_seqlens=_cu(lengths), max_seqlen=13, cu_seqlens_host=_cu(lengths).tolist())
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        out = attn(q, k, v, scale=0.3, meta=meta)
    finally:
        torch.use_deterministic_algorithms(was)
    ref = _per_document_reference(q, k, v, ROWS, 0.3)
    assert out.shape == ref.shape and (out - ref).abs().max().item() <= TOL
    [(name, fq, fk, fv, args, kwargs)] = calls
    assert name == backend
    assert fq.shape == (32, 4, 8) and fk.shape == (32, 2, 8) and fv.shape == (32, 2, 8)  # v padded 6 -> 8
    if backend == "flash":
        assert kwargs["cu_seqlens_q"].dtype == torch.int32 and kwargs["max_seqlen_q"] == 13
        assert kwargs["causal"] is True and kwargs["deterministic"] is deterministic
    else:  # torch's kernel reads the deterministic flag itself
        assert args[0].dtype == torch.int32 and args[2] == 13
        assert kwargs["window_size"] == (-1, 0) and kwargs["enable_gqa"] is True


def test_auto_prefers_flash_then_torch_varlen_then_sdpa(monkeypatch):
    q = torch.randn(1, 2, 4, 8)
    attn = VarlenAttention.Config(backend="auto").build()
    assert attn.kernel(q) == "sdpa"  # CPU fp32
    monkeypatch.setattr(attention_module, "_gpu_half", lambda q: True)
    monkeypatch.setattr(attention_module, "flash_attn_varlen_func", None)
    monkeypatch.setattr(attention_module, "varlen_attn", object())
    assert attn.kernel(q) == "varlen"
    monkeypatch.setattr(attention_module, "flash_attn_varlen_func", object())
    assert attn.kernel(q) == "flash"


@pytest.mark.parametrize("backend", ["flash", "varlen"])
def test_explicit_gpu_backend_on_cpu_says_what_to_change(backend):
    attn = VarlenAttention.Config(backend=backend).build()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="CUDA fp16/bf16"):
        attn(q, q, q, scale=0.3)
