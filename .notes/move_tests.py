#!/usr/bin/env python3
"""Issue 44, tests mirror the package: move tests/torch/ut/test_*.py into tests/torch/ut/<area>/ named by subject,
split the review-round files by subject, and replace re-declared helpers by tests/torch/helpers.py.

Run from the repository root:  python .notes/move_tests.py            (apply)
                               python .notes/move_tests.py --dry-run  (plan and checks only, writes nothing)
                               python .notes/move_tests.py --plan     (print the mapping as markdown)
Plain file moves (os.rename), never git. Refuses to run twice (a destination or tests/torch/helpers.py exists).
Everything it could not fix is listed at the end under "NOT FIXED"; exit status 0 even then (read the list).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from pathlib import Path

UT = Path("tests/torch/ut")
HELPERS = Path("tests/torch/helpers.py")
HELPERS_MOD = "tests.torch.helpers"

# ---------------------------------------------------------------------------------------------------------------
# 1. Whole-file moves: old basename -> new path under tests/torch/ut (areas mirror hyper_parallel/).
#    Package-level subjects (hyper_parallel/__init__.py, torch_features.py, the import graph) stay at ut/ root.
MOVES: dict[str, str] = {
    # config/
    "test_config_manager.py": "config/test_manager.py",
    "test_legacy_yaml.py": "config/test_legacy_yaml.py",
    "test_model_options.py": "config/test_model_options.py",
    # protocols/
    "test_protocol.py": "protocols/test_module_protocol.py",
    # models/common/
    "test_common_attention.py": "models/common/test_attention.py",
    "test_common_block.py": "models/common/test_block.py",
    "test_moe.py": "models/common/test_moe.py",
    "test_moe_padding_mask.py": "models/common/test_moe_padding_mask.py",
    "test_varlen.py": "models/common/test_varlen.py",
    "test_flops.py": "models/common/test_flops.py",
    "test_deltanet_syncs.py": "models/common/test_deltanet_syncs.py",
    "test_qwen3_5_blocks.py": "models/common/test_qwen3_5_blocks.py",
    "test_sharding_helpers.py": "models/common/test_sharding.py",
    "test_lora.py": "models/common/test_lora.py",
    # models/ (every family at once)
    "test_syncs.py": "models/test_syncs.py",
    "test_lora_recipes.py": "models/test_lora_recipes.py",
    # models/glm_image_moe_v2/
    "test_glm_image_moe_model.py": "models/glm_image_moe_v2/test_model.py",
    "test_glm_image_path_checks.py": "models/glm_image_moe_v2/test_image_path_checks.py",
    "test_data_model_packing.py": "models/glm_image_moe_v2/test_packed_forward.py",
    "test_mtp_glm.py": "models/glm_image_moe_v2/test_mtp.py",
    "test_mtp_glm_passthrough.py": "models/glm_image_moe_v2/test_mtp_passthrough.py",
    "test_glm_flash_finetune.py": "models/glm_image_moe_v2/test_glm_flash_finetune.py",
    # models/qwen3_5_v2/
    "test_qwen3_5_model.py": "models/qwen3_5_v2/test_model.py",
    "test_mtp_qwen3_5.py": "models/qwen3_5_v2/test_mtp.py",
    "test_qwen3_5_train.py": "models/qwen3_5_v2/test_debug_recipes.py",
    # models/qwen3_5_moe_v2/
    "test_qwen3_5_moe_model.py": "models/qwen3_5_moe_v2/test_model.py",
    # models/qwen3_vl_moe_v2/
    "test_qwen3_vl_moe_model.py": "models/qwen3_vl_moe_v2/test_model.py",
    "test_qwen3_vl_moe_train.py": "models/qwen3_vl_moe_v2/test_debug_recipe.py",
    "test_qwen3_vl_video_model.py": "models/qwen3_vl_moe_v2/test_video_model.py",
    "test_qwen3_vl_vision.py": "models/qwen3_vl_moe_v2/test_vision.py",
    "test_qwen3_vl_dense.py": "models/qwen3_vl_moe_v2/test_qwen3_vl_dense.py",
    "test_qwen3_5_vl_dense.py": "models/qwen3_vl_moe_v2/test_qwen3_5_vl_dense.py",
    "test_mtp_qwen3_5_vl.py": "models/qwen3_vl_moe_v2/test_mtp.py",
    "test_mtp_vl_io.py": "models/qwen3_vl_moe_v2/test_mtp_hf_io.py",
    "test_vl_syncs.py": "models/qwen3_vl_moe_v2/test_syncs.py",
    # distributed/
    "test_parallel_dims.py": "distributed/test_parallel_dims.py",
    "test_pipeline_plan.py": "distributed/test_pipeline_plan.py",
    "test_context_parallel_cores.py": "distributed/test_context_parallel_cores.py",
    "test_cp_hybrid_config.py": "distributed/test_cp_hybrid.py",
    "test_cp_no_quadratic.py": "distributed/test_cp_no_quadratic.py",
    "test_cp_split_inputs.py": "distributed/test_cp_split_inputs.py",
    "test_fsdp_numerics.py": "distributed/test_fsdp_numerics.py",
    "test_compile_fullgraph.py": "distributed/test_compile_fullgraph.py",
    "test_packed_compile.py": "distributed/test_packed_compile.py",
    "test_trainer_teardown.py": "distributed/test_teardown.py",
    # data/
    "test_chat_masks.py": "data/test_chat_masks.py",
    "test_chat_reasoning.py": "data/test_chat_reasoning.py",
    "test_chat_sft.py": "data/test_chat_sft.py",
    "test_data_bad_samples.py": "data/test_bad_samples.py",
    "test_data_direct_token.py": "data/test_direct_token.py",
    "test_data_layout.py": "data/test_layout.py",
    "test_data_loader.py": "data/test_loader.py",
    "test_data_mixture.py": "data/test_mixture.py",
    "test_data_packing.py": "data/test_packing.py",
    "test_data_text.py": "data/test_text.py",
    "test_text_records.py": "data/test_text_records.py",
    "test_text_tokenizer.py": "data/test_tokenizer.py",
    "test_data_vl.py": "data/test_vision_language.py",
    "test_data_vl_video.py": "data/test_vision_language_video.py",
    "test_vl_preprocess.py": "data/test_vl_preprocess.py",
    "test_vl_video.py": "data/test_vl_video.py",
    # hf/
    "test_hf_storage.py": "hf/test_storage.py",
    "test_fp8_load.py": "hf/test_fp8_load.py",
    "test_export_serving.py": "hf/test_export_serving.py",
    "test_lora_peft.py": "hf/test_lora_peft.py",
    "test_folder_is_model.py": "hf/test_folder_is_model.py",
    "test_folder_is_model_cli.py": "hf/test_folder_is_model_cli.py",
    "test_released_configs.py": "hf/test_released_configs.py",
    # components/
    "test_components_checkpoint.py": "components/test_checkpoint.py",
    "test_components_lr_ema_loss.py": "components/test_lr_ema_loss.py",
    "test_components_metrics.py": "components/test_metrics.py",
    "test_components_muon_fsdp.py": "components/test_muon_fsdp.py",
    "test_components_optimizer.py": "components/test_optimizer.py",
    "test_profiler.py": "components/test_profiler.py",
    "test_validation.py": "components/test_validation.py",
    "test_step_runner.py": "components/test_step_runner.py",
    # dry_run/
    "test_dry_run.py": "dry_run/test_bytes_and_collectives.py",
    "test_dry_run_hf_io.py": "dry_run/test_hf_memory.py",
    "test_dry_run_paths.py": "dry_run/test_deltanet_paths.py",
    "test_dry_run_pp.py": "dry_run/test_pipeline.py",
    "test_dry_run_scan.py": "dry_run/test_chunk_scan.py",
    "test_cp_dry_run.py": "dry_run/test_context_parallel.py",
    "test_mtp_dry_run.py": "dry_run/test_mtp.py",
    # trainer/ (hyper_parallel/trainer.py, train.py)
    "test_trainer.py": "trainer/test_train_and_resume.py",
    "test_mtp_trainer.py": "trainer/test_mtp.py",
    "test_tied_embeddings.py": "trainer/test_tied_embeddings.py",
    # docs/ (README, docs/, the tutorial) and benchmarks/
    "test_readme.py": "docs/test_readme.py",
    "test_docs.py": "docs/test_docs.py",
    "test_tutorial_model.py": "docs/test_tutorial_model.py",
    "test_gpu_check.py": "benchmarks/test_gpu_check.py",
    # stay at ut/ root (the package as a whole): test_public_api.py, test_import_graph.py, test_torch_features.py
}
STAY = {"test_public_api.py", "test_import_graph.py", "test_torch_features.py"}

# ---------------------------------------------------------------------------------------------------------------
# 2. Files named after review rounds, split by subject: (new path, docstring, tests). A test not listed (added since)
#    goes to the FIRST entry and is reported. Support code (constants, helpers, fixtures) goes to the first entry
#    that needs it; later entries import it from there (no copies).
SPLITS: dict[str, list[tuple[str, str, list[str]]]] = {
    "test_review_defects.py": [
        ("data/test_chat_multibyte_masks.py",
         "SFT masks at a multi-byte character: every token whose offsets overlap an assistant span trains, exactly as\n"
         "transformers' ``return_assistant_tokens_mask`` (the oracle), marked and derived spans alike (issue 36).",
         ["test_issue_case_reply_ending_in_a_multibyte_character", "test_marked_and_derived_spans_at_multibyte_edges"]),
        ("models/test_mtp_loss_weights.py",
         "MTP loss weight per family: each family's ``MTP_LOSS_WEIGHT`` (its Megatron-Bridge recipe) is what its\n"
         "builders, readers and recipes use (GLM-4.7-Flash 0.3, Qwen3.5 0.1).",
         ["test_mtp_loss_weight_is_each_familys_reference_value"]),
        ("models/common/test_mtp_router_aux_loss.py",
         "The MTP layer's router aux loss is not scaled by the MTP loss weight: it adds ``coef x`` its Switch loss\n"
         "(transformers' ``load_balancing_loss_func`` is the oracle), whatever ``mtp.loss_weight`` is.",
         ["test_mtp_router_aux_loss_has_the_full_coefficient"]),
        ("models/common/test_experts_output.py",
         "Expert parallel: the experts' output is not an autograd view (FSDP2 warned \"returned a view tensor\" for\n"
         "the experts' own FSDP unit); the launch check is in tests/torch/st/test_trainer_layouts.py.",
         ["test_experts_output_is_not_a_view"]),
        ("distributed/test_intra_op_threads.py",
         "Intra-op threads: a plain run picks a thread count per local rank (OMP_NUM_THREADS kept when set), logs it\n"
         "and restores the caller's count.",
         ["test_default_intra_op_threads", "test_intra_op_threads_keeps_the_users_setting",
          "test_plain_run_picks_and_logs_its_threads"]),
    ],
    "test_trainer_contracts.py": [
        ("trainer/test_export.py",
         "The trainer's HF export: passthrough keys of the initial folder survive training and reach the export, and\n"
         "the export holds the EMA weights when EMA is on.",
         ["test_hf_passthrough_keys_survive_training_and_export", "test_ema_weights_reach_the_trainer_export"]),
        ("trainer/test_accumulation.py",
         "Gradient accumulation in the trainer: dyn_bsz accumulation equals one big batch on gradients, labelled\n"
         "tokens are counted on the host before the device copy, and the model's aux loss is added and logged.",
         ["test_dyn_bsz_accumulation_equals_one_big_batch_on_gradients",
          "test_labelled_tokens_are_counted_on_the_host_before_the_copy", "test_the_model_aux_loss_is_added_and_logged"]),
        ("trainer/test_run_guards.py",
         "What a run promises around the loop: the NaN guard fires inside ``train()`` before a due checkpoint, skipped\n"
         "samples reach metrics.jsonl, a checkpoint made with other data says what to do, the profiler writes a trace.",
         ["test_nonfinite_guard_fires_inside_train_before_a_due_checkpoint", "test_skipped_samples_reach_metrics_jsonl",
          "test_resuming_with_other_data_says_what_to_do_and_the_flag_restarts_the_stream",
          "test_profiler_writes_a_trace_after_a_three_step_run"]),
        ("config/test_cli_habits.py",
         "torchtitan users' command-line habits work: a short run of a recipe with a longer warmup, and boolean fields\n"
         "that are flags and still take a value.",
         ["test_three_step_smoke_run_of_a_recipe_with_longer_warmup", "test_boolean_fields_are_flags_and_still_take_a_value"]),
    ],
    "test_gpu_hazards.py": [
        ("config/test_mixed_precision.py",
         "float16 compute without loss scaling is refused, with the reason (a hazard a GPU run would hit).",
         ["test_float16_compute_is_refused_with_the_reason"]),
        ("components/test_checkpoint_staging.py",
         "Async checkpoints stage into one reused (pinned on CUDA) set of buffers instead of fresh memory per save.",
         ["test_async_saves_reuse_one_stager_and_its_buffers"]),
    ],
    "test_new_user_defects.py": [
        ("hf/test_release_folders.py",
         "A released folder as a new user meets it (issue 45): another model's tokenizer is refused naming both, the\n"
         "release's aux-loss coefficient trains, the export keeps fused experts, a resume without the folder's path\n"
         "rebuilds the folder's model, user errors are one line.",
         ["test_a_tokenizer_other_than_the_folders_is_refused_naming_both",
          "test_vl_shards_written_with_another_tokenizer_are_refused_when_data_tokenizer_is_left_out",
          "test_release_trains_its_aux_loss_exports_fused_and_resumes_without_the_path", "test_user_errors_are_one_line"]),
        ("data/test_writer_errors.py",
         "Shard writers stopped by bad input leave nothing behind and name the line (issue 45).",
         ["test_vl_writer_stopped_by_a_missing_image_leaves_nothing_and_names_the_line",
          "test_direct_token_and_text_writers_leave_nothing_on_error"]),
        ("trainer/test_interrupt_and_help.py",
         "Ctrl-C names the last complete checkpoint; ``--help`` without ``--module`` says a folder replaces the model.",
         ["test_ctrl_c_names_the_last_complete_checkpoint", "test_help_without_module_says_a_folder_replaces_the_model"]),
        ("models/test_recipes.py",
         "Every recipe fixes its global batch (issue 45).",
         ["test_every_recipe_fixes_its_global_batch"]),
        ("components/test_checkpoint_files.py",
         "Checkpoint side files load weights-only, and the loss curve after a resume starts where the run started.",
         ["test_checkpoint_side_files_are_weights_only", "test_loss_curve_after_a_resume_starts_where_the_run_started"]),
        ("dry_run/test_advice.py",
         "The dry run's advice names LoRA when a full fine-tune does not fit.",
         ["test_dry_run_advice_names_lora_when_a_full_fine_tune_does_not_fit"]),
        ("hf/test_lora_adapter_config.py",
         "The PEFT adapter_config.json names the base folder as an absolute path.",
         ["test_adapter_config_names_the_base_folder_absolute"]),
    ],
}

# ---------------------------------------------------------------------------------------------------------------
# 3. Shared helpers: tests/torch/helpers.py. Each local definition is replaced only when its body is equivalent
#    (same AST after dropping annotations/docstring and renaming parameters positionally); otherwise reported.
HELPERS_SOURCE = '''"""Helpers shared by the unit and system tests: one definition each (they were re-declared per file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def trainer_config(base: list[str], dump: Path, *args: str) -> Any:
    """The Trainer.Config of the command line ``base`` + ``--dump_folder dump`` + ``args``."""
    from hyper_parallel.config.manager import ConfigManager  # here: st job modules import this file in every worker

    return ConfigManager().parse_args([*base, "--dump_folder", str(dump), *args])


def run_trainer(cfg: Any) -> tuple[Any, dict]:
    """Build, train and close a Trainer; returns it (closed) and its summary."""
    trainer = cfg.build()
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    return trainer, summary


def read_losses(dump: Path) -> dict[int, float]:
    """Loss per step from ``dump/metrics.jsonl`` (a resumed run appends: the last record of a step wins)."""
    out = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def canonical_fqn(name: str) -> str:
    """A parameter name without the activation-checkpoint and compile wrappers' prefixes."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def build_on_meta(config: Any) -> Any:
    """``config.build()`` on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        return config.build()


def next_token_ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``logits`` [B, T, V] on ``ids`` [B, T], in fp32."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def logits_of(out: Any) -> torch.Tensor:
    """The logits of an HF model output, or ``out`` itself when it is a tensor."""
    return out.logits if hasattr(out, "logits") else out


def write_jsonl(path: Path, rows: list) -> str:
    """Write ``rows`` as JSON lines to ``path``; returns the path as a string."""
    path.write_text("".join(json.dumps(r) + "\\n" for r in rows))
    return str(path)


def edit_config(path: Path, **text: Any) -> None:
    """Update the text config (``text_config`` when present) of the HF folder ``path`` in place."""
    d = json.loads((path / "config.json").read_text())
    (d.get("text_config") or d).update(text)
    (path / "config.json").write_text(json.dumps(d))
'''

# (file relative to tests/torch, local name, shared name). "bind" marks `_config`, whose body reads the file's BASE:
# call sites `_config(x, ...)` become `trainer_config(BASE, x, ...)`.
SHARED: list[tuple[str, str, str]] = [
    ("ut/test_trainer.py", "_config", "trainer_config"),
    ("ut/test_trainer_contracts.py", "_config", "trainer_config"),
    ("ut/test_validation.py", "_config", "trainer_config"),
    ("ut/test_trainer.py", "_run", "run_trainer"),
    ("ut/test_trainer.py", "_losses", "read_losses"),
    ("ut/test_tied_embeddings.py", "_losses", "read_losses"),
    ("st/test_trainer_resume.py", "_losses", "read_losses"),
    ("ut/test_trainer.py", "_full", "full_tensor"),
    ("ut/test_trainer_contracts.py", "_full", "full_tensor"),
    ("ut/test_mtp_trainer.py", "_full", "full_tensor"),
    ("ut/test_qwen3_5_train.py", "_full", "full_tensor"),
    ("st/lora_jobs.py", "_canonical", "canonical_fqn"),
    ("st/pp_jobs.py", "_canonical", "canonical_fqn"),
    ("ut/test_model_options.py", "_built", "build_on_meta"),
    ("ut/test_pipeline_plan.py", "_meta", "build_on_meta"),
    ("ut/test_glm_image_moe_model.py", "_ce", "next_token_ce"),
    ("ut/test_qwen3_5_moe_model.py", "_ce", "next_token_ce"),
    ("ut/test_lora_peft.py", "_logits", "logits_of"),
    ("ut/test_qwen3_vl_dense.py", "_logits", "logits_of"),
    ("ut/test_qwen3_vl_moe_model.py", "_logits", "logits_of"),
    ("ut/test_chat_sft.py", "_jsonl", "write_jsonl"),
    ("ut/test_chat_reasoning.py", "_jsonl", "write_jsonl"),
    ("ut/test_folder_is_model_cli.py", "edit_config", "edit_config"),
    ("ut/test_new_user_defects.py", "edit_config", "edit_config"),
]
BIND = {"_config": "BASE"}  # local name -> the module constant its body reads (passed as the first argument)
BIND_TEMPLATE = {
    "_config": 'def _config(dump, *args):\n    return ConfigManager().parse_args([*BASE, "--dump_folder", str(dump), *args])\n'
}

TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".ini", ".rst", ".jinja", ".j2", ".json"}
SKIP_DIRS = {".git", ".venv", ".notes", ".pytest_cache", "__pycache__", "outputs", "node_modules"}

NOT_FIXED: list[str] = []
DONE: list[str] = []
FAIL_AT_END = False
UNDO: list[tuple] = []  # applied in reverse when the script fails half way: the tree is left as it was


def write(path: Path, text: str) -> None:
    path = Path(path)
    UNDO.append(("restore", path, path.read_text() if path.exists() else None))
    path.write_text(text)


def rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)
    UNDO.append(("rename", dst, src))


def remove(path: Path) -> None:
    UNDO.append(("restore", Path(path), Path(path).read_text()))
    os.remove(path)


def mkdir(path: Path) -> None:
    missing = []
    d = Path(path)
    while not d.exists():
        missing.append(d)
        d = d.parent
    path.mkdir(parents=True, exist_ok=True)
    UNDO.extend(("rmdir", m) for m in reversed(missing))


def rollback() -> None:
    for op in reversed(UNDO):
        if op[0] == "restore":
            _, path, text = op
            if text is None:
                path.unlink(missing_ok=True)
            else:
                path.write_text(text)
        elif op[0] == "rename":
            os.rename(op[1], op[2])
        elif op[0] == "rmdir":
            for cache in op[1].rglob("__pycache__"):
                for f in cache.iterdir():
                    f.unlink()
                cache.rmdir()
            op[1].rmdir()


def note(msg: str) -> None:
    NOT_FIXED.append(msg)


# ---------------------------------------------------------------------------------------------------------------
# AST helpers
def _norm(node: ast.AST) -> str:
    """Structure of a function with annotations, docstring, its name and its parameter names left out."""
    node = ast.parse(ast.unparse(node)).body[0]
    names: dict[str, str] = {}
    if isinstance(node, ast.FunctionDef):
        a = node.args
        every = a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]
        for i, arg in enumerate(every):
            names[arg.arg] = f"_a{i}"
            arg.arg, arg.annotation = f"_a{i}", None
        node.returns, node.name = None, "F"
        b = node.body
        if b and isinstance(b[0], ast.Expr) and isinstance(b[0].value, ast.Constant) and isinstance(b[0].value.value, str):
            node.body = b[1:] or [ast.Pass()]

    class T(ast.NodeTransformer):
        def visit_Name(self, n):
            n.id = names.get(n.id, n.id)
            return n

        def visit_AnnAssign(self, n):
            self.generic_visit(n)
            return None if n.value is None else ast.Assign(targets=[n.target], value=n.value, lineno=0)

    return ast.dump(T().visit(node), annotate_fields=False, include_attributes=False)


def _top_def(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and n.name == name:
            return n
    return None


def _start(n: ast.stmt) -> int:
    decos = getattr(n, "decorator_list", None) or []
    return min([n.lineno] + [d.lineno for d in decos])


def _remove_lines(src: str, first: int, last: int) -> str:
    """Remove lines first..last (1-based) and the blank lines after them."""
    lines = src.splitlines(keepends=True)
    end = last
    while end < len(lines) and lines[end].strip() == "":
        end += 1
    return "".join(lines[: first - 1] + lines[end:])


def _header_end(tree: ast.Module) -> int:
    """Line after the last import of the file's import block (imports before the first def/class/assignment)."""
    last = 0
    for n in tree.body:
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            last = n.end_lineno
        elif isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and last == 0:
            last = n.end_lineno  # module docstring
        else:
            break
    return last


def _add_import(src: str, module: str, names: list[str]) -> str:
    tree = ast.parse(src)
    for n in tree.body:  # merge into an existing import of that module
        if isinstance(n, ast.ImportFrom) and n.module == module and n.level == 0:
            have = [a.name for a in n.names]
            new = ast.ImportFrom(module=module, names=[ast.alias(x) for x in sorted(set(have) | set(names))], level=0)
            return _replace_stmt(src, n, ast.unparse(new))
    lines = src.splitlines(keepends=True)
    at = _header_end(tree)
    return "".join(lines[:at] + [f"from {module} import {', '.join(sorted(set(names)))}\n"] + lines[at:])


def _replace_stmt(src: str, node: ast.stmt, text: str) -> str:
    lines = src.splitlines(keepends=True)
    last = lines[node.end_lineno - 1]
    comment = ""
    m = re.search(r"#[^\n]*$", last.rstrip("\n"))
    if m and "#" not in ast.get_source_segment(src, node):
        comment = "  " + m.group(0)
    indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
    body = [] if not text else [indent + text + comment + "\n"]
    return "".join(lines[: node.lineno - 1] + body + lines[node.end_lineno:])


def _rename(src: str, old: str, new: str) -> str:
    return re.sub(rf"(?<![\w.]){re.escape(old)}(?!\w)", new, src)


# ---------------------------------------------------------------------------------------------------------------
def share_helpers(tests: Path, dry: bool) -> dict[tuple[str, str], str]:
    """Replace equivalent local helper definitions; returns {(module, local name): shared name} for importers."""
    canon = {n.name: n for n in ast.parse(HELPERS_SOURCE).body if isinstance(n, ast.FunctionDef)}
    moved: dict[tuple[str, str], str] = {}
    per_file: dict[Path, list[tuple[str, str]]] = {}
    for rel, local, shared in SHARED:
        path = tests / rel
        if not path.exists():
            note(f"helper: {path} is gone; {local} -> {shared} not applied")
            continue
        tree = ast.parse(path.read_text())
        node = _top_def(tree, local)
        if node is None:
            note(f"helper: {path} no longer defines {local}; nothing to share")
            continue
        ref = ast.parse(BIND_TEMPLATE[local]).body[0] if local in BIND else canon[shared]
        if _norm(node) != _norm(ref):
            note(f"helper: {path}:{node.lineno} {local} differs from {HELPERS_MOD}.{shared}; kept local")
            continue
        per_file.setdefault(path, []).append((local, shared))
    for path, pairs in per_file.items():
        src = path.read_text()
        loaded: set[str] = set()
        for local, shared in pairs:
            node = _top_def(ast.parse(src), local)
            loaded |= {x.id for x in ast.walk(node) if isinstance(x, ast.Name)} | {
                x.value.id for x in ast.walk(node) if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name)}
            src = _remove_lines(src, _start(node), node.end_lineno)
            if local in BIND:
                src = re.sub(rf"(?<![\w.]){re.escape(local)}\(", f"{shared}({BIND[local]}, ", src)
                if re.search(rf"(?<![\w.]){re.escape(local)}(?!\w)", src):
                    note(f"helper: {path} still names {local} (not as a call); check by hand")
            else:
                src = _rename(src, local, shared)
            moved[(_module(path), local)] = shared
        src = _add_import(src, HELPERS_MOD, [s for _, s in pairs])
        src = _prune_imports(src, loaded, path)
        if not dry:
            write(path, src)
        DONE.append(f"helper: {path}: " + ", ".join(f"{a} -> {HELPERS_MOD}.{b}" for a, b in pairs))
    # importers of a shared name from the file that defined it (e.g. `from tests.torch.ut.test_trainer import _run`)
    for path in sorted(tests.rglob("*.py")):
        src = path.read_text()
        changed = False
        for _ in range(20):
            tree = ast.parse(src)
            hit = None
            for n in ast.walk(tree):
                if isinstance(n, ast.ImportFrom) and any((n.module, a.name) in moved for a in n.names):
                    hit = n
                    break
            if hit is None:
                break
            keep = [a for a in hit.names if (hit.module, a.name) not in moved]
            gone = [a for a in hit.names if (hit.module, a.name) in moved]
            text = ast.unparse(ast.ImportFrom(module=hit.module, names=keep, level=0)) if keep else ""
            src = _replace_stmt(src, hit, text)
            for a in gone:
                shared = moved[(hit.module, a.name)]
                src = _rename(src, a.asname or a.name, shared)
                src = _add_import(src, HELPERS_MOD, [shared])
            changed = True
        if changed:
            if not dry:
                write(path, src)
            DONE.append(f"helper importer: {path}")
    return moved


def _prune_imports(src: str, candidates: set[str], path: Path) -> str:
    """Drop top-level imports of ``candidates`` (names the removed helper bodies used) that nothing uses any more."""
    for _ in range(50):
        tree = ast.parse(src)
        imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                   and getattr(n, "module", None) != "__future__"]
        used = {x.id for x in ast.walk(tree) if isinstance(x, ast.Name)}
        # names inside string annotations (`from __future__ import annotations` keeps them as strings in the AST? no:
        # they are parsed) and in strings are not counted: a name only a string mentions is kept to be safe
        text_uses = lambda name: len(re.findall(rf"(?<![\w.]){re.escape(name)}(?!\w)", src))
        hit = None
        for n in imports:
            for a in n.names:
                bound = (a.asname or a.name).split(".")[0]
                if bound in candidates and bound not in used and text_uses(bound) == 1:
                    hit = (n, a)
                    break
            if hit:
                break
        if hit is None:
            return src
        n, a = hit
        keep = [x for x in n.names if x is not a]
        clone = (ast.ImportFrom(module=n.module, names=keep, level=n.level) if isinstance(n, ast.ImportFrom)
                 else ast.Import(names=keep))
        src = _replace_stmt(src, n, ast.unparse(clone) if keep else "")
        DONE.append(f"unused import dropped: {path}: {a.asname or a.name}")
    return src


def _module(path: Path) -> str:
    return ".".join(path.with_suffix("").parts)


# ---------------------------------------------------------------------------------------------------------------
def _defined(n: ast.stmt) -> set[str]:
    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {n.name}
    if isinstance(n, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in n.names}
    return {x.id for x in ast.walk(n) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Store)}


def _used(n: ast.stmt, top: set[str]) -> set[str]:
    out = {x.id for x in ast.walk(n) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load)}
    for x in ast.walk(n):
        if isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef)):  # fixtures are requested by parameter name
            out |= {a.arg for a in x.args.args + x.args.kwonlyargs}
        if isinstance(x, ast.Constant) and isinstance(x.value, str) and x.value in top:  # usefixtures("...")
            out.add(x.value)
    return out & top


def split_file(src_path: Path, groups: list[tuple[str, str, list[str]]]) -> dict[str, tuple[str, str]]:
    """Texts of the split files {new rel path: text}; also returns {name: owner module} for importers."""
    src = src_path.read_text()
    tree = ast.parse(src)
    lines = src.splitlines(keepends=True)
    body = list(tree.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    top: set[str] = set()
    for n in body:
        top |= _defined(n)

    def is_test(n):
        return (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")) or (
            isinstance(n, ast.ClassDef) and n.name.startswith("Test"))

    tests = {n.name: n for n in body if is_test(n)}
    assigned = {t for _, _, ts in groups for t in ts}
    for t in tests:
        if t not in assigned:
            note(f"split: {src_path}: {t} is in no group; put in {groups[0][0]} (move it by hand if wrong)")
            groups[0][2].append(t)
    for _, _, ts in groups:
        for t in [t for t in ts if t not in tests]:
            note(f"split: {src_path}: listed test {t} no longer exists")
            ts.remove(t)
    support = [n for n in body if not is_test(n)]
    definers: dict[str, ast.stmt] = {}
    for n in support:
        for name in _defined(n):
            definers.setdefault(name, n)
    # segment text of a statement: its lines plus the comment lines right above it
    prev_end = {}
    last = tree.body[0].end_lineno if len(body) < len(tree.body) else 0  # after the module docstring
    for n in body:
        prev_end[id(n)] = last
        last = n.end_lineno

    def segment(n):
        start = _start(n)
        first = start
        while first - 1 > prev_end[id(n)] and lines[first - 2].lstrip().startswith("#"):
            first -= 1
        return "".join(lines[first - 1: n.end_lineno]).rstrip() + "\n"

    def closure(start: list[ast.stmt]) -> tuple[set[int], set[str]]:
        need: set[int] = set()
        seen_names: set[str] = set()
        queue = list(start)
        while queue:
            n = queue.pop()
            for name in _used(n, top):
                if name in seen_names or name not in definers:
                    continue
                seen_names.add(name)
                d = definers[name]
                if id(d) not in need:
                    need.add(id(d))
                    queue.append(d)
        return need, seen_names

    closures = [closure([tests[t] for t in names]) for _, _, names in groups]
    used_somewhere = set().union(*(c[0] for c in closures))
    orphans = [n for n in support if id(n) not in used_somewhere and not _is_always(n)
               and not isinstance(n, (ast.Import, ast.ImportFrom))]
    if orphans:  # support code no test uses (e.g. imported by other modules only): keep it in the first part
        names0 = sorted(set().union(*(_defined(n) for n in orphans)))
        note(f"split: {src_path}: {names0} used by no test here; kept in {groups[0][0]}")
        extra_need, extra_names = closure(orphans)
        closures[0] = (closures[0][0] | extra_need | {id(n) for n in orphans},
                       closures[0][1] | extra_names | set(names0))
    owner: dict[int, str] = {}  # id(stmt) -> module owning it
    out: dict[str, str] = {}
    name_owner: dict[str, str] = {}
    for (rel, doc, names), (need, seen_names) in zip(groups, closures):
        mod = "tests.torch.ut." + rel[:-3].replace("/", ".")
        chosen = [n for n in support if id(n) in need or _is_always(n)]
        imports_from: dict[str, set[str]] = {}
        parts: list[tuple[ast.stmt, str]] = []
        for n in chosen:
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                if isinstance(n, ast.ImportFrom) and n.module == "__future__":
                    parts.append((n, segment(n)))
                    continue
                keep = [a for a in n.names if (a.asname or a.name).split(".")[0] in seen_names]
                if not keep:
                    continue
                if len(keep) == len(n.names):
                    parts.append((n, segment(n)))
                else:
                    clone = ast.ImportFrom(module=n.module, names=keep, level=n.level) if isinstance(n, ast.ImportFrom) \
                        else ast.Import(names=keep)
                    seg = segment(n)
                    m = re.search(r"  #[^\n]*$", seg.rstrip("\n").splitlines()[-1])
                    parts.append((n, ast.unparse(clone) + (m.group(0) if m else "") + "\n"))
            elif _is_always(n) or id(n) not in owner:
                if not _is_always(n):
                    owner[id(n)] = mod
                parts.append((n, segment(n)))
            else:
                for name in _defined(n) & seen_names:
                    imports_from.setdefault(owner[id(n)], set()).add(name)
        for name in seen_names:
            d = definers.get(name)
            if d is not None and owner.get(id(d)) == mod and not isinstance(d, (ast.Import, ast.ImportFrom)):
                name_owner.setdefault(name, mod)
        for t in names:
            name_owner[t] = mod
        text = [f'"""{doc}\n"""\n']
        simple_prev = None
        prev_n = None
        last_import = max([i for i, (n, _) in enumerate(parts) if isinstance(n, (ast.Import, ast.ImportFrom))],
                          default=-1)
        extra = [f"from {m} import {', '.join(sorted(ns))}\n" for m, ns in sorted(imports_from.items())]
        items = parts[: last_import + 1] + [(None, e) for e in extra] + parts[last_import + 1:] + \
            [(tests[t], segment(tests[t])) for t in sorted(names, key=lambda t: tests[t].lineno)]
        for n, seg in items:  # seg ends with a newline; sep is the blank lines before it
            is_def = isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or seg.lstrip().startswith(("@", "#"))
            is_imp = n is None or isinstance(n, (ast.Import, ast.ImportFrom))
            if simple_prev is None:
                sep = "\n"
            elif is_def or simple_prev == "def":
                sep = "\n\n"
            elif is_imp and simple_prev == "import":
                sep = "\n" if n is not None and prev_n is not None and _blank_between(lines, prev_n, n) else ""
            elif simple_prev == "import" or is_imp:
                sep = "\n\n"
            else:
                sep = ""
            text.append(sep + seg)
            simple_prev = "def" if is_def else ("import" if is_imp else "stmt")
            prev_n = n
        out[rel] = "".join(text)
    return out, name_owner


def _blank_between(lines: list[str], a: ast.stmt, b: ast.stmt) -> bool:
    """Whether the source had a blank line between statements a and b (import groups)."""
    return any(not line.strip() for line in lines[a.end_lineno: b.lineno - 1])


def _is_always(n: ast.stmt) -> bool:
    """Statements every split file keeps: `from __future__`, `pytestmark = ...`, and statements defining nothing."""
    if isinstance(n, ast.ImportFrom) and n.module == "__future__":
        return True
    d = _defined(n)
    return d == {"pytestmark"} or (not d and not isinstance(n, (ast.Import, ast.ImportFrom)))


# ---------------------------------------------------------------------------------------------------------------
def fix_file_depth(path: Path, depth: int, dry: bool) -> None:
    src = path.read_text()
    new = re.sub(r"Path\(__file__\)((?:\.resolve\(\)|\.absolute\(\))?)\.parents\[(\d+)\]",
                 lambda m: f"Path(__file__){m.group(1)}.parents[{int(m.group(2)) + depth}]", src)
    new = re.sub(r"Path\(__file__\)((?:\.resolve\(\)|\.absolute\(\))?)\.parent(?![\w])",
                 lambda m: f"Path(__file__){m.group(1)}.parents[{depth}]", new)
    for m in re.finditer(r"os\.path\.dirname\([^)]*__file__|__file__\)\.with_name|__file__\)\.parent\.parent", new):
        note(f"path: {path}: `{m.group(0)}` depends on the file's folder; check by hand")
    if new != src:
        DONE.append(f"path depth +{depth}: {path}")
        if not dry:
            write(path, new)


def absolutize(path: Path, package: str = "tests.torch.ut") -> None:
    """Relative imports (``from .hf_utils import x``) resolved against the file's old package, before it moves."""
    src = path.read_text()
    for _ in range(50):
        hit = next((n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom) and n.level > 0), None)
        if hit is None:
            break
        parts = package.split(".")
        base = parts[: len(parts) - (hit.level - 1)]
        module = ".".join(base + ([hit.module] if hit.module else []))
        src = _replace_stmt(src, hit, ast.unparse(ast.ImportFrom(module=module, names=hit.names, level=0)))
        DONE.append(f"relative import made absolute: {path}:{hit.lineno} -> {module}")
    write(path, src)


def repo_text_files(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for f in filenames:
            p = Path(dirpath) / f
            if p.suffix in TEXT_SUFFIXES or f == "Makefile" or p.parent.name == ".ci":
                yield p


def rewrite_references(root: Path, moves: dict[str, str], split_owner: dict[str, dict[str, str]],
                       split_first: dict[str, str], dry: bool) -> None:
    """Module names, paths and bare file names of moved files, everywhere in the repository (not .notes/)."""
    stems = {old[:-3]: new for old, new in moves.items()}
    mod_re = re.compile(r"tests\.torch\.ut\.(test_\w+)(?!\w)")
    path_re = re.compile(r"tests/torch/ut/(test_\w+?)(\.py)?(?![\w*])")
    bare_re = re.compile(r"(?<![\w/.])(test_\w+)\.py(?!\w)")
    from_pkg_re = re.compile(r"^(\s*)from tests\.torch\.ut import (test_\w+)(?: as (\w+))?(\s*(?:#.*)?)$", re.M)
    for p in repo_text_files(root):
        try:
            src = p.read_text()
        except UnicodeDecodeError:
            continue
        if "test_" not in src:
            continue
        new = src
        # `from tests.torch.ut.test_split import a, b` -> one import per owning split file
        if p.suffix == ".py" and any(f"tests.torch.ut.{s[:-3]}" in new for s in split_owner):
            for _ in range(20):
                tree = ast.parse(new)
                hit = next((n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and
                            n.module.startswith("tests.torch.ut.") and n.module.split(".")[-1] + ".py" in split_owner),
                           None)
                if hit is None:
                    break
                owners = split_owner[hit.module.split(".")[-1] + ".py"]
                by: dict[str, list[ast.alias]] = {}
                for a in hit.names:
                    o = owners.get(a.name)
                    if o is None:
                        note(f"ref: {p}:{hit.lineno} imports {a.name} from split {hit.module}: no owner; fix by hand")
                        o = "tests.torch.ut." + split_first[hit.module.split(".")[-1] + ".py"][:-3].replace("/", ".")
                    by.setdefault(o, []).append(a)
                stmts = [ast.unparse(ast.ImportFrom(module=m, names=al, level=0)) for m, al in by.items()]
                indent = re.match(r"\s*", new.splitlines()[hit.lineno - 1]).group(0)
                new = _replace_stmt(new, hit, ("\n" + indent).join(stmts))
        def mod_sub(m):
            stem = m.group(1)
            if stem in stems:
                return "tests.torch.ut." + stems[stem][:-3].replace("/", ".")
            if stem + ".py" in split_first:
                note(f"ref: {p}: mentions split module {m.group(0)}; pointed at its first part, check")
                return "tests.torch.ut." + split_first[stem + ".py"][:-3].replace("/", ".")
            return m.group(0)

        def from_pkg_sub(m):
            indent, stem, alias, tail = m.groups()
            if stem not in stems:
                return m.group(0)
            area, base = stems[stem][:-3].rsplit("/", 1)
            return f"{indent}from tests.torch.ut.{area.replace('/', '.')} import {base} as {alias or stem}{tail}"

        def path_sub(m):
            stem = m.group(1)
            if stem in stems:
                return "tests/torch/ut/" + (stems[stem] if m.group(2) else stems[stem][:-3])
            if stem + ".py" in split_first:
                note(f"ref: {p}: mentions split file {m.group(0)}; check which part it means")
            return m.group(0)

        def bare_sub(m):
            stem = m.group(1)
            if stem in stems and not (p.parent.name == "st" and (root / "tests/torch/st" / (stem + ".py")).exists()):
                return "tests/torch/ut/" + stems[stem]
            if stem + ".py" in split_first:
                note(f"ref: {p}: mentions split file {m.group(0)}; check which part it means")
            return m.group(0)

        new = from_pkg_re.sub(from_pkg_sub, new)
        new = mod_re.sub(mod_sub, new)
        new = path_re.sub(path_sub, new)
        new = bare_re.sub(bare_sub, new)
        if new != src:
            DONE.append(f"references: {p}")
            if not dry:
                write(p, new)


def leftovers(root: Path, olds: set[str]) -> None:
    """Any mention of an old file stem left anywhere (globs, partial names) is reported."""
    pat = re.compile(r"(?<![\w/.])(" + "|".join(re.escape(s[:-3]) for s in sorted(olds)) + r")(?!\w)")
    for p in repo_text_files(root):
        try:
            src = p.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(src.splitlines(), 1):
            for m in pat.finditer(line):
                note(f"ref left: {p}:{i}: `{line.strip()[:120]}`")
    glob = re.compile(r"tests/torch/ut/test_[\w*]*\*[\w*]*(\.py)?")
    for p in repo_text_files(root):
        try:
            src = p.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(src.splitlines(), 1):
            for m in glob.finditer(line):
                note(f"glob: {p}:{i}: `{m.group(0)}` (a pattern over old names)")


def plan_markdown() -> str:
    out = ["| old (tests/torch/ut/) | new (tests/torch/ut/) |", "|---|---|"]
    for old, new in MOVES.items():
        out.append(f"| {old} | {new} |")
    for old, groups in SPLITS.items():
        for rel, _, names in groups:
            out.append(f"| {old} (split) | {rel}: " + ", ".join(names) + " |")
    for s in sorted(STAY):
        out.append(f"| {s} | {s} (stays: the package as a whole) |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--plan", action="store_true")
    ap.add_argument("--check-rollback", action="store_true", help="apply everything, then fail and roll back")
    args = ap.parse_args()
    global FAIL_AT_END
    FAIL_AT_END = args.check_rollback
    if args.plan:
        print(plan_markdown())
        return 0
    root = Path.cwd()
    if not (root / "hyper_parallel").is_dir() or not (root / UT).is_dir():
        print("run from the repository root", file=sys.stderr)
        return 2
    dry = args.dry_run
    # --- preconditions: refuse when applied (wholly or partly) -------------------------------------------------
    dests = list(MOVES.values()) + [r for g in SPLITS.values() for r, _, _ in g]
    assert len(dests) == len(set(dests)), "two sources map to one destination"
    present = [s for s in list(MOVES) + list(SPLITS) if (UT / s).exists()]
    taken = [d for d in dests if (UT / d).exists()]
    if HELPERS.exists() or taken:
        print(f"refusing: already applied (helpers.py exists: {HELPERS.exists()}, destinations present: {taken[:5]})",
              file=sys.stderr)
        return 1
    if not present:
        print("refusing: none of the source files exists", file=sys.stderr)
        return 1
    for s in list(MOVES) + list(SPLITS):
        if s not in present:
            note(f"source gone: tests/torch/ut/{s} (not moved)")
    unmapped = sorted(p.name for p in UT.glob("test_*.py") if p.name not in MOVES and p.name not in SPLITS
                      and p.name not in STAY)
    for u in unmapped:
        note(f"unmapped: tests/torch/ut/{u} stays at ut/ root; give it an area in MOVES and move by hand")
    try:
        return apply(root, dry, present)
    except BaseException:
        import traceback

        traceback.print_exc()
        print(f"FAILED: rolling back {len(UNDO)} changes", file=sys.stderr)
        rollback()
        print("rolled back: the tree is as before (tests/torch/helpers.py removed)", file=sys.stderr)
        return 3


def apply(root: Path, dry: bool, present: list[str]) -> int:
    # --- 1. the shared helper module -----------------------------------------------------------------------------
    if not dry:
        write(HELPERS, HELPERS_SOURCE)
    DONE.append(f"wrote {HELPERS}")
    share_helpers(Path("tests/torch"), dry)
    if dry:
        print("dry run: helper changes computed on the current files only; stopping before moves")
        for d in DONE:
            print("  ", d)
        for n in NOT_FIXED:
            print("NOT FIXED:", n)
        return 0
    for s in present:
        absolutize(UT / s)
    # --- 2. splits ------------------------------------------------------------------------------------------------
    split_owner: dict[str, dict[str, str]] = {}
    split_first: dict[str, str] = {}
    new_files: dict[str, str] = {}
    for old, groups in SPLITS.items():
        if not (UT / old).exists():
            continue
        groups = [(r, d, list(ts)) for r, d, ts in groups]
        texts, owners = split_file(UT / old, groups)
        split_owner[old] = owners
        split_first[old] = groups[0][0]
        new_files.update({r: t for r, t in texts.items()})
    # --- 3. folders, moves, split files written, sources removed ------------------------------------------------
    all_new = [MOVES[s] for s in MOVES if (UT / s).exists()] + list(new_files)
    for rel in all_new:
        d = (UT / rel).parent
        while d != UT:
            mkdir(d)
            if not (d / "__init__.py").exists():
                write(d / "__init__.py", "")
                DONE.append(f"created {d / '__init__.py'}")
            d = d.parent
    for old, new in MOVES.items():
        if (UT / old).exists():
            rename(UT / old, UT / new)
            DONE.append(f"moved tests/torch/ut/{old} -> tests/torch/ut/{new}")
    for rel, text in new_files.items():
        write(UT / rel, text)
        DONE.append(f"split file written: tests/torch/ut/{rel}")
    for old in split_owner:
        remove(UT / old)
        DONE.append(f"removed split source tests/torch/ut/{old}")
    # --- 4. paths relative to a moved file ------------------------------------------------------------------------
    for rel in all_new:
        fix_file_depth(UT / rel, rel.count("/"), dry)
    # --- 5. references everywhere -----------------------------------------------------------------------------------
    moves_done = {o: n for o, n in MOVES.items() if (UT / n).exists()}
    rewrite_references(root, moves_done, split_owner, split_first, dry)
    leftovers(root, set(moves_done) | set(split_owner))
    if FAIL_AT_END:
        raise RuntimeError("--check-rollback: failing on purpose after every change")
    # --- report -------------------------------------------------------------------------------------------------
    print(f"done: {len(moves_done)} files moved, {len(split_owner)} split into {len(new_files)}, "
          f"{len([d for d in DONE if d.startswith('helper: ')])} files use {HELPERS_MOD}")
    for d in DONE:
        print("  ", d)
    print(f"NOT FIXED ({len(NOT_FIXED)}):")
    for n in NOT_FIXED:
        print("  ", n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
