"""Running on an older torch (2.11, the lent GPU image's): each API it lacks takes its named fallback or a clear error.

The probe reads the installed torch; the fallbacks are exercised here by pretending an API is missing.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from hyper_parallel import torch_features
from hyper_parallel.config.errors import ConfigError
from hyper_parallel.distributed import fsdp
from hyper_parallel.models.common import attention
from hyper_parallel.models.common.attention import AttentionMeta


def _pretend_missing(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    found = dict(torch_features.features())
    for name in names:
        found[name] = torch_features.Feature(name, False, found[name].fallback)
    monkeypatch.setattr(torch_features, "features", lambda: found)


def test_probe_names_every_api_and_its_fallback(monkeypatch):
    assert {"varlen_attn", "varlen_attn.enable_gqa", "grouped_mm", "fsdp_unused_params"} <= set(torch_features.features())
    assert torch_features.describe().startswith(f"torch {torch.__version__}: ")
    _pretend_missing(monkeypatch, "fsdp_unused_params")
    assert "fsdp_unused_params missing (multi-rank FSDP groups refused" in torch_features.describe()


class _FakeFSDP:
    """What ``sum_gradients`` touches of an FSDP module: the reduction switches and the group's shard size."""

    def __init__(self, shard_ranks: int) -> None:
        self.calls: list[str] = []
        group = types.SimpleNamespace(mesh_info=types.SimpleNamespace(shard_mesh_size=shard_ranks))
        self._state = types.SimpleNamespace(_fsdp_param_group=group)

    def _get_fsdp_state(self):
        return self._state

    def set_gradient_divide_factor(self, f):
        self.calls.append(f"divide {f}")

    def set_force_sum_reduction_for_comms(self, on):
        self.calls.append(f"sum {on}")

    def set_reduce_scatter_unused_params(self, on, recurse):
        self.calls.append(f"unused {on}")


def test_fsdp_without_unused_param_reduction(monkeypatch):
    mod = _FakeFSDP(shard_ranks=4)
    fsdp.sum_gradients(mod)
    assert mod.calls == ["divide 1.0", "sum True", "unused True"]
    _pretend_missing(monkeypatch, "fsdp_unused_params")
    single = _FakeFSDP(shard_ranks=1)
    fsdp.sum_gradients(single)  # one rank: nothing to desynchronise
    assert single.calls == ["divide 1.0", "sum True"]
    with pytest.raises(ConfigError, match=r"4-rank FSDP group.*--parallelism.data_parallel_shard_degree 1"):
        fsdp.sum_gradients(_FakeFSDP(shard_ranks=4))


def test_varlen_without_grouped_heads_expands_kv(monkeypatch):
    """torch 2.11's ``varlen_attn`` has no ``enable_gqa``: K/V heads are repeated to the query heads instead."""
    seen = {}

    def varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, **kw):
        seen.update(kw, kv_heads=k.shape[1])
        assert window_size == (-1, 0) and cu_q is cu_k
        if kw.get("enable_gqa"):
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        bounds = cu_q.tolist()
        outs = [
            F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scale)
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
        return torch.cat([o.transpose(0, 1) for o in outs])

    monkeypatch.setattr(attention, "varlen_attn", varlen_stand_in)
    g = torch.Generator().manual_seed(0)
    H, Hk, T, d = 4, 2, 12, 8
    q = torch.randn(1, H, T, d, generator=g)
    k, v = (torch.randn(1, Hk, T, d, generator=g) for _ in range(2))
    cu = [0, 5, 12]
    meta = AttentionMeta(cu_seqlens=torch.tensor(cu, dtype=torch.int32), cu_seqlens_host=cu, max_seqlen=7)
    grouped = attention._varlen_kernel("varlen", q, k, v, 0.3, meta)
    assert seen == {"enable_gqa": True, "kv_heads": Hk}
    seen.clear()
    _pretend_missing(monkeypatch, "varlen_attn.enable_gqa")
    expanded = attention._varlen_kernel("varlen", q, k, v, 0.3, meta)
    assert seen == {"kv_heads": H}  # no enable_gqa argument, K/V expanded
    torch.testing.assert_close(expanded, grouped, rtol=0, atol=0)
