"""``launch.kill_when`` leaves no process of a launch alive, even one in a session of its own (as torchrun's
ranks are), and fails loudly when the run ends before it could be killed."""

from __future__ import annotations

import sys

import pytest

from tests.torch.procfs import process_state
from tests.torch.st import launch

# A stand-in for torchrun: starts a "rank" in a new session (as torch elastic does), records its pid, waits.
LAUNCHER = """
import os, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(rank.pid))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


def test_kill_when_kills_ranks_in_their_own_sessions(tmp_path):
    pid_file = tmp_path / "rank.pid"
    launch.kill_when([sys.executable, "-c", LAUNCHER, str(pid_file)], pid_file.is_file, timeout=120)
    rank = int(pid_file.read_text())
    assert process_state(rank) in (None, "Z"), f"the rank (pid {rank}) outlived the kill"


def test_kill_when_fails_if_the_run_ends_first(tmp_path):
    with pytest.raises(AssertionError, match="before it could be killed"):
        launch.kill_when([sys.executable, "-c", "pass"], lambda: False, timeout=120)


def test_run_reports_a_failing_command():
    with pytest.raises(AssertionError, match="no such module"):
        launch.run([sys.executable, "-c", "import sys; sys.exit('no such module')"])
