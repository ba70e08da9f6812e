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


@pytest.mark.slow  # full-size model on the meta device, like dry_run/test_dry_run.py's 64-rank sizing
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


def test_dry_run_counts_kv_gathers_and_deltanet_state_passing_on_the_cp_axis():
    """qwen3_5_moe_debug at cp 4 (x FSDP 2, 8 ranks): its 2 K/V heads and 2 DeltaNet key heads are fewer than 4, so
    attention gathers K/V and DeltaNet passes state. On the cp group per step (fp32, one micro-batch of 512 tokens,
    t = 128 per rank, two pieces of 64): the attention layer gathers ``cat(k, v) [1, 2, t, 32 + 32]``; each of the 3
    DeltaNet layers gathers its pieces' conv tails ``[2, 1, 3, 128]`` (K - 1 = 3 rows of the 2 x (16 + 16 + 2 x 16)
    conv channels) and their state summaries ``[2, 1, 4, 16, 16 + 16]`` (4 value heads, ``S_zero | M``); every
    gather is reduce-scattered back in backward. The Switch aux loss pools its per-expert sums over the cp ranks once
    per forward and once in backward (``distributed/token_split.py``): ``[8 counts | 8 probability sums | rows]``."""
    report = main(["--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--world_size", "8",
                   "--parallelism.context_parallel_degree", "4"])  # fmt: skip
    cp, fp32, t = 4, 4, 512 // 4
    kv = cp * 2 * t * (32 + 32) * fp32
    tails, summaries = cp * 2 * 3 * 128 * fp32, cp * 2 * 4 * 16 * (16 + 16) * fp32
    expect = (1 + 3 * 2, kv + 3 * (tails + summaries))
    comm = {c.kind: (c.calls, c.nbytes) for c in report.comm if c.axis == "cp"}
    aux_pool = (2, 2 * (8 + 8 + 1) * fp32)
    assert comm == {"all_gather": expect, "reduce_scatter": expect, "all_reduce": aux_pool}
    assert report.peak["Total"] > max(m.static for m in report.ranks)
