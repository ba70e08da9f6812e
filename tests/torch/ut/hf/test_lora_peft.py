"""LoRA export (issue 32): the PEFT adapter folder, vLLM's per-expert 2-D form and the merged export.

Per family (Qwen3.5 dense, Qwen3.5-MoE, Qwen3-VL-MoE with an image in the Hub's transposed-experts form,
GlmImageMoe's backbone as Glm4MoeLite), from a tiny random folder written by transformers: our model read from it with adapters on every linear of the layers
(DeltaNet's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a / out_proj included) and on the routed experts, the
adapters set to random non-zero values (``B`` too), then

- ``peft.PeftModel.from_pretrained(<transformers model of the folder>, adapter)`` gives our logits (fp32, 1e-5);
- transformers reading the merged export gives the same logits;
- the vLLM 2-D folder holds, for every expert, ``...experts.{e}.{gate,up,down}_proj.lora_{A,B}.weight`` with the
  shapes vLLM's ``pack_moe`` stacks (``A [r, in]``, ``B [out, r]``), names that vLLM's
  ``parse_fine_tuned_lora_name`` / ``check_unexpected_modules`` accept, and whose products are the merged
  export's change of each expert weight.

One case goes through the trainer (``--lora.*`` flags, two steps, ``--checkpoint.export_hf``).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.torch.helpers import logits_of

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from hyper_parallel.config.lora import LoRAConfig  # noqa: E402
from hyper_parallel.models.common.lora_policy import apply_lora, lora_trainable_names  # noqa: E402
from hyper_parallel.hf import read_safetensors  # noqa: E402
from hyper_parallel.hf.convert import full_tensor  # noqa: E402
from hyper_parallel.hf.load import build_from_hf  # noqa: E402
from hyper_parallel.hf.lora_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_adapter, save_merged  # noqa: E402
from hyper_parallel.protocols.model_spec import discover_model_spec  # noqa: E402
from tests.torch.ut.hf.test_folder_is_model import (  # noqa: E402
    glm_flash_folder,
    image_batch,
    qwen3_5_dense_folder,
    qwen3_5_moe_folder,
    qwen3_vl_moe_folder,
    text_batch,
    write_hf_folder,
)
from tests.torch.ut.hf.test_released_configs import IMG, _shrink  # noqa: E402

TOL = 1e-5


def _ours(spec: Any, folder: Path, lora: LoRAConfig) -> Any:
    """Our model read from ``folder`` with ``lora``'s adapters (as the trainer builds it), adapters random."""
    model = build_from_hf(
        spec.model, folder, config_from_hf=lambda d: apply_lora(spec.hf.config_from_hf(d), lora),
        spec=spec, dtype=torch.float32, device="cpu",
    )  # fmt: skip
    trained = lora_trainable_names(model, lora.modules_to_save)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.requires_grad_(name in trained)  # the frozen base, as the trainer sets it
            if name in trained:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _hf_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    inputs = {"input_ids": batch["input_ids"]}
    if "pixel_values" in batch:
        inputs.update(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                      mm_token_type_ids=(batch["input_ids"] == IMG).int())  # fmt: skip
    return inputs


def _our_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if "pixel_values" in batch:
        return {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}
    return {}


def _hf_logits(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**_hf_inputs(batch), use_cache=False).logits


def _check_vllm_form(folder: Path, merged: Path, base: Path, lora: LoRAConfig) -> int:
    """vLLM's per-expert 2-D folder: names, shapes, and ``scale * B_e A_e`` = the merged change of each expert."""
    cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert cfg.get("target_parameters") is None and not cfg["modules_to_save"]
    assert {"gate_proj", "up_proj", "down_proj"} <= set(cfg["target_modules"])
    sd = load_file(folder / ADAPTER_WEIGHTS)
    new, old = read_safetensors(merged), read_safetensors(base)
    scale = lora.alpha / (math.sqrt(lora.rank) if lora.rslora else lora.rank)
    experts = 0
    for key, a in sd.items():
        # vllm/lora/utils.py parse_fine_tuned_lora_name: "base_model.model." + module + ".lora_A.weight"
        parts = key.split(".")
        assert key.startswith("base_model.model.") and parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"), key
        module = ".".join(parts[2:-2])
        if ".experts." not in module or parts[-2] != "lora_A":
            continue
        # vllm/lora/lora_model.py check_unexpected_modules: the suffix from "experts" is experts.{e}.{proj}
        suffix = module[module.find(".experts") + 1 :].split(".")
        assert suffix[0] == "experts" and suffix[1].isdigit() and suffix[2] in ("gate_proj", "up_proj", "down_proj")
        b = sd[key.replace("lora_A", "lora_B")]
        assert a.shape[0] == lora.rank and b.shape[1] == lora.rank  # pack_moe stacks [E, r, in] / [E, out, r]
        change = new[module + ".weight"] - old[module + ".weight"]
        assert change.shape == (b.shape[0], a.shape[1])
        assert (scale * b @ a - change).abs().max() <= 1e-6, module
        experts += 1
    return experts


