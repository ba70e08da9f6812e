"""VisionTower vs HF ``Qwen3VLMoeVisionModel`` / ``Qwen3_5MoeVisionModel`` (fp32, random weights copied in),
plus the tower's geometry (merge-block order, position-table resampling, 2-D rotary) against torch/HF helpers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3_5MoeConfig, Qwen3VLMoeConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel
from transformers.vision_utils import get_vision_position_ids

from hyper_parallel.models.qwen3_vl_moe_v2.vision import (
    VisionGrid,
    VisionTower,
    vision_tower_config,
    vision_tower_config_from_hf,
    vision_tower_config_to_hf,
)

from tests.torch.ut.hf_utils import randomize_

TOL = 1e-5
# Two images of different grids (24 patches each, so their frames share one batched SDPA call), a 2-frame
# "video" (two attention segments of 16 patches) and the smallest grid (one merged token).
GRIDS = [[1, 4, 6], [1, 6, 4], [2, 4, 4], [1, 2, 2]]
EQUAL_FRAMES = [[1, 4, 4], [2, 4, 4]]  # every frame 16 patches: one SDPA call over a view


def _vision_cfg(**overrides):
    kw = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=25)  # fmt: skip
    kw.update(overrides)
    return kw


def _hf_tower(family: str, **overrides):
    if family == "qwen3_vl_moe":
        vc = Qwen3VLMoeConfig(vision_config=_vision_cfg(deepstack_visual_indexes=[2, 0], **overrides)).vision_config
        cls = Qwen3VLMoeVisionModel
    else:
        vc = Qwen3_5MoeConfig(vision_config=_vision_cfg(**overrides)).vision_config
        cls = Qwen3_5MoeVisionModel
    vc._attn_implementation = "sdpa"
    return randomize_(cls(vc).eval(), seed=1)


def _ours_from_hf(hf) -> VisionTower:
    cfg, out_dim = vision_tower_config_from_hf(hf.config.to_dict(), backend="sdpa")
    ours = cfg.build(out_dim=out_dim)
    ours.load_state_dict(ours.hf_to_ours_(dict(hf.state_dict())), strict=True)
    return ours


def _pixels(grids, patch_dim: int, seed: int = 0) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, patch_dim, generator=gen) * 2 - 1  # normalised pixels live in [-1, 1]


@pytest.mark.parametrize(
    "family, grids",
    [("qwen3_vl_moe", GRIDS), ("qwen3_5_moe", GRIDS), ("qwen3_vl_moe", EQUAL_FRAMES)],
    ids=["qwen3_vl_moe", "qwen3_5_moe", "qwen3_vl_moe-equal-frames"],
)
def test_vision_tower_matches_hf(family, grids):
    hf = _hf_tower(family)
    ours = _ours_from_hf(hf)
    assert ours.config.deepstack_visual_indexes == ([2, 0] if family == "qwen3_vl_moe" else [])
    grid = torch.tensor(grids)
    px = _pixels(grids, ours.patch_dim)
    px_hf, px_ours = px.clone().requires_grad_(), px.clone().requires_grad_()

    out_hf = hf(px_hf, grid_thw=grid)
    merged, deep = ours(px_ours, grid)
    deep_hf = list(getattr(out_hf, "deepstack_features", None) or [])
    assert merged.shape == (sum(t * h * w for t, h, w in grids) // 4, 48)
    assert (merged - out_hf.pooler_output).abs().max().item() <= TOL
    assert len(deep) == len(deep_hf) == (2 if family == "qwen3_vl_moe" else 0)
    for d, d_hf in zip(deep, deep_hf):
        assert d.shape == merged.shape
        assert (d - d_hf).abs().max().item() <= TOL

    # A mean-over-tokens loss (as in training) on every output; compare every parameter and pixel gradient.
    gen = torch.Generator().manual_seed(2)
    weights = [torch.randn(merged.shape, generator=gen) / merged.shape[0] for _ in range(1 + len(deep))]

    def loss(outs):
        return sum((o * w).sum() for o, w in zip(outs, weights))

    loss([out_hf.pooler_output, *deep_hf]).backward()
    loss([merged, *deep]).backward()
    mine = dict(ours.named_parameters())
    assert mine.keys() == dict(hf.named_parameters()).keys()
    for name, p in hf.named_parameters():
        g = mine[name].grad
        assert g is not None and p.grad is not None, name
        assert (g.reshape(p.grad.shape) - p.grad).abs().max().item() <= TOL, name
    assert (px_ours.grad - px_hf.grad).abs().max().item() <= TOL


def test_state_dict_round_trip_is_exact():
    hf = _hf_tower("qwen3_vl_moe")
    ours = _ours_from_hf(hf)
    back = ours.ours_to_hf_(dict(ours.state_dict()))
    ref = hf.state_dict()
    assert back.keys() == ref.keys()
    for k, v in ref.items():
        assert back[k].shape == v.shape and torch.equal(back[k], v), k
    with pytest.raises(ValueError, match="patch_embed.proj.weight"):
        ours.hf_to_ours_({"patch_embed.proj.weight": torch.zeros(32, 3, 1, 4, 4)})


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_hf_config_round_trip(family):
    hf_cfg = _hf_tower(family).config.to_dict()
    cfg, out_dim = vision_tower_config_from_hf(hf_cfg)
    back = vision_tower_config_to_hf(cfg, out_dim)
    assert back == {k: hf_cfg[k] for k in back}
    assert ("deepstack_visual_indexes" in back) == (family == "qwen3_vl_moe")


def test_one_segment_per_frame():
    """Frames attend only within themselves: changing frame 1 of the video leaves frame 0's tokens unchanged."""
    ours = _ours_from_hf(_hf_tower("qwen3_5_moe"))
    grids = [[2, 4, 4]]
    px = _pixels(grids, ours.patch_dim)
    px2 = px.clone()
    px2[16:] += 1.0
    with torch.no_grad():
        a, _ = ours(px, grids)
        b, _ = ours(px2, grids)
    assert torch.equal(a[:4], b[:4]) and not torch.allclose(a[4:], b[4:])
    # Two images: the same pixels give the same tokens whatever image comes before them.
    with torch.no_grad():
        solo, _ = ours(px[:16], [[1, 4, 4]])
        pair, _ = ours(torch.cat([_pixels([[1, 2, 2]], ours.patch_dim, 5), px[:16]]), [[1, 2, 2], [1, 4, 4]])
    assert (pair[1:] - solo).abs().max().item() <= 1e-6


