"""Jobs of the sharded FP8 load test (gloo workers, see ``harness.py``): an FP8 block-quantized release
(``tests/torch/ut/hf/test_fp8_load.py: write_fp8_release``) loaded into each parallel layout of one launch, each
rank dequantizing only its own slices; compared with the one-process load of the dequantized folder."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hyper_parallel.config import ActivationCheckpointConfig, CompileConfig, TrainingConfig
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.hf import load_hf_weights, model_state_dict, read_hf_config
from hyper_parallel.hf.storage import StoredTensor
from hyper_parallel.protocols.model import split_output
from tests.torch.st.glm_jobs import Layout


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _family(family: str) -> tuple[Any, Any]:
    if family == "qwen3_5_moe":
        from hyper_parallel.models import qwen3_5_moe_v2
        from hyper_parallel.models.qwen3_5_moe_v2.parallelize import parallelize_qwen3_5_moe

        return qwen3_5_moe_v2, parallelize_qwen3_5_moe
    from hyper_parallel.models import glm_image_moe_v2
    from hyper_parallel.models.glm_image_moe_v2.parallelize import parallelize_glm_image_moe

    return glm_image_moe_v2, parallelize_glm_image_moe


def fp8_sharded_load_job(family: str, fp8_dir: str, ref_dir: str, vocab: int, layouts: list[Layout]) -> dict[str, Any]:
    """Per layout: the loaded keys whose full tensor differs from the one-process load of the dequantized folder,
    the max logit difference from it on one batch, and the FP8 bytes / scale elements this rank read."""
    package, parallelize = _family(family)
    reference = package.from_pretrained(ref_dir)
    ref_sd = model_state_dict(reference)
    ids = torch.randint(0, min(vocab - 1, 90), (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_logits = split_output(reference(ids))[0][..., :vocab]
    config = package.config_from_hf(read_hf_config(fp8_dir))
    read = {"fp8": 0, "scales": 0}
    original = StoredTensor.read_into

    def counting(self: StoredTensor, out: torch.Tensor, box: Any) -> None:
        if self.dtype == torch.float8_e4m3fn:
            read["fp8"] += out.numel()
        elif self.key.endswith("_scale_inv"):
            read["scales"] += out.numel()
        original(self, out, box)

    results: dict[str, Any] = {}
    StoredTensor.read_into = counting  # type: ignore[method-assign]
    try:
        for layout in layouts:
            with torch.device("meta"):
                model = config.build()
            pd = ParallelDims.from_config(layout.parallelism(), torch.distributed.get_world_size())
            pd.build_mesh("cpu")
            parallelize(
                model, parallel_dims=pd, training=TrainingConfig(mixed_precision_param="float32"),
                parallelism=layout.parallelism(), ac_config=ActivationCheckpointConfig(),
                compile_config=CompileConfig(),
            )  # fmt: skip
            model.to_empty(device="cpu")
            model.init_weights()  # buffers (RoPE), and the parts the folder lacks
            read.update(fp8=0, scales=0)
            start = time.perf_counter()
            load_hf_weights(model, fp8_dir)
            seconds = time.perf_counter() - start
            ours = model_state_dict(model)
            # GLM: the image parts a Glm4MoeLite folder lacks (VQ, head rows [V, V+C)) are initialised, not loaded
            loaded = [k for k in ref_sd if not k.startswith("vq_")]
            rows = {"lm_head.weight": vocab}
            with torch.no_grad():
                logits = _full(split_output(model(ids))[0])[..., :vocab]
            results[str(layout)] = {
                "differ": [
                    k for k in loaded if not torch.equal(_full(ours[k])[: rows.get(k)], ref_sd[k][: rows.get(k)])
                ],
                "logit_diff": (logits - ref_logits).abs().max().item(),
                "logit_size": ref_logits.abs().max().item(),
                "fp8_read": read["fp8"],
                "scales_read": read["scales"],
                "load_s": seconds,
                "sharded": sorted(
                    k for k, v in ours.items() if isinstance(v, DTensor) and v.to_local().numel() < v.numel()
                ),
            }
    finally:
        StoredTensor.read_into = original  # type: ignore[method-assign]
    return results
