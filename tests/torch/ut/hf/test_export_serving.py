"""The export of a fine-tuned release is what a server needs, in the release's own form (issue 31).

A stand-in release made with transformers: a tiny ``Qwen3_5MoeForConditionalGeneration`` folder in the
published Qwen3.5-35B-A3B form (vision tower, an ``mtp.*`` head added under vLLM's names, ids and keys the text
module does not model), a byte-level BPE tokenizer with the Qwen3.5 chat template saved by transformers, a
``generation_config.json`` and processor configs. It is fine-tuned through the CLI path (``ConfigManager``
parses the flags a user types, ``--module qwen3_5_moe --checkpoint.initial_load_path DIR --checkpoint.export_hf
...``: the text module, a chat jsonl), and then:

- the export holds every tensor the folder had: the vision tower byte for byte (passthrough), the trained
  trunk and MTP head changed;
- its ``config.json`` has every key of the folder's, at the same place, with the same value except ``dtype``;
- ``AutoTokenizer`` on it renders and encodes a chat as on the release; ``generate`` stops at the EOS ids of the
  release's ``generation_config.json``; the image processor reads the same ``preprocessor_config.json``;
- transformers reads the export to the trained model's logits (1e-5).

Plus, without a run: every family's config writer keeps a released ``config.json`` in its form, the export's
``config.json`` never carries ``quantization_config``, and the server-file helper takes the tokenizer from one
source only and copies nothing else.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from hyper_parallel.config import ConfigManager  # noqa: E402
from hyper_parallel.models import glm_image_moe_v2, qwen3_5_moe_v2, qwen3_5_v2, qwen3_vl_moe_v2  # noqa: E402
from hyper_parallel.models.glm_image_moe_v2.config_registry import glm_image_moe_debug  # noqa: E402
from hyper_parallel.models.qwen3_5_moe_v2.config_registry import qwen3_5_moe_debug  # noqa: E402
from hyper_parallel.models.qwen3_vl_moe_v2 import state_dict as vl_state_dict  # noqa: E402
from hyper_parallel.hf import read_safetensors, write_safetensors  # noqa: E402
from hyper_parallel.hf.save import export_hf_config  # noqa: E402
from hyper_parallel.hf.serving import write_serving_files  # noqa: E402
from tests.torch.ut.models.qwen3_5_v2.test_mtp import _HFMtp  # noqa: E402

TOL = 1e-5
RELEASED = Path(__file__).parents[1] / "released_configs"
TEMPLATE = (Path(__file__).parents[1] / "data" / "chat_templates" / "qwen3_5.jinja").read_text()
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]  # fmt: skip
PAD, IM_START, IM_END, VS, VE, IMG, VID = range(300, 307)  # their ids (after the 300 BPE tokens)
CHATS = [
    {"messages": [{"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": "It is sunny and warm."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
                  {"role": "assistant", "content": "Hello, what is the weather?"}]},
]  # fmt: skip


# ---- the stand-in release ---------------------------------------------------------------------------------


def _tokenizer(out: Path) -> None:
    """A byte-level BPE with Qwen's special tokens and chat template, saved as transformers saves one."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [m["content"] for c in CHATS for m in c["messages"]] + ["assistant user system think"]
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(corpus * 3, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ["<think>", "</think>"]])
    assert [tok.token_to_id(t) for t in SPECIAL] == list(range(PAD, VID + 1))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out)


