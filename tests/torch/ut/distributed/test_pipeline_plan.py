"""Pipeline stages without processes: the split by layer cost (input and output sides counted, Qwen3-VL's
deepstack layers on stage 0), manual splits, the stage-to-rank maps of the schedules, the pp axis of
``ParallelDims`` and its errors, and a stage model (``restrict_to_stage``) keeping the whole model's names."""

from __future__ import annotations

import pytest

from hyper_parallel.config.errors import ConfigError
from hyper_parallel.config.parallelism import ParallelismConfig
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.pipeline_plan import plan_stages, stage_ranks, stages_of_rank
from hyper_parallel.models.glm_image_moe_v2.config_registry import glm_image_moe_debug
from hyper_parallel.models.qwen3_5_moe_v2.config_registry import qwen3_5_moe_debug
from hyper_parallel.models.qwen3_vl_moe_v2.config_registry import qwen3_vl_moe_pp_debug
from hyper_parallel.protocols.pipeline_stage import StageCosts
from tests.torch.helpers import build_on_meta


def _layers(spans):
    return [(s.layers.start, s.layers.stop) for s in spans]


def test_balanced_split_counts_the_input_and_output_sides():
    assert _layers(plan_stages(StageCosts((1.0,) * 8), 4)) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # a heavy head pushes layers off the last stage, a heavy input side off the first
    assert _layers(plan_stages(StageCosts((1.0,) * 8, first=2.0, last=3.0), 4)) == [(0, 1), (1, 4), (4, 7), (7, 8)]
    # uneven layers: the split minimises the most expensive stage
    spans = plan_stages(StageCosts((4.0, 1.0, 1.0, 1.0, 1.0, 4.0)), 2)
    assert _layers(spans) == [(0, 3), (3, 6)]
    assert spans[0].is_first and spans[-1].is_last and not spans[0].is_last


def test_first_stage_keeps_the_layers_the_input_side_feeds():
    assert _layers(plan_stages(StageCosts((1.0,) * 3, first_stage_min_layers=2), 2)) == [(0, 2), (2, 3)]
    with pytest.raises(ConfigError, match="must sit on stage 0"):
        plan_stages(StageCosts((1.0,) * 4, first_stage_min_layers=2), 2, split=[1])


def test_manual_split_and_its_errors():
    assert _layers(plan_stages(StageCosts((1.0,) * 6), 3, split=[1, 5])) == [(0, 1), (1, 5), (5, 6)]
    for bad in ([3], [2, 2], [0, 3], [2, 6]):
        with pytest.raises(ConfigError, match="pipeline_split"):
            plan_stages(StageCosts((1.0,) * 6), 3, split=bad)
    with pytest.raises(ConfigError, match="fewer than the 4 pipeline stages"):
        plan_stages(StageCosts((1.0,) * 3), 4)


def test_schedules_map_stages_to_ranks():
    assert stage_ranks(4, 4, "1F1B") == [0, 1, 2, 3]
    assert stages_of_rank(1, 4, 2, "Interleaved1F1B") == [1, 3]  # a loop
    assert stages_of_rank(0, 4, 2, "ZBVZeroBubble") == [0, 3]  # a V: the first and the last stage on rank 0
    assert stages_of_rank(1, 4, 2, "ZBVZeroBubble") == [1, 2]


def _dims(world: int, **kw) -> ParallelDims:
    return ParallelDims.from_config(ParallelismConfig(**kw), world)


def test_parallel_dims_pp_axis_and_errors():
    pd = _dims(8, pipeline_parallel_degree=2, tensor_parallel_degree=2)
    assert (pd.pp, pd.dp_shard, pd.tp, pd.num_stages) == (2, 2, 2, 2) and "pp=2" in str(pd)
    assert _dims(8, pipeline_parallel_degree=2, pipeline_schedule="Interleaved1F1B", pipeline_stages_per_rank=3).num_stages == 6
    with pytest.raises(ConfigError, match="pipeline_parallel_degree \\(3\\)"):
        _dims(8, pipeline_parallel_degree=3)
    with pytest.raises(ConfigError, match="pipeline_stages_per_rank is 1: set it to 2"):
        _dims(4, pipeline_parallel_degree=2, pipeline_schedule="Interleaved1F1B")
    with pytest.raises(ConfigError, match="runs 2 stage"):
        _dims(4, pipeline_parallel_degree=2, pipeline_schedule="ZBVZeroBubble", pipeline_stages_per_rank=3)
    with pytest.raises(ConfigError, match="without pipeline parallel"):
        _dims(4, pipeline_stages_per_rank=2)
    with pytest.raises(ConfigError, match="fsdp_reshard_after_forward always"):
        _dims(4, pipeline_parallel_degree=2, pipeline_schedule="ZBVZeroBubble", pipeline_stages_per_rank=2,
              fsdp_reshard_after_forward="always")  # fmt: skip