def _hub_form(d: dict[str, Any], hf_cls: str) -> tuple[dict[str, Any], str]:
    """The Qwen3-VL-MoE folder as the Hub releases are (written by transformers 4.57: fused experts stored
    transposed); the adapter still names transformers 5's run-time ``gate_up_proj [E, 2I, H]``."""
    return {**d, "transformers_version": "4.57.1"}, hf_cls


# (id, folder maker, module, lora settings)
CASES = [
    ("qwen3_5_dense", qwen3_5_dense_folder, "qwen3_5",
     LoRAConfig(rank=4, alpha=8.0, rslora=True, dropout=0.1, targets=("all-linear",))),
    ("qwen3_5_moe", lambda: qwen3_5_moe_folder(causal_lm=True), "qwen3_5_moe",
     LoRAConfig(rank=4, alpha=8.0, targets=("all-linear", "experts"), modules_to_save=("lm_head",))),
    ("qwen3_vl_moe", lambda: _hub_form(*qwen3_vl_moe_folder()), "qwen3_vl_moe",
     LoRAConfig(rank=4, alpha=12.0, targets=("all-linear", "experts"))),
    # Qwen3-VL dense (the shrunk 2B release, tied, deepstack), tower blocks and mergers adapted too
    ("qwen3_vl_dense", lambda: (_shrink("qwen3_vl_2b_instruct.json"), "Qwen3VLForConditionalGeneration"),
     "qwen3_vl_moe", LoRAConfig(rank=4, alpha=12.0, targets=("all-linear",))),
]  # GlmImageMoe's backbone as Glm4MoeLite: through the trainer below


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_peft_and_merged_exports_give_our_logits(case, tmp_path):
    name, make, module, lora = case
    d, hf_cls = make()
    base = tmp_path / "base"
    hf = write_hf_folder(base, copy.deepcopy(d), hf_cls)
    text = d.get("text_config", d)
    batch = image_batch(tmp_path / "b.pt") if name.startswith("qwen3_vl") else text_batch(tmp_path / "b.pt", vocab=text["vocab_size"])
    spec = discover_model_spec(module)
    ours = _ours(spec, base, lora)
    with torch.no_grad():
        want = logits_of(ours(batch["input_ids"], **_our_inputs(batch)))[..., : text["vocab_size"]]
    before = _hf_logits(hf, batch)
    assert (before - want).abs().max() > 1e-2  # the adapters change the model

    moe = name not in ("qwen3_5_dense", "qwen3_vl_dense")
    save_adapter(spec, ours, tmp_path / "adapter", base_model_name_or_path=str(base))
    save_merged(spec, ours, tmp_path / "merged")
    if name == "qwen3_5_moe":  # (the VL folder's experts are fused on disk: the check below reads per-expert keys)
        save_adapter(spec, ours, tmp_path / "vllm", form="vllm", modules_to_save=())

    cfg = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == lora.rank and cfg["use_rslora"] == lora.rslora
    assert cfg["lora_dropout"] == (0.0 if moe else lora.dropout)  # PEFT refuses dropout on target_parameters
    assert any(m.endswith("in_proj_qkv") for m in cfg["target_modules"]) == name.startswith("qwen3_5")
    assert bool(cfg["target_parameters"]) == moe
    assert any("visual.blocks." in m for m in cfg["target_modules"]) == name.startswith("qwen3_vl")  # the tower too
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    got = _hf_logits(peft_model, batch)
    diff = (got - want).abs().max().item()

    merged = getattr(transformers, hf_cls).from_pretrained(tmp_path / "merged", dtype=torch.float32)
    merged.config._attn_implementation = "sdpa"
    merged_diff = (_hf_logits(merged.eval(), batch) - want).abs().max().item()
    print(f"{name}: PEFT max |diff| {diff:.2e}, merged {merged_diff:.2e}")
    assert diff <= TOL, diff
    assert merged_diff <= TOL, merged_diff
    if name == "qwen3_5_moe":
        assert _check_vllm_form(tmp_path / "vllm", tmp_path / "merged", base, lora) == 3 * 8 * 2  # every expert


