"""Async checkpoints stage into one reused (pinned on CUDA) set of buffers instead of fresh memory per save.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager

from hyper_parallel.components import CheckpointManager


# DCP announces that it runs without a process group in these single-process tests
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _tensors(sub, f"{prefix}.{key}").items()}
    return {}


def test_async_saves_reuse_one_stager_and_its_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    stagers: list[Any] = []
    staged: list[dict[str, torch.Tensor]] = []
    real_async_save, real_stage = dcp.async_save, DefaultStager.stage

    def async_save(state: Any, **kwargs: Any) -> Any:
        stagers.append(kwargs.get("async_stager"))
        return real_async_save(state, **kwargs)

    def stage(self: DefaultStager, state_dict: Any, **kwargs: Any) -> Any:
        out = real_stage(self, state_dict, **kwargs)
        staged.append(_tensors(out))
        return out

    monkeypatch.setattr(dcp, "async_save", async_save)
    monkeypatch.setattr(DefaultStager, "stage", stage)
    model = nn.Linear(16, 16)
    mgr = CheckpointManager.Config(enable=True, interval=1, keep_latest_k=0, async_mode="async").build(
        dump_folder=tmp_path, model_parts=[model]
    )
    for step in (1, 2):
        with torch.no_grad():
            model.weight.add_(1.0)
        assert mgr.save(step)
    at_second_save = model.weight.detach().clone()
    mgr.close()
    assert mgr.complete_steps() == [1, 2]

    assert len(stagers) == 2 and stagers[0] is not None and stagers[0] is stagers[1]
    assert stagers[0]._config.use_pinned_memory == torch.cuda.is_available()
    first, second = staged
    key = next(k for k in first if k.endswith("weight"))
    # the second save copied into the first one's buffer (DCP's default allocates new memory every save)
    assert first[key].data_ptr() == second[key].data_ptr()
    assert torch.equal(second[key], at_second_save)
