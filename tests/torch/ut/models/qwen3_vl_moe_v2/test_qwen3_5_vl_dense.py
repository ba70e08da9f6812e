"""Qwen3.5 dense VL (``Qwen3_5ForConditionalGeneration``, the 0.8B-27B releases) served by the VL package
``qwen3_vl_moe_v2`` with the dense Qwen3.5 text decoder, against transformers (fp32) on shrunk folders in the
released form (``released_configs/qwen3_5_0_8b.json``: tied; ``qwen3_5_27b.json``: untied):

- logits and gradients within 1e-5, two images in one document (and, on the tied release, a video: per
  temporal patch a timestamp, then the frame group between vision markers, as HF's processor writes it) packed
  with a text-only document in the same row (ours: one packed row with ``cu_seqlens``; HF: the documents run
  one by one, the loss summed);
- the export (``save_pretrained``) holds the folder's keys (dense ``mlp.gate_proj/up_proj/down_proj``, no
  head when tied) and config form, and reads back in transformers with equal logits;
- the folder-to-package table: a ``qwen3_5`` folder is the text model by default, the VL model for
  ``--module qwen3_vl_moe``; the ``qwen3_5_vl_debug`` recipe trains 2 steps in process.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from hyper_parallel.models import qwen3_vl_moe_v2  # noqa: E402
from hyper_parallel.models.qwen3_vl_moe_v2 import Qwen3VlMoeStateDictAdapter  # noqa: E402
from tests.torch.ut.hf.test_released_configs import IMG, VE, VID, VS, _hf_model, _inputs, _write_folder  # noqa: E402

TOL = 1e-5
HF_CLS = "Qwen3_5ForConditionalGeneration"
RELEASES = ["qwen3_5_0_8b.json", "qwen3_5_27b.json"]


def _folder(name, tmp_path):
    d = _write_folder(name, tmp_path / "hf")
    return d, _hf_model(tmp_path / "hf", HF_CLS)


def _hf_run(hf, ids, **kw):
    extra = {"mm_token_type_ids": (ids == IMG).int() + 2 * (ids == VID).int()} if kw else {}
    return hf(input_ids=ids, **kw, **extra, use_cache=False).logits


def _video_doc() -> dict[str, torch.Tensor]:
    """One document with a video of 2 temporal patches (4 x 6 patches: 6 tokens per frame group)."""
    t, h, w = grid = (2, 4, 6)
    ids = [1, 2, VS]
    for i in range(t):  # "<t seconds>" (two text tokens here), then the frame group between vision markers
        ids += [40 + i, 41, VS] + [VID] * (h * w // 4) + [VE]
    ids += [VE, 9, 10]
    pixels = torch.randn(t * h * w, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(2))
    return {"input_ids": torch.tensor([ids]), "pixel_values_videos": pixels, "video_grid_thw": torch.tensor([grid])}


CASES = [(name, "images") for name in RELEASES] + [("qwen3_5_0_8b.json", "video")]


@pytest.mark.parametrize(("name", "visual"), CASES)
def test_packed_logits_and_grads_match_transformers(name, visual, tmp_path):
    d, hf = _folder(name, tmp_path)
    ours = qwen3_vl_moe_v2.from_pretrained(tmp_path / "hf")
    assert ours.config.text_family == "qwen3_5"
    assert ours.config.tie_word_embeddings == bool(d["tie_word_embeddings"])
    # one document with two images of different grids, or with a video
    doc = _inputs(True) if visual == "images" else _video_doc()
    text_doc = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])  # text only
    docs = [text_doc, doc["input_ids"]]
    packed = torch.cat(docs, dim=1)
    cu = torch.tensor([0, text_doc.shape[1], packed.shape[1]], dtype=torch.int32)
    labels = torch.randint(0, 512, packed.shape, generator=torch.Generator().manual_seed(3))
    n = packed.shape[1]

    vis = {k: v for k, v in doc.items() if k != "input_ids"}
    hf_parts = [_hf_run(hf, text_doc), _hf_run(hf, doc["input_ids"], **vis)]
    hf_logits = torch.cat(hf_parts, dim=1)
    out = ours(packed, **vis, cu_seqlens=cu, max_seqlen=int(doc["input_ids"].shape[1]))
    logits = out.logits if hasattr(out, "logits") else out
    err = (logits - hf_logits).abs().max().item()
    assert err <= TOL, err

    (F.cross_entropy(hf_logits[0], labels[0], reduction="sum") / n).backward()
    (F.cross_entropy(logits[0], labels[0], reduction="sum") / n).backward()
    adapter = Qwen3VlMoeStateDictAdapter(ours.config)
    hf_grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in hf.named_parameters()}
    want = adapter.from_hf(hf_grads)
    got = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in ours.named_parameters()}
    assert set(got) <= set(want), set(got) - set(want)
    assert any(".mlp.gate_proj." in k for k in got) and not any("experts" in k for k in got)
    worst = max((want[k] - got[k]).abs().max().item() for k in got)
    print(f"{name} {visual}: max |logits diff| {err:.2e}, max |grad diff| {worst:.2e} over {len(got)} tensors")
    assert worst <= TOL, worst
    assert got["visual.patch_embed.proj.weight"].abs().max() > 0  # the tower is trained through the images/video


def test_export_keeps_the_folder_form_and_reads_back_in_transformers(tmp_path):
    d, hf = _folder("qwen3_5_0_8b.json", tmp_path)
    ours = qwen3_vl_moe_v2.from_pretrained(tmp_path / "hf")
    qwen3_vl_moe_v2.save_pretrained(ours, tmp_path / "export")
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["model_type"] == "qwen3_5" and written["architectures"] == [HF_CLS]
    assert written["vision_config"]["model_type"] == d["vision_config"]["model_type"]  # "qwen3_5" as released
    assert written["tie_word_embeddings"] is True and written["text_config"]["model_type"] == "qwen3_5_text"
    for key in ("layer_types", "rope_parameters", "intermediate_size", "mtp_num_hidden_layers"):
        assert written["text_config"][key] == d["text_config"][key], key
    # the same tensors under the same keys as the folder transformers wrote (no lm_head: tied)
    keys = set(load_file(tmp_path / "export" / "model.safetensors"))
    assert keys == set(load_file(tmp_path / "hf" / "model.safetensors"))
    inputs = _inputs(True)
    vis = {k: v for k, v in inputs.items() if k != "input_ids"}
    back = _hf_model(tmp_path / "export", HF_CLS)
    with torch.no_grad():
        err = (_hf_run(back, inputs["input_ids"], **vis) - _hf_run(hf, inputs["input_ids"], **vis)).abs().max()
    print(f"export read back by transformers: max |logits diff| {err.item():.2e}")
    assert err.item() <= TOL, err


def test_a_qwen3_5_folder_trains_in_the_vl_recipe_and_is_the_text_model_by_default(tmp_path):
    import hyper_parallel
    from hyper_parallel.config import ConfigManager
    from hyper_parallel.models.qwen3_5_v2 import Qwen3_5Model
    from hyper_parallel.train import main

    _write_folder("qwen3_5_0_8b.json", tmp_path / "hf")  # toy vocabulary and image ids: the recipe's data fits
    assert type(hyper_parallel.from_pretrained(tmp_path / "hf", mtp=False)) is Qwen3_5Model  # default: text part
    args = [
        "--config", "qwen3_5_vl_debug", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
        "--model.use_mtp", "false",  # transformers writes no mtp.* tensors
        "--training.steps", "2", "--checkpoint.enable", "False", "--checkpoint.no_export_hf",
        "--metrics.log_freq", "1", "--data.global_batch_tokens", "512", "--dump_folder", str(tmp_path / "run"),
    ]  # fmt: skip
    manager = ConfigManager()
    cfg = manager.parse_args(list(args))
    assert manager.module == "qwen3_vl_moe" and cfg.model_spec == "qwen3_vl_moe"  # the package with the recipe
    summary = main(args)
    assert summary["steps"] == 2
    assert torch.isfinite(torch.tensor([summary["first_loss"], summary["last_loss"]])).all(), summary


def test_mtp_block_from_the_folder_matches_the_reference_with_images(tmp_path):
    """``from_pretrained(path, mtp=True)``: the folder's ``mtp.*`` keys (here written by HF's own modules, the
    reference of ``models/qwen3_5_v2/test_mtp.py``) load into the dense Qwen3.5 MTP block; at a position before an image token
    its input is that token's visual feature (as for the Qwen3.5-MoE VL model, ``test_mtp_qwen3_5_vl``)."""
    from hyper_parallel.data.packing import add_mtp_targets
    from hyper_parallel.hf import read_safetensors, write_safetensors
    from tests.torch.ut.models.qwen3_5_v2.test_mtp import _HFMtp

    _, hf = _folder("qwen3_5_0_8b.json", tmp_path)  # text_config.mtp_num_hidden_layers 1, as released
    ref = _HFMtp(hf.config.text_config, moe=False, seed=5).eval()
    sd = read_safetensors(tmp_path / "hf")
    sd.update(ref.hf_keys())
    write_safetensors(sd, tmp_path / "hf")
    ours = qwen3_vl_moe_v2.from_pretrained(tmp_path / "hf", mtp=True).eval()
    assert ours.config.mtp is not None and ours.config.text_family == "qwen3_5"

    inputs = _inputs(True)
    ids, vis = inputs["input_ids"], {k: v for k, v in inputs.items() if k != "input_ids"}
    seen = {}
    lm = hf.model.language_model
    hooks = [
        lm.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True),
        lm.register_forward_hook(lambda m, a, kw, out: seen.update(h=out.last_hidden_state), with_kwargs=True),
    ]
    with torch.no_grad():
        hf_logits = _hf_run(hf, ids, **vis)
        for h in hooks:
            h.remove()
        emb, h_last, pos = seen["inputs_embeds"], seen["h"], seen["position_ids"]
        pos = pos[1:] if pos.shape[0] == 4 else pos  # row 0 = text positions (masks only)
        x = ref.fc(torch.cat([ref.pre_fc_norm_embedding(emb[:, 1:]), ref.pre_fc_norm_hidden(h_last[:, :-1])], -1))
        p = pos[..., :-1]
        y = ref.layers[0](x, position_embeddings=lm.rotary_emb(x, p), attention_mask=None, position_ids=p)
        want = hf.lm_head(ref.norm(y[0] if isinstance(y, tuple) else y))
        out = ours(ids, **vis, mtp_input_ids=add_mtp_targets({"input_ids": ids, "labels": ids})["mtp_input_ids"])
    assert (out.logits - hf_logits).abs().max().item() <= TOL
    err = (out.mtp_logits[:, :-1] - want).abs().max().item()
    print(f"MTP: max |mtp logits diff| {err:.2e}")
    assert err <= TOL, err
    qwen3_vl_moe_v2.save_pretrained(ours, tmp_path / "export")  # the block written back under vLLM's names
    written = load_file(tmp_path / "export" / "model.safetensors")
    assert {k for k in written if k.startswith("mtp.")} == set(ref.hf_keys())


