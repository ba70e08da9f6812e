"""The tutorial model of docs/zh/module_protocol.md (`tiny_moe`, a small text MoE) is a real model package:
its `# models/tiny_moe/<file>.py` blocks, written out as one importable module, train through the real
entry point with no edit to trainer / data / distributed, on the embedded toy text corpus and from a
jsonl file with a tokenizer folder (HuggingFaceTextDataLoader); the loss falls in both runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
DOC = REPO / "docs/zh/module_protocol.md"
PACKAGE = "tiny_moe_tutorial"


def _write_package(root: Path) -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(encoding="utf-8"), flags=re.S | re.M)
    files = [b for b in blocks if b.startswith("# models/tiny_moe/")]
    names = [b.splitlines()[0].removeprefix("# models/tiny_moe/") for b in files]
    assert names == ["model.py", "config_registry.py", "sharding.py", "parallelize.py", "state_dict.py",
                     "__init__.py"], names  # fmt: skip
    # the doc's first block holds the shared imports of the example
    (root / PACKAGE).mkdir(parents=True)
    (root / PACKAGE / "__init__.py").write_text(blocks[0] + "\n\n" + "\n\n".join(files), encoding="utf-8")


def _train(root: Path, dump: Path, *extra: str) -> list[float]:
    cmd = [sys.executable, "-m", "hyper_parallel.train", "--module", PACKAGE, "--config", "tiny_moe_debug",
           "--training.steps", "14", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
           "--checkpoint.no_enable", "--checkpoint.no_export_hf", "--dump_folder", str(dump),
           "--data.cache_dir", str(root / "cache"), *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "2"}
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    return [json.loads(line)["loss"] for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tutorial")
    _write_package(root)
    return root


def test_tutorial_model_trains_on_the_toy_text_corpus(package):
    losses = _train(package, package / "toy")
    assert len(losses) == 14
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


def test_tutorial_model_trains_from_a_jsonl_file_with_a_tokenizer_folder(package):
    from hyper_parallel.data.text import ToyTextSpec, cached_toy_text, make_toy_documents

    tokenizer = cached_toy_text(str(package / "cache")).tokenizer_dir
    corpus = package / "corpus.jsonl"
    with corpus.open("w", encoding="utf-8") as f:
        for doc in make_toy_documents(ToyTextSpec(seed=11)):  # other documents than the embedded corpus
            f.write(json.dumps({"text": doc["text"]}) + "\n")
    losses = _train(package, package / "jsonl", "--data.path", str(corpus), "--data.tokenizer", tokenizer)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
