"""Video through the Qwen3-VL-MoE / Qwen3.5-MoE VL models vs HF (fp32): logits, every gradient, M-RoPE positions.

Samples are laid out as HF's processor writes them: per temporal patch a timestamp (text), then
``vision_start``, the frame group's video tokens, ``vision_end``; images and videos mixed in one sample.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.torch.helpers import logits_of

transformers = pytest.importorskip("transformers")

from tests.torch.ut.models.qwen3_vl_moe_v2.test_model import FAMILIES, IMG, VE, VS, _grads_in_our_keys, _ours_from

VID = 501
P = 3 * 2 * 16 * 16


def _video_tokens(grid: tuple[int, int, int], stamp: int) -> list[int]:
    t, h, w = grid
    out = [VS]  # HF 5.x keeps the chat template's markers around the frame groups
    for i in range(t):
        out += [40 + stamp + i, 41] + [VS] + [VID] * (h * w // 4) + [VE]  # "<t seconds>" text, then the group
    return out + [VE]


def _sample(parts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``parts``: ints (text tokens), ("image", grid) or ("video", grid) -> ids [1, L] and the model inputs."""
    g = torch.Generator().manual_seed(5)
    ids: list[int] = []
    images, videos = [], []
    for p in parts:
        if isinstance(p, int):
            ids += list(range(60 + len(ids), 60 + len(ids) + p))
        elif p[0] == "image":
            ids += [VS] + [IMG] * (p[1][0] * p[1][1] * p[1][2] // 4) + [VE]
            images.append(p[1])
        else:
            ids += _video_tokens(p[1], stamp=len(videos) * 5)
            videos.append(p[1])
    kw = {}
    if images:
        grid = torch.tensor(images)
        kw.update(pixel_values=torch.randn(int(grid.prod(-1).sum()), P, generator=g), image_grid_thw=grid)
    if videos:
        grid = torch.tensor(videos)
        kw.update(pixel_values_videos=torch.randn(int(grid.prod(-1).sum()), P, generator=g), video_grid_thw=grid)
    return torch.tensor([ids]), kw


def _type_ids(ids: torch.Tensor) -> torch.Tensor:
    return (ids == IMG).int() + 2 * (ids == VID).int()


CASES = {
    "video": [3, ("video", (2, 4, 6)), 4],
    "image_then_videos": [2, ("image", (1, 4, 4)), 2, ("video", (3, 4, 4)), 1, ("video", (1, 6, 4)), 3],
    "video_then_image": [1, ("video", (2, 4, 4)), 2, ("image", (1, 6, 4)), 2],
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_video_logits_grads_and_positions_match_hf(family, case):
    hf = FAMILIES[family]()
    model, adapter = _ours_from(hf)
    ids, kw = _sample(CASES[case])
    hf_pos, _ = hf.model.get_rope_index(ids, _type_ids(ids), image_grid_thw=kw.get("image_grid_thw"),
                                        video_grid_thw=kw.get("video_grid_thw"))  # fmt: skip
    ours_pos = model.mrope_positions(ids, kw.get("image_grid_thw"), None, kw.get("video_grid_thw"))
    assert torch.equal(ours_pos, hf_pos)
    labels = torch.randint(0, 512, ids.shape, generator=torch.Generator().manual_seed(2))
    hf_logits = hf(input_ids=ids, mm_token_type_ids=_type_ids(ids), use_cache=False, **kw).logits
    ours = logits_of(model(ids, **kw))
    assert (hf_logits - ours).abs().max().item() <= 1e-5
    F.cross_entropy(hf_logits[0], labels[0]).backward()
    F.cross_entropy(ours[0], labels[0]).backward()
    want = _grads_in_our_keys(hf, adapter)
    got = {k: p.grad for k, p in model.named_parameters()}
    worst = max((want[k] - got[k]).abs().max().item() for k in got)
    assert worst <= 1e-5, worst
    assert got["visual.patch_embed.proj.weight"].abs().max() > 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_rows_with_videos_equal_documents_run_separately(family):
    model, _ = _ours_from(FAMILIES[family]())
    docs = [_sample(CASES["video"]), _sample([4, 1]), _sample(CASES["image_then_videos"])]
    packed = torch.cat([d[0] for d in docs], dim=1)
    lengths = [d[0].shape[1] for d in docs]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    kw: dict[str, torch.Tensor] = {}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        parts = [d[1][key] for d in docs if key in d[1]]
        if parts:
            kw[key] = torch.cat(parts)
    with torch.no_grad():
        out = logits_of(model(packed, cu_seqlens=cu, max_seqlen=max(lengths), **kw))
        parts = [logits_of(model(ids, **inputs)) for ids, inputs in docs]
    assert (out - torch.cat(parts, dim=1)).abs().max().item() <= 1e-5
    pos = model.mrope_positions(packed, kw["image_grid_thw"], cu, kw["video_grid_thw"])
    for (ids, inputs), lo in zip(docs, cu[:-1].tolist()):
        alone = model.mrope_positions(ids, inputs.get("image_grid_thw"), None, inputs.get("video_grid_thw"))
        assert torch.equal(pos[:, :, lo : lo + ids.shape[1]], alone)


def test_video_token_count_mismatch_is_named():
    model, _ = _ours_from(FAMILIES["qwen3_vl_moe"]())
    ids, kw = _sample(CASES["video"])
    kw["video_grid_thw"] = torch.tensor([[2, 4, 4]])
    kw["pixel_values_videos"] = kw["pixel_values_videos"][:32]
    with pytest.raises(ValueError, match="video"):
        model(ids, **kw)
