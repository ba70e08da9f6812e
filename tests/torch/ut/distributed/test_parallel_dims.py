"""ParallelDims: degree arithmetic and model checks fail fast, before any model or process group exists,
with a message naming what to change; plus the pure helpers of the distributed package."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from hyper_parallel.config import ActivationCheckpointConfig, ConfigError, ParallelismConfig
from hyper_parallel.distributed.activation_checkpoint import layers_to_checkpoint
from hyper_parallel.distributed.context_parallel import split_batch_for_cp
from hyper_parallel.distributed.expert_parallel import _regroup_index
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.parallelize import declared_shardings
from hyper_parallel.models.glm_image_moe_v2.model import glm_image_moe_config
from hyper_parallel.models.glm_image_moe_v2.parallelize import validate_glm_image_moe_layout
from hyper_parallel.models.glm_image_moe_v2.sharding import set_glm_image_moe_sharding_config
from hyper_parallel.protocols.sharding import MeshAxisName

TP, EP = MeshAxisName.TP, MeshAxisName.EP


def dims(world: int, **kw) -> ParallelDims:
    names = {
        "rep": "data_parallel_replicate_degree",
        "shard": "data_parallel_shard_degree",
        "cp": "context_parallel_degree",
        "tp": "tensor_parallel_degree",
        "ep": "expert_parallel_degree",
    }
    return ParallelDims.from_config(ParallelismConfig(**{names[k]: v for k, v in kw.items()}), world)


def tiny(**kw):
    args = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, codebook_size=32, vq_embed_dim=8, placeholder_token_id=63,
    )  # fmt: skip
    return glm_image_moe_config(**(args | kw))


def test_degrees_resolve_and_derive():
    d = dims(16, rep=2, cp=2, ep=4)  # dp_shard = -1 takes the rest: 16 / (2*2) = 4
    assert (d.dp_replicate, d.dp_shard, d.cp, d.tp, d.ep) == (2, 4, 2, 1, 4)
    assert (d.dp, d.dp_shard_cp, d.efsdp, d.degree("dp_cp")) == (8, 8, 2, 16)
    assert d.fsdp_enabled and d.cp_enabled and d.ep_enabled and not d.tp_enabled and not d.sp_enabled
    t = dims(8, tp=2)
    assert (t.dp_shard, t.efsdp) == (4, 8) and t.sp_enabled and t.loss_parallel_enabled


@pytest.mark.parametrize(
    ("world", "kw", "message"),
    [
        (8, dict(rep=3), "does not divide the world size 8"),
        (8, dict(shard=2, tp=2), "= 4, but the world size is 8"),
        (8, dict(shard=0), "data_parallel_shard_degree is 0"),
        (8, dict(tp=0), "tensor_parallel_degree is 0"),
        (8, dict(shard=2, tp=4, ep=4), "must divide data_parallel_shard_degree x context_parallel_degree"),
        (8, dict(shard=4, tp=2, ep=2), "together with --parallelism.tensor_parallel_degree"),
    ],
)
def test_invalid_degrees_fail_with_the_fix(world, kw, message):
    with pytest.raises(ConfigError, match="--parallelism|degree") as err:
        dims(world, **kw)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("world", "kw", "model_kw", "message"),
    [
        (8, dict(tp=8), {}, "tensor_parallel_degree (8) does not divide the model's n_heads (4)"),
        (6, dict(ep=3), {}, "expert_parallel_degree (3) does not divide the routed experts (8)"),
        (8, dict(tp=2), dict(intermediate_size=63), "does not divide the model's layers.0.mlp hidden size (63)"),
        (8, dict(ep=2), dict(hidden_size=34), "does not divide hidden_size (34)"),
        (2, dict(ep=2), dict(mlp_layer_types=["dense"] * 3), "the model has no routed experts"),
    ],
)
def test_invalid_layouts_for_the_model(world, kw, model_kw, message):
    with pytest.raises(ConfigError) as err:
        validate_glm_image_moe_layout(tiny(**model_kw), dims(world, **kw))
    assert message in str(err.value)


def test_valid_layouts_for_the_model():
    # context parallel beyond the heads per tp rank (tp 2 x cp 4, cp 8 on 4 heads): K/V all-gather, no head check
    layouts = [(8, {}), (8, dict(rep=2)), (2, dict(tp=2)), (8, dict(shard=2, tp=2, cp=2)), (8, dict(ep=4)),
               (8, dict(tp=2, cp=4)), (8, dict(cp=8))]  # fmt: skip
    for world, kw in layouts:
        validate_glm_image_moe_layout(tiny(), dims(world, **kw))


def test_mesh_needs_build_first():
    with pytest.raises(RuntimeError, match="build_mesh"):
        dims(8, tp=2).mesh("tp")
    assert dims(8).mesh("tp") is None  # degree-1 axes never need a mesh
    assert dims(8).mesh("pp") is None  # pipeline parallel is an axis too (degree 1 here)
    with pytest.raises(KeyError, match="unknown mesh axis"):
        dims(8).mesh("vpp")


def test_sharding_config_is_a_pure_function():
    cfg = tiny()
    before = cfg.to_dict()
    out = set_glm_image_moe_sharding_config(cfg, loss_parallel=True, enable_sp=True, ep_degree=2)
    assert cfg.to_dict() == before and out is not cfg
    assert all(getattr(c, "sharding_config", None) is None for _, c, _, _ in cfg.traverse())
    declared = declared_shardings(out)
    attn = declared["layers.1.self_attn.kv_b_proj"]
    assert attn.params["weight"][TP] == Shard(0)  # column-wise over heads
    assert declared["layers.1.self_attn.o_proj"].params["weight"][TP] == Shard(1)
    assert declared["layers.1.self_attn.o_proj"].desired_outputs[TP] == Shard(1)  # SP: reduce-scatter
    assert declared["layers.1.mlp.experts"].params["gate_up_proj"][EP] == Shard(0)
    assert declared["layers.0.mlp.down_proj"].outputs[TP] == Partial()
    assert declared["norm"].params["weight"][TP] == Replicate()
    assert declared["lm_head"].use_local_output is False  # vocab-sharded logits for loss parallel
    assert declared["layers.0"].desired_inputs["x_BTD"][TP] == Shard(1)
    plain_cfg = set_glm_image_moe_sharding_config(cfg, loss_parallel=False, enable_sp=False, ep_degree=1)
    plain = declared_shardings(plain_cfg)
    assert "norm" not in plain and "layers.1.mlp.experts" not in plain
    assert plain["lm_head"].desired_outputs[TP] == Replicate()
    assert plain["layers.1.mlp"].desired_inputs["x"][TP] == Shard(1)  # the MoE routes its sequence chunk


def test_parallelize_rejects_a_model_sharded_for_another_layout():
    from hyper_parallel.config import CompileConfig, TrainingConfig
    from hyper_parallel.models.glm_image_moe_v2.parallelize import parallelize_glm_image_moe

    sharded = set_glm_image_moe_sharding_config(tiny(), loss_parallel=True, enable_sp=True, ep_degree=1)
    with torch.device("meta"):
        model = sharded.build()
    parallelism = ParallelismConfig(tensor_parallel_degree=2, enable_sequence_parallel=False)
    pd = ParallelDims.from_config(parallelism, 2)
    with pytest.raises(ValueError, match="sharded for another layout"):
        parallelize_glm_image_moe(
            model, parallel_dims=pd, training=TrainingConfig(), parallelism=parallelism,
            ac_config=ActivationCheckpointConfig(), compile_config=CompileConfig(),
        )  # fmt: skip


def test_split_batch_for_cp_keeps_images_and_global_cu_seqlens():
    T = 8
    ids = torch.tensor([[5, 9, 9, 7, 1, 2, 9, 3], [4, 4, 9, 9, 9, 6, 7, 8]])
    flat = (ids.reshape(-1) == 9).nonzero().squeeze(-1)
    batch = {
        "input_ids": ids, "labels": ids + 100, "position_ids": torch.arange(T).repeat(2, 1),
        "cu_seqlens": torch.tensor([0, 5, 8, 16], dtype=torch.int32), "max_seqlen": 8,
        "visual_indices": flat, "vq_codes": torch.arange(flat.numel()) + 10,
    }  # fmt: skip
    from hyper_parallel.models.glm_image_moe_v2 import GlmImageMoeModel

    split = GlmImageMoeModel.split_inputs_for_cp
    parts = [split_batch_for_cp(batch, r, 2, split_inputs=split, model_keys=GlmImageMoeModel.input_keys) for r in range(2)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], dim=1), ids)
    for p in parts:
        assert torch.equal(p["cu_seqlens"], batch["cu_seqlens"]) and p["max_seqlen"] == 8
        local = p["input_ids"].reshape(-1)
        assert torch.equal(local[p["visual_indices"]], torch.full_like(p["vq_codes"], 9))
    assert sorted(torch.cat([p["vq_codes"] for p in parts]).tolist()) == batch["vq_codes"].tolist()
    assert parts[1]["position_ids"][0, 0] == 4
    # [3, B, T] M-RoPE positions are split along T too
    mrope = {**batch, "position_ids": torch.arange(T).repeat(3, 2, 1)}
    assert split_batch_for_cp(mrope, 1, 2)["position_ids"].shape == (3, 2, 4)
    with pytest.raises(ValueError, match="not divisible by context_parallel_degree 3"):
        split_batch_for_cp(batch, 0, 3)


def test_expert_parallel_regroup_index():
    # received blocks [source p][local expert l]: p0 sends (2, 0, 1) rows, p1 sends (1, 3, 0)
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])
    assert _regroup_index(counts).tolist() == [0, 1, 3, 4, 5, 6, 2]


def test_layers_to_checkpoint():
    assert layers_to_checkpoint(5, ActivationCheckpointConfig(mode="none")) == []
    assert layers_to_checkpoint(5, ActivationCheckpointConfig(mode="full")) == [0, 1, 2, 3, 4]
    every_2nd = ActivationCheckpointConfig(mode="selective", selective_every_n_layers=2)
    assert layers_to_checkpoint(5, every_2nd) == [0, 2, 4]
    with pytest.raises(ValueError, match="selective_every_n_layers"):
        layers_to_checkpoint(5, ActivationCheckpointConfig(mode="selective", selective_every_n_layers=0))


def test_compile_per_layer_keeps_fqns_and_numerics():
    from hyper_parallel.config import CompileConfig
    from hyper_parallel.distributed.compile import apply_compile

    torch.manual_seed(0)
    eager = tiny().build()
    eager.init_weights()
    compiled = tiny().build()
    compiled.load_state_dict(eager.state_dict())
    names = [n for n, _ in compiled.named_parameters()]
    assert apply_compile(compiled.layers, CompileConfig(enable=True, backend="eager")) == 3
    assert [n for n, _ in compiled.named_parameters()] == names  # in place: FQNs unchanged
    assert all(layer._compiled_call_impl is not None for layer in compiled.layers)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ids = torch.randint(0, 63, (2, 8))
    a, b = eager(ids), compiled(ids)
    assert torch.equal(a, b)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # dynamo really traced the layers
    a.sum().backward()
    b.sum().backward()
    for (n, p), q in zip(eager.named_parameters(), compiled.parameters()):
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), n
    assert apply_compile(compiled.layers, CompileConfig(enable=False)) == 0
