"""Jobs of the tied-embedding layout tests (gloo workers, see ``harness.py``).

The tiny Qwen3.5 models of ``qwen3_5_jobs`` (dense and MoE) with ``tie_word_embeddings=True``: trained a
few steps under FSDP, TP and FSDP x TP in one launch per world size, and in one process for reference. After
training, each layout writes a DCP checkpoint of the model, loads it into a freshly parallelised model and
writes an HF export, reporting whether the embedding and the head are still ONE parameter at every stage.
Each layout is built the trainer's way: on the meta device, parallelised, ``to_empty``, then the seeded
full weights loaded (``set_model_state_dict``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from hyper_parallel.components.checkpoint import ModelWrapper
from hyper_parallel.config import ActivationCheckpointConfig, CompileConfig, TrainingConfig
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.models.qwen3_5_moe_v2.parallelize import parallelize_qwen3_5_moe
from hyper_parallel.models.qwen3_5_v2.parallelize import parallelize_qwen3_5
from hyper_parallel.components.model_builder import init_buffers as _init_buffers
from tests.torch.st.glm_jobs import Layout
from tests.torch.st.grad_check import whole_grads
from tests.torch.st.qwen3_5_jobs import SEED, _train, tiny_config, tiny_dense_config


def build_tied(family: str):
    """The same seeded initial weights everywhere; the head IS the embedding."""
    torch.manual_seed(SEED)
    cfg = tiny_config() if family == "moe" else tiny_dense_config()
    model = dataclasses.replace(cfg, tie_word_embeddings=True).build()
    model.init_weights()
    assert model.lm_head.weight is model.embed_tokens.weight
    return model


def tied_reference_job(steps: int, family: str) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    return _train(build_tied(family), steps, None)


def _parallelized(family: str, layout: Layout):
    """The trainer's path: build on meta, parallelise, ``to_empty``, then load the seeded full weights."""
    cfg = tiny_config() if family == "moe" else tiny_dense_config()
    with torch.device("meta"):
        model = dataclasses.replace(cfg, tie_word_embeddings=True).build()
    pd = ParallelDims.from_config(layout.parallelism(), dist.get_world_size())
    pd.build_mesh("cpu")
    (parallelize_qwen3_5_moe if family == "moe" else parallelize_qwen3_5)(
        model,
        parallel_dims=pd,
        training=TrainingConfig(),
        parallelism=layout.parallelism(),
        ac_config=ActivationCheckpointConfig(),
        compile_config=CompileConfig(),
    )
    model.to_empty(device="cpu")
    set_model_state_dict(model, build_tied(family).state_dict(), options=StateDictOptions(full_state_dict=True))
    _init_buffers(model)
    return model, pd


def _whole(model) -> dict[str, torch.Tensor]:
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def tied_layouts_job(layouts: list[Layout], steps: int, family: str, folder: str) -> dict[str, dict[str, Any]]:
    """Per layout: rank 0's losses, grad norms, first-step gradients, and the one-parameter checks."""
    torch.use_deterministic_algorithms(True)
    out: dict[str, dict[str, Any]] = {}
    for layout in layouts:
        model, pd = _parallelized(family, layout)
        tied_after_parallelize = model.lm_head.weight is model.embed_tokens.weight
        result = _train(model, steps, pd)
        result["parallel_dims"] = str(pd)
        result["tied_after_parallelize"] = tied_after_parallelize
        result["one_optimizer_param"] = sum(1 for _ in model.parameters()) == len(
            {id(p) for _, p in model.named_parameters(remove_duplicate=False)}
        )
        trained = _whole(model)

        # DCP checkpoint -> a fresh model of the same layout: still one parameter, every tensor restored
        ckpt = Path(folder) / f"{family}-{layout}" / "dcp"
        dcp.save({"model": ModelWrapper(model)}, checkpoint_id=str(ckpt))
        fresh, _ = _parallelized(family, layout)
        dcp.load({"model": ModelWrapper(fresh)}, checkpoint_id=str(ckpt))
        result["tied_after_resume"] = fresh.lm_head.weight is fresh.embed_tokens.weight
        restored = _whole(fresh)
        result["resume_max_diff"] = max((restored[k] - trained[k]).abs().max().item() for k in trained)
        result["resume_keys_equal"] = restored.keys() == trained.keys()

        # HF export (rank 0 writes): no lm_head.weight; read back tied and equal
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            from hyper_parallel.models import qwen3_5_moe_v2, qwen3_5_v2
            from hyper_parallel.hf import read_safetensors

            package = qwen3_5_moe_v2 if family == "moe" else qwen3_5_v2
            export = Path(folder) / f"{family}-{layout}" / "hf"
            package.save_pretrained(model, export, state_dict=sd)
            result["export_has_head"] = "lm_head.weight" in read_safetensors(export)
            back = package.from_pretrained(export)
            result["tied_after_export"] = back.lm_head.weight is back.embed_tokens.weight
            result["export_max_diff"] = max((back.state_dict()[k] - trained[k]).abs().max().item() for k in trained)
        dist.barrier()
        out[str(layout)] = result
    return out


__all__ = ["build_tied", "tied_layouts_job", "tied_reference_job", "whole_grads"]
