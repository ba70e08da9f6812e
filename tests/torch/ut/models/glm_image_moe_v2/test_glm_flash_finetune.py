"""GLM-4.7-Flash as a fine-tuning target (issue 41): a Glm4MoeLite release is a Glm4MoeLite model.

A stand-in release made with transformers: a tiny ``Glm4MoeLiteForCausalLM`` folder in the published config form
(``num_nextn_predict_layers: 1`` and the nextn layer's tensors under vLLM's names), a byte-level BPE tokenizer with
GLM's special tokens and a GLM chat template with ``{% generation %}`` marks, and a ``generation_config.json``. It
is fine-tuned through the CLI path (``ConfigManager`` on the flags a user types: ``--module glm_image_moe``, a chat
jsonl) and then:

- the step-1 loss is transformers' assistant-only loss on the folder (1e-5), the masks those of
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``;
- no image path was built (no codebook, head ``[vocab, hidden]``), and the export holds exactly the release's
  tensor names and shapes in the Glm4MoeLite form, which ``Glm4MoeLiteForCausalLM`` reads to the trained model's
  logits (1e-5); ``AutoTokenizer`` renders the chat as on the release; the nextn layer trained (MTP on) or byte
  for byte the release's (``--model.use_mtp false``);
- ``save_pretrained(text_only=True)`` writes the release's shapes (nextn head included) in the folder's dtype;
- the placeholder id matters only with an image path; routers are written in the export dtype.

The mixed run (DirectToken images + this chat data, 1 process vs FSDP2) is tests/torch/st/test_glm_mixed_run.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from hyper_parallel.config import ConfigManager  # noqa: E402
from hyper_parallel.config.errors import ConfigError  # noqa: E402
from hyper_parallel.models.glm_image_moe_v2 import from_pretrained, glm_image_moe_config, save_pretrained  # noqa: E402
from hyper_parallel.hf import read_safetensors  # noqa: E402
from hyper_parallel.protocols.model import split_output  # noqa: E402
from tests.torch.ut.hf.test_folder_is_model import glm_flash_folder, write_hf_folder  # noqa: E402

TOL = 1e-5
SPECIAL = ["[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|system|>", "<|observation|>", "<|endoftext|>"]
# GLM-4.7's turn structure (tests/torch/ut/data/chat_templates/glm4_7.jinja) with the assistant reply marked
TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{% generation %}</think>{{ m['content'] }}"
    "{% if loop.last %}<|endoftext|>{% endif %}{% endgeneration %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>{% endif %}"
)
CHATS = [
    {"messages": [{"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": "It is sunny and warm."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
                  {"role": "assistant", "content": "Hello, what is the weather?"},
                  {"role": "user", "content": "Sunny"}, {"role": "assistant", "content": "Warm then."}]},
]  # fmt: skip


# ---- the stand-in release ---------------------------------------------------------------------------------


def write_tokenizer(out: Path) -> None:
    """A byte-level BPE with GLM's special tokens and the marked GLM template, saved as transformers saves one."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [m["content"] for c in CHATS for m in c["messages"]] + ["assistant user system think"]
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(corpus * 3, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ["<think>", "</think>"]])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out)


def write_release(folder: Path) -> Any:
    """The stand-in GLM-4.7-Flash release (transformers' model read back from it is returned)."""
    d, hf_cls = glm_flash_folder()  # hidden 48, 2 layers + the nextn layer, vocab 512, released config form
    hf = write_hf_folder(folder, copy.deepcopy(d), hf_cls, mtp="glm")
    write_tokenizer(folder)
    eos = [transformers.AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|user|>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}, indent=2))
    return hf


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("release") / "GLM-4.7-Flash-tiny"
    return folder, write_release(folder)


def chat_file(path: Path) -> str:
    path.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    return str(path)


def sft_argv(release: Path, root: Path, *extra: str) -> list[str]:
    """What a GLM-4.7-Flash user types for chat SFT from the release (one step, exported in fp32)."""
    return [
        "--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--dump_folder", str(root / "out"),
        "--checkpoint.initial_load_path", str(release), "--checkpoint.export_hf", "True",
        "--checkpoint.export_dtype", "float32", "--checkpoint.enable", "False", "--training.steps", "1",
        "--data.source", "text", "--data.path", chat_file(root / "chats.jsonl"), "--data.tokenizer", str(release),
        "--data.text.chat_column", "messages", "--data.max_tokens_per_microbatch", "128",
        "--data.global_batch_tokens", "128", "--data.cache_dir", str(root / "cache"), "--metrics.log_freq", "1",
        "--model.router_aux_loss_coef", "0", *extra,
    ]  # fmt: skip


def _probe() -> torch.Tensor:
    return torch.tensor([[300, 301, 302, 5, 17, 40, 41, 99, 120, 303, 250, 7, 8, 9]])


