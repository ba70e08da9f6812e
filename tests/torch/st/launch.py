"""Launching training runs (``python -m hyper_parallel.train``, or under ``torchrun``) from tests, and killing
them whole.

``torchrun`` starts every rank in a session of its own, so killing the launcher's process group (or the
launcher) leaves its ranks running as orphans, still training into the test's folder while the next run
starts there. Every process of a launch therefore carries a marker in its environment (children inherit
it, whatever session or parent they end up with), and ``Launch.kill`` SIGKILLs the launcher's session and
then every marked process until none is left, failing loudly if any survives ``KILL_TIMEOUT_S``. A run
that ends normally is likewise checked to have left no process behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.torch.procfs import process_state, processes_with_env

__all__ = ["KILL_TIMEOUT_S", "Launch", "free_port", "kill_when", "run", "train_command"]

ROOT = Path(__file__).resolve().parents[3]
MARKER = "HYPER_PARALLEL_TEST_LAUNCH"
"""Environment variable whose value names one launch; every process of the launch inherits it."""
KILL_TIMEOUT_S = 60.0
"""How long killed processes may take to exit (SIGKILL waits for an uninterruptible I/O) before the test fails."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(args: Sequence[str], nproc: int) -> list[str]:
    """``python -m hyper_parallel.train ARGS``, under ``torchrun --nproc_per_node NPROC`` when ``nproc > 1``."""
    if nproc == 1:
        return [sys.executable, "-m", "hyper_parallel.train", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), "-m", "hyper_parallel.train", *args]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _describe(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        cmdline = "?"
    return f"pid {pid} state {process_state(pid)}: {cmdline[:200]}"


@dataclass
class Launch:
    """A started run: the launcher process and the marker shared by everything it starts."""

    proc: subprocess.Popen
    token: str

    @classmethod
    def start(cls, command: Sequence[str], *, capture: bool = False) -> Launch:
        """Start ``command`` in the repository root, in a session of its own, marked with a fresh token."""
        token = f"{os.getpid()}-{uuid.uuid4().hex}"
        out = subprocess.PIPE if capture else subprocess.DEVNULL
        proc = subprocess.Popen(
            list(command), cwd=ROOT, env={**_env(), MARKER: token}, stdout=out, stderr=out, text=True,
            start_new_session=True,
        )  # fmt: skip
        return cls(proc, token)

    def processes(self) -> list[int]:
        """Pids of this launch's processes that are still alive (zombies count as exited)."""
        return sorted(processes_with_env(MARKER, self.token))

    def kill(self) -> None:
        """SIGKILL every process of the launch and wait until all of them have exited.

        The launcher's session goes first, so ``torchrun`` cannot start or restart a rank meanwhile; then
        every marked process (ranks sit in sessions of their own) is killed again until none is alive.
        """
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the launcher's session is already gone; its ranks may not be
        self._sweep(kill=True)
        self.proc.wait(timeout=KILL_TIMEOUT_S)

    def _sweep(self, *, kill: bool) -> None:
        """Wait (killing them if ``kill``) until no process of the launch is alive; fail after KILL_TIMEOUT_S."""
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while pids := self.processes():
            if time.monotonic() > deadline:
                alive = "\n".join(_describe(pid) for pid in pids)
                raise AssertionError(f"processes of the launch still alive after {KILL_TIMEOUT_S:.0f}s:\n{alive}")
            for pid in pids:
                if kill:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            time.sleep(0.01)

    def wait_all(self) -> None:
        """After the launcher exited on its own: wait until no process of the launch is left (fail if one stays)."""
        try:
            self._sweep(kill=False)
        except AssertionError:
            self.kill()  # leave no orphan behind for the next test, then fail
            raise


def run(command: Sequence[str], *, timeout: float = 600.0) -> str:
    """Run ``command`` to completion; assert it succeeded and left no process behind; return stdout + stderr.

    On a timeout the whole launch is killed (no orphan keeps training) and the test fails with the output.
    """
    launch = Launch.start(command, capture=True)
    try:
        stdout, stderr = launch.proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launch.kill()
        stdout, stderr = launch.proc.communicate()
        raise AssertionError(f"timed out after {timeout:.0f}s: {command}\n{stdout[-3000:]}{stderr[-4000:]}") from None
    launch.wait_all()
    assert launch.proc.returncode == 0, stdout[-3000:] + stderr[-4000:]
    return stdout + stderr


def kill_when(command: Sequence[str], ready: Callable[[], bool], *, timeout: float = 600.0) -> None:
    """Start ``command``; as soon as ``ready()`` holds, SIGKILL the whole launch and wait until it is gone.

    Fails if the run ended (or ``timeout`` passed) before ``ready()`` held: the kill must really interrupt it.
    """
    launch = Launch.start(command)
    deadline = time.monotonic() + timeout
    killed = False
    try:
        while time.monotonic() < deadline and launch.proc.poll() is None:
            if ready():
                launch.kill()
                killed = True
                break
            time.sleep(0.005)
    finally:
        if not killed:
            launch.kill()
    assert killed and launch.proc.returncode == -signal.SIGKILL, (
        f"the run ended (return code {launch.proc.returncode}) before it could be killed: {command}"
    )
