"""Qwen3.5-MoE v2: parity with HF Qwen3_5MoeForCausalLM through from_pretrained (fp32 logits and every
parameter gradient), packed documents vs HF per document, HF -> ours -> HF round trips (CausalLM and
ConditionalGeneration folders, visual/mtp keys kept), checkpoint-key errors, export loading in HF, and the
a3b parameter counts on the meta device."""

from __future__ import annotations

import dataclasses

import json

import pytest
import torch
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeTextConfig

from hyper_parallel.models.qwen3_5_moe_v2 import (
    CheckpointKeyError,
    Qwen3_5MoeModel,
    config_from_hf,
    config_to_hf,
    from_pretrained,
    save_pretrained,
)
from hyper_parallel.models.qwen3_5_moe_v2.model import qwen3_5_moe_config
from hyper_parallel.hf import read_safetensors, write_safetensors
from hyper_parallel.protocols.model import split_output
from tests.torch.ut.hf_utils import hf_row_order, randomize_
from tests.torch.helpers import next_token_ce

V = 128
TOL = 1e-5


def _text_kwargs(**overrides) -> dict:
    kw = dict(
        vocab_size=V, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
        shared_expert_intermediate_size=20, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[1, 1, 0]),
    )  # fmt: skip
    kw.update(overrides)
    return kw


def _rope(theta: float, partial: float, section: list[int]) -> dict:
    return dict(rope_type="default", rope_theta=theta, partial_rotary_factor=partial, mrope_section=section)


# Four HF configs that vary every axis the issue names: Hv/Hk ratio, key/value head dims, partial rotary
# factor, layer pattern, experts/top-k and the shared expert size.
HF_VARIANTS = {
    "hv2hk_3to1_e8k2": dict(),
    "hv_eq_hk_dk12_dv6_full_rotary_e4k1": dict(
        linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=12, linear_value_head_dim=6,
        num_experts=4, num_experts_per_tok=1, shared_expert_intermediate_size=8, rope_parameters=_rope(1e4, 1.0, [4, 2, 2])),
    "hv4hk_dk4_dv10_alternating_e16k4": dict(
        linear_num_key_heads=1, linear_num_value_heads=4, linear_key_head_dim=4, linear_value_head_dim=10,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=8, shared_expert_intermediate_size=40,
        num_key_value_heads=1, rope_parameters=_rope(1e6, 0.5, [2, 1, 1])),
    "hv3hk_dk16_dv4_attn_first_conv2_bias": dict(
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=4,
        linear_conv_kernel_dim=2, head_dim=32, attention_bias=True,
        layer_types=["full_attention", "linear_attention", "linear_attention", "linear_attention"],
        num_experts=6, num_experts_per_tok=3, rope_parameters=_rope(1e7, 0.25, [2, 1, 1])),
}  # fmt: skip


def _hf_model(seed: int = 0, **overrides) -> Qwen3_5MoeForCausalLM:
    cfg = Qwen3_5MoeTextConfig(**_text_kwargs(**overrides))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    randomize_(model, seed)
    _hf_like_decay_(model)
    return model


@torch.no_grad()
def _hf_like_decay_(model: torch.nn.Module) -> None:
    # HF ranges for the DeltaNet decay (dt_bias ~ 1, A in (0.01, 16)) so the recurrence neither dies nor explodes;
    # zero-centred norms get w ~ 0.2 N (scale 1 + w, as trained checkpoints), not randomize_'s 1 + 0.2 N.
    for name, p in model.named_parameters():
        if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "model.norm.weight" or (
            name.endswith("language_model.norm.weight")
        ):
            p.sub_(1.0)
        elif name.endswith("dt_bias"):
            p.add_(1.0)
        elif name.endswith("A_log"):
            p.copy_(torch.linspace(-2.0, 1.5, p.numel()))


