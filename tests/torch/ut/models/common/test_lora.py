"""LoRA core (issue 32): adapter math and gradients against a merged ``W + scale * B A`` reference, the frozen base
(no gradient, no base-weight matmul in the backward, no optimizer state), fresh adapters leave the logits exactly
unchanged (also when the base comes from an HF folder without adapter keys), in-process LoRA training of two
families through the trainer, and target-name errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.config import ActivationCheckpointConfig
from hyper_parallel.config.errors import ConfigError
from hyper_parallel.config.lora import LoRAConfig
from hyper_parallel.config.manager import ConfigManager
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.lora import LoRA, init_adapters_, is_lora_param
from hyper_parallel.models.common.lora_policy import (
    LoRAExport,
    LoRAPolicy,
    apply_lora,
    lora_targets,
    lora_trainable_names,
)
from hyper_parallel.models.common.moe import GroupedExperts
from hyper_parallel.models.glm_image_moe_v2.config_registry import glm_image_moe_debug
from hyper_parallel.models.qwen3_5_moe_v2.config_registry import qwen3_5_moe_debug
from hyper_parallel.models.qwen3_vl_moe_v2.config_registry import qwen3_vl_moe_debug
from hyper_parallel.hf import load_hf_weights, save_pretrained
from hyper_parallel.hf.convert import full_tensor
from hyper_parallel.protocols.model_spec import discover_model_spec


class _OpShapes(TorchDispatchMode):
    """Records the output shapes of every matmul-like op dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if any(k in str(func) for k in ("mm", "addmm", "linear", "bmm")) and isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


