"""Qwen3-VL dense (``Qwen3VLForConditionalGeneration``, the 2B / 4B / 8B / 32B releases) served by the VL package
``qwen3_vl_moe_v2`` as its ``qwen3_vl`` text family (Qwen3 text layers: GQA with q/k RMSNorm, dense SwiGLU,
interleaved M-RoPE; the tower with deepstack), against transformers (fp32):

- the released config (``released_configs/qwen3_vl_2b_instruct.json``, transformers 4.57 form: legacy
  ``rope_scaling`` + ``rope_theta``, vision ``model_type: qwen3_vl``, tied on both levels) reads field by field
  as transformers reads it, with the release's parameter and tensor counts (2,127,532,032 in 625 tensors), and so
  do the forms a release does not show (untied as 8B / 32B, tied only in text_config, absent keys, transformers 5);
- on a shrunk folder IN THE RELEASED FORM saved by transformers: logits and every gradient within 1e-5, for a
  document with two images, one with a video, and one with a video then an image, each packed with a text-only
  document in the same row
  (ours: one packed row with ``cu_seqlens``; HF: the documents one by one, the loss summed), M-RoPE positions equal;
- ``from_pretrained`` on that folder and the export back: the folder's keys and tensors, its ``config.json``
  form (no key lost or changed), read back by transformers with equal logits; an untied (8B-style) folder and
  transformers 5's own rewrite of the config load too;
- the folder names its package (``model_type: qwen3_vl`` -> ``qwen3_vl_moe``), and the ``qwen3_vl_debug`` recipe
  trains from the folder in process.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tests.torch.helpers import logits_of

transformers = pytest.importorskip("transformers")

from hyper_parallel.models import qwen3_vl_moe_v2  # noqa: E402
from hyper_parallel.models.qwen3_vl_moe_v2 import Qwen3VlMoeStateDictAdapter  # noqa: E402
from hyper_parallel.models.qwen3_vl_moe_v2.state_dict import config_to_hf  # noqa: E402
from tests.torch.ut.hf.test_released_configs import (  # noqa: E402
    IMG,
    VE,
    VID,
    VS,
    _hf_facts,
    _hf_model,
    _our_facts,
    _released,
    _shrink,
)

TOL = 1e-5
NAME = "qwen3_vl_2b_instruct.json"
HF_CLS = "Qwen3VLForConditionalGeneration"
P = 3 * 2 * 16 * 16  # one patch row: (C, T, P, P)


def _write_folder(folder: Path, d: dict[str, Any]) -> dict[str, Any]:
    """A random-weight folder saved by transformers, its ``config.json`` then rewritten in ``d``'s form."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d))
    torch.manual_seed(0)
    model = getattr(transformers, HF_CLS)(transformers.AutoConfig.from_pretrained(folder))
    with torch.no_grad():  # HF's init plus noise on every tensor: no unit norm, no symmetric rows
        for t in model.parameters():
            t.add_(0.02 * torch.randn_like(t))
    model.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(d, indent=2))  # the published form, not transformers' rewrite
    return d


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The shrunk 2B release (tied, deepstack after 3 of 3 vision blocks, 3 text layers of head_dim 128)."""
    folder = tmp_path_factory.mktemp("qwen3_vl_2b") / "hf"
    d = _write_folder(folder, _shrink(NAME))
    return folder, d, _hf_model(folder, HF_CLS)


# ---- the released config.json and its forms ----------------------------------------------------------------


def _forms() -> dict[str, dict[str, Any]]:
    base = _released(NAME)
    forms = {"released": base}
    untied = copy.deepcopy(base)  # the 8B / 32B releases: untied on both levels
    untied["tie_word_embeddings"] = untied["text_config"]["tie_word_embeddings"] = False
    forms["untied"] = untied
    text_tied = copy.deepcopy(base)  # a ConditionalGeneration class reads the TOP level (default False)
    del text_tied["tie_word_embeddings"]
    forms["tied_in_text_config_only"] = text_tied
    absent = copy.deepcopy(base)  # absent keys: Qwen3VLTextConfig's defaults (head_dim 128, MHA, theta 5e5, ...)
    for key in ("head_dim", "num_attention_heads", "num_key_value_heads", "rope_theta", "rope_scaling", "rms_norm_eps",
                "attention_bias"):
        absent["text_config"].pop(key)
    forms["absent_keys"] = absent
    modern = copy.deepcopy(base)  # transformers 5's form: one rope_parameters, vision model_type qwen3_vl_vision
    t = modern["text_config"]
    t["rope_parameters"] = {**t.pop("rope_scaling"), "rope_theta": t.pop("rope_theta")}
    modern["vision_config"]["model_type"] = "qwen3_vl_vision"
    forms["rope_parameters_5x"] = modern
    return forms


@pytest.mark.parametrize("form", sorted(_forms()))
def test_config_forms_read_like_transformers(form):
    d = _forms()[form]
    cfg = qwen3_vl_moe_v2.config_from_hf(copy.deepcopy(d))
    assert cfg.text_family == "qwen3_vl"
    hf, ours = _hf_facts(d, HF_CLS), _our_facts(cfg)
    for key in ours:
        assert ours[key] == hf[key], (key, ours[key], hf[key])
    if form == "released":  # the release's safetensors: 625 tensors, 2,127,532,032 parameters (SOURCES.md)
        assert ours["params"] == 2_127_532_032 and ours["tied"] and ours["deepstack"] == [5, 11, 17]
        with torch.device("meta"):
            keys = Qwen3VlMoeStateDictAdapter(cfg).to_hf(cfg.build().state_dict())
        assert len(keys) == 625 and "lm_head.weight" not in keys


def test_values_not_modelled_are_refused_by_name():
    d = _released(NAME)
    d["text_config"]["head_dim"] = None  # transformers' strict Qwen3VLTextConfig refuses it too
    with pytest.raises(ValueError, match=r"text_config\.head_dim is null"):
        qwen3_vl_moe_v2.config_from_hf(d)
    d = _released(NAME)
    d["text_config"]["rope_scaling"].update(rope_type="yarn", factor=4.0)
    with pytest.raises(NotImplementedError, match=r"text_config\.rope_scaling\.rope_type=.yarn."):
        qwen3_vl_moe_v2.config_from_hf(d)


def test_the_family_is_read_from_the_layers_and_the_folder():
    from hyper_parallel.models.qwen3_vl_moe_v2.config_registry import qwen3_vl_debug, qwen3_vl_moe_debug
    from hyper_parallel.protocols.hf_spec import HF_MODEL_TYPES

    assert HF_MODEL_TYPES["qwen3_vl"] == ("qwen3_vl_moe",)
    dense = qwen3_vl_debug().model
    assert dense.text_family == "qwen3_vl" and dense.tie_word_embeddings
    out = config_to_hf(dense)  # a recipe's model: the dense class, no expert key
    assert out["architectures"] == [HF_CLS] and out["model_type"] == "qwen3_vl"
    assert out["text_config"]["model_type"] == "qwen3_vl_text" and "num_experts" not in out["text_config"]
    assert qwen3_vl_moe_v2.config_from_hf(out).layers == dense.layers
    # a Qwen3-VL-MoE folder whose layers are all dense stays that folder's class
    moe = config_to_hf(qwen3_vl_moe_debug().model)
    moe["text_config"]["mlp_only_layers"] = [0, 1, 2]
    cfg = qwen3_vl_moe_v2.config_from_hf(moe)
    assert cfg.text_family == "qwen3_vl_moe" and config_to_hf(cfg)["model_type"] == "qwen3_vl_moe"


# ---- parity on the shrunk release -----------------------------------------------------------------------


def _video_tokens(grid: tuple[int, int, int], stamp: int) -> list[int]:
    """HF 5.x processor layout: per temporal patch a timestamp (text), then the frame group in vision markers."""
    out = [VS]
    for i in range(grid[0]):
        out += [40 + stamp + i, 41, VS] + [VID] * (grid[1] * grid[2] // 4) + [VE]
    return out + [VE]


def _vl_document(kind: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if kind == "two_images":  # two grids: the M-RoPE sections matter
        grid = torch.tensor([[1, 4, 4], [1, 4, 6]])
        ids = [1, 2, VS] + [IMG] * 4 + [VE, 7, 8, VS] + [IMG] * 6 + [VE, 9, 10]
        return torch.tensor([ids]), dict(pixel_values=torch.randn(int(grid.prod(-1).sum()), P, generator=g),
                                         image_grid_thw=grid)  # fmt: skip
    grid = torch.tensor([[2, 4, 6]])  # two temporal patches of 6 merged tokens
    ids = [3, 4] + _video_tokens((2, 4, 6), stamp=0) + [5, 6]
    kw = dict(pixel_values_videos=torch.randn(int(grid.prod(-1).sum()), P, generator=g), video_grid_thw=grid)
    if kind == "video_then_image":  # deepstack rows interleave video and image features in sequence order
        image = torch.tensor([[1, 6, 4]])
        ids += [VS] + [IMG] * 6 + [VE, 11]
        kw.update(pixel_values=torch.randn(int(image.prod(-1).sum()), P, generator=g), image_grid_thw=image)
    return torch.tensor([ids]), kw


def _type_ids(ids: torch.Tensor) -> torch.Tensor:
    return (ids == IMG).int() + 2 * (ids == VID).int()


def _hf_run(hf, ids: torch.Tensor, **kw) -> torch.Tensor:
    extra = {"mm_token_type_ids": _type_ids(ids)} if kw else {}
    return hf(input_ids=ids, **kw, **extra, use_cache=False).logits


@pytest.mark.parametrize("kind", ["two_images", "video", "video_then_image"])
def test_packed_logits_and_grads_match_transformers(release, kind):
    folder, d, hf = release
    hf.zero_grad(set_to_none=True)
    ours = qwen3_vl_moe_v2.from_pretrained(folder)
    assert ours.config.text_family == "qwen3_vl" and ours.tied_word_embeddings  # one parameter: tied
    assert len(ours.config.visual.deepstack_visual_indexes) == len(d["vision_config"]["deepstack_visual_indexes"])
    vl_ids, vis = _vl_document(kind)
    text_doc = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])  # text only, first in the row
    packed = torch.cat([text_doc, vl_ids], dim=1)
    n = packed.shape[1]
    cu = torch.tensor([0, text_doc.shape[1], n], dtype=torch.int32)
    labels = torch.randint(0, 512, packed.shape, generator=torch.Generator().manual_seed(3))

    # positions: per document, equal to HF's get_rope_index on the document alone
    grids = dict(image_grid_thw=vis.get("image_grid_thw"), video_grid_thw=vis.get("video_grid_thw"))
    hf_pos, _ = hf.model.get_rope_index(vl_ids, _type_ids(vl_ids), **grids)
    pos = ours.mrope_positions(packed, grids["image_grid_thw"], cu, grids["video_grid_thw"])
    assert torch.equal(pos[:, :, text_doc.shape[1] :], hf_pos) and pos[:, 0, : text_doc.shape[1]].tolist() == [
        list(range(text_doc.shape[1]))] * 3  # fmt: skip

    hf_logits = torch.cat([_hf_run(hf, text_doc), _hf_run(hf, vl_ids, **vis)], dim=1)
    logits = logits_of(ours(packed, **vis, cu_seqlens=cu, max_seqlen=int(vl_ids.shape[1])))
    err = (logits - hf_logits).abs().max().item()
    assert err <= TOL, err

    (F.cross_entropy(hf_logits[0], labels[0], reduction="sum") / n).backward()
    (F.cross_entropy(logits[0], labels[0], reduction="sum") / n).backward()
    adapter = Qwen3VlMoeStateDictAdapter(ours.config)
    want = adapter.from_hf({k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in hf.named_parameters()})
    got = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in ours.named_parameters()}
    assert set(got) <= set(want) and set(want) - set(got) <= {"lm_head.weight"}, set(got) ^ set(want)  # tied: one
    assert any(".mlp.gate_proj." in k for k in got) and not any("experts" in k for k in got)
    assert any(k.startswith("visual.deepstack_merger_list.") for k in got)
    worst = max((want[k] - got[k]).abs().max().item() for k in got)
    print(f"{kind}: max |logits diff| {err:.2e}, max |grad diff| {worst:.2e} over {len(got)} tensors")
    assert worst <= TOL, worst
    for key in ("visual.patch_embed.proj.weight", "visual.deepstack_merger_list.0.linear_fc2.weight"):
        assert got[key].abs().max() > 0, key  # the tower and the deepstack path are trained through the visuals


def test_export_keeps_the_folder_form_and_reads_back_in_transformers(release, tmp_path):
    folder, d, hf = release
    ours = qwen3_vl_moe_v2.from_pretrained(folder)
    qwen3_vl_moe_v2.save_pretrained(ours, tmp_path / "export")
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    problems, added = [], []

    def compare(src: dict, out: dict, where: str = "") -> None:
        for key in src.keys() | out.keys():
            if key not in out:
                problems.append(f"missing {where}{key}")
            elif key not in src:
                added.append(f"{where}{key}")
            elif isinstance(src[key], dict) and isinstance(out[key], dict):
                compare(src[key], out[key], f"{where}{key}.")
            elif src[key] != out[key] and key != "dtype":  # dtype: what was written (float32)
                problems.append(f"{where}{key}: {src[key]!r} -> {out[key]!r}")

    compare(d, written)
    assert problems == [], problems  # the legacy rope keys, vision model_type "qwen3_vl", tying on both levels
    # what the writer states beside the folder's keys: the dtype written and defaults transformers fills in anyway
    assert set(added) <= {"dtype", "text_config.pad_token_id", "vision_config.rope_parameters"}, added
    read = [transformers.AutoConfig.from_pretrained(p).to_dict() for p in (folder, tmp_path / "export")]
    for r in read:
        r.pop("_name_or_path")
        for level in (r, r["text_config"], r["vision_config"]):
            level.pop("dtype", None)
    assert read[0] == read[1]  # transformers reads the same model from both
    # the same tensors under the same keys as the folder transformers wrote (no lm_head: tied)
    src, out = load_file(folder / "model.safetensors"), load_file(tmp_path / "export" / "model.safetensors")
    assert set(out) == set(src) and "lm_head.weight" not in out
    assert all(torch.equal(out[k], src[k]) for k in src)
    ids, vis = _vl_document("two_images")
    back = _hf_model(tmp_path / "export", HF_CLS)
    with torch.no_grad():
        err = (_hf_run(back, ids, **vis) - _hf_run(hf, ids, **vis)).abs().max().item()
    print(f"export read back by transformers: max |logits diff| {err:.2e}")
    assert err <= TOL, err


@pytest.mark.parametrize("form", ["untied", "rope_parameters_5x"])
def test_other_forms_load_with_transformers_logits(form, tmp_path):
    d = _shrink(NAME)
    if form == "untied":
        d["tie_word_embeddings"] = d["text_config"]["tie_word_embeddings"] = False
    else:
        t = d["text_config"]
        t["rope_parameters"] = {**t.pop("rope_scaling"), "rope_theta": t.pop("rope_theta")}
        d["vision_config"]["model_type"] = "qwen3_vl_vision"
    _write_folder(tmp_path / "hf", d)
    hf = _hf_model(tmp_path / "hf", HF_CLS)
    ours = qwen3_vl_moe_v2.from_pretrained(tmp_path / "hf")
    assert ours.tied_word_embeddings == (form != "untied")
    ids, vis = _vl_document("video")
    with torch.no_grad():
        err = (logits_of(ours(ids, **vis)) - _hf_run(hf, ids, **vis)).abs().max().item()
    assert err <= TOL, err
    qwen3_vl_moe_v2.save_pretrained(ours, tmp_path / "export")
    keys = [set(load_file(folder / "model.safetensors")) for folder in (tmp_path / "hf", tmp_path / "export")]
    assert keys[0] == keys[1] and ("lm_head.weight" in keys[1]) == (form == "untied")
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    rope_keys = ("rope_scaling", "rope_parameters", "rope_theta")
    assert {k: written["text_config"][k] for k in rope_keys if k in written["text_config"]} == {
        k: d["text_config"][k] for k in rope_keys if k in d["text_config"]}  # fmt: skip
    assert written["vision_config"]["model_type"] == d["vision_config"]["model_type"]


def test_the_folder_is_the_model_and_the_recipe_trains_from_it(release, tmp_path, capfd):
    import hyper_parallel
    from hyper_parallel.config import ConfigManager
    from hyper_parallel.train import main

    folder, _, _ = release  # toy vocabulary and visual ids: the recipe's data fits
    model = hyper_parallel.from_pretrained(folder)
    assert type(model) is qwen3_vl_moe_v2.Qwen3VlMoeModel and model.config.text_family == "qwen3_vl"
    args = [
        "--config", "qwen3_vl_debug", "--checkpoint.initial_load_path", str(folder),
        "--training.steps", "2", "--checkpoint.enable", "False", "--checkpoint.no_export_hf",
        "--metrics.log_freq", "1", "--data.global_batch_tokens", "512", "--dump_folder", str(tmp_path / "run"),
    ]  # fmt: skip
    manager = ConfigManager()
    cfg = manager.parse_args(list(args))
    assert manager.module == "qwen3_vl_moe" and cfg.model.text_family == "qwen3_vl"
    capfd.readouterr()
    summary = main(args)
    log = "".join(capfd.readouterr())
    n = sum(p.numel() for p in model.parameters())  # the folder's model (head_dim 128), not the recipe's
    assert f"model qwen3_vl_moe: {n:,} parameters" in log, log[-2000:]
    assert summary["steps"] == 2
    assert torch.isfinite(torch.tensor([summary["first_loss"], summary["last_loss"]])).all(), summary
