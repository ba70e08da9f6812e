"""Jobs of the MTP layout tests (gloo workers, see ``harness.py``): the tiny Qwen3.5-MoE of ``qwen3_5_jobs``
(``family="qwen3_5_moe"``) or the tiny GlmImageMoe with images of ``glm_jobs`` (``family="glm"``, the nextn
layer) with the MTP block on, trained a few steps under several layouts in ONE launch, and in one process.

The objective is the trainer's: ``CE / global token count + 0.1 * MTP CE / global MTP token count``, the
MTP targets computed per document on the host (``add_mtp_targets``) before the context-parallel split.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.components.loss import CrossEntropyLoss, top1_correct
from hyper_parallel.config import ActivationCheckpointConfig, CompileConfig, TrainingConfig
from hyper_parallel.data.packing import add_mtp_targets
from hyper_parallel.distributed.context_parallel import split_batch_for_cp
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.utils import clip_grad_norm_
from hyper_parallel.models.glm_image_moe_v2.parallelize import parallelize_glm_image_moe
from hyper_parallel.models.qwen3_5_moe_v2.parallelize import parallelize_qwen3_5_moe
from tests.torch.st import glm_jobs, qwen3_5_jobs
from tests.torch.st.glm_jobs import Layout
from tests.torch.st.grad_check import whole_grads
from tests.torch.st.qwen3_5_jobs import LR, MAX_NORM, SEED

WEIGHT = 0.1
JOBS = {"qwen3_5_moe": qwen3_5_jobs, "glm": glm_jobs}


def build_model(family: str):
    if family == "glm":
        return glm_jobs.build_model(num_nextn_predict_layers=1, mtp_loss_weight=WEIGHT)
    torch.manual_seed(SEED)
    model = qwen3_5_jobs.tiny_config(mtp_num_hidden_layers=1, mtp_loss_weight=WEIGHT).build()
    model.init_weights()
    return model


def _counts(family: str, step: int) -> tuple[int, int]:
    jobs = JOBS[family]
    b = add_mtp_targets(jobs.micro_batch(jobs.global_rows(step)))
    return int((b["labels"] != -100).sum()), int((b["mtp_labels"] != -100).sum())


def _train(model, steps: int, pd: ParallelDims | None, family: str) -> dict[str, Any]:
    jobs, keys = JOBS[family], type(model).input_keys
    loss_fn = CrossEntropyLoss.Config().build()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=False)
    dp, dp_rank = (pd.dp, pd.mesh_coordinate("dp")) if pd else (1, 0)
    cp, cp_rank = (pd.cp, pd.mesh_coordinate("cp")) if pd else (1, 0)
    shard = getattr(model, "cp_shard", None)
    losses, mtp_losses, top1, norms, first_grads = [], [], [], [], {}
    for step in range(steps):
        rows = jobs.global_rows(step)
        per = len(rows) // dp
        mb = add_mtp_targets(jobs.micro_batch(rows[dp_rank * per : (dp_rank + 1) * per]))
        mb = {**mb, **model.host_inputs(mb)}  # the model's host facts, before the split (as the trainer)
        mb = split_batch_for_cp(
            mb, cp_rank, cp, split_inputs=type(model).split_inputs_for_cp, model_keys=keys,
            balanced=shard is not None and shard.balanced,
        )  # fmt: skip
        n_tokens, n_mtp = _counts(family, step)
        opt.zero_grad()
        with CrossEntropyLoss.parallel_context(enabled=pd is not None and pd.loss_parallel_enabled):
            out = model(
                mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"],
                max_seqlen=mb["max_seqlen"], mtp_input_ids=mb["mtp_input_ids"], **{k: mb[k] for k in keys if k in mb},
            )  # fmt: skip
            assert out.aux_loss is None
            loss = loss_fn(out.logits, mb["labels"], num_tokens=n_tokens)
            mtp = loss_fn(out.mtp_logits, mb["mtp_labels"], num_tokens=n_mtp)
            (loss + WEIGHT * mtp).backward()
            correct = top1_correct(out.mtp_logits, mb["mtp_labels"])
        if step == 0:
            first_grads = whole_grads(model)
        stats = torch.stack([loss.detach().double(), mtp.detach().double(), correct])
        if pd is not None and pd.dp * pd.cp > 1:
            dist.all_reduce(stats, group=pd.mesh("dp_cp").get_group())
        norms.append(clip_grad_norm_(params, MAX_NORM).item())
        opt.step()
        losses.append(stats[0].item() + WEIGHT * stats[1].item())
        mtp_losses.append(stats[1].item())
        top1.append(stats[2].item() / n_mtp)
    return {"losses": losses, "mtp_losses": mtp_losses, "top1": top1, "grad_norms": norms, "first_grads": first_grads}


def reference_job(steps: int, family: str = "qwen3_5_moe") -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    return _train(build_model(family), steps, None, family)


def layouts_job(layouts: list[Layout], steps: int, family: str = "qwen3_5_moe") -> dict[str, dict[str, Any]]:
    torch.use_deterministic_algorithms(True)
    out: dict[str, dict[str, Any]] = {}
    for layout in layouts:
        model = build_model(family)
        pd = ParallelDims.from_config(layout.parallelism(), dist.get_world_size())
        pd.build_mesh("cpu")
        (parallelize_glm_image_moe if family == "glm" else parallelize_qwen3_5_moe)(
            model,
            parallel_dims=pd,
            training=TrainingConfig(mixed_precision_param=layout.param_dtype),
            parallelism=layout.parallelism(),
            ac_config=ActivationCheckpointConfig(mode=layout.ac),
            compile_config=CompileConfig(),
        )
        result = _train(model, steps, pd, family)
        result["parallel_dims"] = str(pd)
        out[str(layout)] = result
    return out
