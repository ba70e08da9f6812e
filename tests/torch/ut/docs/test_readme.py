"""Every shell command in the README's code blocks runs, so the README cannot drift from the code.

Each ``python -m <module> ARGS`` command runs that module's own entry function in this process with the
same arguments (no interpreter start per command). A training command (plain or under torchrun) is
checked through ``ConfigManager().parse_args``, which resolves the recipe and applies every override
exactly as ``python -m hyper_parallel.train`` does, without training. ``make`` targets are checked with
``make -n``. A command no rule covers fails the test: add a rule when the README gains one.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
README = REPO / "README.md"


def readme_commands() -> list[list[str]]:
    """Each command of every ```bash block, continuation lines joined, comments dropped."""
    text = README.read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                commands.append(argv)
    return commands


def _parse_config(args: list[str]) -> int:
    from hyper_parallel.config import ConfigManager

    ConfigManager().parse_args(args)
    return 0


def _dry_run(args: list[str]) -> int:
    from hyper_parallel.dry_run import main

    main(args)
    return 0


def _runner(argv: list[str]) -> Callable[[], int] | None:
    """What the test runs for a README command, returning its exit status (None: no rule)."""
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # VAR=value before the command
        argv = argv[1:]
    if argv[0] == "bash" and argv[1].startswith("benchmarks/"):  # syntax here; benchmarks/test_gpu_check.py runs gpu_check.sh --cpu
        return lambda: subprocess.run(["bash", "-n", str(REPO / argv[1])], capture_output=True).returncode
    if argv[0] == "make":
        return lambda: subprocess.run(["make", "-n", "-C", str(REPO), *argv[1:]], capture_output=True).returncode
    if argv[0] == "torchrun":
        argv = ["python", *argv[argv.index("-m") :]]  # the launched module and its arguments
    if argv[0] not in ("python", ".venv/bin/python") or len(argv) < 3 or argv[1] != "-m":
        return None
    module, args = argv[2], argv[3:]
    if module in ("hyper_parallel.train", "hyper_parallel.config.manager"):
        return lambda: _parse_config(args)
    if module == "hyper_parallel.dry_run":
        return lambda: _dry_run(args)
    if module.startswith("hyper_parallel.data."):
        return lambda: importlib.import_module(f"{module}.cli").main(args)
    return None


# Release folders the README's fine-tuning commands name -> the transcribed config.json standing in for them (a
# command is parsed, not trained: the folder's config.json is all that is read)
RELEASE_FOLDERS = {
    "Qwen3.5-35B-A3B": "qwen3_5_35b_a3b.json",
    "Qwen3-VL-30B-A3B-Instruct": "qwen3_vl_30b_a3b_instruct.json",
    "GLM-4.7-Flash": "glm_4_7_flash.json",
    "Qwen3.8-27B": "qwen3_8_27b.json",
}


def _prepare(cwd: Path) -> None:
    """Files the README's commands name: its run file, a small DirectToken jsonl, stand-ins of release folders."""
    for folder, config in RELEASE_FOLDERS.items():
        (cwd / folder).mkdir()
        (cwd / folder / "config.json").write_text((Path(__file__).parents[1] / "released_configs" / config).read_text())
    text = README.read_text(encoding="utf-8")
    toml = re.findall(r"^```toml\n(.*?)^```", text, flags=re.S | re.M)
    assert toml, "the README shows a run file"
    # a run file that names itself on its first line ("# glm_mixed.toml") is written under that name; the first
    # other one is run.toml
    named = {block: re.match(r"# (\S+\.toml)\n", block) for block in toml}
    (cwd / "run.toml").write_text(next(b for b, name in named.items() if name is None))
    for block, name in named.items():
        if name is not None:
            (cwd / name.group(1)).write_text(block)
    with (cwd / "docs.jsonl").open("w") as f:
        f.write(json.dumps({"tokens": [1, 154879, 154879, 154879, 154879, 2], "vq_codes": [5, 6, 7, 8],
                            "image_grids": [[2, 2]]}) + "\n")  # fmt: skip
        f.write(json.dumps({"tokens": [3, 4, 5, 6, 7]}) + "\n")


COMMANDS = readme_commands()


def test_the_readme_has_commands_and_every_one_has_a_rule():
    assert len(COMMANDS) >= 10
    missing = [" ".join(c) for c in COMMANDS if _runner(c) is None]
    assert not missing, f"README commands without a rule in this test: {missing}"


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c)[:70] for c in COMMANDS])
def test_readme_command_runs(argv, tmp_path_factory, monkeypatch):
    cwd = tmp_path_factory.getbasetemp() / "readme"
    if not cwd.exists():
        cwd.mkdir()
        _prepare(cwd)
    monkeypatch.chdir(cwd)
    try:
        status = _runner(argv)()
    except SystemExit as e:  # --help
        status = e.code or 0
    assert status == 0, " ".join(argv)
