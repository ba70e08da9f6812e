"""LoRA recipes: every ``*_lora_debug`` recipe builds with adapters where its family has experts, DeltaNet or MLA
projections, one trains 2 steps in-process (only adapters and modules_to_save move); the a3b LoRA recipes fit 2 x 80
GiB and 4 x 40 GiB in the dry run, whose LoRA line equals a hand count (the frozen base once, in bf16)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from hyper_parallel.models.common.lora_policy import apply_lora, lora_trainable_names
from hyper_parallel.config.manager import ConfigManager, available_recipes
from hyper_parallel.distributed.env import intra_op_threads
from hyper_parallel.dry_run import dry_run
from hyper_parallel.models.common.lora import is_lora_param

FAMILIES = ("glm_image_moe_v2", "qwen3_5_v2", "qwen3_5_moe_v2", "qwen3_vl_moe_v2")
# adapter parameters every family's debug recipe must have (its experts, DeltaNet or MLA projections)
MUST_ADAPT = {
    "glm_image_moe_v2": ("self_attn.q_a_proj.lora_A", "self_attn.kv_a_proj_with_mqa.lora_B",
                         "self_attn.kv_b_proj.lora_A", "mlp.experts.gate_up_proj_lora_A",
                         "mlp.experts.down_proj_lora_B", "shared_experts.up_proj.lora_A"),
    "qwen3_5_v2": ("self_attn.in_proj_qkv.lora_A", "self_attn.in_proj_z.lora_A", "self_attn.in_proj_b.lora_B",
                   "self_attn.in_proj_a.lora_A", "self_attn.out_proj.lora_B", "self_attn.q_proj.lora_A",
                   "mlp.down_proj.lora_B"),
    "qwen3_5_moe_v2": ("self_attn.in_proj_qkv.lora_A", "self_attn.out_proj.lora_B", "self_attn.o_proj.lora_A",
                       "mlp.experts.gate_up_proj_lora_B", "mlp.experts.down_proj_lora_A",
                       "shared_experts.gate_proj.lora_A"),
    "qwen3_vl_moe_v2": ("self_attn.q_proj.lora_A", "mlp.experts.gate_up_proj_lora_A", "mlp.down_proj.lora_B",
                        "blocks.0.attn.qkv.lora_A", "merger.linear_fc2.lora_B"),
}  # fmt: skip
GIB = float(1 << 30)
A3B_LORA = [("qwen3_5_moe", "qwen3_5_moe_a3b_lora"), ("glm_image_moe", "glm_image_moe_a3b_lora"),
            ("qwen3_vl_moe", "qwen3_vl_moe_a3b_lora")]  # fmt: skip


def _lora_debug_recipes(family: str) -> list[str]:
    registry = importlib.import_module(f"hyper_parallel.models.{family}.config_registry")
    return [r for r in available_recipes(registry) if r.endswith("_lora_debug")]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_lora_debug_recipe_builds_with_the_familys_adapters(family):
    recipes = _lora_debug_recipes(family)
    assert recipes, f"{family} has no *_lora_debug recipe"
    registry = importlib.import_module(f"hyper_parallel.models.{family}.config_registry")
    for recipe in recipes:
        cfg = getattr(registry, recipe)()
        assert cfg.lora.enabled and cfg.training.steps <= 20, recipe
        with torch.device("meta"):
            model = apply_lora(cfg.model, cfg.lora).build()
        names = [n for n, _ in model.named_parameters()]
        for suffix in MUST_ADAPT[family]:
            assert any(n.endswith(suffix) for n in names), f"{recipe}: no adapter {suffix}"
        trained = lora_trainable_names(model, cfg.lora.modules_to_save)
        assert trained and all(is_lora_param(n) or any(m in n for m in cfg.lora.modules_to_save) for n in trained)
        assert not any(n.startswith(("embed_tokens.", "lm_head.")) for n in trained), recipe


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


def test_glm_lora_debug_trains_two_steps_adapters_and_modules_to_save_only(tmp_path):
    """In-process, 2 steps of the GLM recipe (MLA + experts + the image path): the base does not move."""
    cfg = ConfigManager().parse_args([
        "--module", "glm_image_moe", "--config", "glm_image_moe_lora_debug", "--training.steps", "2",
        "--dump_folder", str(tmp_path), "--checkpoint.enable", "False", "--checkpoint.export_hf", "False",
        "--data.max_tokens_per_microbatch", "256", "--data.global_batch_tokens", "256",
    ])  # fmt: skip
    with intra_op_threads():  # as train.main: one thread on 2 CPUs (torch's default spins on a busy machine)
        _train_and_compare(cfg)


def _train_and_compare(cfg) -> None:
    trainer = cfg.build()
    try:
        before = {n: _local(p).clone() for n, p in trainer.model.named_parameters()}
        summary = trainer.train()
        moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(_local(p), before[n])}
        trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    finally:
        trainer.close()
    assert summary["steps"] == 2 and all(torch.isfinite(torch.tensor(summary["losses"])))
    assert moved and moved <= trainable, sorted(moved - trainable)[:5]
    assert any(".experts.gate_up_proj_lora_B" in n for n in moved) and any("q_a_proj.lora_B" in n for n in moved)
    assert "vq_to_llm_proj.weight" in moved  # modules_to_save trains in full
    assert all(is_lora_param(n) or n.startswith("vq_to_llm_proj.") for n in trainable)


def test_tiny_lora_dry_run_under_tp_keeps_the_frozen_base_in_bf16_without_gradients():
    """glm_image_moe_lora_debug on TP 2 x FSDP 2, bf16 (the layout the family tests also run): the simulated step
    runs with the adapters, the base is stored once in bf16 (routers and the FSDP-ignored codebook in fp32), and a
    rank's gradients are exactly its trained shards."""
    from hyper_parallel.dry_run import main

    report = main(["--module", "glm_image_moe", "--config", "glm_image_moe_lora_debug", "--world_size", "4",
                   "--parallelism.tensor_parallel_degree", "2", "--training.mixed_precision_param", "bfloat16"])  # fmt: skip
    cfg = importlib.import_module("hyper_parallel.models.glm_image_moe_v2.config_registry").glm_image_moe_lora_debug()
    with torch.device("meta"):
        base = cfg.model.build()
    fp32 = {
        n: p.numel() for n, p in base.named_parameters() if n.endswith("mlp.gate.weight") or n.startswith("vq_codebook")
    }
    base_numel = sum(p.numel() for p in base.parameters())
    saved = sum(p.numel() for n, p in base.named_parameters() if n.startswith("vq_to_llm_proj."))
    lora = report.lora
    assert lora.saved_numel == saved and lora.frozen_numel == base_numel - saved
    assert lora.frozen_bytes == 2 * (lora.frozen_numel - sum(fp32.values())) + 4 * sum(fp32.values())
    for mem in report.ranks:
        assert mem.grads == mem.params - mem.frozen_params > 0  # fp32 gradient shards of the trained parameters only
    assert report.peak["Total"] >= max(m.static for m in report.ranks)


