"""GlmImageMoe v2: parity with HF Glm4MoeLiteForCausalLM through save/from_pretrained, round trips,
the VQ image path, checkpoint-key errors and the a3b parameter counts."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import Glm4MoeLiteForCausalLM

from hyper_parallel.models.glm_image_moe_v2 import (
    CheckpointKeyError,
    GlmImageMoeModel,
    from_pretrained,
    glm_image_moe_config,
    save_pretrained,
)
from hyper_parallel.hf import read_safetensors, write_safetensors
from tests.torch.ut.hf_utils import randomize_, tiny_lite_config
from tests.torch.helpers import next_token_ce

V = 256  # tiny lang vocab of tiny_lite_config

# Four HF configs that differ in every axis the issue names.
HF_VARIANTS = {
    "qlora_group2_interleave": dict(),
    "no_qlora_bias_half_rope": dict(q_lora_rank=None, attention_bias=True, rope_interleave=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "flat_routing_unnormed": dict(n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.5,
                                  mlp_layer_types=["sparse", "dense", "sparse"]),
    "eight_experts_4groups": dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
                                  mlp_layer_types=["dense", "dense", "sparse"], attention_bias=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
}  # fmt: skip


def _hf_model(seed: int = 0, **overrides) -> Glm4MoeLiteForCausalLM:
    torch.manual_seed(seed)
    model = Glm4MoeLiteForCausalLM(tiny_lite_config(**overrides)).eval()
    randomize_(model, seed)  # random norms and a random non-zero e_score_correction_bias
    return model


def _batch(seed: int = 1, B: int = 2, T: int = 12) -> torch.Tensor:
    # ids < V - 1: a Glm4MoeLite checkpoint gets placeholder_token_id = V - 1 (a batch with no image tokens)
    return torch.randint(0, V - 1, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_logits_and_grads_match_hf(tmp_path, variant):
    hf = _hf_model(**HF_VARIANTS[variant])
    assert hf.model.layers[-1].mlp.gate.e_score_correction_bias.abs().sum() > 0 or "dense" in str(
        HF_VARIANTS[variant].get("mlp_layer_types", ""))
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    ids = _batch()

    hf_logits = hf(input_ids=ids, use_cache=False).logits
    our_logits = ours(ids)
    assert our_logits.shape == (2, 12, V)  # a Glm4MoeLite folder is a model without image path
    assert (our_logits[..., :V] - hf_logits).abs().max().item() <= 1e-5

    next_token_ce(hf_logits, ids).backward()
    next_token_ce(our_logits[..., :V], ids).backward()
    hf_grads = {n.removeprefix("model."): p.grad for n, p in hf.named_parameters()}
    worst = 0.0
    for name, p in ours.named_parameters():
        if name.startswith(("vq_codebook", "vq_to_llm_proj")):
            assert p.grad is None or p.grad.abs().max() == 0
            continue
        g = hf_grads[name]
        ours_g = p.grad[:V] if name == "lm_head.weight" else p.grad
        worst = max(worst, (ours_g - g).abs().max().item())
    assert worst <= 1e-5, worst


def test_packed_rows_match_hf_block_diagonal(tmp_path):
    """Restarting position_ids make HF build a block-diagonal mask; our cu_seqlens must agree."""
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    ids = _batch(T=15)[:1]
    lens = [6, 4, 5]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, 6, 10, 15], dtype=torch.int32)
    hf_logits = hf(input_ids=ids, position_ids=pos, use_cache=False).logits
    our_logits = ours(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=6)
    assert (our_logits[..., :V] - hf_logits).abs().max().item() <= 1e-5


def test_roundtrip_hf_ours_hf_is_bit_exact(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    first = from_pretrained(tmp_path / "hf", image_path=True)  # grown: the GlmImageMoe form
    save_pretrained(first, tmp_path / "ours", max_shard_size="40KB")  # sharded with an index
    assert (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["model_type"] == "glm_image_moe" and cfg["lang_vocab_size"] == V
    second = from_pretrained(tmp_path / "ours")
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # on disk: per-expert keys, codebook under model.vqmodel, head with the image rows
    disk = read_safetensors(tmp_path / "ours")
    assert "model.language_model.layers.1.mlp.experts.3.down_proj.weight" in disk
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj" not in disk
    assert disk["model.vqmodel.quantize.embedding.weight"].shape == (16384, 2048)
    assert disk["lm_head.weight"].shape == (V + 16384, 64)


def test_text_only_export_loads_in_hf(tmp_path):
    hf = _hf_model(q_lora_rank=None)
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf", codebook_size=64, vq_embed_dim=16, image_path=True)
    save_pretrained(ours, tmp_path / "text", text_only=True)
    back = Glm4MoeLiteForCausalLM.from_pretrained(tmp_path / "text").eval()
    ids = _batch()
    with torch.no_grad():
        diff = (back(input_ids=ids, use_cache=False).logits - ours(ids)[..., :V]).abs().max().item()
    assert diff <= 1e-5


def test_image_checkpoint_passthrough_keeps_vq_and_nextn_keys(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf", codebook_size=64, vq_embed_dim=16, image_path=True)
    save_pretrained(ours, tmp_path / "img")
    sd = read_safetensors(tmp_path / "img")
    sd["model.vqmodel.quant_conv.weight"] = torch.randn(16, 8, 1, 1)  # not modelled: passes through
    sd["model.language_model.layers.3.self_attn.o_proj.weight"] = torch.randn(64, 64)  # MTP layer 3
    write_safetensors(sd, tmp_path / "img")
    again = from_pretrained(tmp_path / "img")
    assert torch.equal(again.vq_codebook.weight, ours.vq_codebook.weight)
    save_pretrained(again, tmp_path / "img2")
    out = read_safetensors(tmp_path / "img2")
    assert torch.equal(out["model.vqmodel.quant_conv.weight"], sd["model.vqmodel.quant_conv.weight"])
    key = "model.language_model.layers.3.self_attn.o_proj.weight"  # MTP off: the nextn layer is kept too
    assert torch.equal(out[key], sd[key])


def test_bad_checkpoint_lists_every_problem(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    sd = read_safetensors(tmp_path / "hf")
    del sd["model.layers.0.self_attn.o_proj.weight"]
    del sd["model.layers.2.mlp.experts.1.up_proj.weight"]
    sd["model.layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)
    sd["model.extra_thing.weight"] = torch.zeros(1)
    write_safetensors(sd, tmp_path / "hf")
    with pytest.raises(CheckpointKeyError) as err:
        from_pretrained(tmp_path / "hf")
    msg = str(err.value)
    for needle in ("missing: layers.0.self_attn.o_proj.weight",
                   "missing: model.layers.2.mlp.experts.1.up_proj.weight",
                   "shape: layers.1.self_attn.kv_b_proj.weight is [3, 3]",
                   "unexpected: extra_thing.weight"):  # fmt: skip
        assert needle in msg, msg


def _tiny_image_model(**kw) -> GlmImageMoeModel:
    torch.manual_seed(0)
    cfg = glm_image_moe_config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=8,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, codebook_size=32, vq_embed_dim=12,
        placeholder_token_id=127, n_group=2, **kw,
    )  # fmt: skip
    model = cfg.build()
    model.init_weights()
    return model


def _image_batch():
    ids = torch.randint(0, 120, (2, 10), generator=torch.Generator().manual_seed(3))
    ids[0, 2:5] = 127
    ids[1, 6:8] = 127
    codes = torch.tensor([5, 0, 31, 7, 9])
    return ids, codes


def test_placeholder_scatter_uses_normalised_codebook_projection():
    model = _tiny_image_model()
    ids, codes = _image_batch()
    h = model.embed(ids, vq_codes=codes)
    flat = ids.view(-1)
    pos = (flat == 127).nonzero().squeeze(-1)
    want = model.vq_to_llm_proj(F.normalize(model.vq_codebook.weight[codes], dim=-1))
    assert torch.allclose(h.view(-1, 32)[pos], want, atol=1e-6)
    text = (flat != 127).nonzero().squeeze(-1)
    assert torch.equal(h.view(-1, 32)[text], model.embed_tokens.weight[flat[text]])
    # explicit visual_indices give the same result; raw (un-normalised) rows differ
    assert torch.equal(model.embed(ids, vq_codes=codes, visual_indices=pos), h)
    raw = _tiny_image_model(vq_l2_normalize=False)
    raw.load_state_dict(model.state_dict())
    assert not torch.allclose(raw.embed(ids, vq_codes=codes), h)


def test_image_input_errors_name_the_numbers():
    model = _tiny_image_model()
    ids, codes = _image_batch()
    with pytest.raises(ValueError, match="5 image placeholders .* 4 vq_codes"):
        model(ids, vq_codes=codes[:4])
    with pytest.raises(ValueError, match=r"vq_codes hold 32, outside the codebook \[0, 32\)"):
        model(ids, vq_codes=torch.tensor([5, 0, 32, 7, 9]))
    with pytest.raises(ValueError, match="--model.placeholder_token_id 200"):
        glm_image_moe_config(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=1, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                             q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                             codebook_size=32, vq_embed_dim=12, placeholder_token_id=200)  # fmt: skip


def test_training_step_trains_projection_and_keeps_codebook_frozen():
    model = _tiny_image_model()
    ids, codes = _image_batch()
    labels = torch.full_like(ids, -100)
    # the position before each image token predicts that code, offset into the image rows
    flat_labels = labels.view(-1)
    pos = (ids.view(-1) == 127).nonzero().squeeze(-1)
    flat_labels[pos - 1] = codes + 128
    codebook_before = model.vq_codebook.weight.detach().clone()
    proj_before = model.vq_to_llm_proj.weight.detach().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    logits = model(ids, vq_codes=codes)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    assert model.vq_codebook.weight.grad is None
    # image targets reach the image rows of the joint head
    assert model.lm_head.weight.grad[128:].abs().sum() > 0
    opt.step()
    assert torch.equal(model.vq_codebook.weight, codebook_before)
    assert not torch.equal(model.vq_to_llm_proj.weight, proj_before)


def _analytic_counts(*, V, H, L, I, Im, E, K, ns, nh, ql, kvl, dn, dr, dv, C, dvq, dense_layers):
    attn = H * ql + ql + ql * nh * (dn + dr) + H * (kvl + dr) + kvl + kvl * nh * (dn + dv) + nh * dv * H
    norms = 2 * H
    dense = 3 * H * I
    routed = E * 3 * H * Im
    moe_rest = E * H + 3 * H * Im * ns
    backbone = V * H + L * (attn + norms) + dense_layers * dense + (L - dense_layers) * (routed + moe_rest) + H
    head = (V + C) * H
    total = backbone + head + C * dvq + dvq * H
    active = backbone - (L - dense_layers) * routed * (1 - K / E) + head
    return total, active, backbone


def test_a3b_param_counts_match_analytic():
    from hyper_parallel.models.glm_image_moe_v2.config_registry import glm_image_moe_a3b

    cfg = dataclasses.replace(glm_image_moe_a3b().model, use_mtp=False)  # the trunk (the recipe has the nextn layer on)
    with torch.device("meta"):
        model = cfg.build()
    total, _ = model.get_nparams_and_flops(seq_len=4096)
    active = model.active_params()
    want_total, want_active, backbone = _analytic_counts(
        V=154880, H=2048, L=47, I=10240, Im=1536, E=64, K=4, ns=1, nh=20, ql=768, kvl=512, dn=192, dr=64,
        dv=256, C=16384, dvq=2048, dense_layers=1,
    )  # fmt: skip
    print(f"glm_image_moe_a3b: total {total / 1e9:.3f}B (backbone {backbone / 1e9:.3f}B), active {active / 1e9:.3f}B")
    assert total == want_total
    assert active == int(want_active)
    assert 28e9 < backbone < 32e9 and 2.5e9 < active < 4.5e9
