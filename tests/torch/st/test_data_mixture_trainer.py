"""A three-source data mixture (issue 16) through the real entry point and a run file.

GlmImageMoe debug model, three DirectToken toy corpora mixed 0.6 / 0.3 / 0.1 by a ``--config-file``
run file (``[[data.sources]]``), fp32 deterministic:

- 1 process and FSDP 2 give the same losses, per-source losses and per-source counters;
- kill -9 after the step-3 checkpoint and run the same command again: the losses, the per-source
  losses (``loss/<name>``) and counters (``data/<name>/tokens``, ``.../epoch``) continue exactly as in
  the uninterrupted run. The kill takes the whole launch and waits until every process of it has exited
  (``launch.py``) before the resume.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hyper_parallel.data import ToyCorpusSpec, write_toy_corpus
from tests.torch.st import launch

STEPS = 8
NAMES = ("gen", "mixed", "text")



@pytest.fixture(scope="module")
def run_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mixture")
    facts = dict(lang_vocab_size=512, codebook_size=256, placeholder_token_id=511, samples_per_shard=64)
    specs = {
        "gen": ToyCorpusSpec(**facts, num_samples=384, text_only_fraction=0.0, seed=1),
        "mixed": ToyCorpusSpec(**facts, num_samples=192, two_image_fraction=0.5, seed=2),
        "text": ToyCorpusSpec(**facts, num_samples=48, text_only_fraction=1.0, seed=3),  # small: repeats
    }
    for name, spec in specs.items():
        write_toy_corpus(str(root / name), spec)
    path = root / "run.toml"
    path.write_text(
        f"""
[data]
max_tokens_per_microbatch = 256
global_batch_tokens = 1024
cache_dir = "{root / 'cache'}"

[[data.sources]]
name = "gen"
source = "direct_token"
path = "{root / 'gen'}"
weight = 0.6
direct_token = {{ loss_on = "image" }}

[[data.sources]]
name = "mixed"
source = "direct_token"
path = "{root / 'mixed'}"
weight = 0.3

[[data.sources]]
name = "text"
source = "direct_token"
path = "{root / 'text'}"
weight = 0.1
"""
    )
    return path


def _command(dump: Path, nproc: int, run_file: Path) -> list[str]:
    args = ["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--config-file", str(run_file),
            "--debug.deterministic", "--metrics.log_freq", "1", "--training.steps", str(STEPS),
            "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "5", "--checkpoint.no_export_hf",
            "--lr_scheduler.warmup_steps", "2", "--dump_folder", str(dump)]  # fmt: skip
    return launch.train_command(args, nproc)


def _run(dump: Path, nproc: int, run_file: Path) -> None:
    launch.run(_command(dump, nproc, run_file))


def _records(dump: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec  # a resumed run appends: the last record of a step wins
    return out


def _compare(a: dict[int, dict], b: dict[int, dict], steps, tol: float) -> None:
    for step in steps:
        ra, rb = a[step], b[step]
        assert abs(ra["loss"] - rb["loss"]) <= tol, (step, ra["loss"], rb["loss"])
        for name in NAMES:
            for key in (f"data/{name}/tokens", f"data/{name}/epoch", f"data/{name}/share"):
                assert ra[key] == rb[key], (step, key, ra[key], rb[key])
            key = f"loss/{name}"
            assert (key in ra) == (key in rb), (step, key)
            if key in ra:
                assert abs(ra[key] - rb[key]) <= tol, (step, key, ra[key], rb[key])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, run_file) -> dict[int, dict]:
    dump = tmp_path_factory.mktemp("ref")
    _run(dump, 1, run_file)
    return _records(dump)


def test_mixture_same_on_one_and_two_ranks(reference, run_file, tmp_path):
    assert sorted(reference) == list(range(1, STEPS + 1))
    last = reference[STEPS]
    assert sum(last[f"data/{n}/tokens"] for n in NAMES) > 0
    assert last["data/text/epoch"] >= 1  # the small source repeats
    assert any(f"loss/{n}" in rec for rec in reference.values() for n in NAMES)
    _run(tmp_path / "fsdp2", 2, run_file)
    _compare(reference, _records(tmp_path / "fsdp2"), range(1, STEPS + 1), 1e-5)


def test_kill9_and_resume_continues_losses_and_source_counters(reference, run_file, tmp_path):
    dump = tmp_path / "split"
    launch.kill_when(_command(dump, 1, run_file), (dump / "checkpoint" / "step-3" / ".metadata").is_file)
    _run(dump, 1, run_file)  # the same command again resumes from step 3 (or later)
    resumed = _records(dump)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    _compare(reference, resumed, range(1, STEPS + 1), 1e-6)
