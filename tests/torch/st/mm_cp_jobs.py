"""Jobs of the multimodal context-parallel tests (gloo workers, see ``harness.py``): the tiny VL models of
``qwen3_vl_jobs`` and the tiny GlmImageMoe of ``glm_jobs`` under CP 2, in both batch orders, against one
process. Every job returns rank 0's view of the run: losses, the MTP loss, every first-step gradient
(``grad_check.whole_grads``) and the first step's logits (and MTP logits) of the WHOLE batch in natural order
(the CP ranks' pieces all-gathered and put back in place).

Families (``MODELS``):

- ``vl35_mtp``: the Qwen3.5-MoE VL model (DeltaNet x3 + gated attention, no deepstack) with its MTP block and
  a video token (``vl35``: without MTP). ``heads`` (``HEADS``) chooses the CP forms and so the order.
- ``vl3``: Qwen3-VL-MoE (deepstack, video); ``heads="gather"``: 1 K/V head, all-gather attention, balanced.
- ``glm_mtp``: GlmImageMoe with its nextn layer; ``heads="gather"``: 1 MLA head, all-gather, balanced order.

The VL rows (``vl_rows``) are written by hand so that image and video tokens open pieces of both orders
(tokens 6, 12 and 18 of a 24-token row: the contiguous CP 2 boundary is 12, the balanced pieces are 6 long)
with the token before them in the same document, and images straddle piece boundaries: the MTP input of a
piece's last position is then a visual feature made on another rank. The GLM rows are ``glm_jobs``' random
rows; the test checks that some straddle.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hyper_parallel.components.loss import CrossEntropyLoss
from hyper_parallel.config import ActivationCheckpointConfig, CompileConfig, TrainingConfig
from hyper_parallel.data.packing import add_mtp_targets
from hyper_parallel.data.vision_language.mrope import mrope_position_ids
from hyper_parallel.distributed.context_parallel import split_batch_for_cp
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.models.glm_image_moe_v2.parallelize import parallelize_glm_image_moe
from hyper_parallel.models.qwen3_5_v2.model import qwen3_5_with_mtp
from hyper_parallel.models.qwen3_vl_moe_v2.model import qwen3_5_moe_vl_config
from hyper_parallel.models.qwen3_vl_moe_v2.parallelize import parallelize_qwen3_vl_moe
from hyper_parallel.protocols.model import ModelOutput
from tests.torch.st import glm_jobs, qwen3_vl_jobs
from tests.torch.st.glm_jobs import Layout
from tests.torch.st.grad_check import whole_grads
from tests.torch.st.qwen3_vl_jobs import IMG, MERGE, PATCH, SEED, VE, VID, VOCAB, VS

WEIGHT = 0.1  # MTP loss weight
LR = 0.3
MODELS = ("vl35_mtp", "vl35", "vl3", "glm_mtp")
HEADS = {"ulysses": (2, 2), "gather": (1, 2), "state": (1, 1)}
"""``heads`` -> (K/V heads, DeltaNet key heads): both divide by CP 2 (Ulysses everywhere, contiguous order);
attention K/V all-gather (balanced order, DeltaNet Ulysses); and DeltaNet state passing too."""


def build_model(family: str, heads: str = "gather"):
    """The same initial weights on every rank and in the reference (seeded CPU init)."""
    kv, linear_k = HEADS[heads]
    if family == "glm_mtp":
        return glm_jobs.build_model(num_attention_heads=kv, num_nextn_predict_layers=1, mtp_loss_weight=WEIGHT)
    torch.manual_seed(SEED)
    if family == "vl3":
        config = qwen3_vl_jobs.tiny_config(num_key_value_heads=kv)
    else:
        config = qwen3_5_moe_vl_config(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=kv,
            head_dim=8, linear_num_key_heads=linear_k, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, rope_theta=1e4, partial_rotary_factor=1.0,
            mrope_section=(2, 1, 1),
            vision=dict(depth=2, dim=16, n_heads=2, intermediate_size=32, patch_size=PATCH,
                        spatial_merge_size=MERGE, num_position_embeddings=16, deepstack_visual_indexes=()),
            image_token_id=IMG, vision_start_token_id=VS, vision_end_token_id=VE,
        )  # fmt: skip
        if family == "vl35_mtp":
            config = qwen3_5_with_mtp(config, loss_weight=WEIGHT)
    model = dataclasses.replace(config, video_token_id=VID).build()
    model.init_weights()
    return model


# ---- VL rows ------------------------------------------------------------------------------------------


def _image_doc(n_text_before: int, grid: tuple[int, int, int], n_text_after: int, first: int) -> dict[str, Any]:
    n_img = grid[0] * grid[1] * grid[2] // MERGE**2
    ids = [(first + j) % 50 for j in range(n_text_before)] + [VS] + [IMG] * n_img + [VE]
    ids += [(first + 20 + j) % 50 for j in range(n_text_after)]
    return {"ids": ids, "grids": [grid], "video_grids": []}


def _video_doc(n_text_before: int, grid: tuple[int, int, int], n_text_after: int, first: int) -> dict[str, Any]:
    """HF's video layout: per temporal patch a timestamp token, then the frame group between vision markers."""
    t, h, w = grid
    ids = [(first + j) % 50 for j in range(n_text_before)] + [VS]
    for i in range(t):
        ids += [50 + i, VS] + [VID] * (h * w // MERGE**2) + [VE]
    ids += [VE] + [(first + 30 + j) % 50 for j in range(n_text_after)]
    return {"ids": ids, "grids": [], "video_grids": [grid]}


# Visual tokens at 6, 12 and 18 of every row, each after a token of its own document (see the module doc).
_VL_DOCS = [
    # IMG 5-6 | VS 11, IMG 12 | VS 17, IMG 18-21
    [_image_doc(4, (1, 2, 4), 2, 1), _image_doc(1, (1, 2, 2), 2, 7), _image_doc(1, (1, 4, 4), 1, 13)],
    # IMG 4-7 | IMG 11-12 | VS 17, IMG 18
    [_image_doc(3, (1, 4, 4), 0, 3), _image_doc(1, (1, 2, 4), 2, 9), _image_doc(1, (1, 2, 2), 4, 17)],
    # VID 6-7, VID 11-12 (two frame groups) | VS 18, IMG 19
    [_video_doc(3, (2, 2, 4), 2, 21), _image_doc(1, (1, 2, 2), 3, 25)],
]
SEQ = 24


def vl_rows() -> list[dict[str, Any]]:
    """The hand-written packed rows in ``qwen3_vl_jobs.micro_batch``'s format (labels: the next text token)."""
    rows = []
    for docs in _VL_DOCS:
        ids, labels, pos, starts, grids, vgrids = [], [], [], [], [], []
        for d in docs:
            starts.append(len(ids))
            ids += d["ids"]
            labels += [t if t < 50 else -100 for t in d["ids"][1:]] + [-100]
            pos.append(mrope_position_ids(
                np.array(d["ids"]), np.array(d["grids"], dtype=np.int64).reshape(-1, 3), image_token_id=IMG,
                merge_size=MERGE, video_grid_thw=np.array(d["video_grids"], dtype=np.int64).reshape(-1, 3),
                video_token_id=VID,
            ))  # fmt: skip
            grids += d["grids"]
            vgrids += d["video_grids"]
        assert len(ids) == SEQ, (len(ids), ids)
        for q in (6, 12, 18):  # the visual tokens that open pieces
            assert ids[q] in (IMG, VID) or ids[q + 1] in (IMG, VID), (q, ids)
        rows.append({"ids": ids, "labels": labels, "pos": np.concatenate(pos, axis=1), "starts": starts,
                     "grids": grids, "video_grids": vgrids})  # fmt: skip
    return rows


def batch(family: str, step: int) -> dict[str, Any]:
    """The whole micro-batch of ``step`` (every CP rank starts from it), with the MTP targets when the family
    has an MTP block (computed per document on the host, before the CP split)."""
    if family == "glm_mtp":
        mb = glm_jobs.micro_batch(glm_jobs.global_rows(step))
    else:
        mb = qwen3_vl_jobs.micro_batch(step, vl_rows(), 0)
    return add_mtp_targets(mb) if family.endswith("_mtp") else mb


# ---- training ------------------------------------------------------------------------------------------


def _whole(x: torch.Tensor, model, pd: ParallelDims | None) -> torch.Tensor:
    """``[B, t, V]`` of this CP rank's pieces -> ``[B, T, V]`` of the whole rows in natural order."""
    if pd is None or not pd.cp_enabled:
        return x.detach().clone()
    shard = model.cp_shard
    parts = [torch.empty_like(x) for _ in range(pd.cp)]
    dist.all_gather(parts, x.detach().contiguous(), group=pd.mesh("cp").get_group())
    t = x.shape[1]
    rank_major = torch.cat(parts, dim=1)  # rank 0's pieces, rank 1's, ...
    return rank_major.index_select(1, shard.natural_index(t, x.device))


def _train(model, family: str, steps: int, pd: ParallelDims | None) -> dict[str, Any]:
    loss_fn = CrossEntropyLoss.Config().build()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=False)
    cp, cp_rank = (pd.cp, pd.mesh_coordinate("cp")) if pd else (1, 0)
    shard = getattr(model, "cp_shard", None)
    keys = type(model).input_keys
    mtp = family.endswith("_mtp")
    out: dict[str, Any] = {"losses": [], "mtp_losses": [], "balanced": shard is not None and shard.balanced}
    for step in range(steps):
        whole = batch(family, step)
        whole = {**whole, **model.host_inputs(whole)}  # the model's host facts, before the split (as the trainer)
        n_tokens = int((whole["labels"] != -100).sum())
        mb = split_batch_for_cp(whole, cp_rank, cp, split_inputs=type(model).split_inputs_for_cp, model_keys=keys,
                                balanced=out["balanced"])  # fmt: skip
        inputs = {k: mb[k] for k in keys if k in mb}
        opt.zero_grad()
        res = model(
            mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"],
            max_seqlen=mb["max_seqlen"], **({"mtp_input_ids": mb["mtp_input_ids"]} if mtp else {}), **inputs,
        )  # fmt: skip
        logits = res.logits if isinstance(res, ModelOutput) else res
        assert not isinstance(res, ModelOutput) or res.aux_loss is None
        loss = loss_fn(logits, mb["labels"], num_tokens=n_tokens)
        total = loss
        if mtp:
            mtp_loss = loss_fn(res.mtp_logits, mb["mtp_labels"], num_tokens=int((whole["mtp_labels"] != -100).sum()))
            total = loss + WEIGHT * mtp_loss
        total.backward()
        if step == 0:
            out["first_grads"] = whole_grads(model)
            out["logits"] = _whole(logits, model, pd)
            if mtp:
                out["mtp_logits"] = _whole(res.mtp_logits, model, pd)
        stats = torch.stack([total.detach(), mtp_loss.detach() if mtp else total.new_zeros(())])
        if pd is not None and pd.cp > 1:
            dist.all_reduce(stats, group=pd.mesh("cp").get_group())
        opt.step()
        out["losses"].append(stats[0].item())
        out["mtp_losses"].append(stats[1].item())
    return out


def reference_job(steps: int, cases: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """One process: ``{family/heads: run}``."""
    torch.use_deterministic_algorithms(True)
    return {f"{f}/{h}": _train(build_model(f, h), f, steps, None) for f, h in cases}


def cp_job(steps: int, cases: list[tuple[str, str]], cp: int = 2) -> dict[str, dict[str, Any]]:
    """CP ``cp`` on every rank of the launch (FSDP over the same ranks): ``{family/heads: run}``."""
    torch.use_deterministic_algorithms(True)
    out = {}
    for family, heads in cases:
        model = build_model(family, heads)
        layout = Layout(world=dist.get_world_size(), cp=cp)
        pd = ParallelDims.from_config(layout.parallelism(), dist.get_world_size())
        pd.build_mesh("cpu")
        parallelize = parallelize_glm_image_moe if family == "glm_mtp" else parallelize_qwen3_vl_moe
        parallelize(
            model, parallel_dims=pd, training=TrainingConfig(), parallelism=layout.parallelism(),
            ac_config=ActivationCheckpointConfig(), compile_config=CompileConfig(),
        )  # fmt: skip
        out[f"{family}/{heads}"] = _train(model, family, steps, pd)
    return out
