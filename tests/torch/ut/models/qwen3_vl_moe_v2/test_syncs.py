"""The vision-language path without device-to-host syncs (issue 43, VL part), and a vision block that compiles once.

- The VL models' forward + backward on a packed row (two documents, two images and a video) make no sync in bf16
  when the batch carries the host facts the trainer adds (``Qwen3VlMoeModel.host_inputs``: image grids, frame
  boundaries, per-patch tables, visual-token positions, made on the host; M-RoPE rows from the collate), counted
  with ``tests/torch/sync_counter.py``. A direct call without them reads its ids and grids back once, at the top of
  the forward, never in a layer. The canary: a ``.tolist()`` in a vision block is seen.
- The context-parallel split of the host facts (``split_inputs_for_cp``) gives each rank the positions of its
  visual tokens, their feature rows, and the feature after each of its pieces, all on the host.
- A vision block compiled with ``fullgraph=True`` (``aot_eager``) runs three image geometries with at most one
  recompile after the first (the SDPA path's per-frame loop is the custom op ``hyper_parallel::
  vision_frame_attention``) and equals eager in output and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hyper_parallel.distributed.context_parallel import split_batch_for_cp
from hyper_parallel.models.common.attention import CPShard
from hyper_parallel.models.qwen3_vl_moe_v2 import config_registry as recipes
from hyper_parallel.models.qwen3_vl_moe_v2.vision import VisionGrid, vision_tower_config
from tests.torch.sync_counter import SyncCounter

IMG, VS, VE, VID = 512, 513, 514, 515
P = 3 * 2 * 16 * 16
MY_FILES = ("hyper_parallel/models/qwen3_vl_moe_v2/", "hyper_parallel/models/common/rope.py")


def _video(grid: tuple[int, int, int]) -> list[int]:
    t, h, w = grid
    out = [VS]
    for i in range(t):  # HF's layout: per temporal patch a timestamp (text), then the frame group
        out += [40 + i, 41, VS] + [VID] * (h * w // 4) + [VE]
    return out + [VE]


def _packed_batch(model, pad: int = 6) -> dict:
    """One row, two documents: text, image (1,4,4), text, video (2,4,4), text | text, image (1,4,6), text; padding.
    The host batch the collate gives (M-RoPE rows per document, boundaries as host ints)."""
    g = torch.Generator().manual_seed(0)
    doc1 = list(range(60, 65)) + [VS] + [IMG] * 4 + [VE] + [70, 71] + _video((2, 4, 4)) + [72]
    doc2 = [80, 81, 82, VS] + [IMG] * 6 + [VE, 83]
    ids = torch.tensor([doc1 + doc2 + [0] * pad])
    cu = [0, len(doc1), len(doc1) + len(doc2), ids.shape[1]]
    images, videos = torch.tensor([[1, 4, 4], [1, 4, 6]]), torch.tensor([[2, 4, 4]])
    batch = {
        "input_ids": ids,
        "pixel_values": torch.randn(int(images.prod(-1).sum()), P, generator=g),
        "image_grid_thw": images,
        "pixel_values_videos": torch.randn(int(videos.prod(-1).sum()), P, generator=g),
        "video_grid_thw": videos,
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "cu_seqlens_host": cu,
        "max_seqlen": max(b - a for a, b in zip(cu[:-1], cu[1:])),
    }
    batch["position_ids"] = model.mrope_positions(ids, images, cu, videos)
    return batch


def _model(recipe: str):
    torch.manual_seed(0)
    model = getattr(recipes, recipe)().model.build()
    model.init_weights()
    return model.to(torch.bfloat16)


def _count(model, batch: dict, *, host_facts: bool) -> SyncCounter:
    """Syncs of forward + backward of one host batch, prepared like the trainer's (host facts made on the host,
    every tensor then "moved" to the device: on CPU the counter treats it as device from there on)."""
    with SyncCounter(host=batch) as syncs:
        mb = {**batch, **model.host_inputs(batch)} if host_facts else dict(batch)
        syncs.mark_device(mb)  # what the trainer's _to_device hands the model (on CPU the copy is the tensor itself)
        kwargs = {k: mb[k] for k in (*model.input_keys, "position_ids", "cu_seqlens", "max_seqlen", "cu_seqlens_host")
                  if k in mb}  # fmt: skip
        out = model(mb["input_ids"], **kwargs)
        logits = out.logits if hasattr(out, "logits") else out
        loss = logits.float().logsumexp(-1).mean() + (0.0 if getattr(out, "aux_loss", None) is None else out.aux_loss)
        loss.backward()
    return syncs


@pytest.mark.parametrize("recipe", ["qwen3_vl_moe_debug", "qwen3_5_moe_vl_debug"])
def test_vl_forward_backward_has_no_sync(recipe):
    """bf16 forward + backward with the host facts: no sync in the tower, the embedding merge, M-RoPE or deepstack
    (Qwen3-VL-MoE: none at all; Qwen3.5-MoE VL: none in the VL files; its Gated DeltaNet layers are S1's)."""
    model = _model(recipe)
    syncs = _count(model, _packed_batch(model), host_facts=True)
    vl_sites = {s: n for s, n in syncs.by_site.items() if s.startswith(MY_FILES)}
    assert not vl_sites, syncs.report()
    if recipe == "qwen3_vl_moe_debug":
        assert syncs.total == 0, syncs.report()


def test_direct_call_reads_back_once_at_the_top():
    """Without host facts (a direct call, as the HF parity tests make) the ids and grids are read back at the top of
    the forward in one copy; no layer, tower block or M-RoPE table syncs."""
    model = _model("qwen3_vl_moe_debug")
    batch = _packed_batch(model)
    syncs = _count(model, batch, host_facts=False)
    forward_top = "hyper_parallel/models/qwen3_vl_moe_v2/model.py"
    # one read-back (ids and grids in one copy), one copy of the host facts to the device
    assert syncs.by_kind == {"cpu": 1, "host->device copy": 1}, syncs.report()
    assert all(s.startswith(forward_top) for s in syncs.by_site), syncs.report()


def test_counter_sees_a_tolist_in_a_vision_block(monkeypatch):
    """The canary: one ``.tolist()`` of device data in a vision block's forward is counted, once per block."""
    from hyper_parallel.models.qwen3_vl_moe_v2 import vision

    forward = vision.VisionBlock.forward

    def syncing_forward(self, x_NC, **kwargs):
        kwargs["grid"].cu_seqlens.tolist()  # what the old tower did in every block
        return forward(self, x_NC, **kwargs)

    monkeypatch.setattr(vision.VisionBlock, "forward", syncing_forward)
    model = _model("qwen3_vl_moe_debug")
    syncs = _count(model, _packed_batch(model), host_facts=True)
    assert syncs.by_kind == {"tolist": len(model.visual.blocks)}, syncs.report()


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("balanced", [False, True])
def test_cp_split_of_visual_host_facts(balanced, cp):
    """Each CP rank's visual positions point at its own visual tokens, their feature rows are the tokens' global
    feature indices (images first, in sequence order), and ``visual_after`` names the next piece's first feature."""
    model = _model("qwen3_vl_moe_debug")
    batch = _packed_batch(model, pad=6 + (-_packed_batch(model)["input_ids"].shape[1]) % (2 * cp))
    full = {**batch, **model.host_inputs(batch)}
    ids = full["input_ids"][0]
    kind = (ids == IMG) | (ids == VID)
    order = torch.cat([torch.nonzero(ids == IMG).flatten(), torch.nonzero(ids == VID).flatten()])
    feature_of = torch.full_like(ids, -1)
    feature_of[order] = torch.arange(len(order))
    T = ids.numel()
    for rank in range(cp):
        local = split_batch_for_cp(full, rank, cp, split_inputs=type(model).split_inputs_for_cp,
                                   model_keys=type(model).input_keys, balanced=balanced)  # fmt: skip
        _, _, (pos, rows), after_BK = local["visual_tokens"].unpack(local["visual_index"])
        ranges = CPShard(rank=rank, size=cp, balanced=balanced).ranges(T // cp)
        global_of_local = torch.cat([torch.arange(lo, hi) for lo, hi in ranges])
        assert sorted(pos.tolist()) == torch.nonzero(kind[global_of_local]).flatten().tolist()
        assert torch.equal(rows, feature_of[global_of_local[pos]])
        after = [feature_of[hi].item() if hi < T and kind[hi] else -1 for _, hi in ranges]
        assert after_BK.tolist() == [after]


def _block_and_inputs(tower, grids, seed):
    g = torch.Generator().manual_seed(seed)
    grid = tower.grid(grids)
    x = torch.randn(grid.num_patches, tower.config.dim, generator=g, requires_grad=True)
    cos, sin = tower.rotary_pos_emb(grid.rows, grid.cols)
    return x, cos, sin, grid


def test_vision_block_compiles_once_for_new_geometries():
    """fullgraph + aot_eager: three geometries (one frame; equal frames; mixed frame sizes), at most one recompile
    after the first, outputs and gradients equal to eager's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    tower = vision_tower_config(depth=1, dim=32, n_heads=2, intermediate_size=64, patch_size=4,
                                num_position_embeddings=16).build(out_dim=8)  # fmt: skip
    tower.init_weights()
    block = tower.blocks[0]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    geometries = [[[1, 4, 4]], [[2, 4, 6], [1, 4, 6]], [[1, 2, 2], [3, 4, 4], [1, 6, 2]]]
    for i, grids in enumerate(geometries):
        outs = []
        for fn in (block, compiled):
            x, cos, sin, grid = _block_and_inputs(tower, grids, seed=i)
            y = fn(x, cos=cos, sin=sin, grid=grid)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            outs.append((y.detach(), x.grad, *[p.grad.clone() for p in block.parameters()]))
            block.zero_grad(set_to_none=True)
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for {len(geometries)} geometries"


def test_sdpa_groups_equal_per_frame_attention():
    """The SDPA path (eager and the custom op) equals plain per-frame attention on mixed frame sizes."""
    grid = VisionGrid.from_grid_thw([[1, 2, 2], [2, 4, 4], [1, 2, 6], [1, 2, 2]], merge_size=2)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, grid.num_patches, 8, generator=g, requires_grad=True) for _ in range(3))
    cu = grid.cu_seqlens_host
    ref = torch.cat([F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], scale=0.3)
                     for a, b in zip(cu[:-1], cu[1:])], dim=1).transpose(0, 1)  # fmt: skip
    from hyper_parallel.models.qwen3_vl_moe_v2.vision import _frame_attention_op, _frame_sdpa

    eager = _frame_sdpa(q, k, v, grid.plan.groups, grid.order, 0.3)
    op = _frame_attention_op(q, k, v, grid.plan.cu_seqlens_cpu, grid.order, 0.3)[0]
    torch.testing.assert_close(eager, ref, rtol=0, atol=1e-6)
    assert torch.equal(op, eager)
    grads = [torch.autograd.grad(o.square().sum(), (q, k, v)) for o in (eager, op)]
    for a, b in zip(*grads):
        assert torch.equal(a, b)
