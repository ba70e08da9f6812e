"""Qwen3-VL-MoE / Qwen3.5-MoE VL models vs HF (fp32), HF folder I/O, packing and the A3B parameter count."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tests.torch.helpers import logits_of

transformers = pytest.importorskip("transformers")

from hyper_parallel.models.qwen3_vl_moe_v2 import (  # noqa: E402
    CheckpointKeyError,
    Qwen3VlMoeModel,
    Qwen3VlMoeStateDictAdapter,
    from_pretrained,
    save_pretrained,
)
from hyper_parallel.models.qwen3_vl_moe_v2.config_registry import qwen3_vl_moe_a3b  # noqa: E402
from hyper_parallel.models.qwen3_vl_moe_v2.state_dict import config_from_hf  # noqa: E402

IMG, VS, VE = 500, 502, 503
VISION = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=16, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)  # fmt: skip
IDS = dict(image_token_id=IMG, video_token_id=501, vision_start_token_id=VS, vision_end_token_id=VE)


def _vl_moe_hf(moe_intermediate_size: int = 24):
    cfg = transformers.Qwen3VLMoeConfig(
        text_config=dict(
            vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=96, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=moe_intermediate_size, mlp_only_layers=[2],
            rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[4, 2, 2], mrope_interleaved=True),
        ),
        vision_config={**VISION, "deepstack_visual_indexes": [1, 2]},
        **IDS,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Qwen3VLMoeForConditionalGeneration(cfg).float()


def _qwen3_5_moe_hf():
    cfg = transformers.Qwen3_5MoeConfig(
        text_config=dict(
            vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=24, shared_expert_intermediate_size=48,
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True),
        ),
        vision_config={**VISION, "depth": 2},
        **IDS,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Qwen3_5MoeForConditionalGeneration(cfg).float()


FAMILIES = {"qwen3_vl_moe": _vl_moe_hf, "qwen3_5_moe": _qwen3_5_moe_hf}


def _ours_from(hf) -> tuple[Qwen3VlMoeModel, Qwen3VlMoeStateDictAdapter]:
    cfg = config_from_hf(hf.config.to_dict())
    model = cfg.build()
    adapter = Qwen3VlMoeStateDictAdapter(cfg)
    state, _ = adapter.from_hf_checked(hf.state_dict(), expected={k: v.shape for k, v in model.state_dict().items()})
    model.load_state_dict(state)
    return model, adapter


def _two_images():
    grid = torch.tensor([[1, 4, 4], [1, 4, 6]])  # 4 and 6 merged tokens: two different grids
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16, generator=g)
    ids = torch.tensor([[1, 2, VS] + [IMG] * 4 + [VE, 7, 8, VS] + [IMG] * 6 + [VE, 9, 10]])
    return ids, pixels, grid


def _grads_in_our_keys(hf, adapter) -> dict[str, torch.Tensor]:
    grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in hf.named_parameters()}
    return adapter.from_hf(grads)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("with_images", [True, False], ids=["two_images", "text_only"])
def test_logits_and_grads_match_hf(family, with_images):
    hf = FAMILIES[family]()
    model, adapter = _ours_from(hf)
    ids, pixels, grid = _two_images()
    kw = dict(pixel_values=pixels, image_grid_thw=grid) if with_images else {}
    if not with_images:
        ids = torch.tensor([[1, 5, 7, 8, 9, 10, 11, 12, 13]])
    labels = torch.randint(0, 512, ids.shape, generator=torch.Generator().manual_seed(2))
    hf_logits = hf(input_ids=ids, mm_token_type_ids=(ids == IMG).int(), use_cache=False, **kw).logits
    ours = logits_of(model(ids, **kw))
    assert (hf_logits - ours).abs().max().item() <= 1e-5
    F.cross_entropy(hf_logits[0], labels[0]).backward()
    F.cross_entropy(ours[0], labels[0]).backward()
    want = _grads_in_our_keys(hf, adapter)
    got = {k: p.grad for k, p in model.named_parameters()}
    assert want.keys() == got.keys()
    worst = max((want[k] - got[k]).abs().max().item() for k in got)
    assert worst <= 1e-5, worst
    if with_images:  # the tower is trained through the image tokens
        assert got["visual.patch_embed.proj.weight"].abs().max() > 0
    else:  # text only: the dummy tower pass contributes exact zeros
        assert got["visual.patch_embed.proj.weight"].abs().max() == 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_rows_equal_documents_run_separately(family):
    model, _ = _ours_from(FAMILIES[family]())
    ids, pixels, grid = _two_images()
    doc1 = torch.tensor([[3, 4, 5, 6, 7]])  # text only
    doc2 = torch.tensor([[1, VS] + [IMG] * 4 + [VE, 9]])
    n1 = int(grid[0].prod())
    doc3 = torch.tensor([[2, VS] + [IMG] * 6 + [VE, 11, 12]])
    packed = torch.cat([doc1, doc2, doc3], dim=1)
    cu = torch.tensor([0, 5, 5 + doc2.shape[1], packed.shape[1]], dtype=torch.int32)
    with torch.no_grad():
        out = logits_of(model(packed, pixel_values=pixels, image_grid_thw=grid, cu_seqlens=cu, max_seqlen=10))
        parts = [
            logits_of(model(doc1)),
            logits_of(model(doc2, pixel_values=pixels[:n1], image_grid_thw=grid[:1])),
            logits_of(model(doc3, pixel_values=pixels[n1:], image_grid_thw=grid[1:])),
        ]
    assert (out - torch.cat(parts, dim=1)).abs().max().item() <= 1e-5
    # positions restart per document (the second image document starts at 0 on all three rows)
    pos = model.mrope_positions(packed, grid, cu)
    assert pos[:, 0, 5].tolist() == [0, 0, 0] and pos.shape == (3, 1, packed.shape[1])


def _tensors(folder) -> dict[str, torch.Tensor]:
    from hyper_parallel.hf.storage import read_safetensors

    return read_safetensors(folder)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_to_ours_to_hf_is_bit_exact(family, tmp_path):
    hf = FAMILIES[family]()
    hf.save_pretrained(tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf")
    save_pretrained(model, tmp_path / "ours")
    a, b = _tensors(tmp_path / "hf"), _tensors(tmp_path / "ours")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    back = type(hf).from_pretrained(tmp_path / "ours", dtype=torch.float32)
    ids, pixels, grid = _two_images()
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMG).int(),
                  use_cache=False).logits  # fmt: skip
        got = back(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMG).int(),
                   use_cache=False).logits  # fmt: skip
    assert (want - got).abs().max().item() <= 1e-6  # same tensors; HF may pick another kernel path on reload


def _hub_folder(hf, folder, *, version: str) -> None:
    """An HF folder in the Hub (transformers 4.x) layout: fused experts transposed to [E, H, 2I] / [E, I, H]."""
    folder.mkdir()
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    for k in state:
        if k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            state[k] = state[k].transpose(1, 2).contiguous()
    save_file(state, str(folder / "model.safetensors"))
    config = hf.config.to_dict()
    config["transformers_version"] = version
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("moe_i", [32, 24], ids=["H_eq_2I", "H_ne_2I"])
def test_hub_expert_layout_is_decided_by_the_config_not_by_shapes(tmp_path, moe_i):
    hf = _vl_moe_hf(moe_intermediate_size=moe_i)  # H = 64: I = 32 gives H == 2I, the case HF mis-loads
    _hub_folder(hf, tmp_path / "hub", version="4.57.0.dev0")
    model = from_pretrained(tmp_path / "hub")
    ours = dict(model.state_dict())
    for k, v in hf.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            layer = k.split(".")[3]
            assert torch.equal(ours[f"layers.{layer}.mlp.experts.gate_up_proj"], v)
    ids, pixels, grid = _two_images()
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMG).int(),
                  use_cache=False).logits  # fmt: skip
        assert (want - logits_of(model(ids, pixel_values=pixels, image_grid_thw=grid))).abs().max() <= 1e-5
    # written back in the layout it was read in: bit-exact
    save_pretrained(model, tmp_path / "back")
    a, b = load_file(str(tmp_path / "hub" / "model.safetensors")), _tensors(tmp_path / "back")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the same tensors declared as the in-memory layout are rejected by shape when H != 2I (a loud error)
    if moe_i != 32:
        with pytest.raises(CheckpointKeyError, match="experts_layout"):
            from_pretrained(tmp_path / "hub", experts_layout="memory")


def test_freeze_options():
    hf = _vl_moe_hf()
    cfg = config_from_hf(hf.config.to_dict())
    import dataclasses

    frozen = dataclasses.replace(cfg, freeze_vision=True).build()
    assert not any(p.requires_grad for p in frozen.visual.parameters())
    assert all(p.requires_grad for n, p in frozen.named_parameters() if not n.startswith("visual."))
    text_frozen = dataclasses.replace(cfg, freeze_text=True).build()
    assert all(p.requires_grad for p in text_frozen.visual.parameters())
    assert not any(p.requires_grad for n, p in text_frozen.named_parameters() if not n.startswith("visual."))


def test_a3b_parameter_count_on_meta_equals_the_analytic_count():
    cfg = qwen3_vl_moe_a3b().model
    with torch.device("meta"):
        model = cfg.build()
    V, H, L, Hq, Hkv, d, E, I = 151936, 2048, 48, 32, 4, 128, 128, 768
    layer = H * Hq * d + 2 * H * Hkv * d + Hq * d * H + 2 * d + 2 * H + E * H + E * 3 * I * H
    text = 2 * V * H + L * layer + H
    C, Iv, P, O, S = 1152, 4304, 3 * 2 * 16 * 16, 2048, 2304
    block = 2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (Iv * C + Iv) + (C * Iv + C)
    merger_mlp = (4 * C * 4 * C + 4 * C) + (O * 4 * C + O)
    vision = (C * P + C) + S * C + 27 * block + (2 * C + merger_mlp) + 3 * (2 * 4 * C + merger_mlp)
    n_text = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("visual."))
    assert n_text == text and 30.4e9 < text < 30.6e9
    assert sum(p.numel() for p in model.visual.parameters()) == vision
    assert model.count_params() == text + vision


def test_layout_checks_name_the_option_to_change():
    from hyper_parallel.config.manager import ConfigError
    from hyper_parallel.distributed.parallel_dims import ParallelDims
    from hyper_parallel.models.qwen3_vl_moe_v2.parallelize import validate_qwen3_vl_moe_layout

    cfg = config_from_hf(_vl_moe_hf().config.to_dict())
    tp_sp = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, ep=1, world_size=2)
    with pytest.raises(ConfigError, match="enable_sequence_parallel"):  # deepstack adds at whole-sequence positions
        validate_qwen3_vl_moe_layout(cfg, tp_sp)
    tp = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, ep=1, world_size=2, enable_sequence_parallel=False)
    validate_qwen3_vl_moe_layout(cfg, tp)
    qwen3_5 = config_from_hf(_qwen3_5_moe_hf().config.to_dict())
    validate_qwen3_vl_moe_layout(qwen3_5, tp)  # TP shards the DeltaNet heads (Hk 2, Hv 4)
    tp4 = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=4, ep=1, world_size=4, enable_sequence_parallel=False)
    with pytest.raises(ConfigError, match="linear_num_key_heads"):
        validate_qwen3_vl_moe_layout(qwen3_5, tp4)