def _release_config() -> dict[str, Any]:
    """Qwen3.5-35B-A3B's published config.json with the sizes of the ``qwen3_5_moe_debug`` recipe; every other
    key, its level and its form kept (ids moved into the tiny vocabulary; a text-level ``bos_token_id`` and
    ``pad_token_id`` as Qwen3.6 writes them)."""
    d = json.loads((RELEASED / "qwen3_5_35b_a3b.json").read_text())
    t = d["text_config"]
    t.update(vocab_size=512, hidden_size=64, num_hidden_layers=4, layer_types=t["layer_types"][:4], num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=64, eos_token_id=IM_END, bos_token_id=PAD,
             pad_token_id=PAD, dtype="float32")  # fmt: skip
    t["rope_parameters"]["mrope_section"] = [2, 1, 1]  # rotary 0.25 of head 32: 4 frequencies
    d["vision_config"].update(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, num_position_embeddings=16,
                              out_hidden_size=64)  # fmt: skip
    d.update(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    return d


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("release") / "Qwen3.5-tiny"
    folder.mkdir()
    d = _release_config()
    (folder / "config.json").write_text(json.dumps(d))
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(transformers.AutoConfig.from_pretrained(folder))
    with torch.no_grad():  # off the init: no zero norm, no symmetric rows
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    hf.save_pretrained(folder)
    sd = read_safetensors(folder)
    sd.update(_HFMtp(hf.config.text_config, moe=True, seed=7).hf_keys())  # vLLM's mtp.* names
    write_safetensors(sd, folder)
    (folder / "config.json").write_text(json.dumps(d, indent=2))  # the published form, not transformers' rewrite
    _tokenizer(folder)
    # generation defaults: a second EOS id that config.json does not name (only this file makes generate stop there)
    gen = {"bos_token_id": PAD, "eos_token_id": [IM_END, PAD], "pad_token_id": PAD, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
    image = transformers.Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2,
                                               min_pixels=32 * 32, max_pixels=64 * 64)  # fmt: skip
    image.save_pretrained(folder)
    video = {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16, "merge_size": 2,
             "temporal_patch_size": 2, "fps": 2, "do_sample_frames": True}  # fmt: skip
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    return folder


def _chats(path: Path) -> str:
    path.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    return str(path)


def _batch() -> torch.Tensor:
    return torch.tensor([[IM_START, 5, 17, 40, 41, 99, 120, IM_END, 250, 7, 8, 9, 10, 200]])


def _train_and_export(release: Path, root: Path, *extra: str) -> dict[str, Any]:
    """One step of chat SFT from the release through the CLI path, exported; the trained model's logits."""
    argv = [
        "--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--dump_folder", str(root / "out"),
        "--checkpoint.initial_load_path", str(release), "--checkpoint.export_hf", "True",
        "--checkpoint.export_dtype", "float32", "--checkpoint.enable", "False", "--training.steps", "1",
        "--data.source", "text", "--data.path", _chats(root / "chats.jsonl"), "--data.tokenizer", str(release),
        "--data.text.chat_column", "messages", "--data.max_tokens_per_microbatch", "64",
        "--data.global_batch_tokens", "64", "--data.cache_dir", str(root / "cache"), "--metrics.log_freq", "1",
        *extra,
    ]  # fmt: skip
    trainer = ConfigManager().parse_args(argv).build()
    try:
        trainer.train()
        trainer.model.eval()
        with torch.no_grad():
            out = trainer.model(_batch())
        logits = out.logits if hasattr(out, "logits") else out
        mtp = trainer.config.model.mtp is not None
    finally:
        trainer.close()
    return {"export": root / "out" / "hf", "logits": logits, "mtp": mtp}


@pytest.fixture(scope="module")
def run(release, tmp_path_factory) -> dict[str, Any]:
    return _train_and_export(release, tmp_path_factory.mktemp("run"))


# ---- the export of the run --------------------------------------------------------------------------------


def test_export_keeps_every_tensor_the_folder_had(release, run):
    before, after = read_safetensors(release), read_safetensors(run["export"])
    assert sorted(after) == sorted(before), (sorted(set(before) - set(after))[:5], sorted(set(after) - set(before))[:5])
    visual = [k for k in before if k.startswith("model.visual.")]
    mtp = [k for k in before if k.startswith("mtp.")]
    assert len(visual) > 20 and len(mtp) > 20
    for key in visual:  # passthrough: the text module does not model the tower
        assert after[key].dtype == before[key].dtype and torch.equal(after[key], before[key]), key
    trunk = [k for k in before if k.startswith("model.language_model.")]
    assert any(not torch.equal(after[k], before[k]) for k in trunk)  # it trained
    # the folder ships an MTP block: it trains by default, and the export writes the trained head
    assert run["mtp"] and [k for k in mtp if not torch.equal(after[k], before[k])]


def test_mtp_off_flag_keeps_the_folders_head_byte_equal(release, tmp_path):
    """``--model.use_mtp false``: the folder's MTP block is not trained; it passes through to the export unchanged."""
    off = _train_and_export(release, tmp_path, "--model.use_mtp", "false")
    before, after = read_safetensors(release), read_safetensors(off["export"])
    mtp = [k for k in before if k.startswith("mtp.")]
    assert not off["mtp"] and len(mtp) > 20 and sorted(after) == sorted(before)
    for key in mtp:
        assert after[key].dtype == before[key].dtype and torch.equal(after[key], before[key]), key
    assert any(not torch.equal(after[k], before[k]) for k in before if k.startswith("model.language_model."))


def _place_problems(src: dict[str, Any], out: dict[str, Any], where: str = "") -> list[str]:
    """Keys of ``src`` missing from ``out`` at the same place, or with another value (nested dicts key by key)."""
    problems = []
    for key, value in src.items():
        if key not in out:
            problems.append(f"missing {where}{key}")
        elif isinstance(value, dict) and isinstance(out[key], dict):
            problems += _place_problems(value, out[key], f"{where}{key}.")
        elif value != out[key]:
            problems.append(f"{where}{key}: {value!r} -> {out[key]!r}")
    return problems


def test_export_config_is_the_folders_form(release, run):
    src = json.loads((release / "config.json").read_text())
    out = json.loads((run["export"] / "config.json").read_text())
    assert out["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and out["model_type"] == "qwen3_5_moe"
    assert _place_problems(src, out) == []
    assert out["dtype"] == out["text_config"]["dtype"] == "float32"  # what was written
    # nothing training-only leaks in: the run trained with the recipe's router aux loss, the folder's keys stay
    added = {k for k in out["text_config"] if k not in src["text_config"]}
    assert added <= {"tie_word_embeddings"}, added
    assert "quantization_config" not in json.dumps(out)


def test_tokenizer_and_chat_template_are_the_runs(release, run):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (run["export"] / name).read_bytes() == (release / name).read_bytes(), name
    src, got = transformers.AutoTokenizer.from_pretrained(release), transformers.AutoTokenizer.from_pretrained(run["export"])
    chat = CHATS[1]["messages"]
    want = src.apply_chat_template(chat, tokenize=False)
    assert got.apply_chat_template(chat, tokenize=False) == want
    ids = got(want, add_special_tokens=False)["input_ids"]
    assert ids == src(want, add_special_tokens=False)["input_ids"] and len(ids) > 10
    assert got.eos_token_id == IM_END


def test_generate_stops_at_the_releases_eos(release, run):
    gen = json.loads((release / "generation_config.json").read_text())
    assert json.loads((run["export"] / "generation_config.json").read_text()) == gen
    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(run["export"], dtype=torch.float32).eval()
    assert hf.generation_config.eos_token_id == [IM_END, PAD]
    prompt = torch.tensor([[IM_START, 5, 17, 40]])
    # PAD is made the greedy choice at once: generate stops there iff it is an EOS id (generation_config.json;
    # config.json names IM_END only)
    out = hf.generate(prompt, max_new_tokens=6, sequence_bias={(PAD,): 100.0}, attention_mask=torch.ones_like(prompt))
    assert out[0, prompt.shape[1] :].tolist() == [PAD]


def test_processor_configs_are_the_releases(release, run):
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        assert (run["export"] / name).read_bytes() == (release / name).read_bytes(), name
    image = torch.rand(3, 48, 64)
    src = transformers.AutoImageProcessor.from_pretrained(release)(images=[image], return_tensors="pt")
    got = transformers.AutoImageProcessor.from_pretrained(run["export"])(images=[image], return_tensors="pt")
    assert torch.equal(got["image_grid_thw"], src["image_grid_thw"])
    assert torch.equal(got["pixel_values"], src["pixel_values"])
    names = {p.name for p in run["export"].iterdir()}
    assert not {n for n in names if "optim" in n or "quant" in n or n.endswith((".pt", ".distcp"))}


def test_transformers_reads_the_export_to_the_trained_logits(run):
    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(run["export"], dtype=torch.float32).eval()
    hf.config._attn_implementation = "sdpa"
    with torch.no_grad():
        want = hf(input_ids=_batch(), use_cache=False).logits
    err = (run["logits"] - want).abs().max().item()
    assert err <= TOL, err


def test_a_text_only_export_keeps_the_mtp_head_and_says_what_it_leaves_out(release, tmp_path, caplog):
    model = qwen3_5_moe_v2.from_pretrained(release)  # MTP off: mtp.* and model.visual.* kept aside
    with caplog.at_level("WARNING", logger="hyper_parallel.hf.convert"):
        qwen3_5_moe_v2.save_pretrained(model, tmp_path / "text", text_only=True)
    before, after = read_safetensors(release), read_safetensors(tmp_path / "text")
    mtp = [k for k in before if k.startswith("mtp.")]
    assert mtp and all(torch.equal(after[k], before[k]) for k in mtp)  # vLLM reads mtp.* in a CausalLM folder too
    assert not any(k.startswith("model.visual.") for k in after)
    visual = sum(k.startswith("model.visual.") for k in before)
    assert f"leaves out {visual} tensor(s)" in caplog.text and "model.visual." in caplog.text


# ---- every family's writer keeps the folder's form (no run) ------------------------------------------------


def _vl_to_hf(cfg, **_: Any) -> dict[str, Any]:
    return vl_state_dict.config_to_hf(cfg)


# (released config.json, reader, writer, writer kwargs)
FORMS = [
    ("qwen3_5_0_8b.json", qwen3_5_v2.config_from_hf, qwen3_5_v2.config_to_hf, {}),
    ("qwen3_5_27b.json", qwen3_5_v2.config_from_hf, qwen3_5_v2.config_to_hf, {}),
    ("qwen3_5_35b_a3b.json", qwen3_5_moe_v2.config_from_hf, qwen3_5_moe_v2.config_to_hf, {}),
    ("qwen3_6_35b_a3b.json", qwen3_5_moe_v2.config_from_hf, qwen3_5_moe_v2.config_to_hf, {}),
    ("qwen3_5_35b_a3b.json", qwen3_vl_moe_v2.config_from_hf, _vl_to_hf, {}),
    ("qwen3_6_35b_a3b.json", qwen3_vl_moe_v2.config_from_hf, _vl_to_hf, {}),
    ("qwen3_vl_30b_a3b_instruct.json", qwen3_vl_moe_v2.config_from_hf, _vl_to_hf, {}),
    ("glm_4_7_flash.json", glm_image_moe_v2.config_from_hf, glm_image_moe_v2.config_to_hf, {"text_only": True}),
]


def _text_only_form(name: str) -> dict[str, Any]:
    """A release's text config lifted to the top level: the ``*ForCausalLM`` form (text-only exports, quantizers)."""
    d = json.loads((RELEASED / name).read_text())
    return {**d["text_config"], "architectures": ["Qwen3_5MoeForCausalLM"], "tie_word_embeddings": False}


def _glm_image_form() -> dict[str, Any]:
    """A GlmImageMoe folder (this project's export of the image model) with keys no reader models."""
    d = glm_image_moe_v2.config_to_hf(glm_image_moe_debug().model)
    d.update(dtype="bfloat16", transformers_version="5.0.0", vision_config={"model_type": "glm_image_vit", "depth": 2})
    d["text_config"].update(eos_token_id=[1, 2], bos_token_id=1)
    return d


@pytest.mark.parametrize(("name", "read", "write", "kwargs"), FORMS, ids=[f"{f[0][:-5]}-{f[1].__module__.split('.')[2]}" for f in FORMS])
def test_every_family_writes_a_released_config_in_its_form(name, read, write, kwargs):
    d = json.loads((RELEASED / name).read_text())
    assert _place_problems(d, write(read(copy.deepcopy(d)), **kwargs)) == []


@pytest.mark.parametrize("form", ["causal_lm", "glm_image_moe", "glm4_moe_lite_in_glm_image_moe"])
def test_other_folder_forms_are_kept(form):
    if form == "causal_lm":
        d = _text_only_form("qwen3_5_35b_a3b.json")
        assert _place_problems(d, qwen3_5_moe_v2.config_to_hf(qwen3_5_moe_v2.config_from_hf(copy.deepcopy(d)))) == []
    elif form == "glm_image_moe":
        d = _glm_image_form()
        assert _place_problems(d, glm_image_moe_v2.config_to_hf(glm_image_moe_v2.config_from_hf(copy.deepcopy(d)))) == []
    else:  # the GlmImageMoe form of a Glm4MoeLite folder that grew an image path: every key of it in text_config
        d = json.loads((RELEASED / "glm_4_7_flash.json").read_text())
        grown = dataclasses.replace(glm_image_moe_v2.config_from_hf(copy.deepcopy(d)), image_path=True)
        out = glm_image_moe_v2.config_to_hf(grown)
        lite = {k: v for k, v in d.items() if k not in ("architectures",)}
        assert out["architectures"] == ["GlmImageMoeForConditionalGeneration"]
        assert _place_problems(lite, out["text_config"]) == []


def test_a_changed_rope_is_written_in_the_folders_form():
    # Qwen3-VL's 4.57 form (rope_scaling + top-level rope_theta): a changed theta / section lands where the folder
    # stated it, and no second RoPE form appears beside it
    d = json.loads((RELEASED / "qwen3_vl_30b_a3b_instruct.json").read_text())
    cfg = qwen3_vl_moe_v2.config_from_hf(copy.deepcopy(d))
    attn = cfg.layers[0].self_attn
    attn.rope.theta = 1234.0  # a changed RoPE (test only: the writer reads the tree)
    t = _vl_to_hf(cfg)["text_config"]
    assert t["rope_theta"] == 1234.0 and "rope_parameters" not in t
    assert t["rope_scaling"] == d["text_config"]["rope_scaling"]


def test_the_export_config_has_no_quantization_config_and_states_its_dtype():
    d = json.loads((RELEASED / "qwen3_6_35b_a3b.json").read_text())
    d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    d["text_config"]["quantization_config"] = dict(d["quantization_config"])
    d["torch_dtype"] = "bfloat16"
    out = export_hf_config(d, dtype=torch.float32)
    assert "quantization_config" not in json.dumps(out)
    assert out["dtype"] == out["torch_dtype"] == "float32"
    assert out["text_config"]["dtype"] == out["vision_config"]["dtype"] == "float32"  # the levels that state one
    assert "dtype" not in out["text_config"]["rope_parameters"]
    # through a family writer too: a config that carries the key (however it got there) exports without it
    cfg = qwen3_5_moe_v2.config_from_hf(json.loads((RELEASED / "qwen3_5_35b_a3b.json").read_text()))
    hf = qwen3_5_moe_v2.config_to_hf(cfg)
    hf["quantization_config"] = d["quantization_config"]
    assert "quantization_config" not in export_hf_config(hf, dtype=torch.bfloat16)


# ---- the server-file helper -------------------------------------------------------------------------------


def _files(folder: Path, names: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in names.items():
        (folder / name).write_text(text)
    return folder


def test_serving_files_take_the_tokenizer_from_one_source(tmp_path):
    model = _files(tmp_path / "release", {
        "config.json": "{}", "model.safetensors": "x", "tokenizer.json": "release tok", "vocab.json": "release vocab",
        "merges.txt": "release merges", "tokenizer_config.json": "{}", "chat_template.json": "release processor tpl",
        "generation_config.json": "gen", "preprocessor_config.json": "pre", "optimizer.pt": "no",
        "quantization_config.json": "no", "README.md": "no",
    })  # fmt: skip
    tok = _files(tmp_path / "tok", {"tokenizer.json": "run tok", "tokenizer_config.json": "{}",
                                    "chat_template.jinja": "run tpl"})  # fmt: skip
    export = _files(tmp_path / "export", {"config.json": "{}", "vocab.json": "stale"})
    names = write_serving_files(export, folder=model, tokenizer=tok)
    assert names == ["chat_template.jinja", "generation_config.json", "preprocessor_config.json", "tokenizer.json",
                     "tokenizer_config.json"]  # fmt: skip
    assert (export / "tokenizer.json").read_text() == "run tok"
    assert sorted(p.name for p in export.iterdir()) == sorted([*names, "config.json"])  # no release vocab, nothing else
    # no run tokenizer: the folder's own (its processor template with it)
    names = write_serving_files(export, folder=model)
    assert (export / "vocab.json").read_text() == "release vocab" and "chat_template.json" in names
    assert not (export / "chat_template.jinja").exists()
    # a lone tokenizer file; a run tokenizer without a template keeps the folder's processor template
    lone = _files(tmp_path / "lone", {"my_tokenizer.json": "lone"})
    names = write_serving_files(export, folder=model, tokenizer=lone / "my_tokenizer.json")
    assert (export / "tokenizer.json").read_text() == "lone" and "chat_template.json" in names
    with pytest.raises(FileNotFoundError, match="data.tokenizer"):
        write_serving_files(export, folder=model, tokenizer=tmp_path / "absent")
