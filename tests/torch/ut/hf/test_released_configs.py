"""Released ``config.json`` files, in the forms users download, read into the model transformers builds.

The files in ``released_configs/`` are transcriptions (see ``released_configs/SOURCES.md`` for where each
comes from); every test reads them through our reader and through transformers (the oracle):

- field by field: theta, rotary dims, M-RoPE sections, layer types, head dims, experts, tying, deepstack;
- the parameter count on the meta device (full size) against transformers' model on meta, naming the
  parts we do not model;
- a shrunk copy IN THE SAME FORM (sizes reduced, keys and their form kept: legacy ``rope_scaling`` +
  ``rope_theta`` stays legacy, a 4.57 folder keeps its transposed hub experts), saved with random weights:
  logits within 1e-5 of transformers reading the same folder, through ``from_pretrained`` and through the
  trainer's ``--checkpoint.initial_load_path``; our export of it reads back in transformers with equal logits,
  and its ``config.json`` states the RoPE in the folder's own form (the same keys, no second form beside them).

Plus the config forms a release does not show (Qwen3.6's top-level RoPE beside an M-RoPE-only dict,
``full_attention_interval`` without ``layer_types``, nulls, ``decoder_sparse_step=2``, yarn refused, M-RoPE
sections with ``s_h != s_w``) and the bf16 cast order of the Llama-style RMSNorm.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from hyper_parallel.config import ConfigManager  # noqa: E402
from hyper_parallel.models import glm_image_moe_v2, qwen3_5_moe_v2, qwen3_5_v2, qwen3_vl_moe_v2  # noqa: E402
from hyper_parallel.models.common.rmsnorm import RMSNorm  # noqa: E402

DATA = Path(__file__).parents[1] / "released_configs"
TOL = 1e-5
IMG, VS, VE, VID = 512, 513, 514, 515  # the toy VL corpus' ids (its trainer recipe reads images with them)


def _released(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


# ---- which package reads which release, and what transformers builds --------------------------------------

# name -> (our package, the HF class transformers builds for the folder)
RELEASES = {
    "qwen3_vl_30b_a3b_instruct.json": (qwen3_vl_moe_v2, "Qwen3VLMoeForConditionalGeneration"),
    "qwen3_5_35b_a3b.json": (qwen3_5_moe_v2, "Qwen3_5MoeForConditionalGeneration"),
    "qwen3_6_35b_a3b.json": (qwen3_5_moe_v2, "Qwen3_5MoeForConditionalGeneration"),  # Qwen3.6: its own form
    "qwen3_5_0_8b.json": (qwen3_5_v2, "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_27b.json": (qwen3_5_v2, "Qwen3_5ForConditionalGeneration"),
    # Qwen3.8's export form: vision_config.model_type "qwen3_5_vision", language_model_only, bos/eos, mtp_* keys
    "qwen3_8_27b.json": (qwen3_5_v2, "Qwen3_5ForConditionalGeneration"),
    "glm_4_7_flash.json": (glm_image_moe_v2, "Glm4MoeLiteForCausalLM"),
}
# the 35B-A3B releases also feed the VL package (the Qwen3.5-MoE VL model shares the text reader)
VL_OF = {"qwen3_5_35b_a3b.json": qwen3_vl_moe_v2, "qwen3_6_35b_a3b.json": qwen3_vl_moe_v2,
         "qwen3_8_27b.json": qwen3_vl_moe_v2}


def _hf_config(d: dict[str, Any]):
    """transformers' reading of a config.json dict (what ``from_pretrained`` does with the file)."""
    return transformers.AutoConfig.for_model(**copy.deepcopy(d))


def _hf_text(cfg):
    return cfg.text_config if hasattr(cfg, "text_config") else cfg


