"""Packed documents (``cu_seqlens``): a packed row equals its documents run one by one, and equals HF's
block-diagonal attention (restarting ``position_ids``, no mask, no cache). fp32, max abs diff <= 1e-5."""

from __future__ import annotations

import copy

import pytest
import torch
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
    rope_config_from_hf,
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
