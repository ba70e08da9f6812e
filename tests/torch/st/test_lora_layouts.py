"""LoRA under every layout, and its checkpoints (issue 32), through the real Trainer (``lora_jobs``): the tiny
Qwen3.5-MoE of ``qwen3_5_moe_debug`` from an HF folder our export wrote, adapters on every linear projection
(gated attention, Gated DeltaNet, shared expert and its gate) and on the routed experts, the LM head trained in
full.

- FSDP 2, TP 2 (+SP, loss parallel), EP 2, CP 2 with full recomputation, FSDP 4 x EP 2, and EP 2 with one
  adapter shared by every expert give the one-process losses (1e-5, 3 steps) and every trainable parameter's
  gradient after steps 1 and 2 (1e-5 relative; the A gradients are zero until B moved); so does GlmImageMoe under
  TP 2 (2 steps), whose MLA latent projections are plain linears inside the TP region;
- the adapters' placements follow their base: a column-wise base shards ``lora_B`` ``Shard(0)`` over tp with
  ``lora_A`` replicated, a row-wise base ``lora_A`` ``Shard(1)`` with ``lora_B`` replicated; the experts' stacks
  are ``Shard(0)`` over ep (replicated when shared);
- the base is frozen in the training dtype (bf16 under ``--training.mixed_precision_param bfloat16``, adapters
  fp32), has no gradient, and the optimizer holds the trainable parameters only;
- a checkpoint of a run from an HF folder holds the adapters, the LM head and the buffers, not the base; a
  4-rank run resumed on 2 ranks (TP 2) re-reads the base from the folder and continues the uninterrupted run;
- resuming such a checkpoint without the folder, or after the folder's config.json changed, is refused;
- a run with a random base (no folder, the toy recipes) saves its base, and resumes after ``kill -9`` exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.torch.st import launch
from tests.torch.st.grad_check import assert_grads_match
from tests.torch.st.lora_jobs import (
    CAPTURE,
    LAYOUTS,
    argv,
    checkpoint_keys,
    error_job,
    glm_argv,
    runs_job,
    write_hf_folder,
)

pytestmark = pytest.mark.slow

TWO_RANKS = ("fsdp2", "tp2", "ep2", "cp2_ac")
RESUME_STEPS = KILL_STEPS = 4
"""Runs that are resumed (from step 2) take 4 steps: step 4 is the first that an optimizer state loaded wrong changes."""


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def folder(tmp) -> str:
    return write_hf_folder(str(tmp / "hf"))


@pytest.fixture(scope="module")
def reference(pool, tmp, folder):
    """One process: from the folder (per-expert and shared expert adapters), and from a random base."""
    runs = {
        "hf": argv(tmp / "ref_hf", folder=folder, steps=RESUME_STEPS),
        "shared": argv(tmp / "ref_shared", "--lora.share_experts", folder=folder),
        "random": argv(tmp / "ref_random", steps=KILL_STEPS),
        "glm": glm_argv(tmp / "ref_glm"),
    }
    return pool.run(runs_job, 1, runs, timeout=600.0)[0]


@pytest.fixture(scope="module")
def two_ranks(pool, tmp, folder):
    runs = {name: argv(tmp / name, *LAYOUTS[name], folder=folder) for name in TWO_RANKS}
    runs["glm_tp2"] = glm_argv(tmp / "glm_tp2", *LAYOUTS["tp2"])
    runs["ep2_shared"] = argv(tmp / "ep2_shared", *LAYOUTS["ep2"], "--lora.share_experts", folder=folder)
    # mixed precision: one step is enough to see what is stored in which dtype
    runs["tp2_bf16"] = argv(tmp / "tp2_bf16", *LAYOUTS["tp2"], "--training.mixed_precision_param", "bfloat16",
                            folder=folder, steps=1)  # fmt: skip
    return pool.run(runs_job, 2, runs, timeout=600.0)[0]


@pytest.fixture(scope="module")
def four_ranks(pool, tmp, folder):
    """FSDP 4 x EP 2 from the folder, 4 steps, checkpointing every 2 steps."""
    runs = {"fsdp2_ep2": argv(tmp / "w4", *LAYOUTS["fsdp2_ep2"], folder=folder, checkpoint=2, steps=RESUME_STEPS)}
    return pool.run(runs_job, 4, runs, timeout=600.0)[0]["fsdp2_ep2"]


def _matches(out: dict, ref: dict, label: str) -> None:
    dloss = [abs(a - b) for a, b in zip(out["losses"], ref["losses"][: len(out["losses"])], strict=True)]
    print(f"\n{label} ({out['parallel_dims']}): max |dloss| {max(dloss):.2e}")
    assert max(dloss) <= 1e-5, dloss
    for step in CAPTURE:
        print(f"  step {step}: " + assert_grads_match(out["grads"][step], ref["grads"][step]))
    assert ref["losses"][-1] < ref["losses"][0]


def _frozen_base(out: dict, dtype: str = "torch.float32") -> None:
    assert all("lora_" in n or n.startswith("lm_head.") for n in out["trainable"]), out["trainable"]
    assert out["frozen_count"] > 0 and out["frozen_with_grad"] == []
    # routers compute in fp32 whatever the policy (their units keep fp32 weights)
    stored = {n: d for n, d in out["frozen_dtypes"].items() if ".mlp.gate." not in n}
    assert set(stored.values()) == {dtype}, {n: d for n, d in stored.items() if d != dtype}
    assert out["trainable_dtypes"] == ["torch.float32"]
    assert out["optimizer_is_trainable"] and out["optimizer_state"] == len(out["trainable"])


@pytest.mark.parametrize("layout", [*TWO_RANKS, "ep2_shared", "glm_tp2"])
def test_lora_layout_matches_one_process(reference, two_ranks, layout):
    out = two_ranks[layout]
    ref = {"ep2_shared": "shared", "glm_tp2": "glm"}.get(layout, "hf")
    _matches(out, reference[ref], layout)
    _frozen_base(out)


def test_lora_fsdp4_ep2_matches_one_process(reference, four_ranks):
    _matches(four_ranks, reference["hf"], "fsdp2_ep2")
    _frozen_base(four_ranks)


def test_adapter_placements_follow_their_base(two_ranks, four_ranks):
    tp = two_ranks["tp2"]["placements"]
    colwise = ("self_attn.q_proj", "self_attn.in_proj_qkv", "self_attn.in_proj_b", "shared_experts.up_proj", "lm_head")
    rowwise = ("self_attn.o_proj", "self_attn.out_proj", "shared_experts.down_proj")
    checked = 0
    for name, placements in tp.items():
        module, _, param = name.rpartition(".")
        if module.endswith(colwise) and param in ("lora_A", "lora_B"):
            assert placements["tp"] == {"lora_A": "R", "lora_B": "S(0)"}[param], (name, placements)
            checked += 1
        if module.endswith(rowwise) and param in ("lora_A", "lora_B"):
            assert placements["tp"] == {"lora_A": "S(1)", "lora_B": "R"}[param], (name, placements)
            checked += 1
    assert checked >= 20, checked
    for out, want in ((four_ranks, "S(0)"), (two_ranks["ep2"], "S(0)"), (two_ranks["ep2_shared"], "R")):
        stacks = {n: p for n, p in out["placements"].items() if ".experts." in n}
        assert len(stacks) == 16 and all(p["ep"] == want for p in stacks.values()), stacks


def test_frozen_base_is_stored_in_the_training_dtype(two_ranks):
    out = two_ranks["tp2_bf16"]
    assert len(out["losses"]) == 1 and out["losses"][0] == out["losses"][0]  # finite
    _frozen_base(out, dtype="torch.bfloat16")


def test_checkpoint_holds_adapters_and_resumes_on_two_ranks(pool, reference, four_ranks, tmp, folder):
    """The 4-rank run's step-2 checkpoint: no frozen parameter in it; resumed on 2 ranks (TP 2) with the base
    re-read from the folder, steps 3 and 4 equal the uninterrupted 4-rank run's and the one-process run's."""
    keys = checkpoint_keys(str(tmp / "w4" / "checkpoint" / "step-2"))
    model = [k.removeprefix("model.") for k in keys if k.startswith("model.")]
    assert model and all(is_saved(k) for k in model), [k for k in model if not is_saved(k)][:5]
    assert any(".experts.gate_up_proj_lora_A" in k for k in model) and any(k.startswith("lm_head.") for k in model)
    assert not any(k.startswith("optimizer.") and ("lora_" not in k and "lm_head" not in k) and ".state." in k
                   for k in keys)  # fmt: skip
    resume = tmp / "resume"
    shutil.copytree(tmp / "w4", resume)
    shutil.rmtree(resume / "checkpoint" / "step-4")  # resume from step 2
    runs = {"tp2": argv(resume, *LAYOUTS["tp2"], folder=folder, checkpoint=2, steps=RESUME_STEPS)}
    out = pool.run(runs_job, 2, runs, timeout=600.0)[0]["tp2"]
    assert out["start"] == 2 and len(out["losses"]) == 2
    print(f"\nresumed on 2 ranks: steps 3-4 {out['losses']}, 4 ranks {four_ranks['losses'][2:]}")
    for got, whole, one in zip(out["losses"], four_ranks["losses"][2:], reference["hf"]["losses"][2:], strict=True):
        assert abs(got - whole) <= 1e-5 and abs(got - one) <= 1e-5, (out["losses"], four_ranks["losses"])


def test_a_lora_checkpoint_without_its_base_is_refused(pool, tmp, folder, four_ranks):
    """The checkpoints of a run from a folder hold no base: resuming without the path takes the folder the run
    started from; after the folder's config.json changed the run stops with what to do instead of training on
    another base."""
    dump = tmp / "nobase"
    shutil.copytree(tmp / "w4", dump)
    # the command without the path resumes the folder the run started from (initial_model/source.json), base and all
    assert pool.run(error_job, 1, argv(dump, steps=RESUME_STEPS, checkpoint=2))[0] == ""
    copy = dump / "initial_model" / "config.json"
    hf = json.loads(copy.read_text())
    copy.write_text(json.dumps({**hf, "rms_norm_eps": 1e-5}))  # the folder no longer says what the run started from
    msg = pool.run(error_job, 1, argv(dump, folder=folder, steps=RESUME_STEPS, checkpoint=2))[0]
    assert "config.json changed since this LoRA run started" in msg, msg


def is_saved(key: str) -> bool:
    """What a LoRA checkpoint of a run from a folder may hold: adapters, the LM head, buffers (MoE bias)."""
    buffers = ("e_score_correction_bias", "tokens_per_expert")
    return "lora_" in key or key.startswith("lm_head.") or key.endswith(buffers)


def test_random_base_run_resumes_exactly_after_kill9(reference, tmp):
    """No HF folder: the checkpoint holds the (seeded random) base too; kill -9 after step 2, run the same command
    again: steps 3 and 4 equal the uninterrupted run's."""
    dump = tmp / "kill"
    command = launch.train_command(argv(dump, steps=KILL_STEPS, checkpoint=1), 1)
    launch.kill_when(command, lambda: (dump / "checkpoint" / "step-2" / ".metadata").is_file())
    keys = checkpoint_keys(str(dump / "checkpoint" / "step-2"))
    assert any(k.startswith("model.") and "lora_" not in k and k.endswith(".weight") for k in keys)  # the base
    log = launch.run(command)
    assert "resumed from" in log, log[-2000:]
    losses: dict[int, float] = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        losses[rec["step"]] = rec["loss"]  # the resumed run appends; the last record of a step wins
    want = reference["random"]["losses"]
    assert sorted(losses) == list(range(1, KILL_STEPS + 1))
    worst = max(abs(losses[s] - want[s - 1]) for s in losses)
    print(f"\nkill -9 at step 2, resumed: worst |dloss| vs the uninterrupted run {worst:.2e}")
    assert worst <= 1e-6, (losses, want)
