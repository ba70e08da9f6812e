"""Jobs of the dense VL layout tests (gloo workers, see ``harness.py``): the two dense vision-language models
of the VL package, tiny, trained a few steps under several parallel layouts in ONE launch, and the same steps
in one process for reference.

- ``qwen3_5``: Qwen3.5 dense VL (``Qwen3_5ForConditionalGeneration``): 3 Gated DeltaNet + 1 gated-attention
  layer, dense SwiGLU MLPs, tied embeddings (as the 0.8B-4B releases), tower without deepstack;
- ``qwen3_vl``: Qwen3-VL dense (``Qwen3VLForConditionalGeneration``): Qwen3 GQA with q/k norms, dense
  SwiGLU, deepstack mergers in the tower (built by helper V's ``qwen3_vl_config``).

The batches, the per-rank loss (``sum of token CE / global token count``) and the training loop are the
Qwen3-VL-MoE layout jobs' (``qwen3_vl_jobs``), with images AND videos in the packed rows: every layout
reads the same global rows, a data-parallel rank takes its rows' images and videos, a CP rank a chunk of
every row (``[3, B, T]`` M-RoPE positions too) with the whole tower.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.config import ActivationCheckpointConfig, CompileConfig, TrainingConfig
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.models.qwen3_vl_moe_v2 import model as vl_model
from hyper_parallel.models.qwen3_vl_moe_v2.parallelize import parallelize_qwen3_vl_moe
from tests.torch.st.glm_jobs import Layout
from tests.torch.st.qwen3_vl_jobs import IMG, MERGE, PATCH, SEED, VE, VID, VOCAB, VS, _train

__all__ = ["build_model", "layouts_job", "reference_job", "tiny_config"]

_VISION = dict(depth=2, dim=16, n_heads=2, intermediate_size=32, patch_size=PATCH, spatial_merge_size=MERGE,
               num_position_embeddings=16)  # fmt: skip
_IDS = dict(image_token_id=IMG, vision_start_token_id=VS, vision_end_token_id=VE, video_token_id=VID)


def tiny_config(family: str) -> vl_model.Qwen3VlMoeModel.Config:
    """The tiny dense VL tree of ``family`` (``qwen3_5`` or ``qwen3_vl``)."""
    if family == "qwen3_5":
        return vl_model.qwen3_5_vl_config(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, intermediate_size=48, rope_theta=1e4, partial_rotary_factor=1.0,
            mrope_section=(2, 1, 1), vision=dict(_VISION), tie_word_embeddings=True, **_IDS,
        )  # fmt: skip
    if family == "qwen3_vl":  # helper V's builder (Qwen3-VL dense text family)
        return vl_model.qwen3_vl_config(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, intermediate_size=48, rope_theta=1e4, mrope_section=(2, 1, 1),
            vision={**_VISION, "deepstack_visual_indexes": (0, 1)}, **_IDS,
        )  # fmt: skip
    raise ValueError(f"family={family!r}: expected 'qwen3_5' or 'qwen3_vl'")


def build_model(family: str) -> vl_model.Qwen3VlMoeModel:
    """The same initial weights on every rank and in the reference (seeded CPU init)."""
    torch.manual_seed(SEED)
    model = tiny_config(family).build()
    model.init_weights()
    assert model.config.text_family == family, model.config.text_family
    return model


def reference_job(families: list[str], steps: int) -> dict[str, dict[str, Any]]:
    torch.use_deterministic_algorithms(True)
    return {family: _train(build_model(family), steps, None, video=True) for family in families}


def layouts_job(cases: list[tuple[str, Layout]], steps: int) -> dict[str, dict[str, Any]]:
    """Train ``steps`` under each ``(family, layout)`` in turn: rank 0's losses, grad norms and first-step
    gradients (whole), and whether the tower's blocks are FSDP-sharded (and carry no TP placement)."""
    from torch.distributed.tensor import DTensor

    torch.use_deterministic_algorithms(True)
    out: dict[str, dict[str, Any]] = {}
    for family, layout in cases:
        model = build_model(family)
        pd = ParallelDims.from_config(layout.parallelism(), dist.get_world_size())
        pd.build_mesh("cpu")
        parallelize_qwen3_vl_moe(
            model, parallel_dims=pd, training=TrainingConfig(mixed_precision_param=layout.param_dtype),
            parallelism=layout.parallelism(), ac_config=ActivationCheckpointConfig(mode=layout.ac),
            compile_config=CompileConfig(),
        )  # fmt: skip
        result = _train(model, steps, pd, video=True)
        result["parallel_dims"] = str(pd)
        tower = [p for p in model.visual.parameters() if isinstance(p, DTensor)]
        result["tower_sharded"] = bool(tower)
        # the tower is FSDP-only: its parameters live on the data-parallel mesh, never on a tp axis
        result["tower_tp_free"] = all("tp" not in (p.device_mesh.mesh_dim_names or ()) for p in tower)
        result["tied"] = model.lm_head.weight is model.embed_tokens.weight
        out[f"{family}-{layout}"] = result
        del model
    return out

