"""The folder is the model (issue 31): ``python -m hyper_parallel.train --config <recipe>
--checkpoint.initial_load_path DIR`` trains the model in DIR's ``config.json``, not the recipe's.

Each folder is made by transformers (tiny, random weights, ``save_pretrained``, the release's form) with
dimensions AND non-shape fields other than the recipe's (hidden size, layer count, rope theta, norm eps,
``norm_topk_prob`` where the family has it, an MTP block with its tensors); on one preset batch the trainer's
first-step loss equals transformers' loss on the folder within 1e-5, and ``loss/mtp`` is logged without a flag.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from hyper_parallel.config import ConfigManager  # noqa: E402
from hyper_parallel.data.vision_language.mrope import mrope_position_ids  # noqa: E402
from tests.torch.ut.models.glm_image_moe_v2.test_mtp import _HFNextn  # noqa: E402
from tests.torch.ut.models.qwen3_5_v2.test_mtp import _HFMtp  # noqa: E402
from tests.torch.ut.hf.test_released_configs import IMG, VE, VS, _shrink  # noqa: E402

TOL = 1e-5


def write_hf_folder(folder: Path, d: dict[str, Any], hf_cls: str, *, mtp: str | None = None) -> Any:
    """A random-weight HF folder in the form ``d`` (written by transformers; config.json as published), with the
    MTP block's tensors when ``mtp`` is ``"qwen"`` (``mtp.*``) or ``"glm"`` (the nextn layer). Returns
    transformers' model read from the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d))
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(folder)
    model = getattr(transformers, hf_cls)(config)
    with torch.no_grad():  # HF's init plus noise on every tensor: no zero norm, no symmetric rows
        for t in [*model.parameters(), *(b for n, b in model.named_buffers() if "inv_freq" not in n)]:
            if t.is_floating_point():
                t.add_(0.02 * torch.randn_like(t))
    model.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(d, indent=2))
    if str(d.get("transformers_version", "5")).startswith("4.") and d["model_type"] == "qwen3_vl_moe":
        # a 4.57 folder stores its fused experts transposed ([E, H, 2I] / [E, I, H]), as the Hub files do
        sd = load_file(folder / "model.safetensors")
        sd = {k: v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v
              for k, v in sd.items()}  # fmt: skip
        save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    if mtp is not None:
        text = config.text_config if hasattr(config, "text_config") else config
        path = folder / "model.safetensors"
        sd = load_file(path)
        if mtp == "qwen":
            sd.update(_HFMtp(text, moe="num_experts" in text.to_dict(), seed=3).hf_keys())
        else:
            ref = _HFNextn(text, seed=3)
            sd.update(ref.hf_keys())
            sd[f"model.layers.{ref.L}.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
            sd[f"model.layers.{ref.L}.shared_head.head.weight"] = sd["lm_head.weight"].clone()
        save_file(sd, path, metadata={"format": "pt"})
    # the oracle reads the folder as a user would (the in-memory model also holds non-persistent buffers)
    model = getattr(transformers, hf_cls).from_pretrained(folder, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def _qwen_text(d: dict[str, Any], *, layers: int = 2) -> dict[str, Any]:
    """A shrunk Qwen3.5(-MoE) text level, then other than the debug recipes: hidden 32, 2 layers, theta, eps, MTP 1."""
    t = d.get("text_config", d)
    t.update(hidden_size=32, num_hidden_layers=layers, rms_norm_eps=1e-2, mtp_num_hidden_layers=1)
    t["layer_types"] = ["linear_attention", "full_attention"][:layers]
    t["rope_parameters"] = {**t["rope_parameters"], "rope_theta": 12345.0}
    return d


def qwen3_5_dense_folder() -> tuple[dict[str, Any], str]:
    return _qwen_text(_shrink("qwen3_5_0_8b.json")), "Qwen3_5ForConditionalGeneration"


def qwen3_5_moe_folder(*, causal_lm: bool) -> tuple[dict[str, Any], str]:
    d = _qwen_text(_shrink("qwen3_5_35b_a3b.json"))
    if not causal_lm:
        return d, "Qwen3_5MoeForConditionalGeneration"
    text = {**d["text_config"], "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"]}
    return text, "Qwen3_5MoeForCausalLM"


def qwen3_vl_moe_folder() -> tuple[dict[str, Any], str]:
    d = _shrink("qwen3_vl_30b_a3b_instruct.json")
    t = d["text_config"]
    # hidden 40: not 2 x moe_intermediate_size (square fused experts make the 4.57 hub layout ambiguous)
    t.update(hidden_size=40, num_hidden_layers=2, rms_norm_eps=1e-2, rope_theta=12345.0)  # its router always renormalises
    d["vision_config"].update(out_hidden_size=40, deepstack_visual_indexes=[0, 1])
    return d, "Qwen3VLMoeForConditionalGeneration"


def glm_flash_folder() -> tuple[dict[str, Any], str]:
    d = _shrink("glm_4_7_flash.json")
    d.update(hidden_size=48, num_hidden_layers=2, rms_norm_eps=1e-2, rope_theta=12345.0, norm_topk_prob=False,
             num_nextn_predict_layers=1)  # fmt: skip
    return d, "Glm4MoeLiteForCausalLM"


def text_batch(path: Path, *, vocab: int, T: int = 24) -> dict[str, torch.Tensor]:
    """One preset micro-batch (one document) of ids below ``vocab``, saved for ``--data.source preset_pt``."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, min(vocab, 500), (1, T + 1), generator=g)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:].clone(), "position_ids": torch.arange(T)[None],
             "cu_seqlens": torch.tensor([0, T], dtype=torch.int32), "max_seqlen": T}  # fmt: skip
    torch.save([batch], path)
    return batch


def image_batch(path: Path, *, merge_size: int = 2) -> dict[str, torch.Tensor]:
    """One preset VL micro-batch: text, an image of a 4 x 4 patch grid (4 image tokens), text."""
    grid = torch.tensor([[1, 4, 4]])
    pixels = torch.randn(16, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[1, 2, VS] + [IMG] * 4 + [VE, 7, 8, 9, 10, 11, 12]])
    labels = torch.cat([ids[:, 1:], torch.tensor([[13]])], dim=1)
    labels[(labels == IMG) | (labels == VE)] = -100
    pos = torch.from_numpy(mrope_position_ids(ids[0].numpy(), grid.numpy(), image_token_id=IMG, merge_size=merge_size))
    T = ids.shape[1]
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos[:, None], "cu_seqlens": torch.tensor([0, T]),
             "max_seqlen": T, "pixel_values": pixels, "image_grid_thw": grid}  # fmt: skip
    torch.save([batch], path)
    return batch


def hf_loss(model: Any, batch: dict[str, torch.Tensor], *, extra_rows: torch.Tensor | None = None) -> float:
    """transformers' token-mean cross entropy on the batch (``extra_rows``: more head rows on HF's final hidden
    states, for a model whose head holds more classes than the folder's text vocabulary)."""
    inputs = {"input_ids": batch["input_ids"]}
    if "pixel_values" in batch:
        inputs.update(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                      mm_token_type_ids=(batch["input_ids"] == IMG).int())  # fmt: skip
    with torch.no_grad():
        out = model(**inputs, use_cache=False, output_hidden_states=extra_rows is not None)
        logits = out.logits
        if extra_rows is not None:
            logits = torch.cat([logits, out.hidden_states[-1] @ extra_rows.T], dim=-1)
    return F.cross_entropy(logits[0], batch["labels"][0], ignore_index=-100).item()


def run_first_step(tmp: Path, folder: Path, batch_path: Path, T: int, *args: str) -> tuple[dict, list[dict], Any]:
    """``python -m hyper_parallel.train ... --checkpoint.initial_load_path folder`` for one step (the ConfigManager
    and Trainer that ``hyper_parallel.train.main`` runs): the summary, the metrics records, the built trainer."""
    argv = [*args, "--checkpoint.initial_load_path", str(folder), "--data.source", "preset_pt",
            "--data.path", str(batch_path), "--data.max_tokens_per_microbatch", str(T),
            "--data.global_batch_tokens", str(T), "--training.steps", "1", "--metrics.log_freq", "1",
            "--checkpoint.enable", "False", "--checkpoint.no_export_hf", "--dump_folder", str(tmp / "run"),
            "--model.router_aux_loss_coef", "0"]  # fmt: skip
    trainer = ConfigManager().parse_args(argv).build()
    try:
        head = trainer.model.lm_head.weight
        head = (head.full_tensor() if hasattr(head, "full_tensor") else head).detach().clone()
        summary = trainer.train()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return summary, records, (trainer, head)


# (case id, folder maker, recipe; None: --module left out, the folder names it)
QWEN_CASES = [
    ("qwen3_5_dense", qwen3_5_dense_folder, ("--module", "qwen3_5", "--config", "qwen3_5_debug")),
    ("qwen3_5_moe_text", lambda: qwen3_5_moe_folder(causal_lm=True), ("--config", "qwen3_5_moe_debug")),
    ("qwen3_5_moe_cond_gen", lambda: qwen3_5_moe_folder(causal_lm=False), ("--config", "qwen3_5_moe_debug")),
]


@pytest.mark.parametrize("case", QWEN_CASES, ids=[c[0] for c in QWEN_CASES])
def test_qwen3_5_first_step_loss_is_transformers_loss_on_the_folder(case, tmp_path):
    _, make, recipe = case
    d, hf_cls = make()
    hf = write_hf_folder(tmp_path / "hf", copy.deepcopy(d), hf_cls, mtp="qwen")
    vocab = d.get("text_config", d)["vocab_size"]
    batch = text_batch(tmp_path / "batch.pt", vocab=vocab)
    summary, records, (trainer, _) = run_first_step(tmp_path, tmp_path / "hf", tmp_path / "batch.pt", 24, *recipe)
    m = trainer.config.model
    assert (m.dim, len(m.layers), m.vocab_size) == (32, 2, vocab)  # the folder's dimensions, not the recipe's
    assert m.option_values()["rope_theta"] == 12345.0 and m.option_values()["rms_norm_eps"] == 1e-2
    want = hf_loss(hf, batch)
    print(f"{case[0]}: first-step loss {summary['first_loss']:.7f}, transformers {want:.7f}")
    assert abs(summary["first_loss"] - want) <= TOL, (summary["first_loss"], want)
    assert "loss/mtp" in records[0] and records[0]["loss/mtp"] > 0  # the folder's MTP block trains, no flag


def test_qwen3_vl_moe_first_step_loss_with_an_image(tmp_path):
    d, hf_cls = qwen3_vl_moe_folder()
    hf = write_hf_folder(tmp_path / "hf", copy.deepcopy(d), hf_cls)
    batch = image_batch(tmp_path / "batch.pt")
    T = batch["input_ids"].shape[1]
    summary, records, (trainer, _) = run_first_step(
        tmp_path, tmp_path / "hf", tmp_path / "batch.pt", T, "--module", "qwen3_vl_moe", "--config", "qwen3_vl_moe_debug"
    )
    m = trainer.config.model
    assert (m.dim, len(m.layers)) == (40, 2) and m.option_values()["rope_theta"] == 12345.0
    assert "loss/mtp" not in records[0]  # Qwen3-VL releases ship no MTP block
    want = hf_loss(hf, batch)
    print(f"qwen3_vl_moe: first-step loss {summary['first_loss']:.7f}, transformers {want:.7f}")
    assert abs(summary["first_loss"] - want) <= TOL, (summary["first_loss"], want)


def test_glm_4_7_flash_first_step_loss_and_nextn(tmp_path):
    d, hf_cls = glm_flash_folder()
    hf = write_hf_folder(tmp_path / "hf", copy.deepcopy(d), hf_cls, mtp="glm")
    batch = text_batch(tmp_path / "batch.pt", vocab=d["vocab_size"])
    summary, records, (trainer, head) = run_first_step(
        tmp_path, tmp_path / "hf", tmp_path / "batch.pt", 24, "--config", "glm_image_moe_debug"
    )
    m = trainer.config.model
    assert (m.dim, len(m.layers), m.vocab_size) == (48, 2, d["vocab_size"])
    assert m.option_values()["rope_theta"] == 12345.0 and m.option_values()["rms_norm_eps"] == 1e-2
    # a text-only folder and text data: a Glm4MoeLite model, no image path (its sizes would be the recipe's)
    assert not m.has_image_path and m.codebook_size == 256 and head.shape[0] == d["vocab_size"]
    assert not m.layers[1].mlp.gate.norm_topk_prob  # the folder's router (the recipe renormalises)
    want = hf_loss(hf, batch)
    print(f"glm_4_7_flash: first-step loss {summary['first_loss']:.7f}, transformers {want:.7f}")
    assert abs(summary["first_loss"] - want) <= TOL, (summary["first_loss"], want)
    assert "loss/mtp" in records[0] and records[0]["loss/mtp"] > 0