def _hf_facts(d: dict[str, Any], hf_cls: str) -> dict[str, Any]:
    cfg = _hf_config(d)
    tc = _hf_text(cfg)
    rope = tc.rope_parameters
    with torch.device("meta"):
        model = getattr(transformers, hf_cls)(cfg)
    lm = model.model.language_model if hasattr(model.model, "language_model") else model.model
    head_dim = getattr(tc, "qk_rope_head_dim", None) or tc.head_dim
    facts = {
        "vocab": tc.vocab_size,
        "hidden": tc.hidden_size,
        "layers": len(lm.layers),
        "theta": float(rope["rope_theta"]),
        "rotary_dim": 2 * lm.rotary_emb.inv_freq.numel(),
        "tied": model.lm_head.weight is lm.embed_tokens.weight,
        "moe_layers": [i for i, layer in enumerate(lm.layers) if hasattr(layer.mlp, "experts")],
        "rope_head_dim": head_dim,
    }
    if hasattr(tc, "layer_types") and "qwen3_5" in tc.model_type:
        facts["layer_types"] = list(tc.layer_types)
    if "mrope_section" in rope or hasattr(lm.rotary_emb, "mrope_section"):
        facts["mrope_section"] = list(getattr(lm.rotary_emb, "mrope_section", rope.get("mrope_section")))
    attn = next(layer.self_attn for layer in lm.layers if hasattr(layer, "self_attn"))
    if hasattr(attn, "k_proj"):
        facts.update(heads=tc.num_attention_heads, kv_heads=tc.num_key_value_heads, head_dim=attn.head_dim)
    moe = next((layer.mlp for layer in lm.layers if hasattr(layer.mlp, "experts")), None)
    if moe is not None:
        experts = moe.experts
        facts.update(experts=experts.num_experts, top_k=getattr(moe.gate, "top_k", None) or tc.num_experts_per_tok,
                     moe_hidden=experts.down_proj.shape[-1] if experts.down_proj.shape[1] == tc.hidden_size
                     else experts.down_proj.shape[1])  # fmt: skip
    if hasattr(model.model, "visual"):
        facts["deepstack"] = list(getattr(cfg.vision_config, "deepstack_visual_indexes", []) or [])
    facts["params"] = sum(p.numel() for p in model.parameters())
    facts["visual_params"] = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    return facts


def _our_facts(cfg) -> dict[str, Any]:
    with torch.device("meta"):
        model = cfg.build()
    layers = list(model.layers)
    attn = next(layer.self_attn for layer in layers if hasattr(layer.self_attn, "rope"))
    facts = {
        "vocab": cfg.vocab_size,
        "hidden": cfg.dim,
        "layers": len(layers),
        "theta": attn.rope.config.theta,
        "rotary_dim": attn.rope.rotary_dim,
        "tied": model.lm_head.weight is model.embed_tokens.weight,
        "moe_layers": [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")],
        "rope_head_dim": attn.rope.head_dim,
    }
    if attn.rope.config.mrope_section is not None:
        facts["mrope_section"] = list(attn.rope.config.mrope_section)
    if hasattr(layers[0], "layer_type"):
        facts["layer_types"] = [layer.layer_type for layer in layers]
    if hasattr(attn.config, "n_kv_heads"):
        c = attn.config
        facts.update(heads=c.n_heads, kv_heads=c.n_kv_heads, head_dim=c.head_dim)
    moe = next((layer.mlp for layer in layers if hasattr(layer.mlp, "experts")), None)
    if moe is not None:
        c = moe.config
        facts.update(experts=c.num_experts, top_k=c.gate.top_k, moe_hidden=c.experts.hidden_dim)
    if hasattr(model, "visual"):
        facts["deepstack"] = list(cfg.visual.deepstack_visual_indexes)
    facts["params"] = sum(p.numel() for p in model.parameters())
    return facts


def _unmodelled(name: str, cfg, hf: dict[str, Any]) -> int:
    """Our parameter count minus transformers': the parts one side has and the other does not (named here)."""
    if name == "glm_4_7_flash.json":
        # a Glm4MoeLite folder is a model without image path: exactly transformers' parameters
        assert not cfg.has_image_path
        return 0
    if hasattr(cfg, "visual"):
        return 0  # the VL package models the tower too
    return -hf["visual_params"]  # a text package reading a ConditionalGeneration folder: model.visual.* kept aside


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_released_config_reads_like_transformers(name):
    package, hf_cls = RELEASES[name]
    d = _released(name)
    ours = package.config_from_hf(d)
    hf, got = _hf_facts(d, hf_cls), _our_facts(ours)
    for key in got:
        if key != "params":
            assert got[key] == hf[key], (key, got[key], hf[key])
    assert got["params"] == hf["params"] + _unmodelled(name, ours, hf), (got["params"], hf["params"])
    if name in VL_OF:  # the same folder through the VL package: text reader shared, tower modelled
        vl = _our_facts(VL_OF[name].config_from_hf(d))
        assert {k: vl[k] for k in got if k not in ("params",)} == {k: got[k] for k in got if k != "params"}
        assert vl["params"] == hf["params"]


# Qwen3.5-35B-A3B's MTP head (``mtp.*``, kept aside unless MTP is on), from the folder's weight table (SOURCES.md):
# fc [2048, 4096], attention q/k/v/o + q/k norms, 256 experts x 3 [512, 2048], shared expert 3 x [512, 2048] + its
# gate [1, 2048], router [256, 2048], five [2048] norms
_QWEN3_5_35B_MTP = (2048 * 4096 + 8192 * 2048 + 2 * 512 * 2048 + 2048 * 4096 + 2 * 256
                    + 256 * 3 * 512 * 2048 + 3 * 512 * 2048 + 2048 + 256 * 2048 + 5 * 2048)  # fmt: skip


def test_released_parameter_counts_are_the_published_ones():
    # Qwen3-VL-30B-A3B-Instruct: 31,070,754,032 parameters in its 13 safetensors files (see SOURCES.md)
    cfg = qwen3_vl_moe_v2.config_from_hf(_released("qwen3_vl_30b_a3b_instruct.json"))
    assert _our_facts(cfg)["params"] == 31_070_754_032
    # Qwen3.5-35B-A3B: 35,951,822,704 parameters in its 14 safetensors files, the MTP head's included
    cfg = qwen3_vl_moe_v2.config_from_hf(_released("qwen3_5_35b_a3b.json"))
    assert _our_facts(cfg)["params"] + _QWEN3_5_35B_MTP == 35_951_822_704


# ---- shrunk copies in the same form -----------------------------------------------------------------------

_VISION = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, num_position_embeddings=16)


