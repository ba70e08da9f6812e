"""Hybrid context parallel (``--parallelism.context_parallel_ulysses_degree``): the checks that run before any
compute, the per-core plan, and the piece order that makes the two levels exact (no process group needed; the
multi-rank runs are ``tests/torch/st/test_context_parallel_hybrid.py``)."""

from __future__ import annotations

import pytest

from hyper_parallel.config import ParallelismConfig
from hyper_parallel.config.errors import ConfigError
from hyper_parallel.distributed.context_parallel import plan_context_parallel
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.dry_run import main
from hyper_parallel.models.common.attention import CPShard
from hyper_parallel.models.common.gated_deltanet import GatedDeltaNet
from hyper_parallel.models.qwen3_5_moe_v2.model import qwen3_5_moe_config
from hyper_parallel.models.qwen3_5_moe_v2.parallelize import validate_qwen3_5_moe_layout

FLAG = "--parallelism.context_parallel_ulysses_degree"


def _dims(cp: int, ulysses: int, world: int | None = None, tp: int = 1) -> ParallelDims:
    p = ParallelismConfig(
        context_parallel_degree=cp, context_parallel_ulysses_degree=ulysses, tensor_parallel_degree=tp
    )
    return ParallelDims.from_config(p, world or cp * tp)


def _config(n_heads: int = 2, n_kv_heads: int = 2, k_heads: int = 2):
    return qwen3_5_moe_config(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads, head_dim=8, linear_num_key_heads=k_heads, linear_num_value_heads=2 * k_heads,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, partial_rotary_factor=0.5,
        mrope_section=(1, 1, 0),
    )  # fmt: skip


@pytest.mark.parametrize("ulysses", [0, 3, 8])
def test_degree_must_divide_cp(ulysses):
    with pytest.raises(ConfigError, match=f"{FLAG} is {ulysses}; it must be >= 1 and divide"):
        _dims(4, ulysses)


def test_degrees_and_mesh_axes():
    pd = _dims(8, 2, world=16)
    assert (pd.cp_inner, pd.cp_outer, pd.hybrid_cp) == (2, 4, True)
    assert (pd.degree("cp_inner"), pd.degree("cp_outer")) == (2, 4)
    assert "cp_inner=2" in str(pd)
    for off in (_dims(4, 1), _dims(4, 4)):  # 1: no hybrid; cp: Ulysses over the whole group, no outer level
        assert not off.hybrid_cp and off.degree("cp_inner") == off.degree("cp_outer") == 1


def test_layout_checks_name_the_flag():
    # 1 K/V head cannot be split over 2 Ulysses ranks (the attention check of ParallelDims.validate_model)
    with pytest.raises(ConfigError, match=f"{FLAG} \\(2\\) ranks, but the model has 1 n_kv_heads"):
        validate_qwen3_5_moe_layout(_config(n_kv_heads=1), _dims(4, 2))
    # 2 DeltaNet key heads per tp rank cannot be split over 4 (nor over 2 under TP 2)
    with pytest.raises(ConfigError, match=f"{FLAG} \\(4\\) ranks, but the model has 2 Gated DeltaNet"):
        validate_qwen3_5_moe_layout(_config(n_heads=4, n_kv_heads=4), _dims(8, 4))
    with pytest.raises(ConfigError, match="has 1 Gated DeltaNet linear_num_key_heads per tensor-parallel rank"):
        validate_qwen3_5_moe_layout(_config(n_heads=4, n_kv_heads=4), _dims(4, 2, tp=2))
    with pytest.raises(ConfigError, match=f"{FLAG} \\(4\\) ranks, but the model has 2 "):
        validate_qwen3_5_moe_layout(_config(n_heads=4), _dims(4, 4))  # = cp: Ulysses everywhere, 2 heads
    validate_qwen3_5_moe_layout(_config(), _dims(4, 2))  # 2 heads everywhere: 2 x 2 is fine
    validate_qwen3_5_moe_layout(_config(n_kv_heads=1), _dims(4, 1))  # no hybrid: K/V all-gather, no check


def test_plan_picks_the_hybrid_forms():
    model = _config().build()
    hybrid = plan_context_parallel(model, 4, ulysses=2)
    assert sorted(set(hybrid.values())) == ["hybrid_allgather", "hybrid_state_passing"]
    assert sorted(set(plan_context_parallel(model, 4).values())) == ["allgather", "state_passing"]
    # heads that divide by the whole CP degree stay on plain Ulysses (cheapest, no outer level)
    assert set(plan_context_parallel(model, 2, ulysses=2).values()) == {"ulysses"}
    wide = _config(n_heads=8, n_kv_heads=8, k_heads=2).build()  # attention divides by 8, DeltaNet does not
    forms = plan_context_parallel(wide, 8, ulysses=2)
    deltanet = {isinstance(_parent(wide, n), GatedDeltaNet): f for n, f in forms.items()}
    assert deltanet == {True: "hybrid_state_passing", False: "ulysses"}, forms
    with pytest.raises(ValueError, match=f"{FLAG} 4 ranks, but the core has 2 key heads"):
        plan_context_parallel(model, 8, ulysses=4)
    with pytest.raises(ValueError, match=f"{FLAG} \\(3\\) must be >= 1 and divide"):
        plan_context_parallel(model, 4, ulysses=3)


def _parent(model, fqn: str):
    return model.get_submodule(fqn.rsplit(".", 1)[0])


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("cp, u", [(4, 2), (8, 2), (8, 4)])
def test_inner_groups_hold_the_outer_pieces(cp, u, balanced):
    """The batch order needs no change: the ``u`` consecutive ranks of inner group ``o`` hold exactly the pieces of
    outer rank ``o`` (``cp / u`` ranks, same order kind), and ``gather_index`` puts them in the outer local order."""
    t = 2 * u  # local tokens per rank: 2 pieces of u tokens (balanced) or 1 piece of 2u
    for o in range(cp // u):
        members = [o * u + j for j in range(u)]
        full = CPShard(rank=members[0], size=cp, balanced=balanced)
        outer = CPShard(rank=o, size=cp // u, balanced=balanced)
        pieces = [P * u + j for P in outer.pieces_of(o) for j in range(u)]
        idx = full.gather_index(t, members, pieces)
        # the tokens the members hold (rank-major), read in gather_index order, are the outer shard's tokens
        held = [g for r in members for lo, hi in full.ranges(t, r) for g in range(lo, hi)]
        want = [g for lo, hi in outer.ranges(t * u) for g in range(lo, hi)]
        assert [held[i] for i in idx.tolist()] == want
    # ranks u apart (the groups exchanged) do not hold one outer shard's pieces
    strided = CPShard(rank=0, size=cp, balanced=balanced)
    outer = CPShard(rank=0, size=cp // u, balanced=balanced)
    with pytest.raises(ValueError, match="do not hold the pieces"):
        strided.gather_index(t, list(range(0, cp, cp // u)), [P * u + j for P in outer.pieces_of(0) for j in range(u)])


def test_dry_run_takes_the_hybrid_layout():
    """The dry run builds the two sub-groups, simulates a step and names them in its collective table: the
    all-to-alls stay inside the Ulysses pairs, the K/V and state all-gathers run across them."""
    report = main(["--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--world_size", "4",
                   "--parallelism.context_parallel_degree", "4", f"{FLAG}", "2"])  # fmt: skip
    comm = {(c.kind, c.axis): c.group_size for c in report.comm}
    assert comm[("all_to_all", "cp_inner")] == 2 and comm[("all_gather", "cp_outer")] == 2, comm
    assert not any(kind == "all_to_all" and "cp_inner" not in axis for kind, axis in comm), comm
