"""The shared placement builders (``models/common/sharding.py``): the placements docs/design.md section 6 asks
for, per module and parameter; pure functions (the input config is untouched, nothing is shared with it);
GlmImageMoe's ``set_glm_image_moe_sharding_config`` is built from them; GQA (Qwen) placements, checked
on a 2-rank gloo TP run against the single-process module."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from hyper_parallel.distributed.parallelize import declared_shardings
from hyper_parallel.models.common import (
    FeedForward,
    GQAttention,
    Linear,
    RMSNorm,
    colwise_config,
    norm_config,
    rowwise_config,
    set_decoder_sharding_config,
    set_dense_ffn_sharding,
    set_gqa_attention_sharding,
    set_qkv_linear_sharding,
)
from hyper_parallel.models.glm_image_moe_v2.model import glm_image_moe_config
from hyper_parallel.models.glm_image_moe_v2.sharding import set_glm_image_moe_sharding_config
from hyper_parallel.protocols.sharding import MeshAxisName, ShardingConfig

TP, EP = MeshAxisName.TP, MeshAxisName.EP


def tiny(**kw):
    args = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, codebook_size=32, vq_embed_dim=8, placeholder_token_id=63,
    )  # fmt: skip
    return glm_image_moe_config(**(args | kw))  # layer 0 dense, layer 1 MoE with a shared expert


def _p(placement) -> str:
    if isinstance(placement, Shard):
        return f"S{placement.dim}"
    if isinstance(placement, Replicate):
        return "R"
    assert isinstance(placement, Partial), placement
    return "P"


def _named(named) -> str:
    return ",".join(f"{axis}:{_p(pl)}" for axis, pl in sorted((str(k), v) for k, v in (named or {}).items())) or "-"


def render(sc: ShardingConfig) -> str:
    """One line per ShardingConfig: params, inputs (handed in > needed), output (comes out > wanted), flags."""
    parts = [f"{name}={_named(named)}" for name, named in sc.params.items()]
    for name in sorted(sc.inputs.keys() | sc.desired_inputs.keys()):
        parts.append(f"in {name} {_named(sc.inputs.get(name))}>{_named(sc.desired_inputs.get(name))}")
    if sc.outputs or sc.desired_outputs:
        parts.append(f"out {_named(sc.outputs)}>{_named(sc.desired_outputs)}")
    if not sc.use_local_output:
        parts.append("dtensor")
    if sc.local_map is not None:
        parts.append("grad " + ";".join(_named(g) for g in sc.local_map.in_grad_placements))
    return " | ".join(parts)


def rendered(config) -> dict[str, str]:
    return {fqn: render(sc) for fqn, sc in declared_shardings(config).items()}


# docs/design.md section 6, written out per module. TP region = input made whole at the entry, activation
# gradients partial inside ("grad tp:P"); column-wise = weight S0, output S-1; row-wise = weight S1,
# partial output reduced to the residual placement; experts S0 on ep; head column-wise.
COLWISE = "weight=tp:S0 | in x tp:R>tp:R | out tp:S-1>- | grad tp:P"
SP_NORM = "weight=tp:R | in x tp:S1>-"

EXPECTED_SP_LOSS_PARALLEL_EP = {
    "embed_tokens": "weight=tp:S0 | in ids tp:R>- | out ->tp:R",  # vocab-parallel, whole output
    "layers.0": "in x_BTD tp:R>tp:S1",  # the first layer keeps its sequence chunk
    "layers.0.input_layernorm": SP_NORM,
    "layers.0.self_attn": "in x_BTD tp:S1>tp:R | grad tp:P",
    "layers.0.self_attn.q_b_proj": COLWISE,
    "layers.0.self_attn.kv_b_proj": COLWISE,
    "layers.0.self_attn.o_proj": "weight=tp:S1 | in x tp:S-1>- | out tp:P>tp:S1",  # reduce-scatter
    "layers.0.post_attention_layernorm": SP_NORM,
    "layers.0.mlp": "in x tp:S1>tp:R | grad tp:P",
    "layers.0.mlp.gate_proj": COLWISE,
    "layers.0.mlp.up_proj": COLWISE,
    "layers.0.mlp.down_proj": "weight=tp:S1 | in x tp:S-1>- | out tp:P>tp:S1",
    "layers.1.input_layernorm": SP_NORM,
    "layers.1.self_attn": "in x_BTD tp:S1>tp:R | grad tp:P",
    "layers.1.self_attn.q_b_proj": COLWISE,
    "layers.1.self_attn.kv_b_proj": COLWISE,
    "layers.1.self_attn.o_proj": "weight=tp:S1 | in x tp:S-1>- | out tp:P>tp:S1",
    "layers.1.post_attention_layernorm": SP_NORM,
    # with SP the MoE runs on the chunk it is handed; only the token mask (whole rows) is cut to that chunk.
    # The shared expert sees flat tokens
    "layers.1.mlp": "in token_mask tp:R>tp:S1",
    "layers.1.mlp.experts": "gate_up_proj=ep:S0 | down_proj=ep:S0",
    "layers.1.mlp.shared_experts": "in x tp:S0>tp:R | grad tp:P",
    "layers.1.mlp.shared_experts.gate_proj": COLWISE,
    "layers.1.mlp.shared_experts.up_proj": COLWISE,
    "layers.1.mlp.shared_experts.down_proj": "weight=tp:S1 | in x tp:S-1>- | out tp:P>tp:S0",
    "norm": SP_NORM,
    "lm_head": "weight=tp:S0 | in x tp:S1>tp:R | out tp:S-1>- | dtensor",  # vocab-sharded logits
}

EXPECTED_PLAIN_TP = {
    "embed_tokens": "weight=tp:S0 | in ids tp:R>- | out ->tp:R",
    "layers.0.self_attn": "in x_BTD tp:R>tp:R | grad tp:P",
    "layers.0.self_attn.q_b_proj": COLWISE,
    "layers.0.self_attn.kv_b_proj": COLWISE,
    "layers.0.self_attn.o_proj": "weight=tp:S1 | in x tp:S-1>- | out tp:P>tp:R",  # all-reduce
    "layers.0.mlp": "in x tp:R>tp:R | grad tp:P",
    "layers.0.mlp.gate_proj": COLWISE,
    "layers.0.mlp.up_proj": COLWISE,
    "layers.0.mlp.down_proj": "weight=tp:S1 | in x tp:S-1>- | out tp:P>tp:R",
    "layers.1.self_attn": "in x_BTD tp:R>tp:R | grad tp:P",
    "layers.1.self_attn.q_b_proj": COLWISE,
    "layers.1.self_attn.kv_b_proj": COLWISE,
    "layers.1.self_attn.o_proj": "weight=tp:S1 | in x tp:S-1>- | out tp:P>tp:R",
    # the MoE routes its sequence chunk only; the token mask is cut like x
    "layers.1.mlp": "in token_mask tp:R>tp:S1 | in x tp:R>tp:S1 | out tp:S1>tp:R",
    "layers.1.mlp.shared_experts": "in x tp:S0>tp:R | grad tp:P",
    "layers.1.mlp.shared_experts.gate_proj": COLWISE,
    "layers.1.mlp.shared_experts.up_proj": COLWISE,
    "layers.1.mlp.shared_experts.down_proj": "weight=tp:S1 | in x tp:S-1>- | out tp:P>tp:S0",
    "lm_head": "weight=tp:S0 | in x tp:R>tp:R | out tp:S-1>tp:R",  # logits gathered
}


def test_glm_image_moe_tp_sp_loss_parallel_ep():
    out = set_glm_image_moe_sharding_config(tiny(), loss_parallel=True, enable_sp=True, ep_degree=2)
    assert rendered(out) == EXPECTED_SP_LOSS_PARALLEL_EP


def test_glm_image_moe_plain_tp():
    out = set_glm_image_moe_sharding_config(tiny(), loss_parallel=False, enable_sp=False, ep_degree=1)
    assert rendered(out) == EXPECTED_PLAIN_TP


@pytest.mark.parametrize(
    ("loss_parallel", "enable_sp", "ep_degree"), [(True, False, 1), (False, True, 1), (True, True, 4)]
)
def test_glm_image_moe_other_switches(loss_parallel, enable_sp, ep_degree):
    kw = dict(loss_parallel=loss_parallel, enable_sp=enable_sp, ep_degree=ep_degree)
    got = rendered(set_glm_image_moe_sharding_config(tiny(), **kw))
    # the rest equals the table with the same SP switch; the head and the experts follow their own switches
    expected = dict(EXPECTED_SP_LOSS_PARALLEL_EP if enable_sp else EXPECTED_PLAIN_TP)
    head_input = "S1>tp:R" if enable_sp else "R>tp:R"
    head_output = "- | dtensor" if loss_parallel else "tp:R"
    expected["lm_head"] = f"weight=tp:S0 | in x tp:{head_input} | out tp:S-1>{head_output}"
    if ep_degree > 1:
        expected["layers.1.mlp.experts"] = "gate_up_proj=ep:S0 | down_proj=ep:S0"
    else:
        expected.pop("layers.1.mlp.experts", None)
    assert got == expected


def test_glm_image_moe_model_variants():
    # full-rank queries: q_proj column-wise instead of q_b_proj; biases follow their weight (col S0, row R)
    got = rendered(set_glm_image_moe_sharding_config(
        tiny(q_lora_rank=None, attention_bias=True, n_shared_experts=0), loss_parallel=True, enable_sp=True, ep_degree=1
    ))  # fmt: skip
    assert got["layers.0.self_attn.q_proj"] == COLWISE
    assert "layers.0.self_attn.q_b_proj" not in got
    assert got["layers.0.self_attn.o_proj"] == "weight=tp:S1 | bias=tp:R | in x tp:S-1>- | out tp:P>tp:S1"
    # no shared expert, no EP: the MoE declares only the cut of its token mask to the SP chunk
    assert {k: v for k, v in got.items() if k.startswith("layers.1.mlp")} == {"layers.1.mlp": "in token_mask tp:R>tp:S1"}
    # the latent projections/norms and the VQ path stay undeclared (replicated)
    assert not any(s in k for k in got for s in ("q_a_", "kv_a_", "vq_", "gate.", "rope"))


def test_glm_image_moe_rejects_a_non_mla_mixer():
    cfg = tiny()
    gqa = GQAttention.Config(n_heads=4, n_kv_heads=2, head_dim=8)
    cfg = dataclasses.replace(cfg, layers=[dataclasses.replace(cfg.layers[0], self_attn=gqa), cfg.layers[1]])
    with pytest.raises(TypeError, match="layers.0.self_attn is Config; GlmImageMoe uses MLA"):
        set_glm_image_moe_sharding_config(cfg, loss_parallel=True, enable_sp=True, ep_degree=1)


def _config_ids(config) -> set[int]:
    return {id(c) for _, c, _, _ in config.traverse()}


def test_pure_functions_share_nothing_and_ignore_stale_placements():
    cfg = tiny()
    # a stale placement on a module the function never declares must not survive
    stale = ShardingConfig(params={"weight": {TP: Shard(0)}})
    cfg = dataclasses.replace(cfg, vq_to_llm_proj=dataclasses.replace(cfg.vq_to_llm_proj, sharding_config=stale))
    before = copy.deepcopy(cfg)
    out = set_glm_image_moe_sharding_config(cfg, loss_parallel=True, enable_sp=True, ep_degree=2)
    assert cfg == before and cfg.vq_to_llm_proj.sharding_config is stale  # the input is untouched
    assert out.vq_to_llm_proj.sharding_config is None
    assert not _config_ids(cfg) & _config_ids(out)  # no config object is shared with the input
    scs = [id(c.sharding_config) for _, c, _, _ in out.traverse() if getattr(c, "sharding_config", None)]
    assert len(scs) == len(set(scs))  # nor between two modules of the result
    # the result depends on the arguments only: re-sharding a sharded config for another layout
    again = set_glm_image_moe_sharding_config(out, loss_parallel=False, enable_sp=False, ep_degree=1)
    assert rendered(again) == EXPECTED_PLAIN_TP
    # the model still builds from it (same tree, same FQNs)
    with torch.device("meta"):
        model = out.build()
    assert set(declared_shardings(out)) <= {n for n, _ in model.named_modules()}


def test_generic_decoder_builder_equals_the_glm_wrapper():
    cfg = tiny(mlp_layer_types=["sparse", "dense"])
    for kw in (
        dict(loss_parallel=True, enable_sp=True, ep_degree=2),
        dict(loss_parallel=False, enable_sp=False, ep_degree=1),
    ):
        assert set_decoder_sharding_config(cfg, **kw) == set_glm_image_moe_sharding_config(cfg, **kw)


def test_linear_and_norm_builders():
    with_bias, without = Linear.Config(bias=True), Linear.Config()
    assert render(colwise_config(with_bias)) == "weight=tp:S0 | bias=tp:S0 | in x tp:R>tp:R | out tp:S-1>- | grad tp:P"
    assert render(colwise_config(without, input_placement=Shard(1), in_region=False)) == (
        "weight=tp:S0 | in x tp:S1>tp:R | out tp:S-1>-"
    )
    assert render(rowwise_config(with_bias, output_placement=Replicate())) == (
        "weight=tp:S1 | bias=tp:R | in x tp:S-1>- | out tp:P>tp:R"
    )
    assert render(norm_config()) == SP_NORM
    ffn = set_dense_ffn_sharding(FeedForward.Config(hidden_dim=8), token_placement=Shard(1))
    assert render(ffn.sharding_config) == "in x tp:S1>tp:R | grad tp:P"
    assert render(ffn.down_proj.sharding_config) == "weight=tp:S1 | in x tp:S-1>- | out tp:P>tp:S1"
    with pytest.raises(AttributeError, match="has no field 'wq'"):
        set_qkv_linear_sharding(ffn, ("wq",))


def gqa_config() -> GQAttention.Config:
    """Qwen3-style GQA: q/k/v biases (Qwen2) and per-head q/k norms (Qwen3), 4 query and 2 kv heads."""
    biased = Linear.Config(bias=True)
    return GQAttention.Config(
        n_heads=4, n_kv_heads=2, head_dim=8, q_proj=biased, k_proj=copy.deepcopy(biased), v_proj=copy.deepcopy(biased),
        q_norm=RMSNorm.Config(eps=1e-6), k_norm=RMSNorm.Config(eps=1e-6),
    )  # fmt: skip


def test_gqa_attention_placements():
    attn = gqa_config()
    before = copy.deepcopy(attn)
    out = set_gqa_attention_sharding(attn, residual=Shard(1))
    assert attn == before
    got = {fqn: render(c.sharding_config) for fqn, c, _, _ in out.traverse() if getattr(c, "sharding_config", None)}
    qkv = "weight=tp:S0 | bias=tp:S0 | in x tp:R>tp:R | out tp:S-1>- | grad tp:P"
    assert got == {
        "": "in x_BTD tp:S1>tp:R | grad tp:P",
        "q_proj": qkv,
        "k_proj": qkv,
        "v_proj": qkv,
        "o_proj": "weight=tp:S1 | in x tp:S-1>- | out tp:P>tp:S1",
    }  # the per-head norms stay replicated (plain parameters inside the region)


# ------------------------------------------------------------------------------------------------------------
# GQA under TP 2 on gloo: the sharded module reproduces the single-process one (output, input grad, weight grads)
# ------------------------------------------------------------------------------------------------------------


def _gqa_tp_job(enable_sp: bool) -> dict[str, float]:
    import torch.distributed as dist

    from hyper_parallel.config import ParallelismConfig
    from hyper_parallel.distributed.parallel_dims import ParallelDims
    from hyper_parallel.distributed.tensor_parallel import apply_sharding_configs

    rank, B, T, D = dist.get_rank(), 2, 8, 32
    torch.manual_seed(0)
    ref = gqa_config().build(dim=D)
    for p in ref.parameters():  # non-trivial norm weights and biases
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(B, T, D)
    grad_out = torch.randn(B, T, D)
    pos = torch.arange(T).expand(B, T)

    x_ref = x.clone().requires_grad_(True)
    out_ref = ref(x_ref, position_ids=pos)
    out_ref.backward(grad_out)

    parallelism = ParallelismConfig(tensor_parallel_degree=2, enable_sequence_parallel=enable_sp)
    pd = ParallelDims.from_config(parallelism, 2)
    pd.build_mesh("cpu")
    residual = Shard(1) if enable_sp else Replicate()
    tp = set_gqa_attention_sharding(gqa_config(), residual=residual).build(dim=D)
    tp.load_state_dict(ref.state_dict())
    apply_sharding_configs(tp, pd, TP, declared_shardings(tp.config))
    chunk = slice(rank * T // 2, (rank + 1) * T // 2) if enable_sp else slice(None)
    x_tp = x[:, chunk].clone().requires_grad_(True)
    out_tp = tp(x_tp, position_ids=pos)
    out_tp.backward(grad_out[:, chunk])

    ref_grads = dict(ref.named_parameters())
    weight_diff = 0.0
    for name, p in tp.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
        if not isinstance(p, DTensor):  # replicated per-head norm: per-rank partial sum (FSDP sums it in training)
            dist.all_reduce(g)
        weight_diff = max(weight_diff, (g - ref_grads[name].grad).abs().max().item())
    return {
        "out": (out_tp - out_ref[:, chunk]).abs().max().item(),
        "x_grad": (x_tp.grad - x_ref.grad[:, chunk]).abs().max().item(),
        "weight_grad": weight_diff,
        "dtensor_params": sorted(n for n, p in tp.named_parameters() if isinstance(p, DTensor)),
    }


@pytest.fixture(scope="module")
def pool():
    from tests.torch.st.harness import WorkerPool

    workers = WorkerPool(max_world=2)
    yield workers
    workers.close()


@pytest.mark.slow
@pytest.mark.parametrize("enable_sp", [True, False], ids=["sp", "no_sp"])
def test_gqa_tensor_parallel_matches_single_process(pool, enable_sp):
    for out in pool.run(_gqa_tp_job, 2, enable_sp):
        assert out["out"] < 2e-5 and out["x_grad"] < 2e-5 and out["weight_grad"] < 2e-5, out
        assert out["dtensor_params"] == [
            "k_proj.bias", "k_proj.weight", "o_proj.weight", "q_proj.bias", "q_proj.weight",
            "v_proj.bias", "v_proj.weight",
        ]  # fmt: skip
