"""Pipeline parallel through the real trainer (``--parallelism.pipeline_*`` flags, torch.distributed.pipelining)
reproduces the one-process run (fp32, gloo): PP2 and PP4 with 1F1B, PP2 with two stages per rank
(Interleaved1F1B; and the zero-bubble V and DualPipeV schedules for Qwen3.5-MoE), and PP2 composed with FSDP 2, TP 2, EP 2 and CP 2, for
GlmImageMoe (images, its toy corpus), Qwen3.5-MoE with its MTP block (MTP embeddings made on stage 0 cross the
stages; the MoE aux loss's router statistics travel with them) and Qwen3-VL-MoE (the tower and the deepstack
layers on stage 0): every first-step parameter gradient within 1e-5 relative (each stage's parameters gathered
from its own ranks), every step-3 gradient within 1e-4, |dloss| <= 1e-5 at every step and the clipped gradient
norms within 1e-4.

GlmImageMoe's runs also validate through the pipeline (val/loss as one process), and its PP2 x FSDP2 HF export
equals the one-process export; PP4 loads it per stage. A GlmImageMoe LoRA run under PP2 x FSDP2 trains and exports
(PEFT adapter, merged folder) as the one-process LoRA run does. A checkpoint written by PP2 x FSDP2 resumes on FSDP 4 (no
pipeline) and on PP4 to the losses of the uninterrupted run."""

from __future__ import annotations

import shutil

import pytest

from tests.torch.st import pp_jobs
from tests.torch.st.grad_check import assert_grads_match, assert_matches_reference

pytestmark = pytest.mark.slow

STEPS = 3
P = "--parallelism."


def _pp(degree: int, *extra: str) -> list[str]:
    return [f"{P}pipeline_parallel_degree", str(degree), *extra]


WORLD2 = {
    "pp2": _pp(2),
    "pp2_interleaved": _pp(2, f"{P}pipeline_schedule", "Interleaved1F1B", f"{P}pipeline_stages_per_rank", "2"),
}
ZBV = {
    "pp2_zbv": _pp(2, f"{P}pipeline_schedule", "ZBVZeroBubble", f"{P}pipeline_stages_per_rank", "2"),
    "pp2_dualpipev": _pp(2, f"{P}pipeline_schedule", "DualPipeV", f"{P}pipeline_stages_per_rank", "2"),
}
"""The V schedules (two stages per rank, weight gradients apart: zero-bubble V and DualPipeV, 4 micro-batches per
step), for the family with MTP and the aux loss."""
WORLD4 = {
    "pp4": _pp(4),
    "pp2_fsdp2": _pp(2, f"{P}data_parallel_shard_degree", "2"),
    "pp2_tp2": _pp(2, f"{P}tensor_parallel_degree", "2"),
    "pp2_ep2": _pp(2, f"{P}expert_parallel_degree", "2", f"{P}data_parallel_shard_degree", "2"),
    "pp2_cp2": _pp(2, f"{P}context_parallel_degree", "2"),
}
# deepstack adds whole-sequence features between layers: Qwen3-VL's TP runs without sequence parallel
VL_TP = {"pp2_tp2": [*WORLD4["pp2_tp2"], f"{P}enable_sequence_parallel", "false"]}
LORA = ["--lora.rank", "4", "--lora.alpha", "8", "--lora.targets", "all-linear", "experts",
        "--lora.modules_to_save", "lm_head", "--lora.export_merged", "True"]  # fmt: skip
