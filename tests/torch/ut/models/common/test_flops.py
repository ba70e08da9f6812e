"""Training FLOPs from the step's real documents (``BaseModel.training_flops``) against ``FlopCounterMode``.

Convention (``models/common/flops.py``, the README's "FLOPs and MFU"): model FLOPs, backward twice the forward, no
recompute; attention counts the query-key pairs computed, causal within each packed document (``L (L + 1) / 2``
pairs), bidirectional inside a vision frame (``L^2``); routed experts at top-k. ``FlopCounterMode`` counts what
runs; ``flop_counter_formulas()`` gives it the same attention convention (torch's own SDPA formulas ignore the
causal mask and count the backward's score recompute, and it has none for the CPU flash kernel, ``grouped_mm``
and triangular solves).

Each family's debug recipe: its first packed micro-batch from the recipe's own data (several documents per
micro-batch, images for VL), one forward + backward; the logged FLOPs per token (what the trainer logs:
``training_flops(batch) / tokens``) within 15% of the counted ones.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from hyper_parallel.components import MetricsProcessor
from hyper_parallel.models.common.flops import attention_flops, document_lengths, flop_counter_formulas
from hyper_parallel.protocols.model import split_output
from hyper_parallel.protocols.model_spec import get_spec

RELEASED = Path(__file__).parents[2] / "released_configs"

RECIPES = {
    "glm_image_moe_debug": "hyper_parallel.models.glm_image_moe_v2.config_registry",
    "qwen3_5_debug": "hyper_parallel.models.qwen3_5_v2.config_registry",
    "qwen3_5_moe_debug": "hyper_parallel.models.qwen3_5_moe_v2.config_registry",
    "qwen3_vl_moe_debug": "hyper_parallel.models.qwen3_vl_moe_v2.config_registry",
}


def _packed_step(recipe: str) -> tuple[torch.nn.Module, dict]:
    cfg = getattr(importlib.import_module(RECIPES[recipe]), recipe)()
    spec = get_spec(cfg.model_spec)
    data = cfg.data.build(dp_rank=0, dp_world_size=1, seq_multiple=1, model_facts=spec.data_facts(cfg.model))
    batch = data.next_step()[0]
    torch.manual_seed(0)
    model = cfg.model.build()
    model.init_weights()
    return model, batch


def _counted(model: torch.nn.Module, batch: dict) -> dict[str, int]:
    """FLOPs ``FlopCounterMode`` counts per op over one forward + backward of ``batch``."""
    kwargs = dict(position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"],
                  cu_seqlens_host=batch.get("cu_seqlens_host"), token_mask=batch.get("token_mask"),
                  **{k: batch[k] for k in type(model).input_keys if k in batch})  # fmt: skip
    with FlopCounterMode(display=False, custom_mapping=flop_counter_formulas()) as counter:
        logits, aux = split_output(model(batch["input_ids"], **kwargs))
        loss = logits.float().logsumexp(-1).mean() + (aux if aux is not None else 0.0)
        loss.backward()
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_logged_flops_per_token_match_flop_counter_on_a_packed_step(recipe):
    model, batch = _packed_step(recipe)
    lengths = document_lengths(batch)
    assert len(lengths) > 3, "the debug step should pack several documents"
    if recipe.startswith("qwen3_vl"):
        assert batch["image_grid_thw"].shape[0] > 0
    tokens = batch["input_ids"].numel()
    logged = model.training_flops(batch) / tokens
    by_op = _counted(model, batch)
    counted = sum(by_op.values()) / tokens
    print(f"\n{recipe}: {len(lengths)} segments, logged {logged:.4g} vs FlopCounterMode {counted:.4g} FLOPs/token "
          f"({logged / counted:.3f}); one-document estimate {model.get_nparams_and_flops(tokens)[1]:.4g}")  # fmt: skip
    assert logged == pytest.approx(counted, rel=0.15)
    # softmax attention alone, both sides by the same convention: exactly equal (per document, causal; the vision
    # tower's frames bidirectional)
    sdpa = sum(n for op, n in by_op.items() if "scaled_dot_product" in op)
    mixers = [layer.self_attn for layer in model.all_layers() if type(layer.self_attn).__name__ != "GatedDeltaNet"]
    want = 0.0
    for m in mixers:
        qk, v = getattr(m, "qk_head_dim", None), getattr(m.config, "v_head_dim", None)
        # SDPA zero-pads MLA's smaller v head dim to the qk one (computed, but not model FLOPs): count it here
        want += m.flops(lengths) * (2 * qk / (qk + v) if qk is not None and v is not None and v < qk else 1.0)
    if "image_grid_thw" in batch:
        grids = [*batch["image_grid_thw"].tolist(), *batch.get("video_grid_thw", torch.empty(0, 3)).tolist()]
        frames = [h * w for t, h, w in grids for _ in range(t)]  # a video's frames attend within themselves
        for block in model.visual.blocks:
            want += attention_flops(frames, heads=block.attn.config.n_heads, qk_dim=block.attn.head_dim,
                                    v_dim=block.attn.head_dim, causal=False)  # fmt: skip
    assert sdpa == want


def test_attention_is_counted_causal_per_document_on_both_sides():
    """One causal SDPA call per document (as the packed path runs on CPU): the registered formulas count exactly
    ``attention_flops``; torch's own would count the full rectangle (and nothing for the CPU kernel)."""
    H, d, lengths = 2, 8, [5, 17, 1]
    q = [torch.randn(1, H, n, d, requires_grad=True) for n in lengths]
    with FlopCounterMode(display=False, custom_mapping=flop_counter_formulas()) as counter:
        sum(F.scaled_dot_product_attention(x, x, x, is_causal=True).sum() for x in q).backward()
    assert counter.get_total_flops() == attention_flops(lengths, heads=H, qk_dim=d, v_dim=d)
    assert attention_flops([4], heads=1, qk_dim=1, v_dim=1, causal=True) == 6 * 2 * 10
    assert attention_flops([4], heads=1, qk_dim=1, v_dim=1, causal=False) == 6 * 2 * 16


