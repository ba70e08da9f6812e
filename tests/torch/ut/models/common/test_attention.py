"""RoPE, MLAttention and GQAttention vs HF (transformers 5.24.0) in fp32: outputs and every gradient."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import (
    Glm4MoeLiteAttention,
    Glm4MoeLiteRotaryEmbedding,
)
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3RotaryEmbedding,
)

from hyper_parallel.models.common.attention import VarlenAttention
from hyper_parallel.models.common.gqa import GQAttention
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.mla import MLAttention
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.models.common.rope import RoPE
from hyper_parallel.protocols.module import Module
from tests.torch.ut.hf_utils import (
    assert_backward_parity,
    load_from_hf_,
    max_grad_diff,
    mla_config_from_hf,
    randomize_,
    rope_config_from_hf,
    tiny_lite_config,
)

TOL = 1e-5
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707,
}  # fmt: skip


def _inputs(B: int = 2, T: int = 11, D: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen)
    # Offsets make the rows' positions differ, so a rope that ignores position_ids would fail.
    pos = torch.arange(T).unsqueeze(0) + torch.tensor([[0], [5]])[:B]
    return x, pos


@pytest.mark.parametrize("rope_parameters", [None, YARN], ids=["default", "yarn"])
@pytest.mark.parametrize("interleave", [True, False])
def test_rope_tables_bit_equal_hf(rope_parameters, interleave):
    extra = {"rope_parameters": rope_parameters} if rope_parameters else {}
    cfg = tiny_lite_config(rope_interleave=interleave, **extra)
    hf = Glm4MoeLiteRotaryEmbedding(cfg)
    ours = rope_config_from_hf(cfg).build(head_dim=cfg.qk_rope_head_dim)
    x, pos = _inputs()
    for dtype in (torch.float32, torch.bfloat16):
        cos_hf, sin_hf = hf(x.to(dtype), pos)
        cos, sin = ours.cos_sin(pos, dtype)
        assert cos.dtype == dtype
        assert torch.equal(cos, cos_hf) and torch.equal(sin, sin_hf)
    hf_attn = Glm4MoeLiteAttention(cfg, 0)
    assert ours.attention_scale_factor() * cfg.qk_head_dim**-0.5 == pytest.approx(hf_attn.scaling, rel=1e-12)
    if rope_parameters:
        assert ours.attention_scale_factor() != 1.0 and ours.cos_sin_factor() != 1.0


def test_rope_init_weights_rebuilds_inv_freq_after_meta_build():
    cfg = RoPE.Config(theta=500.0)
    with torch.device("meta"):
        rope = cfg.build(head_dim=8)
    rope.to_empty(device="cpu")
    rope.init_weights()
    assert torch.equal(rope.inv_freq, cfg.build(head_dim=8).inv_freq)


def test_rope_partial_rotary_passes_the_tail_through():
    rope = RoPE.Config(layout="half", partial_rotary_factor=0.5).build(head_dim=8)
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8)
    cos, sin = rope.cos_sin(torch.arange(5)[None], torch.float32)
    assert cos.shape == (1, 5, 4)
    q2, k2 = rope.apply(q, k, cos, sin)
    assert torch.equal(q2[..., 4:], q[..., 4:]) and torch.equal(k2[..., 4:], k[..., 4:])
    assert not torch.allclose(q2[..., 1:, :4], q[..., 1:, :4])


def _mla_parity(cfg, B: int = 2, T: int = 11, x_scale: float = 1.0) -> tuple[float, float, float]:
    torch.manual_seed(0)
    hf = randomize_(Glm4MoeLiteAttention(cfg, layer_idx=0), seed=3)
    ours = load_from_hf_(mla_config_from_hf(cfg).build(dim=cfg.hidden_size), hf)
    hf_rope = Glm4MoeLiteRotaryEmbedding(cfg)

    x, pos = _inputs(B, T, cfg.hidden_size)
    x = x * x_scale
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_hf, _ = hf(x_hf, position_embeddings=hf_rope(x, pos), attention_mask=None)
    out = ours(x_ours, position_ids=pos)
    grad_out = torch.randn_like(out)
    out_hf.backward(grad_out)
    out.backward(grad_out)
    return (
        (out - out_hf).abs().max().item(),
        max_grad_diff(ours, hf),
        (x_ours.grad - x_hf.grad).abs().max().item(),
    )


@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["q_lora", "q_proj"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleave", "half"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_mla_matches_hf(q_lora_rank, interleave, bias):
    cfg = tiny_lite_config(q_lora_rank=q_lora_rank, rope_interleave=interleave, attention_bias=bias)
    out_diff, grad_diff, dx_diff = _mla_parity(cfg)
    assert out_diff <= TOL and grad_diff <= TOL and dx_diff <= TOL, (out_diff, grad_diff, dx_diff)


def test_mla_matches_hf_on_small_activations():
    """Small latents make the 1e-6 eps of q_a/kv_a_layernorm visible (1e-5 there misses by > 1e-3)."""
    out_diff, grad_diff, dx_diff = _mla_parity(tiny_lite_config(), x_scale=0.02)
    # d/dx grows by 1/0.02 through the norms; compare the gradient w.r.t. the unscaled input (x * 0.02).
    assert out_diff <= TOL and grad_diff <= TOL and dx_diff * 0.02 <= TOL, (out_diff, grad_diff, dx_diff)


def test_mla_yarn_matches_hf():
    out_diff, grad_diff, dx_diff = _mla_parity(tiny_lite_config(rope_parameters=YARN))
    assert out_diff <= TOL and grad_diff <= TOL and dx_diff <= TOL, (out_diff, grad_diff, dx_diff)


def test_mla_state_dict_names_and_bias_placement_match_hf():
    for q_lora_rank in (32, None):
        cfg = tiny_lite_config(q_lora_rank=q_lora_rank, attention_bias=True)
        ours = mla_config_from_hf(cfg).build(dim=cfg.hidden_size)
        hf = Glm4MoeLiteAttention(cfg, 0)
        assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}
        fqns = {fqn for fqn, *_ in ours.config.traverse(Module.Config) if fqn}
        assert fqns == {name for name, _ in ours.named_modules() if name}


def test_mla_config_q_lora_rank_selects_the_query_branch():
    kw = dict(n_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    low = MLAttention.Config(q_lora_rank=8, q_proj=Linear.Config(), q_a_proj=Linear.Config(bias=True), **kw)
    assert low.q_proj is None and low.q_a_proj.bias and low.q_a_layernorm.eps == 1e-6 and low.kv_a_layernorm.eps == 1e-6
    full = MLAttention.Config(q_lora_rank=None, q_a_proj=Linear.Config(), **kw)
    assert full.q_proj is not None and full.q_a_proj is full.q_a_layernorm is full.q_b_proj is None
    assert {f for f, *_ in full.traverse(Module.Config)} >= {"q_proj"}
    assert not {f for f, *_ in full.traverse(Module.Config)} & {"q_a_proj", "q_a_layernorm", "q_b_proj"}


def test_mla_works_on_a_tensor_parallel_head_shard():
    """Half the heads (what a TP rank holds after column-sharding q_b/kv_b) = the matching half of o_proj's input."""
    cfg = tiny_lite_config()
    full = randomize_(mla_config_from_hf(cfg).build(dim=cfg.hidden_size), seed=5)
    x, pos = _inputs()
    captured = {}
    full.o_proj.register_forward_hook(lambda m, inp, out: captured.setdefault("o_in", inp[0]))
    full(x, position_ids=pos)
    shard = mla_config_from_hf(cfg).build(dim=cfg.hidden_size)
    dq, dkv = 24, 32  # per-head rows of q_b_proj and kv_b_proj
    with torch.no_grad():
        shard.load_state_dict(full.state_dict())
        shard.q_b_proj.weight = torch.nn.Parameter(full.q_b_proj.weight[: 2 * dq].clone())
        shard.kv_b_proj.weight = torch.nn.Parameter(full.kv_b_proj.weight[: 2 * dkv].clone())
        shard.o_proj.weight = torch.nn.Parameter(full.o_proj.weight[:, : 2 * 16].clone())  # row-wise shard
    shard.o_proj.register_forward_hook(lambda m, inp, out: captured.setdefault("o_in_shard", inp[0]))
    shard(x, position_ids=pos)
    torch.testing.assert_close(captured["o_in_shard"], captured["o_in"][..., : 2 * 16], atol=1e-6, rtol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_gqa_matches_hf_qwen3(bias):
    qcfg = Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=bias,
        rms_norm_eps=1e-6, max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    qcfg._attn_implementation = "sdpa"
    hf = randomize_(Qwen3Attention(qcfg, layer_idx=0), seed=7)
    ours = GQAttention.Config(
        n_heads=4, n_kv_heads=2, head_dim=16,
        q_proj=Linear.Config(bias=bias), k_proj=Linear.Config(bias=bias),
        v_proj=Linear.Config(bias=bias), o_proj=Linear.Config(bias=bias),
        q_norm=RMSNorm.Config(eps=1e-6), k_norm=RMSNorm.Config(eps=1e-6),
        rope=RoPE.Config(theta=1e6, layout="half"),
        inner_attention=VarlenAttention.Config(backend="sdpa"),
    ).build(dim=64)  # fmt: skip
    load_from_hf_(ours, hf)
    x, pos = _inputs(D=64)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_hf, _ = hf(x_hf, position_embeddings=Qwen3RotaryEmbedding(qcfg)(x, pos), attention_mask=None)
    out = ours(x_ours, position_ids=pos)
    assert_backward_parity(out, out_hf, ours, hf, x_ours, x_hf, TOL)


def test_varlen_attention_flash_backend_fails_clearly_without_flash():
    attn = VarlenAttention.Config(backend="flash").build()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="backend='auto' or 'sdpa'"):
        attn(q, q, q, scale=0.5)
