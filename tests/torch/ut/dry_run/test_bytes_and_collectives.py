"""Dry run (``python -m hyper_parallel.dry_run``): per-rank bytes and the collectives of a step equal hand-computed
values on a tiny GlmImageMoe (FSDP, TP x FSDP, EP, HSDP with two micro-batches); the layer-scaled step equals the
full-depth one; invalid layouts fail with the Trainer's message; every registered recipe dry-runs. Every run is
one process on a fake process group (no peers, no data)."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import re

import pytest
import torch

from hyper_parallel.config import ConfigError
from hyper_parallel.config.manager import available_modules, available_recipes
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.dry_run import dry_run, main
from hyper_parallel.dry_run import step as dry_run_step
from hyper_parallel.dry_run.step import LayerPlan, layer_plan, simulate_step
from hyper_parallel.dry_run.world import MESH_DEVICE, fake_world, validate_layout
from hyper_parallel.models.glm_image_moe_v2.config_registry import glm_image_moe_a3b, glm_image_moe_debug
from hyper_parallel.models.glm_image_moe_v2.model import glm_image_moe_config
from hyper_parallel.protocols.model_spec import discover_model_spec

FP32 = 4
ADAMW_STATE = 2 * FP32  # exp_avg + exp_avg_sq per element
ADAMW_STEP = 4  # the fp32 ``step`` counter of every parameter tensor
BF16 = ("--training.mixed_precision_param", "bfloat16")


def _tiny(*, rep: int = 1, tp: int = 1, ep: int = 1, cp: int = 1):
    """The tiny recipe with a layout; data_parallel_shard_degree takes the rest of the world."""
    cfg = copy.deepcopy(glm_image_moe_debug())
    p = cfg.parallelism
    p.data_parallel_replicate_degree, p.tensor_parallel_degree, p.expert_parallel_degree = rep, tp, ep
    p.context_parallel_degree, p.data_parallel_shard_degree = cp, -1
    return cfg


def _params(cfg, *, ndim: bool = False) -> dict[str, int]:
    """FQN -> numel (or ndim) of the unsharded model (built on meta)."""
    with torch.device("meta"):
        model = cfg.model.build()
    return {n: p.ndim if ndim else p.numel() for n, p in model.named_parameters()}


def _divisor(fqn: str, layout: str) -> int:
    """How many ways the parallelize path splits a parameter (docs/design.md section 6, sharding.py), by hand."""
    if fqn == "vq_codebook.weight":
        return 1  # frozen, FSDP-ignored: whole on every rank
    if layout == "tp2_fsdp2":
        # sequence-parallel norms are replicated over tp and FSDP-sharded over dp_shard (2); the image
        # projection sits in the root unit on the dp_shard mesh. Everything else is split 4 ways:
        # TP x FSDP, or FSDP over a mesh that includes tp (latent projections, router, routed experts).
        sequence_parallel_norm = fqn.endswith("layernorm.weight") and ".self_attn." not in fqn
        if sequence_parallel_norm or fqn in ("norm.weight", "vq_to_llm_proj.weight"):
            return 2
    return 4  # fsdp4: 4-way FSDP; ep2: experts 2 (ep) x 2 (efsdp, dim 1), the rest 4-way FSDP


def _adamw_under_muon(fqn: str, ndim: int) -> bool:
    """Parameters Muon leaves to AdamW: 1-D ones, the embedding, the head and the routers (optimizer.py)."""
    return ndim < 2 or fqn.startswith(("embed_tokens.", "lm_head.")) or fqn.endswith("mlp.gate.weight")


@pytest.mark.parametrize(
    "layout, kw, optimizer",
    [
        ("fsdp4", {}, "adamw"),
        ("tp2_fsdp2", {"tp": 2}, "adamw"),
        ("ep2", {"ep": 2}, "adamw"),
        ("fsdp4", {}, "muon"),
    ],
)
def test_per_rank_bytes_equal_analytic_values(layout, kw, optimizer):
    cfg = _tiny(**kw)
    cfg.optimizer.name = optimizer
    report = dry_run(cfg, world_size=4, simulate=False)
    numels, ndims = _params(cfg), _params(cfg, ndim=True)
    trainable = {n for n in numels if n != "vq_codebook.weight"}
    local = {n: numels[n] // _divisor(n, layout) for n in numels}
    assert all(numels[n] % _divisor(n, layout) == 0 for n in numels)
    params = sum(local.values()) * FP32
    grads = sum(local[n] for n in trainable) * FP32
    if optimizer == "adamw":
        optim = sum(local[n] * ADAMW_STATE + ADAMW_STEP for n in trainable)
    else:  # Muon keeps one fp32 momentum buffer per element of the matrices it trains
        adamw = {n for n in trainable if _adamw_under_muon(n, ndims[n])}
        optim = sum(local[n] * ADAMW_STATE + ADAMW_STEP for n in adamw)
        optim += sum(local[n] * FP32 for n in trainable - adamw)
    for mem in report.ranks:
        assert (mem.params, mem.grads, mem.optimizer) == (params, grads, optim), (layout, mem)
    assert report.distinct_shard_numel == report.model_numel == sum(numels.values())


def test_cli_prints_exact_bytes_and_the_fsdp_step_volume(capsys):
    """FSDP 4, one step: every non-root unit is all-gathered twice (forward, backward re-gather), the root
    (final norm + image projection) once; every trainable parameter is reduce-scattered once, all in fp32."""
    report = main(["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--world_size", "4"])
    out = capsys.readouterr().out
    numels = _params(glm_image_moe_debug())
    trainable = sum(v for n, v in numels.items() if n != "vq_codebook.weight")
    root = numels["norm.weight"] + numels["vq_to_llm_proj.weight"]
    tensors = len(numels) - 1  # trainable parameter tensors (one AdamW step counter each)
    local = (trainable // 4) + numels["vq_codebook.weight"]
    optim = trainable // 4 * ADAMW_STATE + tensors * ADAMW_STEP
    expect = f"ranks 0-3: {local * FP32:,} / {trainable // 4 * FP32:,} / {optim:,}"
    assert expect in out, out
    comm = {(c.kind, c.axis): c for c in report.comm}
    assert set(comm) == {("all_gather", "dp_shard_cp"), ("reduce_scatter", "dp_shard_cp")}
    units = 1 + 4 + 1 + 1  # embedding, 4 layers, head, root
    ag, rs = comm["all_gather", "dp_shard_cp"], comm["reduce_scatter", "dp_shard_cp"]
    assert (ag.calls, ag.nbytes) == (2 * units - 1, (2 * trainable - root) * FP32)
    assert (rs.calls, rs.nbytes) == (units, trainable * FP32)
    assert ag.sent_bytes == ag.nbytes * 3 / 4
    assert report.peak["Total"] > report.ranks[0].static and "Activation" in report.peak


def test_tp_step_gathers_every_unit_over_tp_once_per_pass():
    """TP 2 x FSDP 2: MLA's latent projections and norms, the router and the routed experts (the weights a layer
    reduces over dp_shard x tp, ``efsdp``) form one FSDP unit per layer: gathered in forward and again in
    backward, and reduce-scattered once."""
    report = dry_run(_tiny(tp=2), world_size=4)
    numels = _params(glm_image_moe_debug())
    latent = ("q_a_proj.", "q_a_layernorm.", "kv_a_proj_with_mqa.", "kv_a_layernorm.", "mlp.gate.", "mlp.experts.")
    on_efsdp = sum(v for n, v in numels.items() if any(k in n for k in latent))
    units = 4  # one efsdp unit per layer (latent projections and norms; the MoE layers' router and experts too)
    comm = {(c.kind, c.axis): (c.calls, c.nbytes) for c in report.comm}
    assert comm["all_gather", "efsdp"] == (2 * units, 2 * on_efsdp * FP32)
    assert comm["reduce_scatter", "efsdp"] == (units, on_efsdp * FP32)


def test_hsdp_step_with_two_micro_batches_reduce_scatters_each_and_all_reduces_once():
    """HSDP 2 x 2, two micro-batches per step (Trainer default): gather and reduce-scatter every micro-batch,
    all-reduce the gradient shards across replicas once, after the last."""
    cfg = _tiny(rep=2)
    cfg.data = dataclasses.replace(cfg.data, global_batch_tokens=2 * 4 * cfg.data.max_tokens_per_microbatch)
    report = dry_run(cfg, world_size=4)
    numels = _params(cfg)
    trainable = sum(v for n, v in numels.items() if n != "vq_codebook.weight")
    root = numels["norm.weight"] + numels["vq_to_llm_proj.weight"]
    units = 7
    comm = {(c.kind, c.axis): (c.calls, c.nbytes) for c in report.comm}
    assert report.micro_batches_per_step == 2
    assert comm == {
        ("all_gather", "dp_shard_cp"): (2 * (2 * units - 1), 2 * (2 * trainable - root) * FP32),
        ("reduce_scatter", "dp_shard_cp"): (2 * units, 2 * trainable * FP32),
        ("all_reduce", "dp_replicate"): (units, trainable // 2 * FP32),
    }


def test_layer_scaled_step_equals_full_depth(monkeypatch):
    """Two shallow copies scaled per layer give the full-depth peak and collectives (EP: all-to-alls too)."""
    monkeypatch.setattr(dry_run_step, "FULL_DEPTH_MAX_LAYERS", 4)  # scale a 6-layer model (test speed)
    cfg = _tiny(ep=2)
    base = cfg.model
    cfg.model = glm_image_moe_config(
        vocab_size=base.vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=6, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, codebook_size=256,
        vq_embed_dim=32, placeholder_token_id=base.placeholder_token_id, n_group=2, topk_group=2,
    )  # fmt: skip
    micro = 2  # micro-batches per step
    cfg.data = dataclasses.replace(cfg.data, max_tokens_per_microbatch=128, global_batch_tokens=micro * 4 * 128)
    spec, pd = discover_model_spec(cfg.model_spec), ParallelDims.from_config(cfg.parallelism, 4)
    with fake_world(4, rank=0):
        pd.build_mesh(MESH_DEVICE)
        plan = layer_plan(cfg.model.layers)  # one dense layer, then two periods of one MoE layer (and three)
        assert plan.depths == (3, 4) and plan.representative("layers.5.mlp.gate.weight") == "layers.1.mlp.gate.weight"
        deeper = layer_plan(cfg.model.layers, buildable=lambda depth: depth >= 4)  # a model with a minimum depth
        assert deeper.depths == (4, 5)
        assert deeper.representative("layers.5.mlp.gate.weight") == "layers.1.mlp.gate.weight"
        scaled = simulate_step(spec, cfg, pd, plan)
        full = simulate_step(spec, cfg, pd, layer_plan(cfg.model.layers, full=True))
    assert scaled.peak == pytest.approx(full.peak, rel=1e-9) and full.peak["Activation"] > 0  # every category
    assert set(scaled.comm) == set(full.comm) and any(kind == "all_to_all" for kind, _, _ in full.comm)
    for key, (calls, nbytes) in full.comm.items():
        assert scaled.comm[key] == [pytest.approx(calls), pytest.approx(nbytes)], key
    # Balanced routing: per MoE layer and micro-batch the token rows (T*K slots x D fp32) cross the ep group four
    # times (dispatch, combine, and their backward), plus one exchange of the E int64 counts.
    (a2a,) = [v for (kind, _, _), v in full.comm.items() if kind == "all_to_all"]
    moe_layers, slots, dim, experts = 5, 128 * 2, 64, 8
    assert a2a == [micro * moe_layers * 5, micro * moe_layers * (4 * slots * dim * FP32 + experts * 8)]


def test_layer_scaled_peak_follows_the_moment_that_peaks_at_full_depth(monkeypatch):
    """EP 2, full recomputation, one micro-batch, a large vocabulary and large experts: the 3- and 4-layer copies peak
    at the loss (vocabulary-sized logits, few gradients yet), the 6-layer model at the end of its backward (expert
    gradient shards of five MoE layers). Scaling the shallow peaks themselves mixes the two moments (the qwen3_5_moe
    a3b EP 8 report once showed a peak below its own static memory); scaling each segment of the step gives the
    full-depth peak in every category. The optimizer step holds every gradient shard, experts' included: exactly
    the analytic per-rank bytes."""
    monkeypatch.setattr(dry_run_step, "FULL_DEPTH_MAX_LAYERS", 4)
    cfg = _tiny(ep=2)
    base = cfg.model
    cfg.model = glm_image_moe_config(
        vocab_size=8192, hidden_size=64, intermediate_size=128, moe_intermediate_size=2048, num_hidden_layers=6,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, codebook_size=256, vq_embed_dim=32,
        placeholder_token_id=base.placeholder_token_id, n_group=2, topk_group=2,
    )  # fmt: skip
    cfg.activation_checkpoint.mode = "full"
    cfg.training.mixed_precision_param = "bfloat16"
    cfg.data = dataclasses.replace(cfg.data, max_tokens_per_microbatch=256, global_batch_tokens=0)
    spec, pd = discover_model_spec(cfg.model_spec), ParallelDims.from_config(cfg.parallelism, 4)
    with fake_world(4, rank=0):
        pd.build_mesh(MESH_DEVICE)
        plan = layer_plan(cfg.model.layers)
        assert plan.depths == (3, 4) and (plan.head, plan.period) == (1, 1)
        low, high = (simulate_step(spec, cfg, pd, LayerPlan(6, (k,))) for k in plan.depths)
        full = simulate_step(spec, cfg, pd, layer_plan(cfg.model.layers, full=True))
    scaled = low.combine(high, plan)
    assert scaled.peak == pytest.approx(full.peak, rel=1e-9)
    # the moment moved: the shallow copies peak with no gradient shard yet, the full model with most of them
    assert low.peak["Sharded Grad"] < full.peak["Sharded Grad"] / 2
    numels = _params(cfg)
    grads = sum(v for n, v in numels.items() if n != "vq_codebook.weight") // 4 * FP32  # 4 ranks: FSDP, or ep x efsdp
    experts = sum(v for n, v in numels.items() if ".mlp.experts." in n) // 4 * FP32
    assert experts > grads / 2  # the expert shards dominate the gradients
    census = dry_run(cfg, world_size=4, simulate=False).ranks[0]
    assert census.grads == grads and full.peak["Total"] >= census.static
    (opt,) = [seg for key, seg in full.segments.items() if key[1] == "optimizer"]
    assert opt.categories["Sharded Grad"] == grads


@pytest.mark.parametrize(
    "world, kw",
    [
        (8, {"tp": 3}),  # the degrees do not divide the world size
        (8, {"ep": 3}),  # ep does not divide dp_shard x cp
        (8, {"tp": 8}),  # tp does not divide the 4 heads
        (8, {"tp": 2, "ep": 2}),  # expert parallel combined with tensor parallel is rejected
        (16, {"ep": 16}),  # ep does not divide the 8 routed experts
    ],
)
def test_invalid_layouts_fail_with_the_trainers_message(world, kw):
    cfg = _tiny(**kw)
    with pytest.raises(ConfigError) as real:  # what the Trainer runs before it builds anything
        validate_layout(discover_model_spec(cfg.model_spec), cfg, ParallelDims.from_config(cfg.parallelism, world))
    with pytest.raises(ConfigError) as dry:
        dry_run(cfg, world_size=world, simulate=False)
    assert str(dry.value) == str(real.value)


def test_a3b_on_64_ranks_sizes_every_shard_exactly():
    """Full-size recipe, meta only: FSDP over 64 ranks splits every trainable parameter 64 ways (all dims divide),
    the frozen codebook stays whole; the distinct shards add up to the 30,658,400,256 parameters (the nextn layer's
    643,706,112 included)."""
    report = main(["--module", "glm_image_moe", "--config", "glm_image_moe_a3b", "--world_size", "64", "--no_step"])
    codebook = 16384 * 2048
    assert report.model_numel == report.distinct_shard_numel == 30_658_400_256
    trainable = report.model_numel - codebook
    assert trainable % 64 == 0
    tensors = len(_params(glm_image_moe_a3b())) - 1  # trainable parameter tensors
    for mem in report.ranks:  # bf16 compute, but FSDP keeps fp32 shards (and fp32 gradient shards)
        assert mem.params == (trainable // 64 + codebook) * FP32
        assert mem.grads == trainable // 64 * FP32
        # the optimizer stepped a 2-layer copy; the 45 deeper MoE layers take layer 1's state layout
        assert mem.optimizer == trainable // 64 * ADAMW_STATE + tensors * ADAMW_STEP
    assert report.peak == {} and report.comm == []


def test_a3b_invalid_layout_fails_before_anything_is_built():
    """Full-size recipe, meta only: TP 8 does not divide the 20 heads (context parallel would not need to:
    beyond the heads per TP rank it gathers K/V)."""
    argv = ["--module", "glm_image_moe", "--config", "glm_image_moe_a3b", "--world_size", "16",
            "--parallelism.tensor_parallel_degree", "8", "--parallelism.context_parallel_degree", "2"]  # fmt: skip
    message = "tensor_parallel_degree (8) does not divide the model's n_heads (20)"
    with pytest.raises(ConfigError, match=re.escape(message)):
        main(argv)


def _recipes(debug: bool) -> list[tuple[str, str]]:
    """Every (module, recipe) of every model package, tiny (``*debug*``) or full-size. The LoRA variants
    (``*_lora*``: the family's recipe plus ``--lora.*``) are dry-run by tests/torch/ut/models/test_lora_recipes.py, on
    fewer layouts (each simulated step here costs ~5 s of CPU)."""
    found = []
    for module in available_modules():
        try:
            registry = importlib.import_module(f"hyper_parallel.models.{module}.config_registry")
        except ModuleNotFoundError:
            continue  # the short alias of a ``*_v2`` package
        found += [(module, r) for r in available_recipes(registry) if ("debug" in r) == debug and "_lora" not in r]
    return found


@pytest.mark.parametrize("module, recipe", _recipes(debug=True))
@pytest.mark.parametrize(
    "layout",
    [
        # bf16 compute (routers compute in fp32 inside their layer's unit) with the family's EP placements
        pytest.param(["--world_size", "2", "--parallelism.expert_parallel_degree", "2", *BF16], id="ep2_bf16"),
        pytest.param(["--world_size", "2"], id="fsdp2", marks=pytest.mark.slow),
        pytest.param(
            ["--world_size", "4", "--parallelism.tensor_parallel_degree", "2", *BF16],
            id="tp2_fsdp2_bf16",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_every_tiny_recipe_dry_runs(module, recipe, layout):
    """Any registered family (also ones added later) sizes and simulates with nothing model-specific here."""
    try:
        report = main(["--module", module, "--config", recipe, *layout])
    except ConfigError as e:  # the family's own layout check declines this layout (the real run would, too)
        if "--parallelism.expert_parallel_degree" not in layout:
            pytest.skip(f"{module}.{recipe} does not take this layout: {e}")
        report = main(["--module", module, "--config", recipe, "--world_size", "2", *BF16])  # a dense model
    assert report.distinct_shard_numel == report.model_numel
    assert report.peak["Total"] >= max(m.static for m in report.ranks) > 0


@pytest.mark.slow
@pytest.mark.parametrize("module, recipe", _recipes(debug=False))
def test_every_full_size_recipe_sizes_on_64_ranks(module, recipe):
    """Full-size recipes on 64 simulated ranks, meta only (the simulated step is left out to stay fast)."""
    try:
        report = main(["--module", module, "--config", recipe, "--world_size", "64", "--no_step"])
    except ConfigError as e:
        pytest.skip(f"{module}.{recipe} does not take 64 ranks: {e}")
    assert report.distinct_shard_numel == report.model_numel
