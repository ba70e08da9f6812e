"""Dry run of pipeline-parallel layouts (``hyper_parallel/dry_run/pipeline.py``): the schedule arithmetic (bubble,
micro-batches in flight, p2p bytes), the per-stage split and memory, the PP advice, and the ``qwen3_5_moe_397b``
recipe (dimensions of the release, fitting PP layouts on 128 and, as LoRA, on 64 x 80 GiB)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hyper_parallel.config import ParallelismConfig
from hyper_parallel.config.errors import ConfigError
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.pipeline_plan import plan_stages
from hyper_parallel.dry_run import main
from hyper_parallel.dry_run.advice import fitting_pp_degree
from hyper_parallel.dry_run.pipeline import boundary_bytes, bubble_fraction, in_flight, pp_group
from hyper_parallel.models.qwen3_5_moe_v2.config_registry import qwen3_5_moe_397b, qwen3_5_moe_debug
from hyper_parallel.models.qwen3_5_moe_v2.hf_config import config_to_hf

GIB = 1 << 30

# Qwen/Qwen3.5-397B-A17B config.json, text_config (the keys our reader takes), as published
RELEASED_397B = {
    "vocab_size": 248320, "hidden_size": 4096, "num_hidden_layers": 60, "num_attention_heads": 32,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 64,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
    "full_attention_interval": 4, "mtp_num_hidden_layers": 1,
}  # fmt: skip


def test_bubble_fraction_per_schedule():
    assert bubble_fraction("1F1B", 8, 32) == pytest.approx(7 / 39)
    assert bubble_fraction("GPipe", 4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction("Interleaved1F1B", 4, 8, stages_per_rank=2) == pytest.approx(3 / 19)
    assert bubble_fraction("ZBVZeroBubble", 4, 8, stages_per_rank=2) == 0.0
    assert bubble_fraction("DualPipeV", 4, 8, stages_per_rank=2) == 0.0
    assert bubble_fraction("1F1B", 1, 8) == 0.0


def test_micro_batches_in_flight_per_stage():
    assert [in_flight("1F1B", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1F1B", 4, 2, r) for r in range(4)] == [2, 2, 2, 1]
    assert [in_flight("GPipe", 4, 6, r) for r in range(4)] == [6] * 4
    # Megatron's interleaved warm-up: 2 (P - r - 1) + (v - 1) P + 1 chunks, each half of the rank's layers
    assert [in_flight("Interleaved1F1B", 4, 8, r, 2) for r in range(4)] == [5.5, 4.5, 3.5, 2.5]
    assert [in_flight("ZBVZeroBubble", 4, 8, r, 2) for r in range(4)] == [4] * 4
    # DualPipe README: PP + 1 stage-sized activations per device (PP = 2 P stages), i.e. P + 1/2 of the rank's layers
    assert [in_flight("DualPipeV", 4, 8, r, 2) for r in range(4)] == [4.5] * 4
    assert in_flight("DualPipeV", 4, 2, 0, 2) == 2.0  # no more than the step's micro-batches


def test_p2p_bytes_per_boundary():
    """qwen3_5_moe_debug (D 64, 8 experts, aux loss on) with its MTP block, 512 tokens, cp 2 x tp 2 (sequence
    parallel), fp32: hidden states [1, 512 / 4, 64], MTP embeddings [1, 512 / 2, 64], router statistics 2 x 8 + 2."""
    cfg = qwen3_5_moe_debug()
    cfg.model = dataclasses.replace(cfg.model, use_mtp=True)
    pd = ParallelDims.from_config(
        ParallelismConfig(pipeline_parallel_degree=2, context_parallel_degree=2, tensor_parallel_degree=2), 8
    )
    assert pd.sp_enabled
    assert boundary_bytes(cfg, pd) == 128 * 64 * 4 + 256 * 64 * 4 + (2 * 8 + 2) * 4
    assert [pp_group(r, pd) for r in range(8)] == [0] * 4 + [1] * 4


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_p2p_sends_per_rank_skip_local_boundaries(schedule):
    """A V over 2 ranks: stages 0, 3 on rank 0 and 1, 2 on rank 1; the 1 -> 2 boundary stays on rank 1 (4
    micro-batches per step: DualPipeV runs at least one per stage)."""
    report = _debug_pp("--parallelism.pipeline_schedule", schedule, "--parallelism.pipeline_stages_per_rank", "2",
                       "--data.global_batch_tokens", "8192", "--no_step")  # fmt: skip
    pipe = report.pipeline
    assert pipe.stage_rank == [0, 1, 1, 0] and pipe.boundaries == 2 and pipe.bubble == 0.0 and pipe.micro_batches == 4
    per = pipe.micro_batches * pipe.boundary_bytes
    assert [pipe.rank_sent_bytes(r) for r in range(2)] == [2 * per, 2 * per]


def _debug_pp(*extra: str):
    return main(["--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--world_size", "8",
                 "--parallelism.pipeline_parallel_degree", "2", "--data.global_batch_tokens", "4096", *extra])  # fmt: skip


def test_per_stage_split_memory_and_in_flight_peak():
    """PP 2 x FSDP 4 of qwen3_5_moe_debug, 2 micro-batches per step: the stages are the trainer's plan, each rank
    holds exactly its stage's FSDP shards (padded to the 4 ranks), and stage 0's peak adds one more micro-batch."""
    report = _debug_pp()
    pipe = report.pipeline
    cfg = qwen3_5_moe_debug()
    with torch.device("meta"):
        whole = cfg.model.build()
    spans = plan_stages(whole.stage_costs(512), 2)
    assert [s.layers for s in pipe.spans] == [s.layers for s in spans]
    assert report.distinct_shard_numel == report.model_numel == sum(p.numel() for p in whole.parameters())
    for group, span in zip(pipe.ranks, spans, strict=True):
        with torch.device("meta"):
            stage = cfg.model.build()
        stage.restrict_to_stage(span)
        padded = sum(math.ceil(p.shape[0] / 4) * p[0].numel() for p in stage.parameters())  # FSDP Shard(0) over 4
        for rank in group.ranks:
            assert report.ranks[rank].params == padded * 4, (group.pp_rank, rank)
    assert [g.in_flight for g in pipe.ranks] == [2, 1]
    first, last = pipe.ranks
    assert first.held_per_micro_batch > 0
    # torch's PipelineStage: a gradient receive buffer per micro-batch on stage 0, an activation one on stage 1
    boundary = 512 * 64 * 4 + (2 * 8 + 2) * 4  # hidden [1, 512, 64] fp32 + router statistics
    assert first.recv_buffers == last.recv_buffers == 2 * boundary and last.received == boundary
    assert first.peak == pytest.approx(first.step_peak + first.held_per_micro_batch + 2 * boundary)
    assert last.peak == pytest.approx(last.step_peak - boundary + 2 * boundary)
    assert report.estimated_peak(report.ranks[0]) == pytest.approx(first.peak)
    assert pipe.boundary_step_bytes() == 2 * 2 * boundary * 4


def test_too_few_micro_batches_fail_like_the_trainer():
    with pytest.raises(ConfigError, match="needs >= 2 micro-batches per step"):
        _debug_pp("--data.global_batch_tokens", "2048", "--no_step")


def test_fitting_pp_degree():
    # HSDP 8 x 8 on 64 ranks, 200 GiB static into 70 GiB of room: 4 stages from the replicas leave 50 GiB
    pd = ParallelDims.from_config(ParallelismConfig(data_parallel_replicate_degree=8, data_parallel_shard_degree=8), 64)
    assert fitting_pp_degree(pd, 200 * GIB, 70 * GIB, num_layers=60) == (4, 2, 64)
    assert fitting_pp_degree(pd, 200 * GIB, 20 * GIB, num_layers=60) == (10, 8, 640)  # past the replicas: more ranks
    assert fitting_pp_degree(pd, 200 * GIB, 0, num_layers=60) is None
    pd = ParallelDims.from_config(ParallelismConfig(pipeline_parallel_degree=8), 64)
    assert fitting_pp_degree(pd, 110 * GIB, 70 * GIB, num_layers=60) == (16, 1, 128)
    assert fitting_pp_degree(pd, 110 * GIB, 1 * GIB, num_layers=60) is None  # more stages than layers


def test_397b_recipe_has_the_released_dimensions():
    cfg = qwen3_5_moe_397b()
    ours = config_to_hf(cfg.model)
    for key, value in RELEASED_397B.items():
        if key == "full_attention_interval":
            types = ours["layer_types"]
            assert types == ["full_attention" if (i + 1) % value == 0 else "linear_attention" for i in range(60)]
        elif key == "mtp_num_hidden_layers":  # the recipe turns the block off; it is the release's when on
            assert cfg.model.mtp is None
            assert len(dataclasses.replace(cfg.model, use_mtp=True).mtp.layers) == value
        elif key == "rope_parameters":
            assert {k: ours[key][k] for k in value} == {**value, "mrope_section": list(value["mrope_section"])}
        else:
            assert ours[key] == value, key
    with torch.device("meta"):
        model = cfg.model.build()
    assert round(sum(p.numel() for p in model.parameters()) / 1e9) == 396  # "397B": 396.35B without the MTP block


@pytest.mark.parametrize("recipe, world", [("qwen3_5_moe_397b", 128), ("qwen3_5_moe_397b_lora", 64)])
def test_397b_pipeline_layout_fits_80_gib(recipe, world):
    """Static memory per stage (the simulated peaks, minutes of CPU, are in the recipe docstring); the fit here is
    checked with 20 GiB left for activations."""
    report = main(["--module", "qwen3_5_moe", "--config", recipe, "--world_size", str(world), "--no_step"])
    assert report.pipeline is not None and report.pipeline.pp == 8
    assert report.distinct_shard_numel == report.model_numel
    assert max(m.static for m in report.ranks) <= 60 * GIB
    assert report.fits is None  # static only: "static memory does"


def test_advice_names_a_pp_degree_when_static_does_not_fit():
    """Full training of 397B with AdamW on 64 x 80 GiB: 16 bytes per parameter, 99.8 GiB on the fullest stage; the
    advice names the pipeline degree (on more ranks) whose stages would fit."""
    report = main(["--module", "qwen3_5_moe", "--config", "qwen3_5_moe_397b", "--world_size", "64", "--no_step",
                   "--parallelism.expert_parallel_degree", "8", "--optimizer.name", "adamw"])  # fmt: skip
    assert report.fits is False
    assert any("--parallelism.pipeline_parallel_degree 16 (now 8) on 128 ranks" in line for line in report.advice)