"""GlmImageMoe fine-tuned with adapters (the LM head, on the last stage, trained in full) under PP2 x FSDP2,
against the same LoRA run in one process; both export the PEFT adapter and the merged folder."""
LORA_LAYOUTS = {"pp2_fsdp2_lora": [*WORLD4["pp2_fsdp2"], *LORA]}
REFERENCE = {"pp2_fsdp2_lora": "lora_ref"}
"""The one-process run a layout is compared with, where it is not ``ref``."""
FAMILIES = ("glm", "qwen3_5_moe", "qwen3_vl_moe")
CASES = [(f, name) for f in FAMILIES for name in (*WORLD2, *(ZBV if f == "qwen3_5_moe" else {}), *WORLD4)]
CASES += [("glm", name) for name in LORA_LAYOUTS]
VALIDATION = ["--validation.split", "0.1", "--validation.freq", "3", "--validation.steps", "4"]
"""GlmImageMoe's runs validate too (a held-out split, at the start and after step 3): through the pipeline's
forward-only schedule, a step's micro-batches at a time."""
EXPORT = ["--checkpoint.export_hf", "--checkpoint.export_dtype", "float32"]
EXPORTED = ("ref", "pp2_fsdp2", "lora_ref", "pp2_fsdp2_lora")
"""GlmImageMoe's runs that write their HF export (each stage's ranks write that stage's files)."""


@pytest.fixture(scope="module")
def runs(pool, tmp_path_factory):
    """Per family: the one-process reference, then every layout (one launch per world size)."""
    out: dict[str, dict] = {"folders": {}}
    for family in FAMILIES:
        tmp = tmp_path_factory.mktemp(family)
        out["folders"][family] = tmp

        def argvs(layouts: dict[str, list[str]]) -> dict[str, list[str]]:
            extra = lambda name: [*VALIDATION, *(EXPORT if name in EXPORTED else [])] if family == "glm" else []  # noqa: E731
            return {name: pp_jobs.argv(family, str(tmp / name), STEPS, *flags, *extra(name)) for name, flags in layouts.items()}

        refs = {"ref": [], **({"lora_ref": LORA} if family == "glm" else {})}
        ref = pool.run(pp_jobs.runs_job, 1, argvs(refs), timeout=600.0)
        out[family] = {name: pp_jobs.merged(ref, name) for name in refs}
        world2 = WORLD2 | (ZBV if family == "qwen3_5_moe" else {})
        world4 = WORLD4 | (VL_TP if family == "qwen3_vl_moe" else {}) | (LORA_LAYOUTS if family == "glm" else {})
        for world, layouts in ((2, world2), (4, world4)):
            per_rank = pool.run(pp_jobs.runs_job, world, argvs(layouts), timeout=900.0)
            out[family] |= {name: pp_jobs.merged(per_rank, name) for name in layouts}
    return out