def _adapter_numel_qwen3_5_moe(m, r: int) -> int:
    """Hand count of ("all-linear", "experts") adapters on a Qwen3.5-MoE text model: r * (in + out) per projection,
    E * r * (D + 2F) + E * r * (F + D) per routed-expert stack."""
    d, kv = m.hidden_size, m.num_key_value_heads * m.head_dim
    qk, v = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
    deltanet = (d + 2 * qk + v) + (d + v) + 2 * (d + m.linear_num_value_heads) + (v + d)  # qkv, z, b and a, out
    attn_q = m.num_attention_heads * m.head_dim
    attention = (d + 2 * attn_q) + 2 * (d + kv) + (attn_q + d)  # q (with its gate), k, v, o
    s = m.shared_expert_intermediate_size
    shared = 3 * (d + s)
    f = m.moe_intermediate_size
    experts = m.num_experts * ((d + 2 * f) + (f + d))
    n_attn = m.num_hidden_layers // m.full_attention_interval
    n_delta = m.num_hidden_layers - n_attn
    return r * (n_delta * deltanet + n_attn * attention + m.num_hidden_layers * (shared + experts))


@pytest.fixture(scope="module")
def a3b_lora_4x40():
    """Every a3b LoRA recipe sized (no simulated step) on 4 ranks of 40 GiB. Under plain FSDP the static state per
    rank halves from 2 to 4 ranks while the rest of the peak (one 8192-token micro-batch) stays, so 4 x 40 GiB is
    the tighter of the two targets (the recipes' tables: 9.5-15.5 GiB headroom there, 30-40 GiB on 2 x 80)."""
    out = {}
    for module, recipe in A3B_LORA:
        registry = importlib.import_module(f"hyper_parallel.models.{module}_v2.config_registry")
        out[recipe] = dry_run(getattr(registry, recipe)(), world_size=4, device_memory_gib=40, simulate=False)
    return out