def _batch(seed: int = 1, B: int = 2, T: int = 20) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _hf_name(ours_name: str, linear_layers: set[int]) -> str:
    parts = ours_name.split(".")
    if parts[0] == "layers" and parts[2] == "self_attn" and int(parts[1]) in linear_layers:
        parts[2] = "linear_attn"
    name = ".".join(parts).replace(".shared_experts.", ".shared_expert.")
    return name if name == "lm_head.weight" else "model." + name


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_logits_and_every_grad_match_hf(tmp_path, variant):
    hf = _hf_model(**HF_VARIANTS[variant])
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    assert isinstance(ours, Qwen3_5MoeModel)
    T = 70 if variant == "hv2hk_3to1_e8k2" else 20  # one variant crosses a DeltaNet chunk (64)
    ids = _batch(T=T)
    hf_logits = hf(input_ids=ids, use_cache=False).logits
    our_logits = ours(ids)
    assert isinstance(our_logits, torch.Tensor)  # no aux loss configured: plain logits, like the GLM model
    assert (our_logits - hf_logits).abs().max().item() <= TOL

    next_token_ce(hf_logits, ids).backward()
    next_token_ce(our_logits, ids).backward()
    linear = {i for i, t in enumerate(hf.config.layer_types) if t == "linear_attention"}
    hf_params = dict(hf.named_parameters())
    worst = 0.0
    for name, p in ours.named_parameters():
        g = hf_params.pop(_hf_name(name, linear)).grad
        worst = max(worst, (hf_row_order(ours, name, p.grad) - g).abs().max().item())
    assert not hf_params, f"HF parameters with no counterpart: {sorted(hf_params)}"
    assert worst <= TOL, worst


def test_packed_rows_equal_hf_per_document(tmp_path):
    """DeltaNet conv and state restart and attention is block-diagonal at every cu_seqlens boundary."""
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    lens = [[7, 20, 3], [30]]
    ids = _batch(B=2, T=30)
    cu = torch.tensor([0, 7, 27, 30, 60], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for row in lens for n in row]).view(2, 30)
    with torch.no_grad():
        packed = ours(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=30)
        flat = ids.view(1, -1)
        ref = torch.cat(
            [hf(input_ids=flat[:, s:e], use_cache=False).logits for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())],
            dim=1,
        ).view(2, 30, V)
        leaked = ours(ids, position_ids=pos)  # no cu_seqlens: documents of a row see each other
    assert (packed - ref).abs().max().item() <= TOL
    assert (leaked - ref).abs().max().item() > 1e-3


