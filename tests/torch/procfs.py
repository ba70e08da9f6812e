"""Reading ``/proc`` in tests (Linux): the threads of a process, and the processes of a launch.

Process groups leak as threads (gloo runs three per group, a TCPStore one), and a killed launcher's
ranks live on as processes; both are only visible from outside, so the tests read them here.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

__all__ = ["GROUP_THREADS", "group_threads", "process_state", "processes_with_env", "thread_names"]

GROUP_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop", "pt_tcpstore_uv")
"""Threads owned by gloo process groups (a tcp loop and two run loops each) and TCPStores (a uv loop)."""


def thread_names(pid: int) -> Counter[str]:
    """Thread names (``/proc/<pid>/task/*/comm``) of process ``pid``, counted."""
    names: Counter[str] = Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            names[Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()] += 1
        except FileNotFoundError:  # the thread ended while we listed
            continue
    return names


def group_threads(pid: int) -> dict[str, int]:
    """How many threads of each ``GROUP_THREADS`` name process ``pid`` runs."""
    names = thread_names(pid)
    return {name: names[name] for name in GROUP_THREADS}


def process_state(pid: int) -> str | None:
    """The state letter of ``/proc/<pid>/stat`` (``R``, ``S``, ``D``, ``Z`` zombie ...); None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rindex(")") + 2]  # the command name may contain spaces and parentheses


def processes_with_env(key: str, value: str) -> Iterator[int]:
    """Pids of the live (non-zombie) processes whose initial environment has ``key=value``.

    Children inherit the environment, so a marker set on a launcher finds every process it started,
    whatever session or parent they have now (torchrun puts each rank in its own session, and a killed
    launcher's ranks are re-parented). Only this user's processes are readable; others are skipped.
    """
    marker = f"{key}={value}".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if marker in environ.split(b"\0") and process_state(pid) not in (None, "Z"):
            yield pid