def _shrink(name: str) -> dict[str, Any]:
    """The release with sizes reduced; keys, their level and their form (legacy RoPE keys ...) kept."""
    d = copy.deepcopy(_released(name))
    if name == "glm_4_7_flash.json":
        d.update(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, pad_token_id=500,
                 eos_token_id=[500, 501], max_position_embeddings=256)  # fmt: skip
        return d
    t = d.get("text_config", d)
    t.update(vocab_size=520 if "vision_config" in d else 512, hidden_size=64, max_position_embeddings=4096)
    if "layer_types" in t:
        t["layer_types"] = t["layer_types"][:4]
    t["num_hidden_layers"] = 4 if "linear_num_key_heads" in t or "layer_types" in t else 3
    if "linear_num_key_heads" in t:  # Qwen3.5: keep head_dim 256, its rope form and its value/key head ratio
        ratio = t["linear_num_value_heads"] // t["linear_num_key_heads"]  # 1 (0.8B), 2 (35B-A3B), 3 (27B)
        t.update(num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=2,
                 linear_num_value_heads=2 * ratio, linear_key_head_dim=16, linear_value_head_dim=16)  # fmt: skip
    else:  # Qwen3-VL: keep head_dim 128 and the [24, 20, 20] sections
        t.update(num_attention_heads=2, num_key_value_heads=1)
    if "intermediate_size" in t:
        t["intermediate_size"] = 96
    if "num_experts" in t:
        t.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24)  # 2I != H: hub layout visible
        if "shared_expert_intermediate_size" in t:
            t["shared_expert_intermediate_size"] = 32
    if "vision_config" in d:
        v = d["vision_config"]
        v.update(_VISION, out_hidden_size=64)
        if v.get("deepstack_visual_indexes"):
            v["deepstack_visual_indexes"] = [0, 1, 2]
        d.update(image_token_id=IMG, vision_start_token_id=VS, vision_end_token_id=VE, video_token_id=VID)
    return d