def test_release_recipes_have_the_release_dimensions():
    """``qwen3_5_27b_vl`` builds what the 27B release's config.json builds; ``qwen3_5_9b_vl`` what transformers'
    ``Qwen3_5Config`` defaults build (the "Qwen3.5-9B style" configuration, with the releases' RoPE and its tower
    out 4096): every dimension and the parameter count as transformers' model on the meta device."""
    from hyper_parallel.models.qwen3_vl_moe_v2.config_registry import qwen3_5_9b_vl, qwen3_5_27b_vl
    from tests.torch.ut.hf.test_released_configs import _hf_facts, _our_facts, _released

    release = _released("qwen3_5_27b.json")
    recipe, folder = qwen3_5_27b_vl().model, qwen3_vl_moe_v2.config_from_hf(release)
    assert recipe.layers == folder.layers and recipe.visual == folder.visual
    ours, hf = _our_facts(recipe), _hf_facts(release, HF_CLS)
    assert {k: ours[k] for k in ours} == {k: hf[k] for k in ours}
    rope = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                mrope_interleaved=True)  # the releases' RoPE (transformers' default theta is 1e4)
    nine = {"model_type": "qwen3_5", "text_config": {"rope_parameters": rope},
            "vision_config": {"out_hidden_size": 4096}}  # fmt: skip
    ours, hf = _our_facts(qwen3_5_9b_vl().model), _hf_facts(nine, HF_CLS)
    assert {k: ours[k] for k in ours} == {k: hf[k] for k in ours}, (ours, hf)
