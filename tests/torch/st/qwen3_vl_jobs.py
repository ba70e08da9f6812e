"""Jobs of the Qwen3-VL-MoE layout tests (gloo workers, see ``harness.py``): a tiny VL model (2-block tower
with deepstack, 3 text layers: 2 MoE + 1 dense) trained a few steps under several parallel layouts in ONE
launch, and the same steps in one process for reference.

Every layout reads the same global batches: ``GLOBAL_ROWS`` packed rows of ``SEQ`` tokens per step, each
row a few documents, some with an image (grids of different sizes), with ``[3, B, T]`` M-RoPE positions
restarting per document. A data-parallel rank takes its slice of rows and exactly those rows' images;
a rank whose rows hold no image runs the tower on the model's dummy grid (zero contribution). Its loss
is ``sum of its token CE / global token count`` and gradients are summed over ranks, so every layout
computes the single process's global token mean. The Switch aux loss is off (a per-rank statistic).

``video=True`` jobs (issue 23) add video documents: per temporal patch a timestamp token, then
``vision_start``, the frame group's video tokens, ``vision_end``, as HF's processor writes them; the
model gets ``pixel_values_videos`` / ``video_grid_thw`` and M-RoPE places every frame group. Some
ranks' rows then hold no video (or nothing visual) and still take part in every collective.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hyper_parallel.components.loss import CrossEntropyLoss
from hyper_parallel.config import ActivationCheckpointConfig, CompileConfig, TrainingConfig
from hyper_parallel.data.vision_language.mrope import mrope_position_ids
from hyper_parallel.distributed.context_parallel import split_batch_for_cp
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.utils import clip_grad_norm_
from hyper_parallel.models.qwen3_vl_moe_v2.model import Qwen3VlMoeModel, qwen3_5_moe_vl_config, qwen3_vl_moe_config
from hyper_parallel.models.qwen3_vl_moe_v2.parallelize import parallelize_qwen3_vl_moe
from hyper_parallel.protocols.model import split_output
from tests.torch.st.glm_jobs import Layout
from tests.torch.st.grad_check import whole_grads

VOCAB, IMG, VS, VE = 64, 61, 62, 63
PATCH, MERGE = 4, 2
P = 3 * 2 * PATCH * PATCH
GLOBAL_ROWS, SEQ = 4, 24
SEED, LR, MAX_NORM = 1234, 0.3, 0.5
GRIDS = [(1, 2, 2), (1, 4, 2), (1, 2, 4)]  # 1, 2 and 2 merged tokens
VID = 60  # video token id of the video jobs (text tokens are 0..59)
VIDEO_GRIDS = [(2, 2, 2), (3, 2, 4), (1, 4, 2)]  # 2, 6 and 2 video tokens in 2, 3 and 1 frame groups


def tiny_config(**overrides: Any) -> Qwen3VlMoeModel.Config:
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        mlp_only_layers=[2], rope_theta=1e4, mrope_section=(2, 1, 1),
        vision=dict(depth=2, dim=16, n_heads=2, intermediate_size=32, patch_size=PATCH, spatial_merge_size=MERGE,
                    num_position_embeddings=16, deepstack_visual_indexes=(0, 1)),
        image_token_id=IMG, vision_start_token_id=VS, vision_end_token_id=VE,
    )  # fmt: skip
    kwargs.update(overrides)
    return qwen3_vl_moe_config(**kwargs)


def tiny_qwen3_5_config() -> Qwen3VlMoeModel.Config:
    """The Qwen3.5-MoE VL composition: DeltaNet x3 + gated attention, gated shared expert, no deepstack."""
    return qwen3_5_moe_vl_config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, rope_theta=1e4, partial_rotary_factor=1.0, mrope_section=(2, 1, 1),
        vision=dict(depth=2, dim=16, n_heads=2, intermediate_size=32, patch_size=PATCH, spatial_merge_size=MERGE,
                    num_position_embeddings=16, deepstack_visual_indexes=()),
        image_token_id=IMG, vision_start_token_id=VS, vision_end_token_id=VE,
    )  # fmt: skip


def build_model(freeze_vision: bool = False, family: str = "qwen3_vl_moe", video: bool = False) -> Qwen3VlMoeModel:
    """The same initial weights on every rank and in the reference (seeded CPU init); ``family`` is the text
    decoder: ``qwen3_vl_moe`` or ``qwen3_5_moe``; ``video`` gives the model its video token."""
    torch.manual_seed(SEED)
    config = tiny_config() if family == "qwen3_vl_moe" else tiny_qwen3_5_config()
    config = dataclasses.replace(config, video_token_id=VID if video else -1)
    model = dataclasses.replace(config, freeze_vision=freeze_vision).build()
    model.init_weights()
    return model


def _video_doc(rng: random.Random, room: int) -> tuple[list[int], tuple[int, int, int]] | None:
    """A document with one video (HF's layout) that fits ``room`` tokens, or None."""
    t, h, w = grid = rng.choice(VIDEO_GRIDS)
    doc = [rng.randrange(VOCAB - 4), VS]
    for i in range(t):  # "<t seconds>" (one text token here), then the frame group between vision markers
        doc += [10 + i, VS] + [VID] * (h * w // MERGE**2) + [VE]
    doc += [VE] + [rng.randrange(VOCAB - 4) for _ in range(2)]
    return (doc, grid) if len(doc) <= room else None


def _row(rng: random.Random, video: bool = False) -> dict[str, Any]:
    """One packed row of SEQ tokens: documents of text, some with one image between vision markers (and with
    ``video``, some with one video)."""
    ids, labels, pos, starts, grids, vgrids = [], [], [], [], [], []
    while len(ids) < SEQ:
        room = SEQ - len(ids)
        vdoc = _video_doc(rng, room) if video and rng.random() < 0.35 else None
        if vdoc is not None:
            doc, vgrid = vdoc
            starts.append(len(ids))
            ids += doc
            labels += [t if t < VOCAB - 4 else -100 for t in doc[1:]] + [-100]
            pos.append(mrope_position_ids(np.array(doc), np.zeros((0, 3)), image_token_id=IMG, merge_size=MERGE,
                                          video_grid_thw=np.array([vgrid]), video_token_id=VID))  # fmt: skip
            vgrids.append(vgrid)
            continue
        grid = rng.choice(GRIDS) if room >= 7 and rng.random() < 0.6 else None
        n_img = grid[0] * grid[1] * grid[2] // MERGE**2 if grid else 0
        n_text = room if room < 4 + n_img else rng.randint(3, min(room - n_img - (2 if grid else 0), 8))
        first = rng.randrange(VOCAB - 4)
        text = [(first + j) % (VOCAB - 4) for j in range(n_text)]
        doc = text[:1] + ([VS] + [IMG] * n_img + [VE] if grid else []) + text[1:]
        doc = doc[:room]
        starts.append(len(ids))
        ids += doc
        labels += [t if t < VOCAB - 3 else -100 for t in doc[1:]] + [-100]
        g = np.array([grid] if grid and IMG in doc else np.zeros((0, 3)), dtype=np.int64).reshape(-1, 3)
        pos.append(mrope_position_ids(np.array(doc), g, image_token_id=IMG, merge_size=MERGE))
        grids += [tuple(x) for x in g.tolist()]
    return {"ids": ids, "labels": labels, "pos": np.concatenate(pos, axis=1), "starts": starts, "grids": grids,
            "video_grids": vgrids}  # fmt: skip


def global_rows(step: int, video: bool = False) -> list[dict[str, Any]]:
    rng = random.Random(1000 + step + (500 if video else 0))
    return [_row(rng, video) for _ in range(GLOBAL_ROWS)]


def _pixels(step: int, row: int, k: int, grid: tuple[int, int, int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + row * 10 + k)
    return torch.randn(grid[0] * grid[1] * grid[2], P, generator=g)


def micro_batch(step: int, rows: list[dict[str, Any]], first_row: int) -> dict[str, Any]:
    cu = torch.tensor([b * SEQ + s for b, r in enumerate(rows) for s in r["starts"]] + [len(rows) * SEQ], dtype=torch.int32)
    grids = [g for r in rows for g in r["grids"]]
    pixels = [_pixels(step, first_row + b, k, g) for b, r in enumerate(rows) for k, g in enumerate(r["grids"])]
    return {
        "input_ids": torch.tensor([r["ids"] for r in rows]),
        "labels": torch.tensor([r["labels"] for r in rows]),
        "position_ids": torch.from_numpy(np.stack([r["pos"] for r in rows], axis=1)),  # [3, B, T]
        "cu_seqlens": cu,
        "max_seqlen": int((cu[1:] - cu[:-1]).max()),
        "pixel_values": torch.cat(pixels) if pixels else torch.zeros(0, P),
        "image_grid_thw": torch.tensor(grids, dtype=torch.int64).reshape(-1, 3),
        **_video_inputs(step, rows, first_row),
    }


def _video_inputs(step: int, rows: list[dict[str, Any]], first_row: int) -> dict[str, torch.Tensor]:
    vgrids = [g for r in rows for g in r.get("video_grids", [])]
    videos = [_pixels(step + 77, first_row + b, k, g) for b, r in enumerate(rows) for k, g in enumerate(r["video_grids"])]
    return {
        "pixel_values_videos": torch.cat(videos) if videos else torch.zeros(0, P),
        "video_grid_thw": torch.tensor(vgrids, dtype=torch.int64).reshape(-1, 3),
    }


def global_token_count(step: int, video: bool = False) -> int:
    return sum(sum(1 for t in r["labels"] if t != -100) for r in global_rows(step, video))


def _train(model, steps: int, pd: ParallelDims | None, video: bool = False) -> dict[str, Any]:
    loss_fn = CrossEntropyLoss.Config().build()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=False)
    dp, dp_rank = (pd.dp, pd.mesh_coordinate("dp")) if pd else (1, 0)
    cp, cp_rank = (pd.cp, pd.mesh_coordinate("cp")) if pd else (1, 0)
    losses, norms, first_grads = [], [], {}
    for step in range(steps):
        rows = global_rows(step, video)
        per = len(rows) // dp
        mb = micro_batch(step, rows[dp_rank * per : (dp_rank + 1) * per], dp_rank * per)
        mb = {**mb, **model.host_inputs(mb)}  # the model's host facts, before the split (as the trainer)
        # a CP rank takes a chunk of every row ([3, B, T] positions too); pixels and grids stay whole
        mb = split_batch_for_cp(mb, cp_rank, cp, split_inputs=Qwen3VlMoeModel.split_inputs_for_cp,
                                model_keys=Qwen3VlMoeModel.input_keys)  # fmt: skip
        opt.zero_grad()
        with CrossEntropyLoss.parallel_context(enabled=pd is not None and pd.loss_parallel_enabled):
            loss = _forward_loss(model, mb, global_token_count(step, video), loss_fn)
            loss.backward()
        if step == 0:
            first_grads = whole_grads(model)
        total = loss.detach().clone()
        if pd is not None and pd.dp * pd.cp > 1:
            dist.all_reduce(total, group=pd.mesh("dp_cp").get_group())
        norms.append(clip_grad_norm_(params, MAX_NORM).item())
        opt.step()
        losses.append(total.item())
    return {"losses": losses, "grad_norms": norms, "first_grads": first_grads}


def _forward_loss(model, mb: dict[str, Any], num_tokens: int, loss_fn) -> torch.Tensor:
    videos = {k: mb[k] for k in ("pixel_values_videos", "video_grid_thw") if mb[k].numel()}
    logits, aux = split_output(
        model(mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"],
              max_seqlen=mb["max_seqlen"], pixel_values=mb["pixel_values"], image_grid_thw=mb["image_grid_thw"],
              **videos, **{k: mb[k] for k in ("visual_tokens", "visual_index") if k in mb})
    )  # fmt: skip
    assert aux is None
    return loss_fn(logits, mb["labels"], num_tokens=num_tokens)


def reference_job(
    steps: int, freeze_vision: bool = False, family: str = "qwen3_vl_moe", video: bool = False
) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    return _train(build_model(freeze_vision, family, video), steps, None, video)


def layouts_job(
    layouts: list[tuple[Layout, bool]], steps: int, family: str = "qwen3_vl_moe", video: bool = False
) -> dict[str, dict[str, Any]]:
    """Train ``steps`` under each ``(layout, freeze_vision)`` in turn; rank 0's losses and grad norms, and
    for a frozen tower whether it stayed bit-identical to the initial weights and outside FSDP on every rank."""
    from torch.distributed.tensor import DTensor

    torch.use_deterministic_algorithms(True)
    out: dict[str, dict[str, Any]] = {}
    for layout, freeze in layouts:
        model = build_model(freeze, family, video)
        initial = {k: v.clone() for k, v in model.visual.state_dict().items()}
        pd = ParallelDims.from_config(layout.parallelism(), dist.get_world_size())
        pd.build_mesh("cpu")
        parallelize_qwen3_vl_moe(
            model, parallel_dims=pd, training=TrainingConfig(mixed_precision_param=layout.param_dtype),
            parallelism=layout.parallelism(), ac_config=ActivationCheckpointConfig(mode=layout.ac),
            compile_config=CompileConfig(),
        )  # fmt: skip
        result = _train(model, steps, pd, video)
        result["parallel_dims"] = str(pd)
        if freeze:
            tower = model.visual.state_dict()
            same = all(torch.equal(tower[k], v) for k, v in initial.items())
            plain = not any(isinstance(p, DTensor) for p in model.visual.parameters())
            flags = torch.tensor([int(same), int(plain)])
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            result["tower_identical"], result["tower_fsdp_ignored"] = bool(flags[0]), bool(flags[1])
        else:
            result["tower_sharded"] = any(isinstance(p, DTensor) for p in model.visual.blocks.parameters())
        out[f"{layout}{'-freeze_vision' if freeze else ''}"] = result
    return out