def _hf_model(folder: Path, hf_cls: str):
    model = getattr(transformers, hf_cls).from_pretrained(folder, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def _write_folder(name: str, folder: Path, d: dict[str, Any] | None = None) -> dict[str, Any]:
    """A random-weight HF folder whose config.json is ``d`` (default: the shrunk release) in its own form."""
    _, hf_cls = RELEASES[name]
    d = d or _shrink(name)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d))
    torch.manual_seed(0)
    model = getattr(transformers, hf_cls)(transformers.AutoConfig.from_pretrained(folder))
    with torch.no_grad():  # HF's init plus noise on every tensor: no zero norm, no symmetric rows
        for t in [*model.parameters(), *(b for n, b in model.named_buffers() if "inv_freq" not in n)]:
            if t.is_floating_point():
                t.add_(0.02 * torch.randn_like(t))
    model.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(d, indent=2))  # the published form, not transformers' rewrite
    if str(d.get("transformers_version", "5")).startswith("4.") and d["model_type"] == "qwen3_vl_moe":
        # a 4.57 folder stores its fused experts transposed ([E, H, 2I] / [E, I, H]), as the Hub files do
        path = folder / "model.safetensors"
        sd = load_file(path)
        sd = {k: v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v
              for k, v in sd.items()}  # fmt: skip
        save_file(sd, path, metadata={"format": "pt"})
    return d


def _inputs(vl: bool) -> dict[str, torch.Tensor]:
    if not vl:
        return {"input_ids": torch.tensor([[1, 5, 7, 8, 9, 10, 11, 12, 13, 40, 41, 300]])}
    grid = torch.tensor([[1, 4, 4], [1, 4, 6]])  # two images of different grids: M-RoPE sections matter
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16, generator=g)
    ids = torch.tensor([[1, 2, VS] + [IMG] * 4 + [VE, 7, 8, VS] + [IMG] * 6 + [VE, 9, 10]])
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid}