def _sft(release: Path, root: Path, *extra: str) -> dict[str, Any]:
    """One step of chat SFT through the CLI path: the step's micro-batches, the summary, the trained logits."""
    trainer = ConfigManager().parse_args(sft_argv(release, root, *extra)).build()
    try:
        step = trainer.data.next_step()
        trainer.data.next_step = lambda: step
        summary = trainer.train()
        trainer.model.eval()
        with torch.no_grad():
            logits = split_output(trainer.model(_probe()))[0]
        model_cfg = trainer.config.model
        head_rows = trainer.model.lm_head.weight.shape[0]
        has_codebook = trainer.model.vq_codebook is not None
    finally:
        trainer.close()
    records = [json.loads(line) for line in (root / "out" / "metrics.jsonl").read_text().splitlines()]
    return dict(step=step, summary=summary, logits=logits, config=model_cfg, head_rows=head_rows,
                has_codebook=has_codebook, records=records, export=root / "out" / "hf")  # fmt: skip


@pytest.fixture(scope="module")
def sft(release, tmp_path_factory) -> dict[str, Any]:
    return _sft(release[0], tmp_path_factory.mktemp("sft"))


# ---- chat SFT: the loss, the model, the export -------------------------------------------------------------


def _hf_masks(release: Path) -> list[tuple[list[int], list[int]]]:
    tok = transformers.AutoTokenizer.from_pretrained(release)
    out = []
    for chat in CHATS:
        enc = tok.apply_chat_template(chat["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        out.append((list(enc["input_ids"]), list(enc["assistant_masks"])))
    return out


def test_step_one_loss_is_transformers_assistant_only_loss(release, sft):
    folder, hf = release
    masks = _hf_masks(folder)
    total, count, seen = 0.0, 0, set()
    for mb in sft["step"]:
        assert "vq_codes" not in mb or mb["vq_codes"] is None or mb["vq_codes"].numel() == 0  # text: no image codes
        cu = mb["cu_seqlens"].tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            ids, labels = mb["input_ids"][0, a:b].tolist(), mb["labels"][0, a:b].tolist()
            match = [(i, m) for i, m in masks if i[: len(ids)] == ids and len(i) - len(ids) in (0, 1)]
            assert match, f"document {ids[:8]}... is none of the chats rendered by transformers"
            hf_ids, hf_mask = match[0]
            # the label of position t is token t + 1 where transformers' assistant mask marks it
            want = [hf_ids[t + 1] if t + 1 < len(hf_ids) and hf_mask[t + 1] else -100 for t in range(len(ids))]
            assert labels == want, (labels, want)
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([hf_ids]), use_cache=False).logits[0, : len(ids)]
            target = torch.tensor(want)
            total += F.cross_entropy(logits, target, ignore_index=-100, reduction="sum").item()
            count += int((target != -100).sum())
            seen.add(masks.index((hf_ids, hf_mask)))
    assert seen == set(range(len(CHATS))) and count > 10  # every chat (the step repeats the small file)
    want_loss = total / count
    got = sft["summary"]["first_loss"]
    print(f"GLM-4.7-Flash chat SFT: step-1 loss {got:.7f}, transformers assistant-only {want_loss:.7f} "
          f"(|diff| {abs(got - want_loss):.2e}, {count} trained tokens)")  # fmt: skip
    assert abs(got - want_loss) <= TOL
    assert sft["records"][0]["loss/mtp"] > 0  # the release's nextn layer trains (MTP follows the folder)


def test_the_run_is_a_glm4_moe_lite_model(sft):
    m = sft["config"]
    assert not m.has_image_path and not sft["has_codebook"]
    assert sft["head_rows"] == m.vocab_size == 512  # no image rows in the softmax


def test_export_is_the_release_in_its_own_form(release, sft):
    folder, _ = release
    before, after = read_safetensors(folder), read_safetensors(sft["export"])
    shapes = lambda sd: {k: tuple(v.shape) for k, v in sd.items()}  # noqa: E731
    assert shapes(after) == shapes(before)  # exactly the release's tensor names and shapes
    src, out = json.loads((folder / "config.json").read_text()), json.loads((sft["export"] / "config.json").read_text())
    assert out["architectures"] == ["Glm4MoeLiteForCausalLM"] and out["model_type"] == "glm4_moe_lite"
    assert out["num_nextn_predict_layers"] == 1 and "vq_config" not in out
    assert {k for k in src if k != "dtype"} <= set(out)
    nextn = [k for k in before if k.startswith("model.layers.2.")]
    assert len(nextn) > 20 and any(not torch.equal(after[k], before[k]) for k in nextn)  # trained (MTP on)
    back = transformers.Glm4MoeLiteForCausalLM.from_pretrained(sft["export"], dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (back(input_ids=_probe(), use_cache=False).logits - sft["logits"]).abs().max().item()
    print(f"Glm4MoeLiteForCausalLM.from_pretrained(export) vs the trained model: max |logits diff| {diff:.2e}")
    assert diff <= TOL
    # what a server needs beside the weights: the chat renders as on the release, generation stops as there
    src_tok = transformers.AutoTokenizer.from_pretrained(folder)
    out_tok = transformers.AutoTokenizer.from_pretrained(sft["export"])
    for chat in CHATS:
        for prompt in (False, True):
            assert out_tok.apply_chat_template(chat["messages"], tokenize=False, add_generation_prompt=prompt) == (
                src_tok.apply_chat_template(chat["messages"], tokenize=False, add_generation_prompt=prompt))
    gen = json.loads((sft["export"] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == json.loads((folder / "generation_config.json").read_text())["eos_token_id"]


def test_mtp_off_keeps_the_nextn_layer_byte_equal(release, tmp_path):
    folder, _ = release
    off = _sft(folder, tmp_path, "--model.use_mtp", "false")
    before, after = read_safetensors(folder), read_safetensors(off["export"])
    nextn = [k for k in before if k.startswith("model.layers.2.")]
    assert sorted(after) == sorted(before) and "loss/mtp" not in off["records"][0]
    for key in nextn:
        assert after[key].dtype == before[key].dtype and torch.equal(after[key], before[key]), key
    assert any(not torch.equal(after[k], before[k]) for k in before if k.startswith("model.layers.0."))


# ---- save_pretrained, placeholder id, router dtype (no run) ------------------------------------------------


def test_text_only_save_keeps_the_nextn_head_shape_and_the_folders_dtype(release, tmp_path):
    folder, _ = release
    before = read_safetensors(folder)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"  # the release's declared dtype
    for mtp in (True, False):  # the nextn layer as the MTP block, and kept aside (passthrough)
        grown = from_pretrained(folder, mtp=mtp, image_path=True, codebook_size=64, vq_embed_dim=16)
        assert grown.lm_head.weight.shape[0] == 512 + 64
        save_pretrained(grown, tmp_path / f"text_{mtp}", text_only=True)
        after = read_safetensors(tmp_path / f"text_{mtp}")
        assert {k: v.shape for k, v in after.items()} == {k: v.shape for k, v in before.items()}
        assert after["model.layers.2.shared_head.head.weight"].shape == (512, 48)
        assert {v.dtype for v in after.values()} == {torch.bfloat16}, mtp  # routers included
        written = json.loads((tmp_path / f"text_{mtp}" / "config.json").read_text())
        assert written["dtype"] == "bfloat16" and written["model_type"] == "glm4_moe_lite"
    # a model read from the release saves in its form by default
    save_pretrained(from_pretrained(folder), tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["architectures"] == ["Glm4MoeLiteForCausalLM"]


def test_placeholder_id_matters_only_with_an_image_path():
    kw = dict(vocab_size=300, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=8,
              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, codebook_size=16, vq_embed_dim=8,
              placeholder_token_id=511)  # fmt: skip
    text = glm_image_moe_config(**kw, image_path=False)  # a text-only model needs no placeholder id
    assert not text.has_image_path and text.output_size == 300
    with pytest.raises(ConfigError, match="--model.placeholder_token_id 511 .* vocab_size=300"):
        glm_image_moe_config(**kw)
    import dataclasses

    with pytest.raises(ConfigError, match="--model.placeholder_token_id"):
        dataclasses.replace(text, image_path=True)
    grown = dataclasses.replace(text, image_path=True, placeholder_token_id=299)
    assert grown.has_image_path and grown.output_size == 316 and grown.option_values()["image_path"]
    assert not dataclasses.replace(grown, image_path=False).has_image_path


def test_lora_merged_export_writes_routers_in_the_export_dtype(release, tmp_path):
    """The merged LoRA export is the family's own export: every floating tensor in the export dtype, routers too."""
    from hyper_parallel.models.glm_image_moe_v2 import GLM_IMAGE_MOE_SPEC
    from hyper_parallel.hf.lora_export import save_merged

    folder, _ = release
    save_merged(GLM_IMAGE_MOE_SPEC, from_pretrained(folder, mtp=True), tmp_path / "merged", dtype=torch.bfloat16)
    after = read_safetensors(tmp_path / "merged")
    routers = [k for k in after if k.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))]
    assert len(routers) == 2 * 2 and all(after[k].dtype == torch.bfloat16 for k in routers)  # layer 1 + nextn
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["architectures"] == ["Glm4MoeLiteForCausalLM"]


def test_image_path_is_one_cli_option():
    """``--model.image_path true|false`` on the command line, also over a recipe that sets it (a text-only one)."""
    grown = ConfigManager().parse_args(["--module", "glm_image_moe", "--config", "glm_4_7_flash_sft_debug",
                                        "--model.image_path", "true"]).model  # fmt: skip
    assert grown.has_image_path and grown.output_size == 512 + 256
    text = ConfigManager().parse_args(["--module", "glm_image_moe", "--config", "glm_image_moe_debug",
                                       "--model.image_path", "false"]).model  # fmt: skip
    assert not text.has_image_path and text.output_size == 512