@pytest.mark.parametrize("hw", [(2, 2), (2, 8), (6, 4), (5 * 2, 5 * 2), (14, 6)])
@pytest.mark.parametrize("side", [5, 4, 1])
def test_position_table_resampling_equals_interpolate(hw, side):
    """Bilinear taps equal ``F.interpolate(align_corners=True)`` of the table, reordered to merge-block order."""
    h, w, m, C = *hw, 2, 3
    table = torch.randn(side * side, C, dtype=torch.float64)
    grid = VisionGrid.from_grid_thw([[1, h, w]], merge_size=m)
    idx, wts = grid.bilinear_taps(side)
    ours = (table[idx] * wts.double()[..., None]).sum(1)  # [N, C]
    ref = F.interpolate(table.T.reshape(1, C, side, side), size=(h, w), mode="bilinear", align_corners=True)[0]
    ref = ref.reshape(C, h // m, m, w // m, m).permute(1, 3, 2, 4, 0).reshape(-1, C)  # merge-block order
    assert (ours - ref).abs().max().item() <= 1e-6  # taps/weights are fp32 (as HF)
    assert torch.allclose(wts.sum(-1), torch.ones(len(wts)))


def test_rotary_coordinates_equal_hf():
    """Rows/cols in merge-block order, repeated per frame, equal HF's ``get_vision_position_ids``."""
    grids = torch.tensor([[1, 4, 6], [3, 2, 4], [1, 8, 2]])
    g = VisionGrid.from_grid_thw(grids, merge_size=2)
    ref = get_vision_position_ids(grids, 2)
    assert torch.equal(torch.stack([g.rows, g.cols], -1), ref)
    assert g.cu_seqlens_host == (0, 24, 32, 40, 48, 64) and g.max_seqlen == 24
    # Merge-block order: every m*m consecutive patches form one 2x2 block in row-major order.
    assert g.rows[:4].tolist() == [0, 0, 1, 1] and g.cols[:8].tolist() == [0, 1, 0, 1, 2, 3, 2, 3]


def test_rotary_tables_equal_hf():
    hf = _hf_tower("qwen3_5_moe")
    ours = _ours_from_hf(hf)
    grids = torch.tensor([[1, 4, 6]])
    g = ours.grid(grids)
    cos, sin = ours.rotary_pos_emb(g.rows, g.cols)
    cos_hf, sin_hf = hf.rotary_pos_emb(torch.zeros(1), get_vision_position_ids(grids, 2))
    assert torch.equal(cos, cos_hf) and torch.equal(sin, sin_hf)


def test_bad_inputs_and_configs_raise():
    ours = vision_tower_config(depth=1, dim=32, n_heads=2, intermediate_size=64, patch_size=4,
                               num_position_embeddings=16).build(out_dim=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"grid_thw\[1\].*multiples of the spatial merge size 2"):
        ours(torch.zeros(4 + 3, ours.patch_dim), [[1, 2, 2], [1, 1, 3]])
    with pytest.raises(ValueError, match=r"pixel_values has shape \(5, 96\).*\[4, 96\]"):
        ours(torch.zeros(5, ours.patch_dim), [[1, 2, 2]])
    with pytest.raises(ValueError, match="must be a square"):
        vision_tower_config(depth=1, dim=32, n_heads=2, intermediate_size=64,
                            num_position_embeddings=20).build(out_dim=8)  # fmt: skip
    with pytest.raises(ValueError, match="distinct block indices"):
        vision_tower_config(depth=2, dim=32, n_heads=2, intermediate_size=64,
                            deepstack_visual_indexes=[1, 2]).build(out_dim=8)  # fmt: skip
    cfg = vision_tower_config(depth=2, dim=32, n_heads=2, intermediate_size=64, deepstack_visual_indexes=[1])
    cfg.deepstack_merger_list = []
    with pytest.raises(ValueError, match="one merger per index"):
        cfg.build(out_dim=8)
    with pytest.raises(ValueError, match="divisible by 4"):
        vision_tower_config(depth=1, dim=36, n_heads=6, intermediate_size=64).build(out_dim=8)


def test_meta_build_then_init():
    """Built on meta, materialised and initialised: finite outputs, rotary buffer recomputed, biases zero."""
    cfg = vision_tower_config(depth=2, dim=32, n_heads=2, intermediate_size=64, patch_size=4,
                              num_position_embeddings=16, deepstack_visual_indexes=[0])  # fmt: skip
    with torch.device("meta"):
        tower = cfg.build(out_dim=8)
    tower.to_empty(device="cpu")
    tower.init_weights()
    ref = cfg.build(out_dim=8)
    assert torch.equal(tower.rotary_pos_emb.inv_freq, ref.rotary_pos_emb.inv_freq)
    assert torch.all(tower.blocks[0].norm1.weight == 1) and torch.all(tower.blocks[0].attn.qkv.bias == 0)
    merged, deep = tower(_pixels([[1, 4, 4]], tower.patch_dim), [[1, 4, 4]])
    assert merged.shape == (4, 8) and len(deep) == 1 and torch.isfinite(merged).all()


def test_bf16_matches_hf():
    """bf16 weights: the position table and the rotary run in fp32 as in HF (bf16 math there: ~4e-3 mean diff)."""
    hf = _hf_tower("qwen3_vl_moe").to(torch.bfloat16)
    ours = _ours_from_hf(hf).to(torch.bfloat16)
    grid = torch.tensor(GRIDS)
    px = _pixels(GRIDS, ours.patch_dim)
    with torch.no_grad():
        ref = hf(px, grid_thw=grid)
        merged, deep = ours(px, grid)  # float32 pixels are cast to the weight dtype, as HF does
    for a, b in zip([merged, *deep], [ref.pooler_output, *ref.deepstack_features]):
        assert a.dtype == b.dtype == torch.bfloat16
        diff = (a.float() - b.float()).abs()
        # Identical on CPU; other kernels (GPU) may differ by an ulp here and there.
        assert diff.mean().item() <= 5e-4 and diff.max().item() <= 0.04


def test_attention_kernel_choice():
    """``auto`` falls back to SDPA on CPU fp32; asking for a GPU kernel where it cannot run is an error."""
    from hyper_parallel.models.qwen3_vl_moe_v2.vision import BidirectionalAttention

    q = torch.randn(2, 8, 4)
    assert BidirectionalAttention.Config().build()._kernel(q) == "sdpa"
    for backend in ("flash", "varlen"):
        with pytest.raises(RuntimeError, match=f"backend='{backend}' needs CUDA fp16/bf16"):
            BidirectionalAttention.Config(backend=backend).build()._kernel(q)