def test_stage_model_keeps_the_whole_models_names():
    config = glm_image_moe_debug().model
    whole = set(build_on_meta(config).state_dict())
    spans = plan_stages(build_on_meta(config).stage_costs(128), 2)
    names = []
    for span in spans:
        part = build_on_meta(config)
        part.restrict_to_stage(span)
        keys = set(part.state_dict())
        assert {int(k.split(".")[1]) for k in keys if k.startswith("layers.")} == set(span.layers)
        assert ("embed_tokens.weight" in keys) == span.is_first and ("vq_to_llm_proj.weight" in keys) == span.is_first
        assert ("lm_head.weight" in keys) == span.is_last and ("norm.weight" in keys) == span.is_last
        assert part.pipeline_full_shapes.keys() == whole
        names.append(keys)
    assert names[0] | names[1] == whole and not names[0] & names[1]


def test_stage_costs_differ_by_layer_kind_and_keep_deepstack_on_stage_0():
    qwen = build_on_meta(qwen3_5_moe_debug().model)  # Gated DeltaNet x 3 + gated attention
    costs = qwen.stage_costs(4096)
    kinds = [type(layer.self_attn).__name__ for layer in qwen.layers]
    attention = [c for c, k in zip(costs.layers, kinds) if k == "GatedAttention"]
    deltanet = [c for c, k in zip(costs.layers, kinds) if k == "GatedDeltaNet"]
    assert attention and deltanet and attention[0] != deltanet[0]
    assert costs.last > 0 and costs.first == 0.0  # the embedding lookup is free, the head is not
    vl = build_on_meta(qwen3_vl_moe_pp_debug().model)
    vl_costs = vl.stage_costs(256)
    assert vl_costs.first_stage_min_layers == 2 and vl_costs.first > 0  # the tower's matmuls on stage 0
    assert plan_stages(vl_costs, 4)[0].layers == range(0, 2)


def test_tied_embeddings_are_refused_by_name():
    from hyper_parallel.models.qwen3_vl_moe_v2.config_registry import qwen3_vl_debug

    part = build_on_meta(qwen3_vl_debug().model)
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        part.restrict_to_stage(plan_stages(part.stage_costs(128), 2)[0])


def test_microbatch_count_is_checked_with_the_fix_named():
    from hyper_parallel.distributed.pipeline_parallel import check_microbatches

    pd = _dims(8, pipeline_parallel_degree=4)  # dp 2
    check_microbatches(pd, "1F1B", 4, tokens_per_microbatch=128)
    check_microbatches(pd, "GPipe", 1, tokens_per_microbatch=128)
    with pytest.raises(ConfigError, match="needs >= 4 micro-batches per step, but the step has 2.*to 1024"):
        check_microbatches(pd, "1F1B", 2, tokens_per_microbatch=128)
    pd = _dims(4, pipeline_parallel_degree=2, pipeline_schedule="Interleaved1F1B", pipeline_stages_per_rank=2)
    with pytest.raises(ConfigError, match="a multiple of 2.*has 3.*to 2048"):
        check_microbatches(pd, "Interleaved1F1B", 3, tokens_per_microbatch=256)
    pd = _dims(4, pipeline_parallel_degree=2, pipeline_schedule="DualPipeV", pipeline_stages_per_rank=2)
    check_microbatches(pd, "DualPipeV", 4, tokens_per_microbatch=256)  # one per stage
    with pytest.raises(ConfigError, match="DualPipeV over 2 ranks needs >= 4 micro-batches.*has 3.*to 2048"):
        check_microbatches(pd, "DualPipeV", 3, tokens_per_microbatch=256)


def test_every_schedule_has_its_rules_and_the_layout_check_reads_them():
    from hyper_parallel.distributed.pipeline_parallel import torch_schedules
    from hyper_parallel.distributed.pipeline_plan import SCHEDULES

    assert {n: hasattr(torch_schedules, r.torch_class) for n, r in SCHEDULES.items()} == dict.fromkeys(SCHEDULES, True)
    assert stage_ranks(4, 2, "DualPipeV") == [0, 1, 1, 0] == stage_ranks(4, 2, "ZBVZeroBubble")
    assert stage_ranks(4, 2, "Interleaved1F1B") == [0, 1, 0, 1]
    with pytest.raises(ConfigError, match="DualPipeV runs 2 stage.*pipeline_stages_per_rank is 3: set it to 2$"):
        _dims(4, pipeline_parallel_degree=2, pipeline_schedule="DualPipeV", pipeline_stages_per_rank=3)
    with pytest.raises(ConfigError, match="Interleaved1F1B runs >= 2 stage.*is 1: set it to 2 or more"):
        _dims(4, pipeline_parallel_degree=2, pipeline_schedule="Interleaved1F1B")
    with pytest.raises(ConfigError, match="DualPipeV computes weight gradients apart.*always frees"):
        ParallelDims.from_config(ParallelismConfig(pipeline_parallel_degree=2, pipeline_schedule="DualPipeV",
                                                   pipeline_stages_per_rank=2, fsdp_reshard_after_forward="always"), 4)  # fmt: skip
