"""Dry run of context parallel beyond the head counts: ``qwen3_5_moe_a3b`` (2 K/V heads, 16 DeltaNet key heads)
takes context_parallel_degree 4, 8 and 16 (attention gathers K/V; DeltaNet splits its heads while they divide,
else passes state); the advice for a layout that does not fit names the CP degree that would."""

from __future__ import annotations

import pytest

from hyper_parallel.config import ParallelismConfig
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.dry_run import main
from hyper_parallel.dry_run.advice import fitting_cp_degree

GIB = 1 << 30


@pytest.mark.slow  # full-size model on the meta device, like test_dry_run's 64-rank sizing
@pytest.mark.parametrize("cp, world", [(4, 8), (8, 8), (16, 16)])
def test_qwen3_5_moe_a3b_takes_cp_beyond_the_kv_heads(cp, world):
    report = main(["--module", "qwen3_5_moe", "--config", "qwen3_5_moe_a3b", "--world_size", str(world),
                   "--parallelism.context_parallel_degree", str(cp), "--no_step"])  # fmt: skip
    assert report.distinct_shard_numel == report.model_numel


def test_advice_names_the_cp_degree_that_fits():
    pd = ParallelDims.from_config(ParallelismConfig(context_parallel_degree=2), 16)
    # 40 GiB of activations at cp 2 (20 GiB per sequence half) into 12 GiB of room: cp 8 leaves 10 GiB
    assert fitting_cp_degree(pd, 40 * GIB, 12 * GIB) == 8
    assert fitting_cp_degree(pd, 40 * GIB, 10 * GIB) == 8
    assert fitting_cp_degree(pd, 40 * GIB, 9 * GIB) == 16
    assert fitting_cp_degree(pd, 40 * GIB, 4 * GIB) is None  # cp 16 would still need 5 GiB
    assert fitting_cp_degree(pd, 40 * GIB, 0) is None