def test_roundtrip_hf_ours_hf_is_bit_exact(tmp_path):
    hf = _hf_model(**HF_VARIANTS["hv4hk_dk4_dv10_alternating_e16k4"])
    hf.save_pretrained(tmp_path / "hf")
    first = from_pretrained(tmp_path / "hf")
    save_pretrained(first, tmp_path / "ours", max_shard_size="40KB")
    assert (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe_text" and cfg["architectures"] == ["Qwen3_5MoeForCausalLM"]
    src, out = read_safetensors(tmp_path / "hf"), read_safetensors(tmp_path / "ours")
    assert src.keys() == out.keys()  # per-expert keys, HF names (linear_attn, shared_expert)
    for k in src:
        assert torch.equal(src[k], out[k]), k
    assert "model.layers.0.mlp.experts.15.down_proj.weight" in out and "model.layers.0.linear_attn.A_log" in out
    # HF reads our export with equal logits
    back = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = _batch()
    with torch.no_grad():
        assert (back(input_ids=ids, use_cache=False).logits - first(ids)).abs().max().item() <= TOL


def test_fused_expert_keys_load(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    sd = read_safetensors(tmp_path / "hf")
    fused = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    for i in range(4):
        base = f"model.layers.{i}.mlp.experts."
        fused[base + "gate_up_proj"] = hf.model.layers[i].mlp.experts.gate_up_proj.detach().clone()
        fused[base + "down_proj"] = hf.model.layers[i].mlp.experts.down_proj.detach().clone()
    write_safetensors(fused, tmp_path / "fused")
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    a, b = from_pretrained(tmp_path / "hf").state_dict(), from_pretrained(tmp_path / "fused").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _hf_vl_model() -> Qwen3_5MoeForConditionalGeneration:
    cfg = Qwen3_5MoeConfig(
        text_config=_text_kwargs(),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=16),
        image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    cfg.text_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    randomize_(model, 0)
    _hf_like_decay_(model)
    return model


def test_conditional_generation_folder_loads_and_keeps_visual_and_mtp(tmp_path):
    vl = _hf_vl_model()
    vl.save_pretrained(tmp_path / "vl")
    sd = read_safetensors(tmp_path / "vl")
    sd["mtp.fc.weight"] = torch.randn(32, 64)  # HF has no MTP module; the checkpoint layout keeps it
    sd["mtp.layers.0.input_layernorm.weight"] = torch.randn(32)
    write_safetensors(sd, tmp_path / "vl")
    ours = from_pretrained(tmp_path / "vl")
    ids = _batch(T=12)
    with torch.no_grad():
        want = vl(input_ids=ids, use_cache=False).logits
        assert (ours(ids) - want).abs().max().item() <= TOL
    assert any(k.startswith("model.visual.") for k in ours.hf_passthrough)
    save_pretrained(ours, tmp_path / "back")
    out = read_safetensors(tmp_path / "back")
    assert out.keys() == sd.keys()
    for k in sd:
        assert torch.equal(out[k], sd[k]), k
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe" and cfg["vision_config"]["depth"] == 1
    again = Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert (again(input_ids=ids, use_cache=False).logits - want).abs().max().item() <= TOL
    # the text-only export of the same model is a CausalLM folder: the vision tower is left out, the MTP block
    # (which a Qwen3_5MoeForCausalLM folder also carries, and vLLM drafts with) is kept
    save_pretrained(ours, tmp_path / "text", text_only=True)
    keys = read_safetensors(tmp_path / "text")
    assert not any(k.startswith("model.visual.") for k in keys)
    assert any(k.startswith("mtp.") for k in keys)


def test_bad_checkpoint_lists_every_problem(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    sd = read_safetensors(tmp_path / "hf")
    del sd["model.layers.3.self_attn.o_proj.weight"]
    del sd["model.layers.1.mlp.experts.2.up_proj.weight"]
    sd["model.layers.0.linear_attn.in_proj_z.weight"] = torch.zeros(3, 3)
    sd["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)  # layer 0 is a DeltaNet layer
    write_safetensors(sd, tmp_path / "hf")
    with pytest.raises(CheckpointKeyError) as err:
        from_pretrained(tmp_path / "hf")
    msg = str(err.value)
    for needle in ("missing: layers.3.self_attn.o_proj.weight",
                   "missing: model.layers.1.mlp.experts.2.up_proj.weight",
                   "shape: layers.0.self_attn.in_proj_z.weight is [3, 3]",
                   "unexpected: model.layers.0.self_attn.q_proj.weight"):  # fmt: skip
        assert needle in msg, msg


@pytest.mark.parametrize("variant", ["hv2hk_3to1_e8k2", "hv4hk_dk4_dv10_alternating_e16k4"])
def test_model_aux_loss_and_its_gradient_equal_hf(tmp_path, variant):
    # HF pools the router statistics of ALL layers (load_balancing_loss_func over the concatenated router
    # logits) before the Switch product; a sum of per-layer losses is about num_layers times larger.
    coef = 0.01
    hf = _hf_model(**HF_VARIANTS[variant], output_router_logits=True, router_aux_loss_coef=coef)
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    assert ours.layers[0].mlp.config.router_aux_loss_coef == coef
    ids = _batch(T=20)
    out = hf(input_ids=ids, use_cache=False)
    logits, aux = split_output(ours(ids))
    assert (logits - out.logits).abs().max().item() <= TOL
    assert aux is not None and aux.dim() == 0
    want = coef * out.aux_loss  # HF returns the unweighted loss and adds coef * aux_loss to its loss
    diff = abs(aux.item() - want.item())
    assert diff <= 1e-7 * max(1.0, want.item()), (aux.item(), want.item())
    (coef * out.aux_loss).backward()
    aux.backward()
    linear = {i for i, t in enumerate(hf.config.layer_types) if t == "linear_attention"}
    hf_params = dict(hf.named_parameters())
    worst = 0.0
    for name, p in ours.named_parameters():
        g = hf_params[_hf_name(name, linear)].grad
        if name.endswith("mlp.gate.weight"):
            assert p.grad is not None and p.grad.abs().max() > 0, name  # the loss trains every router
        if g is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        worst = max(worst, (hf_row_order(ours, name, p.grad) - g).abs().max().item())
    assert worst <= 1e-7, worst


def _ours_tiny() -> dict:
    return dict(
        vocab_size=V, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20,
        mrope_section=(1, 1, 0),
    )  # fmt: skip


def test_hf_config_round_trip_keeps_fields():
    hf_cfg = Qwen3_5MoeTextConfig(**_text_kwargs(**HF_VARIANTS["hv3hk_dk16_dv4_attn_first_conv2_bias"])).to_dict()
    ours = config_from_hf(hf_cfg)
    back = config_to_hf(ours)
    for key in ("layer_types", "linear_conv_kernel_dim", "linear_num_value_heads", "num_experts", "head_dim",
                "attention_bias", "shared_expert_intermediate_size", "router_aux_loss_coef", "output_router_logits"):
        assert back[key] == hf_cfg[key], key
    assert back["rope_parameters"]["mrope_section"] == [2, 1, 1]
    with pytest.raises(ValueError, match="qwen3_5 package"):
        config_from_hf({**hf_cfg, "model_type": "qwen3_5_text"})


def _analytic_params(*, V, H, L, n_linear, Hq, Hkv, d, Hk, Hv, Dk, Dv, K, E, top_k, I, Is) -> tuple[int, int]:  # noqa: E741
    conv = 2 * Hk * Dk + Hv * Dv
    gdn = conv * H + Hv * Dv * H + 2 * Hv * H + conv * K + 2 * Hv + Dv + H * Hv * Dv
    attn = 2 * Hq * d * H + 2 * Hkv * d * H + H * Hq * d + 2 * d
    routed = E * 3 * I * H
    moe = E * H + routed + 3 * Is * H + H
    total = 2 * V * H + H + L * (2 * H + moe) + n_linear * gdn + (L - n_linear) * attn
    active = total - L * routed * (1 - top_k / E)
    return total, int(active)


def test_a3b_parameter_count_on_meta(capsys):
    from hyper_parallel.models.qwen3_5_moe_v2.config_registry import qwen3_5_moe_a3b

    cfg = dataclasses.replace(qwen3_5_moe_a3b().model, use_mtp=False)  # the trunk (the recipe has the MTP block on)
    with torch.device("meta"):
        model = cfg.build()
    total = sum(p.numel() for p in model.parameters())
    want_total, want_active = _analytic_params(
        V=248320, H=2048, L=40, n_linear=30, Hq=16, Hkv=2, d=256, Hk=16, Hv=32, Dk=128, Dv=128, K=4, E=256, top_k=8,
        I=512, Is=512,
    )  # fmt: skip
    assert total == want_total
    assert model.active_params() == want_active
    with capsys.disabled():
        print(f"\nqwen3_5_moe_a3b: total {total / 1e9:.2f}B, active {want_active / 1e9:.2f}B")
    assert abs(total / 1e9 - 34.66) < 0.01 and abs(want_active / 1e9 - 3.45) < 0.01


@pytest.mark.parametrize(
    ("degrees", "message"),
    [
        (dict(tensor_parallel_degree=2), None),  # TP shards the DeltaNet heads: allowed
        (dict(tensor_parallel_degree=4), "does not divide the Gated DeltaNet linear_num_key_heads (2)"),
        (dict(tensor_parallel_degree=2, context_parallel_degree=2), None),  # beyond the heads: state passing
        (dict(context_parallel_degree=4), None),  # beyond the heads: K/V all-gather + DeltaNet state passing
        (dict(context_parallel_degree=2), None),  # Ulysses CP splits the DeltaNet heads: allowed
        (dict(expert_parallel_degree=4), None),
    ],
)
def test_validate_layout_names_the_degree_to_change(degrees, message):
    from hyper_parallel.config import ParallelismConfig
    from hyper_parallel.config.manager import ConfigError
    from hyper_parallel.distributed.parallel_dims import ParallelDims
    from hyper_parallel.models.qwen3_5_moe_v2.parallelize import validate_qwen3_5_moe_layout

    cfg = qwen3_5_moe_config(**_ours_tiny())  # Hk 2, Hv 4, 4 q / 2 kv heads, 8 experts
    pd = ParallelDims.from_config(ParallelismConfig(**degrees), 4)
    if message is None:
        validate_qwen3_5_moe_layout(cfg, pd)
        return
    with pytest.raises(ConfigError) as e:
        validate_qwen3_5_moe_layout(cfg, pd)
    assert message in str(e.value), str(e.value)
