"""CheckpointManager (single process): exact resume of model/optimizer/scheduler/EMA/data/RNG state,
keep-last-K, atomic writes (leftover ``*.tmp`` ignored), refusal of non-finite weights, async save,
HF export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hyper_parallel.components import (
    EMA,
    CheckpointManager,
    LRSchedulersContainer,
    OptimizersContainer,
    assert_finite,
)

# DCP announces that it runs without a process group in these single-process tests
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Counter:
    """Stands in for the data loader's per-rank position."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.value = sd["value"]


def _run(tmp: Path, *, seed: int = 0, **cfg: object) -> SimpleNamespace:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    opt_cfg = OptimizersContainer.Config(name="muon", lr=1e-2)
    opt = opt_cfg.build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, total_steps=10)
    ema = EMA.Config(decay=0.5).build(model=model)
    data = Counter()
    options = {"enable": True, "interval": 2, "keep_latest_k": 0, **cfg}
    mgr = CheckpointManager.Config(**options).build(
        dump_folder=tmp,
        model_parts=[model],
        optimizers=opt,
        lr_schedulers=sched,
        states={"ema": ema},
        rank_states={"dataloader": data},
        run_config=opt_cfg,
    )
    return SimpleNamespace(model=model, opt=opt, sched=sched, ema=ema, data=data, mgr=mgr)


def _step(run: SimpleNamespace) -> float:
    x = torch.randn(5, 6)  # global RNG: a resume must restore it to see the same batch
    run.opt.zero_grad()
    loss = run.model(x).pow(2).mean()
    loss.backward()
    run.opt.step()
    run.sched.step()
    run.ema.update(run.model)
    run.data.value += 1
    return loss.item()


def _same_params(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_resume_continues_exactly(tmp_path: Path) -> None:
    a = _run(tmp_path)
    for step in (1, 2):
        _step(a)
        assert a.mgr.save(step) == (step == 2)  # interval 2
    losses_a = [_step(a) for _ in range(2)]

    b = _run(tmp_path, seed=1)  # different init and RNG position
    assert b.mgr.load_latest() == 2
    assert b.data.value == 2
    losses_b = [_step(b) for _ in range(2)]
    assert losses_a == losses_b
    assert _same_params(a.model, b.model)
    assert all(torch.equal(a.ema.shadow[k], b.ema.shadow[k]) for k in a.ema.shadow)
    assert a.opt.param_groups[0]["lr"] == b.opt.param_groups[0]["lr"]

    folder = tmp_path / "checkpoint"
    assert json.loads((folder / "step-2" / "run_config.json").read_text())["name"] == "muon"
    assert (folder / "latest").read_text().strip() == "step-2"
    assert (folder / "step-2" / "rank0.pt").is_file()


def test_keep_latest_k(tmp_path: Path) -> None:
    run = _run(tmp_path, interval=1, keep_latest_k=2)
    for step in range(1, 5):
        _step(run)
        assert run.mgr.save(step)
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["step-3", "step-4"]
    assert run.mgr.complete_steps() == [3, 4]
    assert (folder / "latest").read_text().strip() == "step-4"


def test_leftover_tmp_is_ignored_and_cleaned(tmp_path: Path) -> None:
    run = _run(tmp_path)
    _step(run)
    _step(run)
    assert run.mgr.save(2)
    saved = {k: v.clone() for k, v in run.model.state_dict().items()}
    folder = tmp_path / "checkpoint"
    # a kill after DCP wrote everything but before the rename, and a kill in the middle of a write
    shutil.copytree(folder / "step-2", folder / "step-4.tmp")
    (folder / "step-6.tmp").mkdir()
    (folder / "step-6.tmp" / "__0_0.distcp").write_bytes(b"truncated")
    (folder / "step-8").mkdir()  # no .metadata: not a complete checkpoint either
    for _ in range(3):
        _step(run)

    fresh = _run(tmp_path, seed=3)
    assert fresh.mgr.load_latest() == 2
    assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in saved.items())

    _step(fresh)
    assert fresh.mgr.save(4)
    assert not list(folder.glob("*.tmp"))
    assert fresh.mgr.complete_steps() == [2, 4]


def test_non_finite_weights_are_never_saved(tmp_path: Path) -> None:
    run = _run(tmp_path)
    with torch.no_grad():
        run.model[2].weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"2\.weight"):
        assert_finite(run.model)
    with pytest.raises(FloatingPointError):
        run.mgr.save(2)
    assert run.mgr.complete_steps() == []


def test_async_save_then_resume(tmp_path: Path) -> None:
    run = _run(tmp_path, async_mode="async")
    _step(run)
    _step(run)
    assert run.mgr.save(2)
    at_save = {k: v.clone() for k, v in run.model.state_dict().items()}
    rng_at_save = torch.get_rng_state()
    _step(run)  # training goes on (and mutates the weights) while the write may still be running
    run.mgr.close()  # waits and finalises (rename, marker)
    assert run.mgr.complete_steps() == [2]
    assert (tmp_path / "checkpoint" / "latest").read_text().strip() == "step-2"

    other = _run(tmp_path, seed=5, async_mode="async")
    assert other.mgr.load_latest() == 2
    assert all(torch.equal(other.model.state_dict()[k], v) for k, v in at_save.items())
    assert torch.equal(torch.get_rng_state(), rng_at_save)


def test_disabled_manager_does_nothing(tmp_path: Path) -> None:
    run = _run(tmp_path, enable=False)
    _step(run)
    assert run.mgr.save(2) is False
    assert run.mgr.load_latest() is None
    assert not (tmp_path / "checkpoint").exists()
