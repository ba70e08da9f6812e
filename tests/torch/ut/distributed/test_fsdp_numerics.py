"""FSDP numerics and overlap: fp32 gradient reduction by default, explicit prefetch, pinned host batches.

- A bf16 run (``--training.mixed_precision_param bfloat16``, reduce dtype left at its default) reduce-scatters
  every trainable parameter's gradient in fp32 (FSDP's per-parameter ``reduce_dtype``; FSDP drops it when it
  equals the compute dtype), and ``--training.mixed_precision_reduce bfloat16`` still turns it down.
- ``parallelize_decoder`` chains explicit prefetch: embedding -> layer 0 -> ... -> last layer -> LM head in
  forward (the next module's units, nested ones included), the reverse in backward; a step runs with it.
  Checked on the tiny GLM of the layout tests after ``parallelize`` on a 1-rank gloo world (its own process).
- Host batches are pinned before their ``non_blocking`` copy when (and only when) the device is CUDA: the
  helper and the trainer's copy, with ``pin_memory`` / ``Tensor.to`` recorded (no GPU here).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hyper_parallel.data.packing import batch_to_device, pins_host_memory
from hyper_parallel.distributed.fsdp import _param_groups


def _inspect(reduce: str | None) -> dict:
    """Parallelize the tiny GLM with bf16 params (and ``reduce``, or the default), run one step, report its units."""
    from hyper_parallel.config import ActivationCheckpointConfig, CompileConfig, TrainingConfig
    from hyper_parallel.distributed.parallel_dims import ParallelDims
    from hyper_parallel.models.glm_image_moe_v2.parallelize import parallelize_glm_image_moe
    from tests.torch.st.glm_jobs import Layout, _train, build_model

    model = build_model()
    layout = Layout(world=1)
    pd = ParallelDims.from_config(layout.parallelism(), 1)
    pd.build_mesh("cpu")
    reduce_flag = {"mixed_precision_reduce": reduce} if reduce else {}  # None: the default
    training = TrainingConfig(mixed_precision_param="bfloat16", **reduce_flag)
    parallelize_glm_image_moe(
        model, parallel_dims=pd, training=training, parallelism=layout.parallelism(),
        ac_config=ActivationCheckpointConfig(), compile_config=CompileConfig(),
    )  # fmt: skip
    result, _ = _train(model, 1, pd)  # (FSDP settles its dtypes at its lazy init, in the first forward)
    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    by_state = {id(m._get_fsdp_state()): names[id(m)] for m in model.modules() if hasattr(m, "_get_fsdp_state")}
    reduce_dtypes, param_dtypes, forward, backward = set(), set(), {}, {}
    for m in model.modules():
        if not hasattr(m, "_get_fsdp_state") or not _param_groups(m._get_fsdp_state()):
            continue
        state = m._get_fsdp_state()
        for fp in (fp for group in _param_groups(state) for fp in group.fsdp_params):
            if fp.sharded_param.requires_grad:
                # FSDP keeps reduce_dtype None when it equals the compute dtype: it reduces in that one
                reduce_dtypes.add(str(fp.reduce_dtype or fp.param_dtype or fp.orig_dtype))
                param_dtypes.add(str(fp.param_dtype or fp.orig_dtype))
        forward[names[id(m)]] = [by_state[id(s)] for s in state._states_to_forward_prefetch]
        backward[names[id(m)]] = [by_state[id(s)] for s in state._states_to_backward_prefetch]
    return {
        "reduce": sorted(reduce_dtypes), "param": sorted(param_dtypes), "forward": forward, "backward": backward,
        "loss": result["losses"][0], "n_layers": len(model.layers),
    }  # fmt: skip


def _worker(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        Path(out).write_text(json.dumps({"default": _inspect(None), "bfloat16": _inspect("bfloat16")}))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs() -> dict:
    """Both runs in one spawned 1-rank gloo world (its own process: no group left in this one)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), out), nprocs=1, join=True)
        return json.loads(Path(out).read_text())


@pytest.fixture(scope="module")
def default_run(runs) -> dict:
    return runs["default"]


def test_bf16_params_reduce_gradients_in_fp32_by_default(default_run):
    assert default_run["param"] == ["torch.bfloat16"]  # the routers' units compute in fp32: not trainable-bf16
    assert default_run["reduce"] == ["torch.float32"], default_run["reduce"]
    assert torch.isfinite(torch.tensor(default_run["loss"]))


def test_reduce_dtype_flag_still_applies(runs):
    assert runs["bfloat16"]["reduce"] == ["torch.bfloat16"]


def test_prefetch_chain(default_run):
    fwd, bwd, n = default_run["forward"], default_run["backward"], default_run["n_layers"]
    layers = [f"layers.{i}" for i in range(n)]
    chain = ["embed_tokens", *layers, "lm_head"]
    for prev, nxt in zip(chain[:-1], chain[1:]):
        assert fwd[prev][0] == nxt, (prev, fwd[prev])
        assert bwd[nxt][0] == prev, (nxt, bwd[nxt])
        # a layer's nested units (experts / routers on other meshes) are prefetched with it
        assert all(u == nxt or u.startswith(nxt + ".") for u in fwd[prev]), fwd[prev]
    assert fwd["lm_head"] == [] and bwd["embed_tokens"] == []


def test_pins_only_for_cuda():
    assert pins_host_memory(torch.device("cuda")) and pins_host_memory("cuda:1")
    assert not pins_host_memory("cpu") and not pins_host_memory(torch.device("meta"))


def _record_copies(monkeypatch) -> list:
    """Record ``pin_memory`` and ``Tensor.to`` calls; ``to`` returns the tensor (no CUDA on this machine)."""
    calls = []

    def pin(self):
        calls.append(("pin", self.data_ptr()))
        out = self.clone()
        out.pinned_marker = True
        return out

    def to(self, *args, **kwargs):
        calls.append(("to", getattr(self, "pinned_marker", False), str(args[0]), kwargs.get("non_blocking")))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return calls


def test_cuda_copies_go_through_pinned_memory(monkeypatch):
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "max_seqlen": 4, "cu_seqlens_host": [0, 4, 8]}
    calls = _record_copies(monkeypatch)
    out = batch_to_device(batch, torch.device("cuda"))
    assert [c[0] for c in calls] == ["pin", "to"]
    assert calls[1] == ("to", True, "cuda", True)  # the pinned copy goes, asynchronously
    assert out["max_seqlen"] == 4 and out["cu_seqlens_host"] == [0, 4, 8]  # host facts stay Python

    calls.clear()  # the trainer's device copy takes the same path for its device
    from hyper_parallel.components.step import StepRunner

    StepRunner.to_device(SimpleNamespace(device=torch.device("cuda")), batch)
    assert [c[0] for c in calls] == ["pin", "to"] and calls[1][1] is True

    calls.clear()  # a CPU run pins nothing
    StepRunner.to_device(SimpleNamespace(device=torch.device("cpu")), batch)
    assert [c[0] for c in calls] == ["to"] and calls[0][1] is False
