"""Every shell command in the README's code blocks runs, so the README cannot drift from the code.

Commands that are cheap run as written. A training command (plain or under torchrun) is checked through
``python -m hyper_parallel.config.manager`` with the same arguments, which resolves the recipe and
applies every override exactly as the trainer would, without training. ``make`` targets are checked
with ``make -n``. A command no rule covers fails the test: add a rule when the README gains one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
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


def _check_argv(argv: list[str]) -> list[str] | None:
    """The command the test runs for a README command (None: no rule)."""
    py = [sys.executable]
    if argv[0] == "make":
        return ["make", "-n", *argv[1:]]
    if argv[0] == "torchrun":
        argv = ["python", *argv[argv.index("-m") :]]  # the launched module and its arguments
    if argv[0] not in ("python", ".venv/bin/python") or len(argv) < 3 or argv[1] != "-m":
        return None
    module, args = argv[2], argv[3:]
    if module == "hyper_parallel.train":
        return [*py, "-m", "hyper_parallel.config.manager", *args]
    if module in ("hyper_parallel.config.manager", "hyper_parallel.dry_run") or module.startswith("hyper_parallel.data."):
        return [*py, "-m", module, *args]
    return None


def _prepare(cwd: Path) -> None:
    """Files the README's commands name: its run file and a small DirectToken jsonl."""
    text = README.read_text(encoding="utf-8")
    toml = re.findall(r"^```toml\n(.*?)^```", text, flags=re.S | re.M)
    assert toml, "the README shows a run file"
    (cwd / "run.toml").write_text(toml[0])
    with (cwd / "docs.jsonl").open("w") as f:
        f.write(json.dumps({"tokens": [1, 154879, 154879, 154879, 154879, 2], "vq_codes": [5, 6, 7, 8],
                            "image_grids": [[2, 2]]}) + "\n")  # fmt: skip
        f.write(json.dumps({"tokens": [3, 4, 5, 6, 7]}) + "\n")


COMMANDS = readme_commands()


def test_the_readme_has_commands_and_every_one_has_a_rule():
    assert len(COMMANDS) >= 10
    missing = [" ".join(c) for c in COMMANDS if _check_argv(c) is None]
    assert not missing, f"README commands without a rule in this test: {missing}"


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c)[:70] for c in COMMANDS])
def test_readme_command_runs(argv, tmp_path_factory):
    cwd = tmp_path_factory.getbasetemp() / "readme"
    if not cwd.exists():
        cwd.mkdir()
        _prepare(cwd)
    cmd = _check_argv(argv)
    if cmd[0] == "make":
        cmd = [*cmd[:2], "-C", str(REPO), *cmd[2:]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{' '.join(argv)}\n-> {' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