def _random_adapters_(module: torch.nn.Module) -> None:
    """Non-zero B (a fresh adapter's B is 0, which would hide errors in the B path)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.15 if is_lora_param(name) else 0.1))


def _freeze_base(module: torch.nn.Module) -> None:
    for name, p in module.named_parameters():
        p.requires_grad_(is_lora_param(name))


@pytest.mark.parametrize("rslora", [False, True])
def test_linear_adapter_matches_merged_weight(rslora):
    lora = LoRA.Config(rank=4, alpha=6.0, rslora=rslora)
    assert lora.scale == (6.0 / 2.0 if rslora else 6.0 / 4.0)
    lin = Linear.Config(bias=True, lora=lora).build(in_features=12, out_features=8)
    _random_adapters_(lin)
    _freeze_base(lin)
    # O(1) values: the 1e-6 bar is then a few fp32 ulps
    x = (0.5 * torch.randn(5, 12)).requires_grad_()
    cot = 0.1 * torch.randn(5, 8)
    loss = (lin(x) * cot).sum()
    with _OpShapes() as ops:  # the backward only
        loss.backward()
    # reference: autograd through the merged weight, in float64 (the exact math; ours is fp32)
    a, b = (lin.lora_A.detach().double().requires_grad_(), lin.lora_B.detach().double().requires_grad_())
    x_ref = x.detach().double().requires_grad_()
    y_ref = F.linear(x_ref, lin.weight.detach().double() + lora.scale * b @ a, lin.bias.detach().double())
    (y_ref * cot.double()).sum().backward()
    assert (lin(x).double() - y_ref).abs().max().item() <= 1e-6
    for got, want in ((lin.lora_A.grad, a.grad), (lin.lora_B.grad, b.grad), (x.grad, x_ref.grad)):
        assert (got.double() - want).abs().max().item() <= 1e-6
    assert lin.weight.grad is None and lin.bias.grad is None
    assert (8, 12) not in ops.shapes, "the backward computed a gradient of the frozen weight [out, in]"


def _experts_reference(ex: GroupedExperts, x_SD: torch.Tensor, counts: list[int], leaves: dict[str, torch.Tensor]):
    """Per expert: merged weights ``W_e + scale * B_e A_e`` (a shared adapter: index 0), plain SwiGLU, in float64."""
    scale, shared = ex.config.lora.scale, ex.config.lora.share_experts
    out, start = [], 0
    for e, n in enumerate(counts):
        k = 0 if shared else e
        b_gu, a_gu, b_d, a_d = (leaves[f"{w}_lora_{m}"][k] for w in ("gate_up_proj", "down_proj") for m in "BA")
        w_gu = ex.gate_up_proj.detach()[e].double() + scale * b_gu @ a_gu
        w_d = ex.down_proj.detach()[e].double() + scale * b_d @ a_d
        gate, up = F.linear(x_SD[start : start + n], w_gu).chunk(2, dim=-1)
        out.append(F.linear(F.silu(gate) * up, w_d))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize(
    "share, rslora, impl",
    [(False, False, "grouped_mm"), (False, True, "loop"), (True, False, "grouped_mm"), (True, True, "loop")],
)
def test_experts_adapters_match_merged_weights(share, rslora, impl):
    lora = LoRA.Config(rank=4, alpha=8.0, rslora=rslora, share_experts=share)
    ex = GroupedExperts.Config(hidden_dim=8, grouped_mm_impl=impl, lora=lora).build(dim=16, num_experts=4)
    stacks = 1 if share else 4
    shapes = [tuple(getattr(ex, f"{w}_lora_{m}").shape) for w in ("gate_up_proj", "down_proj") for m in "AB"]
    assert shapes == [(stacks, 4, 16), (stacks, 16, 4), (stacks, 4, 8), (stacks, 16, 4)]
    _random_adapters_(ex)
    _freeze_base(ex)
    counts = [3, 0, 5, 4]  # an expert without rows too
    x = (0.5 * torch.randn(sum(counts), 16)).requires_grad_()
    cot = 0.1 * torch.randn(sum(counts), 16)
    y = ex(x, torch.tensor(counts))
    with _OpShapes() as ops:  # the backward only
        (y * cot).sum().backward()
    names = ("gate_up_proj_lora_A", "gate_up_proj_lora_B", "down_proj_lora_A", "down_proj_lora_B")
    leaves = {n: getattr(ex, n).detach().double().requires_grad_() for n in names}
    x_ref = x.detach().double().requires_grad_()
    y_ref = _experts_reference(ex, x_ref, counts, leaves)
    (y_ref * cot.double()).sum().backward()
    assert (y.double() - y_ref).abs().max().item() <= 1e-6
    for n in names:
        assert (getattr(ex, n).grad.double() - leaves[n].grad).abs().max().item() <= 1e-6, n
    assert (x.grad.double() - x_ref.grad).abs().max().item() <= 1e-6
    assert ex.gate_up_proj.grad is None and ex.down_proj.grad is None
    # no matmul of the backward produced a base-weight gradient (whole stack or one expert's slice)
    for shape in ((4, 16, 16), (4, 16, 8), (16, 16), (16, 8)):
        assert shape not in ops.shapes, f"a {shape} matmul output: the frozen experts got a weight gradient"


def test_adapter_init_and_dropout():
    lin = Linear.Config(lora=LoRA.Config(rank=8, alpha=8.0, dropout=0.5)).build(in_features=64, out_features=16)
    ex = GroupedExperts.Config(hidden_dim=8, lora=LoRA.Config(rank=4, alpha=4.0)).build(dim=16, num_experts=2)
    torch.manual_seed(0)
    lin.init_weights()
    ex.init_weights()
    for a in (lin.lora_A, ex.gate_up_proj_lora_A, ex.down_proj_lora_A):  # PEFT: kaiming-uniform(a=sqrt(5)) on [r, in]
        bound = 1 / math.sqrt(a.shape[-1])
        assert a.abs().max() <= bound and a.abs().max() > 0.8 * bound
    assert not lin.lora_B.any() and not ex.gate_up_proj_lora_B.any() and not ex.down_proj_lora_B.any()
    _random_adapters_(lin)
    x = torch.randn(4, 64)
    lin.eval()
    assert torch.equal(lin(x), F.linear(x, lin.weight) + 1.0 * (x @ lin.lora_A.T) @ lin.lora_B.T)
    lin.train()
    assert not torch.allclose(lin(x), lin(x))  # dropout on the adapter's input in training
    with pytest.raises(ValueError, match="no dropout"):
        lora = LoRA.Config(rank=4, alpha=4.0, dropout=0.1)
        GroupedExperts.Config(hidden_dim=8, lora=lora).build(dim=16, num_experts=2)


def _logits(model, ids):
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("recipe, targets", [
    (qwen3_5_moe_debug, ("all-linear", "experts")),
    (glm_image_moe_debug, ("all-linear", "experts", "vq_to_llm_proj")),
])  # fmt: skip
def test_fresh_adapters_keep_the_base_logits(recipe, targets, tmp_path):
    """B = 0 at init: a LoRA model equals its base exactly, here with the base read from an HF folder that has no
    adapter keys (the loader neither reports them missing nor runs a whole-model init for them; ``init_adapters_``,
    which the trainer calls after the load, gives them PEFT's values)."""
    run = recipe()
    spec = discover_model_spec(run.model_spec)
    torch.manual_seed(0)
    base = run.model.build()
    base.init_weights()
    save_pretrained(base, tmp_path, spec=spec)
    lora_cfg = apply_lora(run.model, LoRAConfig(rank=4, targets=targets, share_experts=recipe is glm_image_moe_debug))
    model = lora_cfg.build()
    load_hf_weights(model, str(tmp_path), spec=spec, init_missing=lambda: pytest.fail("the folder fills the whole base"))
    assert init_adapters_(model, seed=0) > 0
    adapters = {n: p for n, p in model.named_parameters() if is_lora_param(n)}
    assert len(adapters) > 0 and all(not p.any() for n, p in adapters.items() if "lora_B" in n)
    assert all(p.abs().sum() > 0 for n, p in adapters.items() if "lora_A" in n)
    ids = torch.randint(0, 500, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(_logits(model, ids), _logits(base, ids))


def _train(argv: list[str], check) -> None:
    """What ``hyper_parallel.train.main`` does (parse, build, train, close), with ``check(trainer, start, summary)``
    looking inside before the trainer is closed (``main`` returns the summary only)."""
    trainer = ConfigManager().parse_args(argv).build()
    try:
        # every step trains on the same batch, so its loss must go down (fresh batches would make 3 steps noisy)
        batch = trainer.data.next_step()
        trainer.data.next_step = lambda: [dict(mb) for mb in batch]
        start = {n: full_tensor(p.detach()).clone() for n, p in trainer.model.named_parameters()}
        check(trainer, start, trainer.train())
    finally:
        trainer.close()


@pytest.mark.parametrize("module, recipe, targets", [
    ("qwen3_5_moe", "qwen3_5_moe_debug", ["in_proj_qkv", "out_proj", "q_proj", "o_proj", "shared_expert", "experts"]),
    ("glm_image_moe", "glm_image_moe_debug", ["q_b_proj", "kv_b_proj", "gate_proj", "down_proj", "experts"]),
])  # fmt: skip
def test_lora_training_moves_only_adapters(module, recipe, targets, tmp_path):
    # GLM: the base from an HF folder (no adapter keys in it) and a module trained in full; Qwen: random init, and
    # model.freeze composes with LoRA (layer 0's adapters stay frozen too)
    base_sd = None
    if module == "glm_image_moe":
        torch.manual_seed(3)
        base = glm_image_moe_debug().model.build()
        base.init_weights()
        save_pretrained(base, tmp_path / "base", spec=discover_model_spec(module))
        base_sd = base.state_dict()
        extra = ["--lora.modules_to_save", "vq_to_llm_proj", "--checkpoint.initial_load_path", str(tmp_path / "base")]
    else:
        extra = ["--model.freeze", "layers.0.*"]
    argv = [
        "--module", module, "--config", recipe, "--training.steps", "3", "--lr_scheduler.warmup_steps", "0",
        "--optimizer.lr", "1e-2", "--data.max_tokens_per_microbatch", "128", "--data.global_batch_tokens", "128",
        "--checkpoint.no_enable", "--checkpoint.no_export_hf", "--metrics.log_freq", "1", "--dump_folder", str(tmp_path),
        "--lora.rank", "4", "--lora.alpha", "8", "--lora.targets", *targets, *extra,
    ]  # fmt: skip

    def check(trainer, start, summary):
        assert summary["steps"] == 3 and summary["last_loss"] < summary["first_loss"], summary
        trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
        frozen_by_model = {n for n in trainer.lora_trainable if n.startswith("layers.0.") and module == "qwen3_5_moe"}
        assert trained == set(trainer.lora_trainable) - frozen_by_model and trained
        assert module != "qwen3_5_moe" or frozen_by_model
        assert all(is_lora_param(n) or n.startswith("vq_to_llm_proj.") for n in trained)
        if module == "glm_image_moe":
            assert "vq_to_llm_proj.weight" in trained
            assert trainer.run_model.folder is not None and trainer.run_model.differences == []  # LoRA is no difference
            assert all(torch.equal(start[k], v) for k, v in base_sd.items() if k in start), "not the folder's base"
            assert not [k for k in start if is_lora_param(k) and "lora_B" in k and start[k].any()]
        assert any(n.endswith("experts.gate_up_proj_lora_A") for n in trained)
        for name, p in trainer.model.named_parameters():
            changed = not torch.equal(full_tensor(p.detach()), start[name])
            if name in trained:
                assert changed or "lora_A" in name and p.grad is not None, f"{name} did not train"
            else:
                assert not changed, f"frozen {name} changed"
                assert p.grad is None, f"frozen {name} has a gradient"
        # the optimizer holds state for the trained parameters only
        state_ids = {id(p) for opt in trainer.optimizers for p in opt.state}
        group_ids = {id(p) for g in trainer.optimizers.param_groups for p in g["params"]}
        assert state_ids == group_ids == {id(p) for n, p in trainer.model.named_parameters() if n in trained}

    _train(argv, check)


def test_targets_and_errors():
    model = qwen3_5_moe_debug().model
    paths = lora_targets(model, ["all-linear"])
    assert "layers.0.self_attn.in_proj_qkv" in paths and "layers.3.self_attn.q_proj" in paths
    assert "layers.0.mlp.shared_experts.gate_proj" in paths
    assert not [p for p in paths if p.endswith(("experts", "shared_expert_gate")) or p.startswith(("lm_head", "mtp"))]
    assert lora_targets(model, ["shared_expert"]) == lora_targets(model, ["shared_experts"])
    shared = lora_targets(model, ["shared_expert"])
    assert {p.rsplit(".", 1)[1] for p in shared} == {"gate_proj", "up_proj", "down_proj"}
    assert lora_targets(model, ["experts"]) == [f"layers.{i}.mlp.experts" for i in range(4)]
    for bad, why in (("qproj", "no module of this model"), ("q_a_proj", "no module"), ("lm_head", "takes no adapter"),
                     ("gate", "takes no adapter"), ("embed_tokens", "takes no adapter")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"'{bad}'.*{why}.*Targets that exist: all-linear.*in_proj_qkv"):
            apply_lora(model, LoRAConfig(rank=4, targets=("q_proj", bad)))
    with pytest.raises(ConfigError, match="modules_to_save 'vq_proj' names no module"):
        apply_lora(model, LoRAConfig(rank=4, modules_to_save=("vq_proj",)))
    run = qwen3_5_moe_debug()  # adapter dropout under AC needs the replayed RNG (else other masks in the recompute)
    run.lora, run.activation_checkpoint = LoRAConfig(rank=4, dropout=0.1), ActivationCheckpointConfig(mode="full")
    with pytest.raises(ValueError, match="preserve_rng_state"):
        run.validate()
    run.activation_checkpoint.preserve_rng_state = True
    run.validate()
    assert "q_a_proj" in lora_targets(glm_image_moe_debug().model, ["q_a_proj"])[0]
    vl = qwen3_vl_moe_debug().model
    assert lora_targets(vl, ["merger"]) == ["visual.merger.linear_fc1", "visual.merger.linear_fc2"]
    vision = [p for p in lora_targets(vl, ["all-linear"]) if p.startswith("visual.")]
    assert "visual.blocks.0.attn.qkv" in vision and "visual.deepstack_merger_list.0.linear_fc2" in vision
    assert not [p for p in vision if "patch_embed" in p]


def test_apply_lora_is_pure_and_not_a_model_difference():
    model = glm_image_moe_debug().model
    before = model.to_dict()
    new = apply_lora(model, LoRAConfig(rank=4, targets=("q_b_proj", "experts"), dropout=0.1))
    assert model.to_dict() == before and model.layers[1].self_attn.q_b_proj.lora is None
    assert new.layers[1].self_attn.q_b_proj.lora == LoRA.Config(rank=4, alpha=16.0, dropout=0.1)
    assert new.layers[1].mlp.experts.lora.dropout == 0.0  # PEFT allows none on the fused experts
    assert new.layers[1].self_attn.o_proj.lora is None
    assert apply_lora(model, LoRAConfig()) is model
    # the trained names of a built model
    built = dataclasses.replace(new).build()
    names = lora_trainable_names(built, ["lm_head"])
    assert "lm_head.weight" in names and "layers.1.mlp.experts.down_proj_lora_B" in names
    assert not [n for n in names if not is_lora_param(n) and not n.startswith("lm_head")]
    # --lora.* is its own group: the model fields the user set do not include it
    argv = ["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--lora.rank", "4"]
    run = ConfigManager().parse_args(argv)
    assert run.lora.rank == 4 and not [f for f in run.explicit_model_fields if "lora" in f]
    assert all(c.lora is None for _, c, _, _ in run.model.traverse(Linear.Config))



def test_lora_policy_answers_every_lora_question(tmp_path):
    model_cfg = glm_image_moe_debug().model
    source = tmp_path / "source.json"
    source.write_text("not json: a run without LoRA never reads it")
    off = LoRAPolicy(LoRAConfig(), "folder")
    with torch.device("meta"):
        plain = off.apply(model_cfg).build()
    assert off.apply(model_cfg) is model_cfg and off.trainable_names(plain) == frozenset()
    trained_before = [n for n, p in plain.named_parameters() if p.requires_grad]
    off.freeze(plain, ())
    assert [n for n, p in plain.named_parameters() if p.requires_grad] == trained_before and trained_before
    assert off.saves_frozen and not off.base_from_folder
    assert off.export_form(["lm_head.weight"]) is None and off.init_adapters(plain, 0) == 0
    off.check_resume(source, lambda: 1 / 0)  # neither the file nor the listing is read

    lora = LoRAConfig(rank=4, targets=("q_b_proj",), modules_to_save=("lm_head",), export_merged=True)
    from_folder, random_base = LoRAPolicy(lora, "/models/glm"), LoRAPolicy(lora, "")
    with torch.device("meta"):
        model = from_folder.apply(model_cfg).build()
    trainable = from_folder.trainable_names(model)
    assert trainable == lora_trainable_names(model, ["lm_head"]) and "lm_head.weight" in trainable
    from_folder.freeze(model, trainable)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    assert from_folder.targets(model_cfg) == lora_targets(model_cfg, ["q_b_proj"])
    assert from_folder.adapter == LoRA.Config(rank=4, alpha=16.0) and from_folder.adapter.scale == 4.0
    assert from_folder.base_from_folder and not from_folder.saves_frozen
    assert not random_base.base_from_folder and random_base.saves_frozen
    assert from_folder.export_form(trainable) == LoRAExport(
        vllm=False, merged=True, base_model_name_or_path="/models/glm", modules_to_save=["lm_head.weight"]
    )
    summary = from_folder.summary(model, model_cfg, "bfloat16")
    assert summary.startswith("LoRA rank 4 (scale 4) on 4 projections (q_b_proj): ") and "(lm_head)" in summary

    # the resume guard: an adapters-only run (started from a folder) resumed without it
    from_folder.check_resume(source, lambda: 1 / 0)  # the base comes from the folder again: nothing to check
    source.write_text('{"initial_load_path": "/models/glm"}')
    random_base.check_resume(source, lambda: False)  # no checkpoint yet: a fresh start
    with pytest.raises(ValueError, match="resume with --checkpoint.initial_load_path /models/glm"):
        random_base.check_resume(source, lambda: True)
    source.write_text('{"initial_load_path": ""}')
    random_base.check_resume(source, lambda: True)  # it started from a random base: its checkpoints hold it

def test_lora_under_compile_and_activation_checkpointing_equals_eager(tmp_path):
    """torch.compile (aot_eager: AOTAutograd traces the adapters' forward and backward; inductor's C++ build is too
    slow on this CPU) over fully checkpointed layers trains the same adapters as eager, and the base stays frozen."""
    results = {}
    for name, extra in {"eager": [], "compiled": ["--compile.enable", "--compile.backend", "aot_eager",
                                                  "--activation_checkpoint.mode", "full"]}.items():  # fmt: skip
        argv = [
            "--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--training.steps", "2",
            "--lr_scheduler.warmup_steps", "0", "--optimizer.lr", "1e-2", "--data.max_tokens_per_microbatch", "128",
            "--data.global_batch_tokens", "128", "--checkpoint.no_enable", "--checkpoint.no_export_hf",
            "--dump_folder", str(tmp_path / name), "--lora.rank", "4", "--lora.alpha", "8",
            "--lora.targets", "in_proj_qkv", "o_proj", "shared_expert", "experts", *extra,
        ]  # fmt: skip

        def check(trainer, start, summary, name=name):
            grads = [n for n, p in trainer.model.named_parameters() if p.grad is not None and not p.requires_grad]
            assert not grads, grads[:3]
            clean = {n: n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
                     for n, _ in trainer.model.named_parameters()}  # fmt: skip
            after = {clean[n]: full_tensor(p.detach()).clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
            moved = max((after[clean[n]] - start[n]).abs().max().item() for n in start if clean[n] in after)
            results[name] = (summary, after, moved)

        _train(argv, check)
    (eager, eager_p, moved), (compiled, compiled_p, _) = results["eager"], results["compiled"]
    assert abs(eager["last_loss"] - compiled["last_loss"]) < 1e-5, (eager, compiled)
    assert eager_p.keys() == compiled_p.keys() and eager_p
    diff = max((eager_p[k] - compiled_p[k]).abs().max().item() for k in eager_p)
    print(f"adapters moved up to {moved:.3g}; compiled vs eager {diff:.3g}")
    # AdamW's early steps are sign-like: fp32 reassociation in the compiled graph moves a near-zero gradient's update
    # by a fraction of one step, far below a missing or wrong adapter's effect (a whole step, and the loss)
    assert moved > 1e-3 and diff < 1e-2 * moved, (diff, moved)