def test_a3b_lora_memory_line_equals_a_hand_count(a3b_lora_4x40):
    from hyper_parallel.dry_run.report import format_report
    from hyper_parallel.models.qwen3_5_moe_v2.config_registry import qwen3_5_moe_a3b_lora

    cfg, world, report = qwen3_5_moe_a3b_lora(), 4, a3b_lora_4x40["qwen3_5_moe_a3b_lora"]
    dims = dict(hidden_size=2048, num_hidden_layers=40, full_attention_interval=4, num_attention_heads=16,
                num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                linear_key_head_dim=128, linear_value_head_dim=128, num_experts=256, moe_intermediate_size=512,
                shared_expert_intermediate_size=512)  # fmt: skip
    adapters = _adapter_numel_qwen3_5_moe(type("M", (), dims), cfg.lora.rank)
    with torch.device("meta"):
        base = cfg.model.build()  # the model without adapters
    base_numel = sum(p.numel() for p in base.parameters())
    routers = sum(p.numel() for n, p in base.named_parameters() if n.endswith("mlp.gate.weight"))  # kept fp32
    lora = report.lora
    assert lora.adapter_numel == adapters and lora.adapter_bytes == 4 * adapters
    assert lora.saved_numel == 0 and lora.frozen_numel == base_numel == report.model_numel - adapters
    frozen_bytes = 2 * (base_numel - routers) + 4 * routers  # once, in bf16: no fp32 master copy
    assert lora.frozen_bytes == frozen_bytes
    for mem in report.ranks:
        assert mem.frozen_params == pytest.approx(frozen_bytes / world, rel=2e-3)  # FSDP's shard padding
        assert mem.params - mem.frozen_params == pytest.approx(4 * adapters / world, rel=2e-3)  # fp32 adapters
        assert mem.grads == pytest.approx(4 * adapters / world, rel=2e-3)  # adapters only, fp32
        assert mem.optimizer == pytest.approx(8 * adapters / world, rel=2e-3)  # AdamW's two fp32 moments
    text = format_report(report)
    assert f"trains {adapters:,} adapter parameters" in text and f"frozen base {base_numel:,} parameters" in text
    assert f"{base_numel - routers:,} bfloat16, {routers:,} float32" in text


# the largest part of a simulated peak beyond the static state, over the recipes' tables (qwen3_5_moe 4 x 40: 10.85)
ACTIVATION_ALLOWANCE_GIB = 11.5


@pytest.mark.parametrize("module, recipe", A3B_LORA)
def test_a3b_lora_recipe_fits_4x40_and_2x80(module, recipe, a3b_lora_4x40):
    """Static state + the simulated step's share beyond it fit a 40 GiB rank of 4 (and so an 80 GiB rank of 2). The
    whole simulated steps take 5-12 s each on 2 cores (46 s for the six): ``HP_DRY_RUN_STEPS=1`` runs them (next
    test)."""
    report = a3b_lora_4x40[recipe]
    worst = max(m.static for m in report.ranks)
    assert worst + ACTIVATION_ALLOWANCE_GIB * GIB < 40 * GIB, (recipe, worst / GIB)
    assert report.lora is not None and report.lora.adapter_numel > 0 and report.lora.frozen_bytes > 0
    assert all(m.grads < 0.1 * m.frozen_params for m in report.ranks)  # no gradient for the frozen base


@pytest.mark.skipif(not os.environ.get("HP_DRY_RUN_STEPS"), reason="5-12 s per run: set HP_DRY_RUN_STEPS=1")
@pytest.mark.parametrize("world, gib", [(2, 80), (4, 40)])
@pytest.mark.parametrize("module, recipe", A3B_LORA)
def test_a3b_lora_recipe_simulated_step_fits(module, recipe, world, gib):
    registry = importlib.import_module(f"hyper_parallel.models.{module}_v2.config_registry")
    report = dry_run(getattr(registry, recipe)(), world_size=world, device_memory_gib=gib)
    assert report.fits and report.peak["Total"] < gib * GIB
    assert report.peak["Total"] - max(m.static for m in report.ranks) < ACTIVATION_ALLOWANCE_GIB * GIB