def test_trainer_lora_run_exports_what_peft_vllm_and_transformers_read(tmp_path):
    """``--lora.*`` through the trainer on GLM-4.7-Flash's form, one adapter shared by the routed experts (expanded
    per expert in the exports): two steps (the adapters' B leave zero), then
    ``--checkpoint.export_hf`` writes adapter/ (PEFT), adapter_vllm/ (vLLM's 2-D form: GLM's server path) and
    merged/ (Glm4MoeLite form), each read back to the trained model's logits."""
    from hyper_parallel.config import ConfigManager

    d, hf_cls = glm_flash_folder()
    base = tmp_path / "base"
    hf = write_hf_folder(base, copy.deepcopy(d), hf_cls)
    T = 24
    batch = text_batch(tmp_path / "b.pt", vocab=d["vocab_size"], T=T)
    argv = ["--config", "glm_image_moe_debug", "--checkpoint.initial_load_path", str(base), "--data.source", "preset_pt",
            "--data.path", str(tmp_path / "b.pt"), "--data.max_tokens_per_microbatch", str(T),
            "--data.global_batch_tokens", str(T), "--training.steps", "2", "--checkpoint.enable", "False",
            "--checkpoint.export_hf", "True", "--checkpoint.export_dtype", "float32", "--dump_folder", str(tmp_path / "run"),
            "--model.router_aux_loss_coef", "0", "--model.use_mtp", "False", "--lora.rank", "4", "--lora.alpha", "8", "--lora.targets", "all-linear",
            "experts", "--lora.share_experts", "True", "--lora.export_vllm", "True", "--lora.export_merged", "True"]  # fmt: skip
    trainer = ConfigManager().parse_args(argv).build()
    try:
        trainer.train()
        model = trainer.model.eval()
        assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
        b = [p for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj_lora_B")]
        assert b and all(float(full_tensor(p).abs().max()) > 0 for p in b)  # trained off its zero init
        with torch.no_grad():
            want = logits_of(model(batch["input_ids"]))[..., : d["vocab_size"]]
    finally:
        trainer.close()
    out = tmp_path / "run" / "hf"
    assert {p.name for p in out.iterdir()} == {"adapter", "adapter_vllm", "merged"}
    got = _hf_logits(peft.PeftModel.from_pretrained(hf, out / "adapter").eval(), batch)
    merged = getattr(transformers, hf_cls).from_pretrained(out / "merged", dtype=torch.float32)
    merged.config._attn_implementation = "sdpa"
    merged_got = _hf_logits(merged.eval(), batch)
    diff, merged_diff = (got - want).abs().max().item(), (merged_got - want).abs().max().item()
    print(f"trainer glm4_moe_lite: PEFT max |diff| {diff:.2e}, merged {merged_diff:.2e}")
    assert diff <= TOL and merged_diff <= TOL, (diff, merged_diff)
    experts = _check_vllm_form(out / "adapter_vllm", out / "merged", base, trainer.config.lora)
    assert experts == 3 * d["n_routed_experts"] * (d["num_hidden_layers"] - d.get("first_k_dense_replace", 1))


def test_vllm_form_refuses_modules_to_save():
    """vLLM loads no ``modules_to_save`` (vllm/lora/peft_helper.py): the flag pair is refused before any run."""
    from hyper_parallel.config.errors import ConfigError

    with pytest.raises(ConfigError, match="modules_to_save"):
        LoRAConfig(rank=4, modules_to_save=("lm_head",), export_vllm=True)