def test_routed_experts_count_at_top_k():
    model, batch = _packed_step("qwen3_5_moe_debug")
    moe = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts"))
    tokens = 100
    routed = 6.0 * sum(p.numel() for p in moe.experts.parameters()) * tokens
    everything = 6.0 * sum(p.numel() for p in moe.parameters()) * tokens
    k, e = moe.config.gate.top_k, moe.config.num_experts
    assert moe.flops(tokens) == pytest.approx(everything - routed * (1 - k / e))


@pytest.mark.parametrize("image_path", [False, True])
def test_glm_4_7_flash_folder_config_has_positive_right_flops(image_path):
    """A model built from the released Glm4MoeLite config.json (GLM-4.7-Flash) logged -1.55e8 FLOPs/token once (the
    codebook was subtracted twice). Now: 6 x the active non-embedding parameters plus causal attention, with or
    without the image path (its projection runs on image codes only)."""
    from hyper_parallel.models.glm_image_moe_v2.hf_config import config_from_hf

    cfg = config_from_hf(json.loads((RELEASED / "glm_4_7_flash.json").read_text()))
    if "image_path" in {f.name for f in dataclasses.fields(cfg)}:
        cfg = dataclasses.replace(cfg, image_path=image_path)
    elif not image_path:
        pytest.skip("this GlmImageMoe config has no text-only form")
    with torch.device("meta"):
        model = cfg.build()
    seq = 4096
    _, per_token = model.get_nparams_and_flops(seq)
    hf = json.loads((RELEASED / "glm_4_7_flash.json").read_text())
    V, D, L = hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"]
    E, K = hf["n_routed_experts"], hf["num_experts_per_tok"]
    routed = sum(p.numel() for layer in model.layers if hasattr(layer.mlp, "experts") for p in layer.mlp.experts.parameters())
    image = sum(p.numel() for name in ("vq_codebook", "vq_to_llm_proj") if getattr(model, name, None) is not None
                for p in getattr(model, name).parameters())  # fmt: skip
    active = sum(p.numel() for p in model.parameters()) - V * D - image - routed * (1 - K / E)
    if model.mtp is not None:
        active += model.lm_head.weight.numel()
    pairs = seq * (seq + 1) / 2
    attention = L * 6 * hf["num_attention_heads"] * (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"] + hf["v_head_dim"])
    want = 6 * active + attention * pairs / seq
    print(f"\nGLM-4.7-Flash folder (image path {image_path}): {per_token:.4g} FLOPs/token at {seq} tokens")
    assert per_token > 0
    assert per_token == pytest.approx(want, rel=1e-6)


def test_metrics_log_flops_and_tflops_and_mfu_only_against_a_known_peak(tmp_path, caplog):
    """Every record holds ``flops_per_token`` and ``tflops``; a CPU has no known peak, so no MFU unless
    ``--metrics.peak_tflops`` gives one."""
    steps = [(1000, 2e6), (3000, 1e6)]  # (tokens, FLOPs per token) of two steps: the window's mean is by token
    records, console = {}, {}
    for peak in (0.0, 2.0):
        caplog.clear()
        folder = tmp_path / f"peak{peak}"
        metrics = MetricsProcessor.Config(log_freq=2, peak_tflops=peak, plot_loss=False).build(
            dump_folder=folder, total_steps=2, device="cpu"
        )
        with caplog.at_level(logging.INFO, logger="hyper_parallel.components.metrics"):
            for step, (tokens, fpt) in enumerate(steps, 1):
                metrics.log(step, loss=1.0, num_tokens=tokens, flops_per_token=fpt)
        metrics.close()
        console[peak] = [m for m in caplog.messages if m.startswith("step")]
        records[peak] = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for peak, recs in records.items():
        first, second = recs
        assert first["flops_per_token"] == 2e6 and second["flops_per_token"] == pytest.approx(1e6)
        assert second["tflops"] == pytest.approx(second["tps"] * second["flops_per_token"] / 1e12)
        assert ("mfu" in second) == (peak > 0)
    assert records[2.0][1]["mfu"] == pytest.approx(100 * records[2.0][1]["tflops"] / 2.0)
    assert all("tflops" in m and "mfu" not in m for m in console[0.0]) and "mfu" in console[2.0][-1]


def test_the_trainer_logs_each_steps_flops_and_no_mfu_on_cpu(tmp_path):
    """One CLI step of ``qwen3_vl_moe_debug`` (images, several documents): the record's ``flops_per_token`` is
    ``training_flops`` of the step's own micro-batches (not the one-document estimate, 1.4x off here), with TFLOP/s
    and no MFU (a CPU has no known peak)."""
    from hyper_parallel.train import main as train_main

    recipe = "qwen3_vl_moe_debug"
    train_main(["--module", "qwen3_vl_moe", "--config", recipe, "--training.steps", "1", "--dump_folder",
                str(tmp_path), "--checkpoint.enable", "false", "--checkpoint.no_export_hf",
                "--data.global_batch_tokens", "512"])  # fmt: skip
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    model, batch = _packed_step(recipe)  # the same first micro-batch (one per step at 512 tokens)
    assert record["flops_per_token"] == pytest.approx(model.training_flops(batch) / batch["input_ids"].numel())
    assert record["tflops"] == pytest.approx(record["tps"] * record["flops_per_token"] / 1e12)
    assert "mfu" not in record


def test_the_projects_custom_ops_are_counted_like_the_modules():
    """Under torch.compile attention and the DeltaNet core run as ``hyper_parallel::*`` custom ops, opaque to
    ``FlopCounterMode``: the registered formulas count them as the mixers' ``flops`` do."""
    from hyper_parallel.models.common import gated_delta_rule  # noqa: F401  (registers hyper_parallel::gated_delta_rule)
    from hyper_parallel.models.common.flops import chunked_delta_rule_flops
    from hyper_parallel.models.common.packed_sdpa import sdpa_packed

    lengths, H, d = [5, 17, 10], 2, 8
    cu = torch.tensor([0, 5, 22, 32], dtype=torch.int32)
    q, k, v = (torch.randn(1, H, 32, d, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False, custom_mapping=flop_counter_formulas()) as counter:
        sdpa_packed(q, k, v, cu, d**-0.5)  # forward: its backward op runs functorch's vjp, which a dispatch mode breaks
    assert counter.get_total_flops() == attention_flops(lengths, heads=H, qk_dim=d, v_dim=d) / 3

    Hk, Hv, Dk, Dv = 1, 2, 8, 8
    qkv = torch.randn(1, 32, Hk, 2 * Dk + 2 * Dv, requires_grad=True)
    g = -torch.rand(1, 32, Hv, requires_grad=True)
    beta = torch.rand(1, 32, Hv, requires_grad=True)
    w = torch.randn(Hk * (2 * Dk + 2 * Dv), 4, requires_grad=True)
    with FlopCounterMode(display=False, custom_mapping=flop_counter_formulas()) as counter:
        out = torch.ops.hyper_parallel.gated_delta_rule(qkv, g, beta, w, cu, cu, Dk, Dv, 64, "torch")
        out.sum().backward()
    forward = int(chunked_delta_rule_flops(lengths, heads=Hv, k_dim=Dk, v_dim=Dv, chunk=64) / 3)
    assert counter.get_total_flops() == 3 * forward  # the backward op counts twice the forward


def test_a_small_glm_with_a_large_codebook_has_positive_flops():
    """The issue's stand-in (a 64-wide Glm4MoeLite folder grown a 16384 x 2048 codebook) logged -1.55e8 FLOPs/token:
    the frozen codebook was subtracted from a count that had already left it out. A lookup costs nothing either way."""
    from hyper_parallel.models.glm_image_moe_v2.model import glm_image_moe_config

    cfg = glm_image_moe_config(
        vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, codebook_size=16384,
        vq_embed_dim=2048, placeholder_token_id=1023, mlp_layer_types=["dense", "sparse"],
    )  # fmt: skip
    with torch.device("meta"):
        model = cfg.build()
    _, per_token = model.get_nparams_and_flops(4096)
    text = [p for name, p in model.named_parameters() if not name.startswith(("vq_", "embed_tokens"))]
    routed = sum(p.numel() for p in model.layers[1].mlp.experts.parameters())
    attention = 2 * 6 * 4 * (24 + 16) * 4097 / 2
    assert per_token > 0
    assert per_token == pytest.approx(6 * (sum(p.numel() for p in text) - routed * 6 / 8) + attention)
