"""Profiler (torchtitan's profiling flags): Chrome traces per rank on the global-step schedule, CUDA-only
memory snapshots ignored off-GPU, option checks that name the flag."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from hyper_parallel.components import Profiler
from hyper_parallel.components.profiler import ProfilingConfig


def tiny_loop(profiler: Profiler, steps: int) -> None:
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        with torch.profiler.record_function("tiny_train_step"):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        profiler.step()


def traces(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.json"))


def test_three_steps_write_one_trace(tmp_path):
    cfg = ProfilingConfig(enable_profiling=True, profile_freq=3, profiler_warmup=1, profiler_active=1)
    with cfg.build(dump_folder=tmp_path, device="cpu") as profiler:
        tiny_loop(profiler, 3)
    assert traces(tmp_path) == ["profile_traces/iteration_3/rank0_trace.json"]
    events = json.loads((tmp_path / "profile_traces/iteration_3/rank0_trace.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "tiny_train_step" in names and "aten::addmm" in names  # the recorded step, with its ops
    assert sum(name == "tiny_train_step" for name in (e.get("name") for e in events)) == 1  # active = 1 step


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events at the end of each cycle")  # one trace per cycle
def test_schedule_follows_global_steps(tmp_path):
    # every profile_freq steps; a run resumed at step 5 traces the same steps (8) as an uninterrupted one
    cfg = ProfilingConfig(enable_profiling=True, profile_freq=4, profiler_warmup=1, profiler_active=2,
                          save_traces_folder="tr")  # fmt: skip
    with cfg.build(dump_folder=tmp_path / "a") as profiler:
        tiny_loop(profiler, 9)
    assert traces(tmp_path / "a") == ["tr/iteration_4/rank0_trace.json", "tr/iteration_8/rank0_trace.json"]
    with cfg.build(dump_folder=tmp_path / "b", global_step=5) as profiler:
        tiny_loop(profiler, 4)  # steps 6..9
    assert traces(tmp_path / "b") == ["tr/iteration_8/rank0_trace.json"]


def test_disabled_writes_nothing(tmp_path):
    with ProfilingConfig().build(dump_folder=tmp_path) as profiler:
        tiny_loop(profiler, 12)
    assert not any(tmp_path.iterdir())


def test_memory_snapshot_is_ignored_off_cuda(tmp_path, caplog):
    cfg = ProfilingConfig(enable_memory_snapshot=True, profile_freq=2)
    with caplog.at_level(logging.INFO, logger="hyper_parallel.components.profiler"):
        with cfg.build(dump_folder=tmp_path, device="cpu") as profiler:
            tiny_loop(profiler, 2)
    assert "enable_memory_snapshot is ignored: it needs CUDA" in caplog.text
    assert not profiler.memory_snapshot and not any(tmp_path.iterdir())


def test_memory_snapshot_schedule_and_oom_dump(tmp_path, monkeypatch):
    # The CUDA allocator calls are stubbed (no GPU here): this checks when and where snapshots are dumped.
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda enabled="all", **kw: calls.append(enabled))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: open(path, "wb").close())  # noqa: SIM115
    cfg = ProfilingConfig(enable_memory_snapshot=True, profile_freq=2)
    with pytest.raises(torch.OutOfMemoryError):
        with cfg.build(dump_folder=tmp_path, global_step=1, device="cuda") as profiler:
            for _ in range(3):  # steps 2, 3, 4
                profiler.step()
            raise torch.OutOfMemoryError("step 5 ran out of memory")  # the exception is not swallowed
    dumped = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.pickle"))
    assert dumped == [
        "memory_snapshot/iteration_2/rank0_memory_snapshot.pickle",
        "memory_snapshot/iteration_4/rank0_memory_snapshot.pickle",
        "memory_snapshot/iteration_5_exit/rank0_memory_snapshot.pickle",
    ]
    assert calls == ["all", None]  # recording started on entry and stopped on exit


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory snapshots need a GPU")
def test_memory_snapshot_on_cuda(tmp_path):
    cfg = ProfilingConfig(enable_memory_snapshot=True, profile_freq=2)
    with cfg.build(dump_folder=tmp_path, device="cuda") as profiler:
        for _ in range(2):
            torch.randn(1024, 1024, device="cuda").sum()
            profiler.step()
    assert (tmp_path / "memory_snapshot/iteration_2/rank0_memory_snapshot.pickle").stat().st_size > 0


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(profile_freq=0), "profiling.profile_freq=0 must be >= 1"),
        (dict(profiler_active=0), "profiling.profiler_active=0 must be >= 1"),
        (dict(enable_profiling=True, profile_freq=3), "raise --profiling.profile_freq"),  # warmup 3 + active 1 > 3
    ],
)
def test_bad_options_name_the_flag(kw, message):
    with pytest.raises(ValueError, match=message):
        ProfilingConfig(**kw)