@pytest.mark.parametrize(("family", "layout"), CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_pipeline_layout_matches_single_process(runs, family, layout):
    out, ref = runs[family][layout], runs[family][REFERENCE.get(layout, "ref")]
    assert out["stages"] is not None and "pp=" in out["parallel_dims"]
    assert_matches_reference(out, ref, f"{family} {layout} ({out['parallel_dims']})", learns_by=0.0)
    # after 3 steps: every loss within 1e-5; the step-3 gradients within 1e-4 (two AdamW steps turn 1e-7 of
    # reduction-order noise into up to ~6e-5 where Adam divides by a tiny sqrt(v): any layout does, PP or not)
    assert max(abs(a - b) for a, b in zip(out["losses"], ref["losses"], strict=True)) <= 1e-5
    assert_grads_match(out["last_grads"], ref["last_grads"], tol=1e-4)
    if family == "qwen3_5_moe":  # the MTP block (last stage) and the routers of every stage trained
        assert any(n.startswith("mtp.") for n in out["first_grads"]) and any(".mlp.gate." in n for n in out["first_grads"])
    if layout in LORA_LAYOUTS:  # the adapters of both stages and the head (trained in full, last stage)
        assert {n.split(".")[1] for n in out["first_grads"] if "lora_" in n} == {"0", "1", "2", "3"}
        assert "lm_head.weight" in out["first_grads"] and not any(n.endswith("experts.gate_up_proj") for n in out["first_grads"])
    elif family != "qwen3_5_moe":  # the image path (stage 0) trained
        assert any(n.startswith(("visual.", "vq_to_llm_proj.")) for n in out["first_grads"])
    if family == "glm":  # validation through the pipeline: val/loss at the start and after step 3
        assert len(ref["val"]) == 2 and out["val"] == pytest.approx(ref["val"], abs=1e-5)


def test_pipeline_checkpoint_resumes_on_other_layouts(pool, tmp_path):
    """PP2 x FSDP2 writes a checkpoint at step 2; FSDP 4 and PP4 resume it to the uninterrupted run's losses."""
    steps, layout = 4, WORLD4["pp2_fsdp2"]
    straight = pool.run(pp_jobs.runs_job, 4, {"s": pp_jobs.argv("glm", str(tmp_path / "straight"), steps, *layout)})
    want = straight[0]["s"]["losses"]
    first = pool.run(pp_jobs.runs_job, 4, {"a": pp_jobs.argv("glm", str(tmp_path / "a"), 2, *layout, checkpoint=2)})
    assert first[0]["a"]["losses"] == pytest.approx(want[:2], abs=1e-6)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    resumed = pool.run(pp_jobs.runs_job, 4, {
        "fsdp4": pp_jobs.argv("glm", str(tmp_path / "a"), steps, checkpoint=2),
        "pp4": pp_jobs.argv("glm", str(tmp_path / "b"), steps, *WORLD4["pp4"], checkpoint=2),
    })[0]  # fmt: skip
    for name, run in resumed.items():
        assert run["start"] == 2, name
        assert max(abs(a - b) for a, b in zip(run["losses"], want[2:], strict=True)) <= 1e-5, (name, run["losses"], want)


def _folder_tensors(folder) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def test_pipeline_hf_export_and_load_per_stage(runs, pool, tmp_path):
    """The HF export of PP2 x FSDP2 (each stage's ranks write that stage's files, rank 0 the one index) holds what
    the one-process export holds; a PP4 run started from that folder (each stage reads its own layers) starts
    from the one-process run's loss."""
    glm = runs["folders"]["glm"]
    want, got = _folder_tensors(glm / "ref" / "hf"), _folder_tensors(glm / "pp2_fsdp2" / "hf")
    assert got.keys() == want.keys() and len(list((glm / "pp2_fsdp2" / "hf").glob("model-*.safetensors"))) >= 2
    worst = max((got[k] - v).abs().max().item() for k, v in want.items())
    assert worst <= 1e-5, worst
    assert (glm / "pp2_fsdp2" / "hf" / "config.json").read_text() == (glm / "ref" / "hf" / "config.json").read_text()
    load = ["--checkpoint.initial_load_path", str(glm / "ref" / "hf")]
    one = pool.run(pp_jobs.runs_job, 1, {"one": pp_jobs.argv("glm", str(tmp_path / "one"), 2, *load)})[0]["one"]
    pp4 = pool.run(pp_jobs.runs_job, 4, {"pp4": pp_jobs.argv("glm", str(tmp_path / "pp4"), 2, *load, *WORLD4["pp4"])})
    assert pp4[0]["pp4"]["losses"] == pytest.approx(one["losses"], abs=1e-5)
    assert one["losses"][0] < runs["glm"]["ref"]["losses"][0]  # it started from the trained weights


def test_pipeline_lora_export_equals_one_process(runs):
    """A LoRA run under PP2 x FSDP2 exports what the one-process LoRA run exports: each stage's ranks write that
    stage's adapters (the LM head, trained in full, from the last stage), and rank 0 joins them into PEFT's one
    file with one ``adapter_config.json`` naming every stage's modules; the merged folder likewise."""
    glm = runs["folders"]["glm"]
    for sub in ("adapter", "merged"):
        want, got = _folder_tensors(glm / "lora_ref" / "hf" / sub), _folder_tensors(glm / "pp2_fsdp2_lora" / "hf" / sub)
        assert got.keys() == want.keys() and want, sub
        worst = max((got[k] - v).abs().max().item() for k, v in want.items())
        assert worst <= 1e-5, (sub, worst)
    config = lambda run: (glm / run / "hf" / "adapter" / "adapter_config.json").read_text()  # noqa: E731
    assert config("pp2_fsdp2_lora") == config("lora_ref")
    assert '"lm_head"' in config("lora_ref") and not (glm / "pp2_fsdp2_lora" / "hf" / "adapter" / ".adapter_parts").exists()
