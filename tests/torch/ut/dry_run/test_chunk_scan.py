"""Dry run of Gated DeltaNet's chunk scan: without data (fake tensors) it runs two steps per document count instead
of every chunk, with the same allocations: the tracked peak is the same to the byte as the full loop's, for one
document and for packed documents of different lengths, and for a whole simulated training step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.dry_run import dry_run
from hyper_parallel.dry_run.simulation import SimulationMode
from hyper_parallel.models.common import gated_delta_rule as gdr
from hyper_parallel.models.common.attention import AttentionMeta
from hyper_parallel.models.qwen3_5_moe_v2.config_registry import qwen3_5_moe_debug


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _all_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the scan run every step, as it does with data."""
    monkeypatch.setattr(gdr, "_steps_to_run", lambda steps, like: [True] * len(steps))


def _fake_rule_step(cu: list[int] | None, T: int) -> tuple[int, int]:
    """Peak bytes and dispatched ops of one fake forward + backward of the rule (1 key, 2 value heads of 128: the
    recurrent state, 128 x 128 per head, is larger than a 64 x 64 chunk's intra-chunk matrices)."""
    Hk, Hv, D = 1, 2, 128
    rule = gdr.GatedDeltaRule.Config(backend="torch").build(head_k_dim=D, head_v_dim=D)
    # the boundaries are host data (real), as in a dry run; the activations are fake
    meta = AttentionMeta(cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32))
    with FakeTensorMode(allow_non_fake_inputs=True), SimulationMode():
        qkv = torch.randn(1, T, Hk, 2 * D + 2 * D, requires_grad=True)
        g = torch.randn(1, T, Hv, requires_grad=True)
        beta = torch.rand(1, T, Hv, requires_grad=True)
        conv = torch.randn(Hk * 4 * D, 4, requires_grad=True)
        tracker, count = MemTracker(), _CountOps()
        with tracker, count:
            rule(qkv, g, beta, conv_weight=conv, meta=meta).sum().backward()
        peak = tracker.get_tracker_snapshot("peak")
    return sum(dev["Total"] for dev in peak.values()), count.ops


# many short documents: a chunk step's temporaries (a state per document) are larger than the whole stream's
# activations, so the peak is in the scan
_SHORT = list(range(0, 2049, 64))
_MIXED = [0, *range(64, 2048, 64), 3000, 3100, 4096]


@pytest.mark.parametrize("cu", [None, _SHORT + [4096], _MIXED], ids=["one_document", "short_documents", "mixed"])
def test_fake_scan_has_the_full_loops_peak_with_few_dispatches(cu, monkeypatch):
    T = 4096  # 64 chunk steps of 64
    fast_peak, fast_ops = _fake_rule_step(cu, T)
    _all_steps(monkeypatch)
    full_peak, full_ops = _fake_rule_step(cu, T)
    assert fast_peak == full_peak > 0
    assert fast_ops * 2 < full_ops  # ~30 dispatches per skipped chunk step are gone


def test_dry_run_step_peak_equals_the_full_scans(monkeypatch):
    """qwen3_5_moe_debug (3 DeltaNet layers), 4096 tokens per micro-batch, context parallel 2 (Ulysses over the
    DeltaNet key heads: every rank scans whole sequences), full recomputation: the same peak, in every category."""
    cfg = copy.deepcopy(qwen3_5_moe_debug())
    cfg.parallelism.context_parallel_degree = 2
    cfg.activation_checkpoint.mode = "full"
    cfg.data.max_tokens_per_microbatch = 4096
    cfg.data.global_batch_tokens = 0
    fast = dry_run(cfg, world_size=2)
    _all_steps(monkeypatch)
    full = dry_run(cfg, world_size=2)
    assert fast.peak == full.peak and fast.peak["Total"] > 0
