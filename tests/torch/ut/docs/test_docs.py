"""The docs run and match the code: every python block of docs/zh/module_protocol.md (and config_system.md)
executes, and the generated tables (config fields, v1 mapping) are up to date."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools import docgen
from hyper_parallel.config.legacy import LEGACY_KEYS

REPO = Path(__file__).resolve().parents[4]
MODULE_PROTOCOL = REPO / "docs/zh/module_protocol.md"
CONFIG_SYSTEM = REPO / "docs/zh/config_system.md"
MIGRATION = REPO / "docs/migrations/v2_migration.md"

# Runs the ```python blocks of a markdown file in order, in one namespace, in the current folder; a failure
# names the block and its first line in the doc. A fresh process: the blocks create a process group.
RUNNER = r"""
import re, sys, traceback
text = open(sys.argv[1], encoding="utf-8").read()
ns = {"__name__": "__doc_example__"}
blocks = [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
          for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]
print(f"{len(blocks)} blocks")
for i, (line, code) in enumerate(blocks):
    try:
        exec(compile(code, f"{sys.argv[1]}:block{i}@line{line}", "exec"), ns)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"block {i} (doc line {line}) failed")
"""


def _run_blocks(doc: Path, cwd: Path) -> subprocess.CompletedProcess:
    sys_path = f"{REPO}"
    return subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {sys_path!r})\n{RUNNER}", str(doc)],
        capture_output=True, text=True, cwd=cwd, timeout=300,
    )  # fmt: skip


def test_module_protocol_covers_the_five_steps():
    text = MODULE_PROTOCOL.read_text()
    headings = re.findall(r"^## 第 (\d) 步：(.*)$", text, flags=re.M)
    assert [n for n, _ in headings] == ["1", "2", "3", "4", "5"]
    titles = " ".join(t for _, t in headings)
    for topic in ("Config", "config_registry.py", "set_<name>_sharding_config", "parallelize_<name>", "register_spec"):
        assert topic in titles, topic
    # the worked example is GlmImageMoe's real code
    for name in ("glm_image_moe_config", "GlmImageMoeModel.Config", "traverse(", "set_glm_image_moe_sharding_config",
                 "parallelize_glm_image_moe", "GlmImageMoeStateDictAdapter", "from_pretrained", "save_pretrained"):  # fmt: skip
        assert name in text, name


def test_module_protocol_code_blocks_run(tmp_path):
    out = _run_blocks(MODULE_PROTOCOL, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert int(out.stdout.split()[0]) >= 10
    # the examples wrote their HF folders into the working folder, not into the repository
    assert (tmp_path / "glm_image_moe_hf" / "config.json").is_file()
    assert (tmp_path / "tiny_moe_hf" / "model.safetensors.index.json").is_file()


def test_config_system_code_blocks_run(tmp_path):
    out = _run_blocks(CONFIG_SYSTEM, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_doc_runner_reports_the_failing_block(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n\n```python\nx = 1\n```\n\ntext\n\n```python\nassert x == 2, 'wrong'\n```\n")
    out = _run_blocks(doc, tmp_path)
    assert out.returncode != 0 and "block 1 (doc line 10) failed" in out.stderr and "wrong" in out.stderr


def test_generated_tables_are_up_to_date():
    stale = docgen.stale_docs(REPO, write=False)
    assert not stale, f"{stale} out of date: run python -m tools.docgen"


def test_docgen_detects_and_fixes_drift(tmp_path):
    for rel, _ in docgen.DOCS.values():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp_path / rel)
    doc = tmp_path / "docs/zh/config_system.md"
    doc.write_text(doc.read_text().replace("| `steps` |", "| `stepz` |"))
    assert docgen.stale_docs(tmp_path, write=True) == ["docs/zh/config_system.md"]
    assert docgen.stale_docs(tmp_path) == []
    assert "| `steps` |" in doc.read_text()
    doc.write_text(doc.read_text().replace("<!-- END GENERATED: config-fields -->", ""))
    with pytest.raises(ValueError, match="no <!-- BEGIN GENERATED: config-fields --> .* block"):
        docgen.stale_docs(tmp_path)


def test_config_field_table_documents_every_field():
    text = CONFIG_SYSTEM.read_text()
    block = text.split("<!-- BEGIN GENERATED: config-fields -->")[1]
    assert "（无说明）" not in block, "a config field has no docstring"
    # every run-config section and its fields appear
    from hyper_parallel.config.manager import resolve_recipe

    cfg = resolve_recipe(*docgen.RECIPE)()
    import dataclasses

    for section in ("training", "parallelism", "data", "optimizer", "lr_scheduler", "checkpoint", "metrics", "ema"):
        value = getattr(cfg, section)
        assert f"### `{type(value).__qualname__}`\n\n位置：`{section}`" in block, section
        for f in dataclasses.fields(value):
            assert f"| `{f.name}` |" in block, f"{section}.{f.name}"
    assert "### `GlmImageMoeModel.Config`" in block and "### `MoE.Config`" in block and "### `Router.Config`" in block


def test_field_info_reads_attribute_docstrings():
    from hyper_parallel.config.training import TrainingConfig
    from hyper_parallel.models.common.block import TransformerBlock
    from hyper_parallel.protocols.module import Module

    owner, info = docgen.field_info(TrainingConfig, "steps")
    assert owner is TrainingConfig and info.annotation == "int" and info.doc == "Number of optimizer steps to run."
    _, info = docgen.field_info(TransformerBlock.Config, "self_attn")
    assert info.annotation == "TokenMixer.Config"  # any mixer
    from hyper_parallel.models.glm_image_moe_v2 import GlmImageMoeModel

    _, info = docgen.field_info(GlmImageMoeModel.Config, "hf_extra")
    assert info.annotation == "dict[str, Any]"  # Annotated[..., tyro.conf.Suppress] stripped
    owner, info = docgen.field_info(TransformerBlock.Config, "sharding_config")
    assert owner is Module.Config and not info.cli


def test_migration_table_matches_the_code_table():
    text = MIGRATION.read_text()
    block = text.split("<!-- BEGIN GENERATED: v1-mapping -->")[1].split("<!-- END GENERATED: v1-mapping -->")[0]
    rows = re.findall(r"^\| `([^`]+)` \| (.*?) \| (.*) \|$", block, flags=re.M)
    assert [key for key, _, _ in rows] == list(LEGACY_KEYS)
    for key, targets, rule in rows:
        entry = LEGACY_KEYS[key]
        assert re.findall(r"`--([^`]+)`", targets) == list(entry.targets), key
        assert rule.replace("\\|", "|") == entry.rule, key


def test_code_cites_only_docs_that_exist_in_the_repo():
    """Docstrings cite docs/design.md sections (the repo's own design doc), never a file outside the repo."""
    design = (REPO / "docs/design.md").read_text(encoding="utf-8")
    sections = set(re.findall(r"^## (\d+)\. ", design, flags=re.M))
    cited: set[str] = set()
    for path in [*(REPO / "hyper_parallel").rglob("*.py"), *(REPO / "tests").rglob("*.py")]:
        if path == Path(__file__):
            continue
        text = path.read_text(encoding="utf-8")
        assert "DESIGN.md" not in text, f"{path} cites DESIGN.md (not in this repo)"
        cited |= set(re.findall(r"docs/design\.md section (\d+)", text))
    assert cited and cited <= sections, (sorted(cited), sorted(sections))