def _hf_logits(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    extra = {"mm_token_type_ids": (inputs["input_ids"] == IMG).int()} if "pixel_values" in inputs else {}
    with torch.no_grad():
        return model(**inputs, **extra, use_cache=False).logits


def _our_logits(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = inputs["input_ids"]
    kw = {k: v for k, v in inputs.items() if k != "input_ids"}
    with torch.no_grad():
        out = model(ids, **kw)
    out = out.logits if hasattr(out, "logits") else out
    return out[..., : _hf_vocab(model)]


def _hf_vocab(model) -> int:
    return model.config.vocab_size  # GlmImageMoe's head has image rows after the text vocabulary


# GlmImageMoe from a text-only GLM folder: a small image path (the folder has none); export the Glm4MoeLite form
_LOAD = {glm_image_moe_v2: dict(codebook_size=64, vq_embed_dim=32)}
# the Glm4MoeLite form (a model without image path); the release is bf16, the round trip compares fp32
_SAVE = {glm_image_moe_v2: dict(text_only=True, dtype=torch.float32)}

# (release, package reading it, with images)
CASES = [
    ("qwen3_vl_30b_a3b_instruct.json", qwen3_vl_moe_v2, True),
    ("qwen3_5_35b_a3b.json", qwen3_5_moe_v2, False),
    ("qwen3_5_35b_a3b.json", qwen3_vl_moe_v2, True),
    ("qwen3_5_0_8b.json", qwen3_5_v2, False),
    ("qwen3_5_27b.json", qwen3_5_v2, False),
    ("qwen3_8_27b.json", qwen3_vl_moe_v2, True),
    ("glm_4_7_flash.json", glm_image_moe_v2, False),
]


def _id(case) -> str:
    return f"{case[0].removesuffix('.json')}-{case[1].__name__.rsplit('.', 1)[-1]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_shrunk_release_logits_match_transformers_and_export_reads_back(case, tmp_path):
    name, package, vl = case
    _, hf_cls = RELEASES[name]
    d = _write_folder(name, tmp_path / "hf")
    hf = _hf_model(tmp_path / "hf", hf_cls)
    inputs = _inputs(vl)
    want = _hf_logits(hf, inputs)
    ours = package.from_pretrained(tmp_path / "hf", **_LOAD.get(package, {}))
    tied = bool(d.get("tie_word_embeddings", False))  # the top level: where transformers reads it for these classes
    assert ours.config.tie_word_embeddings == tied and ours.tied_word_embeddings == tied  # one parameter if tied
    assert (_our_logits(ours, inputs) - want).abs().max().item() <= TOL

    package.save_pretrained(ours, tmp_path / "export", **_SAVE.get(package, {}))
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    # the RoPE in the folder's own form: the same keys at the same level, with the same values (no second form)
    rope_keys = ("rope_scaling", "rope_parameters", "rope_theta", "partial_rotary_factor")
    for level, was in ((written, d), (written.get("text_config", {}), d.get("text_config", {}))):
        assert {k: level[k] for k in rope_keys if k in level} == {k: was[k] for k in rope_keys if k in was}
    keys = set(load_file(tmp_path / "export" / "model.safetensors"))
    assert ("lm_head.weight" in keys) == (not ours.config.tie_word_embeddings)  # HF writes no head when tied
    back = _hf_model(tmp_path / "export", hf_cls)
    assert (_hf_logits(back, inputs) - want).abs().max().item() <= TOL


_TRAINER = {
    qwen3_5_v2: ("qwen3_5", "qwen3_5_debug"),
    qwen3_5_moe_v2: ("qwen3_5_moe", "qwen3_5_moe_debug"),
    qwen3_vl_moe_v2: ("qwen3_vl_moe", "qwen3_vl_moe_debug"),
    glm_image_moe_v2: ("glm_image_moe", "glm_image_moe_debug"),
}


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_shrunk_release_through_the_trainer_initial_load_path(case, tmp_path):
    name, package, vl = case
    _, hf_cls = RELEASES[name]
    _write_folder(name, tmp_path / "hf")
    module, recipe = _TRAINER[package]
    cfg = ConfigManager().parse_args(
        ["--module", module, "--config", recipe, "--dump_folder", str(tmp_path / "run"),
         "--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.enable", "False",
         "--model.use_mtp", "false"]  # transformers writes no mtp.* tensors: the folder's MTP block is absent
    )  # fmt: skip
    model_cfg = package.config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    if package is glm_image_moe_v2:  # the recipe's DirectToken data needs its own image path
        m = cfg.model
        model_cfg = dataclasses.replace(model_cfg, codebook_size=m.codebook_size, vq_embed_dim=m.vq_embed_dim,
                                        placeholder_token_id=m.placeholder_token_id)  # fmt: skip
    trainer = dataclasses.replace(cfg, model=model_cfg).build()
    try:
        trainer.model.eval()
        got = _our_logits(trainer.model, _inputs(vl))
    finally:
        trainer.close()
    want = _hf_logits(_hf_model(tmp_path / "hf", hf_cls), _inputs(vl))
    assert (got - want).abs().max().item() <= TOL


# ---- forms a release does not show ------------------------------------------------------------------------


def _qwen3_5_forms() -> dict[str, dict[str, Any]]:
    base = _shrink("qwen3_6_35b_a3b.json")
    t = base["text_config"]
    forms = {}
    # Qwen3.6: top-level rope_theta / partial_rotary_factor beside a rope_parameters holding only the M-RoPE layout
    qwen36 = copy.deepcopy(base)
    qwen36["text_config"].update(rope_theta=2_500_000.0, partial_rotary_factor=0.125,
                                 rope_parameters={"mrope_interleaved": True, "mrope_section": [6, 5, 5]})  # fmt: skip
    forms["qwen3_6_top_level_rope"] = qwen36
    # the 4.x legacy form, M-RoPE sections with s_h != s_w
    legacy = copy.deepcopy(base)
    legacy["text_config"].pop("rope_parameters")
    legacy["text_config"].update(rope_theta=1e6, rope_scaling={"rope_type": "default", "mrope_section": [13, 12, 7],
                                                               "mrope_interleaved": True})  # fmt: skip
    forms["legacy_rope_scaling_sh_ne_sw"] = legacy
    # full_attention_interval without layer_types; absent keys take the class defaults
    interval = copy.deepcopy(base)
    interval["text_config"].pop("layer_types")
    interval["text_config"].update(full_attention_interval=2)
    for key in ("rms_norm_eps", "attention_bias", "linear_conv_kernel_dim", "pad_token_id"):
        interval["text_config"].pop(key, None)
    forms["full_attention_interval"] = interval
    # shared_expert_intermediate_size=0: HF's empty shared expert adds exactly 0; ours has none (keys kept aside)
    empty = copy.deepcopy(base)
    empty["text_config"]["shared_expert_intermediate_size"] = 0
    forms["shared_expert_0"] = empty
    del t
    return forms


@pytest.mark.parametrize("form", sorted(_qwen3_5_forms()))
def test_qwen3_5_config_forms_build_what_transformers_builds(form, tmp_path):
    d = _qwen3_5_forms()[form]
    name = "qwen3_6_35b_a3b.json"
    hf = _hf_facts(d, RELEASES[name][1])
    ours = _our_facts(qwen3_5_moe_v2.config_from_hf(d))
    for key in ours:
        if key != "params":
            assert ours[key] == hf[key], (key, ours[key], hf[key])
    _write_folder(name, tmp_path / "hf", d)
    inputs = _inputs(True)
    want = _hf_logits(_hf_model(tmp_path / "hf", RELEASES[name][1]), inputs)
    got = _our_logits(qwen3_vl_moe_v2.from_pretrained(tmp_path / "hf"), inputs)
    assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize("vision_type", ["qwen3_5_vision", "qwen3_5"])
def test_qwen3_8_vision_model_type_reads_either_way_and_is_written_as_read(vision_type):
    # Megatron-Bridge / xtuner exports of Qwen3.8 write vision_config.model_type "qwen3_5_vision" (the class's
    # own), the Qwen3.5 dense releases "qwen3_5" (transformers renames it on read): the same model either way
    d = copy.deepcopy(_released("qwen3_8_27b.json"))
    d["vision_config"]["model_type"] = vision_type
    hf = _hf_config(d)
    assert hf.vision_config.model_type == "qwen3_5_vision" and hf.vision_config.out_hidden_size == 5120
    cfg = qwen3_vl_moe_v2.config_from_hf(d)
    assert cfg.visual == qwen3_vl_moe_v2.config_from_hf(_released("qwen3_8_27b.json")).visual
    assert _our_facts(cfg)["params"] == _hf_facts(d, "Qwen3_5ForConditionalGeneration")["params"]
    written = qwen3_vl_moe_v2.state_dict.config_to_hf(cfg)
    # every key as the folder wrote it (its model_type spelling, deepstack [] ...); the writer states the
    # tower's axial RoPE besides (transformers' default theta 1e4)
    assert {k: written["vision_config"][k] for k in d["vision_config"]} == d["vision_config"]
    assert written["language_model_only"] is False  # top-level keys transformers does not model kept
    for key in ("bos_token_id", "eos_token_id", "partial_rotary_factor", "mtp_num_hidden_layers",
                "mtp_use_dedicated_embeddings", "attn_output_gate", "output_gate_type", "mamba_ssm_dtype"):
        assert written["text_config"][key] == d["text_config"][key], key  # fmt: skip


def test_qwen3_5_text_only_causal_lm_form_reads_like_transformers():
    # the form a text-only export of a release takes (quantizers write it: ``Qwen3_5ForCausalLM``, the text
    # config at the top level, rope_theta / partial_rotary_factor in rope_parameters): the 27B release, lifted
    d = copy.deepcopy(_released("qwen3_5_27b.json")["text_config"])
    d.update(architectures=["Qwen3_5ForCausalLM"], tie_word_embeddings=False)
    d.pop("layer_types")  # full_attention_interval alone: transformers derives the same layer types
    hf, ours = _hf_facts(d, "Qwen3_5ForCausalLM"), _our_facts(qwen3_5_v2.config_from_hf(d))
    for key in ours:
        assert ours[key] == hf[key], (key, ours[key], hf[key])
    assert ours["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]


def _vl_forms() -> dict[str, dict[str, Any]]:
    base = _shrink("qwen3_vl_30b_a3b_instruct.json")
    forms = {}
    # every second layer MoE; nulls and absent keys where transformers fills in: mlp_only_layers null -> [],
    # head_dim null -> hidden / heads, num_key_value_heads absent -> the class default 16
    sparse = copy.deepcopy(base)
    sparse["text_config"].update(decoder_sparse_step=2, mlp_only_layers=None, head_dim=None, num_attention_heads=16)
    sparse["text_config"].pop("num_key_value_heads")
    sparse["text_config"]["rope_scaling"]["mrope_section"] = [1, 1, 0]  # hidden 64 / 16 heads: head_dim 4
    forms["decoder_sparse_step_2_and_nulls"] = sparse
    hw = copy.deepcopy(base)  # M-RoPE sections with s_h != s_w, and no deepstack key (the class default applies)
    hw["text_config"]["rope_scaling"]["mrope_section"] = [30, 22, 12]
    hw["text_config"]["num_hidden_layers"] = 3
    hw["vision_config"].pop("deepstack_visual_indexes")
    hw["vision_config"]["depth"] = 25  # the default indexes (8, 16, 24) need 25 blocks ...
    hw["vision_config"]["hidden_size"] = 16
    hw["vision_config"]["num_heads"] = 1
    hw["text_config"]["num_hidden_layers"] = 3  # ... and 3 text layers
    forms["mrope_sh_ne_sw_default_deepstack"] = hw
    # tied at the top level, where a ConditionalGeneration class reads it (text_config says nothing)
    tied = copy.deepcopy(base)
    tied["tie_word_embeddings"] = True
    forms["tied_top_level"] = tied
    return forms


@pytest.mark.parametrize("form", sorted(_vl_forms()))
def test_qwen3_vl_config_forms_build_what_transformers_builds(form, tmp_path):
    d = _vl_forms()[form]
    name = "qwen3_vl_30b_a3b_instruct.json"
    hf = _hf_facts(d, RELEASES[name][1])
    ours = _our_facts(qwen3_vl_moe_v2.config_from_hf(d))
    for key in ours:
        assert ours[key] == hf[key], (key, ours[key], hf[key])
    _write_folder(name, tmp_path / "hf", d)
    inputs = _inputs(True)
    want = _hf_logits(_hf_model(tmp_path / "hf", RELEASES[name][1]), inputs)
    got = _our_logits(qwen3_vl_moe_v2.from_pretrained(tmp_path / "hf"), inputs)
    assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("qwen3_vl_30b_a3b_instruct.json",
         lambda d: d["text_config"]["rope_scaling"].update(rope_type="yarn", factor=4.0),
         r"text_config\.rope_scaling\.rope_type='yarn'"),
        ("qwen3_6_35b_a3b.json", lambda d: d["text_config"]["rope_parameters"].update(rope_type="dynamic", factor=2.0),
         r"text_config\.rope_parameters\.rope_type='dynamic'"),
        ("glm_4_7_flash.json", lambda d: d.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
         r"config\.json\.rope_scaling\.rope_type='yarn'"),
        ("glm_4_7_flash.json", lambda d: d.update(first_k_dense_replace=3), r"first_k_dense_replace=3"),
        ("glm_4_7_flash.json", lambda d: d.update(tie_word_embeddings=True), r"tie_word_embeddings"),
        ("qwen3_5_0_8b.json", lambda d: d["text_config"].update(attention_dropout=0.1), r"attention_dropout=0\.1"),
        ("qwen3_5_0_8b.json", lambda d: d["text_config"].update(hidden_act="gelu"), r"hidden_act='gelu'"),
    ],
    ids=["vl_yarn", "qwen3_5_dynamic", "glm_yarn", "glm_first_k_dense", "glm_tied", "dropout", "act"],
)
def test_values_not_modelled_are_refused_by_name(name, edit, message):
    d = copy.deepcopy(_released(name))
    edit(d)
    with pytest.raises((ValueError, NotImplementedError), match=message):
        RELEASES[name][0].config_from_hf(d)


def test_untied_conditional_generation_folder_without_head_says_where_the_flag_is(tmp_path):
    d = _shrink("qwen3_5_0_8b.json")
    _write_folder("qwen3_5_0_8b.json", tmp_path / "hf", d)  # tied: the folder holds no lm_head.weight
    d["tie_word_embeddings"] = False  # transformers reads the top level for ConditionalGeneration
    (tmp_path / "hf" / "config.json").write_text(json.dumps(d))
    with pytest.raises(KeyError, match=r"missing: lm_head\.weight \(the model is untied: config\.json \(top level\)"):
        qwen3_5_v2.from_pretrained(tmp_path / "hf")


def test_llama_style_rmsnorm_casts_like_transformers_in_bf16():
    # Qwen3-VL-MoE's RMSNorm: w * cast(x_hat) (the weight multiplies AFTER the cast to the input dtype)
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextRMSNorm

    torch.manual_seed(0)
    hf = Qwen3VLMoeTextRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    ours = RMSNorm.Config(eps=1e-6).build(dim=64).to(torch.bfloat16)
    with torch.no_grad():
        w = (1.0 + 0.3 * torch.randn(64)).to(torch.bfloat16)
        hf.weight.copy_(w)
        ours.weight.copy_(w)
    x = (3 * torch.randn(4, 9, 64)).to(torch.bfloat16)
    got, want = ours(x), hf(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
