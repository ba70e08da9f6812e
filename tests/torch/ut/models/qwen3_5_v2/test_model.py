"""Qwen3.5 (dense) v2: parity with HF Qwen3_5ForCausalLM through from_pretrained (fp32 logits and every
parameter gradient), packed documents vs HF per document, HF -> ours -> HF round trips (CausalLM and
ConditionalGeneration folders), and the qwen3_5_4b parameter count on the meta device."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

from hyper_parallel.models.qwen3_5_v2 import Qwen3_5Model, config_from_hf, from_pretrained, save_pretrained
from hyper_parallel.hf import read_safetensors, write_safetensors
from tests.torch.ut.hf_utils import hf_row_order, randomize_
from tests.torch.ut.models.qwen3_5_moe_v2.test_model import _batch, _hf_like_decay_, _hf_name, _rope
from tests.torch.helpers import next_token_ce

V = 128
TOL = 1e-5


def _text_kwargs(**overrides) -> dict:
    kw = dict(
        vocab_size=V, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, intermediate_size=48, tie_word_embeddings=False,
        rope_parameters=_rope(1e7, 0.25, [1, 1, 0]),
    )  # fmt: skip
    kw.update(overrides)
    return kw


HF_VARIANTS = {
    "hv2hk_3to1_mlp48": dict(),
    "hv_eq_hk_dk12_dv6_full_rotary": dict(
        linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=12, linear_value_head_dim=6,
        intermediate_size=24, rope_parameters=_rope(1e4, 1.0, [4, 2, 2])),
    "hv4hk_dk4_dv10_alternating_mqa": dict(
        linear_num_key_heads=1, linear_num_value_heads=4, linear_key_head_dim=4, linear_value_head_dim=10,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_key_value_heads=1, rope_parameters=_rope(1e6, 0.5, [2, 1, 1])),
    "hv3hk_dk16_dv4_attn_first_conv2_bias": dict(
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=4,
        linear_conv_kernel_dim=2, head_dim=32, attention_bias=True, intermediate_size=64,
        layer_types=["full_attention", "linear_attention", "linear_attention", "linear_attention"],
        rope_parameters=_rope(1e7, 0.25, [2, 1, 1])),
}  # fmt: skip


def _hf_model(seed: int = 0, **overrides) -> Qwen3_5ForCausalLM:
    cfg = Qwen3_5TextConfig(**_text_kwargs(**overrides))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(cfg).eval()
    randomize_(model, seed)
    _hf_like_decay_(model)
    return model


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_logits_and_every_grad_match_hf(tmp_path, variant):
    hf = _hf_model(**HF_VARIANTS[variant])
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    assert type(ours) is Qwen3_5Model
    ids = _batch(T=70 if variant == "hv2hk_3to1_mlp48" else 20)
    hf_logits = hf(input_ids=ids, use_cache=False).logits
    our_logits = ours(ids)
    assert (our_logits - hf_logits).abs().max().item() <= TOL
    next_token_ce(hf_logits, ids).backward()
    next_token_ce(our_logits, ids).backward()
    linear = {i for i, t in enumerate(hf.config.layer_types) if t == "linear_attention"}
    hf_params = dict(hf.named_parameters())
    worst = max(
        (hf_row_order(ours, n, p.grad) - hf_params.pop(_hf_name(n, linear)).grad).abs().max().item()
        for n, p in ours.named_parameters()
    )
    assert not hf_params, sorted(hf_params)
    assert worst <= TOL, worst


def test_packed_rows_equal_hf_per_document(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    ids = _batch(B=1, T=40)
    cu = torch.tensor([0, 11, 12, 40], dtype=torch.int32)
    with torch.no_grad():
        packed = ours(ids, cu_seqlens=cu, max_seqlen=28)  # positions restart per document by default
        ref = torch.cat([hf(input_ids=ids[:, s:e], use_cache=False).logits for s, e in ((0, 11), (11, 12), (12, 40))], 1)
    assert (packed - ref).abs().max().item() <= TOL


def test_roundtrip_and_conditional_generation_folder(tmp_path):
    hf = _hf_model(**HF_VARIANTS["hv4hk_dk4_dv10_alternating_mqa"])
    hf.save_pretrained(tmp_path / "hf")
    first = from_pretrained(tmp_path / "hf")
    save_pretrained(first, tmp_path / "ours")
    src, out = read_safetensors(tmp_path / "hf"), read_safetensors(tmp_path / "ours")
    assert src.keys() == out.keys() and all(torch.equal(src[k], out[k]) for k in src)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "qwen3_5_text"
    back = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = _batch()
    with torch.no_grad():
        assert (back(input_ids=ids, use_cache=False).logits - first(ids)).abs().max().item() <= TOL

    cfg = Qwen3_5Config(
        text_config=_text_kwargs(),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=16),
        image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    cfg.text_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    vl = randomize_(Qwen3_5ForConditionalGeneration(cfg).eval())
    _hf_like_decay_(vl)
    vl.save_pretrained(tmp_path / "vl")
    sd = read_safetensors(tmp_path / "vl")
    sd["mtp.fc.weight"] = torch.randn(32, 64)
    write_safetensors(sd, tmp_path / "vl")
    ours = from_pretrained(tmp_path / "vl")
    with torch.no_grad():
        want = vl(input_ids=ids, use_cache=False).logits
        assert (ours(ids) - want).abs().max().item() <= TOL
    save_pretrained(ours, tmp_path / "vl_back")
    again = read_safetensors(tmp_path / "vl_back")
    assert again.keys() == sd.keys() and all(torch.equal(again[k], sd[k]) for k in sd)
    with pytest.raises(ValueError, match="qwen3_5_moe package"):
        config_from_hf({"model_type": "qwen3_5_moe_text"})


def test_4b_parameter_count_on_meta(capsys):
    from hyper_parallel.models.qwen3_5_v2.config_registry import qwen3_5_4b

    with torch.device("meta"):
        model = qwen3_5_4b().model.build()
    V_, H, L, n_lin, Hq, Hkv, d, Hk, Hv, Dk, Dv, K, I = 248320, 2560, 32, 24, 16, 4, 256, 16, 32, 128, 128, 4, 9216  # noqa: E741
    conv = 2 * Hk * Dk + Hv * Dv
    gdn = conv * H + Hv * Dv * H + 2 * Hv * H + conv * K + 2 * Hv + Dv + H * Hv * Dv
    attn = 2 * Hq * d * H + 2 * Hkv * d * H + H * Hq * d + 2 * d
    want = V_ * H + H + L * (2 * H + 3 * I * H) + n_lin * gdn + (L - n_lin) * attn  # tied: one V x H table
    total = sum(p.numel() for p in model.parameters())
    assert model.lm_head.weight is model.embed_tokens.weight
    assert total == want and model.active_params() == want
    with capsys.disabled():
        print(f"\nqwen3_5_4b: total {total / 1e9:.2f}B (tied head), active {total / 1e9:.2f}B")
