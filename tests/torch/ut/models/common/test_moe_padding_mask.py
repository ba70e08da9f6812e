"""Padding positions are left out of the MoE router statistics, as HF's masked ``load_balancing_loss_func``.

The packing collate marks the padding run in the batch's ``token_mask`` (True at document tokens); the decoder
hands it to every MoE (``AttentionMeta.token_mask`` -> block -> ``MoE.forward(x, token_mask=)``), whose Switch
statistics then weight each row's routed slots and probabilities by it and count only the masked-in rows
(``LoadBalanceStats.from_router(..., token_mask=)``). Oracles: transformers' ``load_balancing_loss_func`` with an
``attention_mask`` (the statistics, and a whole Qwen3.5-MoE model given padded rows), and, per family, the same
documents without any padding (the decoder, MTP, GLM and Qwen3-VL forwards all pass the mask on).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

from hyper_parallel.data.packing import TokenDocument, add_mtp_targets, collate_packed
from hyper_parallel.models.common.moe import LoadBalanceStats
from hyper_parallel.models.qwen3_5_moe_v2 import from_pretrained
from hyper_parallel.protocols.model import split_output
from tests.torch.ut.hf_utils import hf_row_order
from tests.torch.ut.models.qwen3_5_moe_v2.test_model import _hf_model, _hf_name


def _stats_loss(logits: list[torch.Tensor], top_k: int, mask: torch.Tensor | None) -> torch.Tensor:
    stats = None
    for layer in logits:
        scores_TE = layer.softmax(dim=-1)
        idx_TK = torch.topk(scores_TE, top_k, dim=-1).indices
        one = LoadBalanceStats.from_router(scores_TE, idx_TK, coef=1.0, token_mask=mask)
        stats = one if stats is None else stats + one
    return stats.loss()


def test_masked_statistics_equal_hf_load_balancing_loss_with_attention_mask():
    E, K, B, T = 8, 2, 3, 10
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(B * T, E, generator=g, requires_grad=True) for _ in range(3)]
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, :] = True  # a full row, a right-padded one, and one with holes (any mask is allowed)
    mask[1, :6] = True
    mask[2] = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1, 0], dtype=torch.bool)
    want = load_balancing_loss_func(tuple(logits), E, K, attention_mask=mask.long())
    want_grads = torch.autograd.grad(want, logits)
    ours = _stats_loss(logits, K, mask.reshape(-1))
    ours_grads = torch.autograd.grad(ours, logits)
    assert abs(ours.item() - want.item()) <= 1e-7 * want.item(), (ours.item(), want.item())
    worst = max((a - b).abs().max().item() for a, b in zip(ours_grads, want_grads, strict=True))
    assert worst <= 1e-8, worst
    unmasked = _stats_loss(logits, K, None)
    assert abs(unmasked.item() - load_balancing_loss_func(tuple(logits), E, K).item()) <= 1e-7 * want.item()
    assert abs(unmasked.item() - want.item()) > 1e-3 * want.item()  # the mask matters in this case


def test_qwen3_5_moe_aux_loss_with_padded_rows_equals_hf_attention_mask(tmp_path):
    """Two rows, the second right-padded: HF gets ``attention_mask``; ours the padding as the row's last segment
    of ``cu_seqlens`` and ``token_mask``. The aux loss and every gradient it gives are HF's."""
    coef, T, length = 0.01, 20, 13
    hf = _hf_model(output_router_logits=True, router_aux_loss_coef=coef)
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    ids = torch.randint(1, hf.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    ids[1, length:] = 0
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, length:] = False
    out = hf(input_ids=ids, attention_mask=mask.long(), use_cache=False)
    cu = [0, T, T + length, 2 * T]
    position_ids = torch.cat([torch.arange(T), torch.arange(length), torch.arange(T - length)]).view(2, T)
    kw = dict(position_ids=position_ids, cu_seqlens=torch.tensor(cu, dtype=torch.int32), cu_seqlens_host=cu,
              max_seqlen=T)  # fmt: skip
    logits, aux = split_output(ours(ids, **kw, token_mask=mask))
    assert (logits - out.logits)[mask].abs().max().item() <= 1e-5
    want = coef * out.aux_loss
    assert abs(aux.item() - want.item()) <= 1e-7, (aux.item(), want.item())  # the unmasked HF parity test's bar
    _, unmasked = split_output(ours(ids, **kw))
    assert abs(unmasked.item() - want.item()) > 1e-6  # padding counted: 10x the bar away (5e-6 here)
    want.backward()
    aux.backward()
    linear = {i for i, t in enumerate(hf.config.layer_types) if t == "linear_attention"}
    hf_params = dict(hf.named_parameters())
    worst = 0.0
    for name, p in ours.named_parameters():
        g = hf_params[_hf_name(name, linear)].grad
        if g is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        worst = max(worst, (hf_row_order(ours, name, p.grad) - g).abs().max().item())
    assert worst <= 1e-7, worst


def _qwen3_5_moe_mtp():
    from tests.torch.st.qwen3_5_jobs import tiny_config

    return tiny_config(mtp_num_hidden_layers=1, router_aux_loss_coef=0.01)


def _glm_image_moe():
    from hyper_parallel.models.glm_image_moe_v2.config_registry import glm_image_moe_debug

    return dataclasses.replace(glm_image_moe_debug().model, router_aux_loss_coef=0.01)


def _qwen3_vl_moe():
    from hyper_parallel.models.qwen3_vl_moe_v2.config_registry import qwen3_vl_moe_debug

    return qwen3_vl_moe_debug().model


FAMILIES = {"qwen3_5_moe_mtp": _qwen3_5_moe_mtp, "glm_image_moe": _glm_image_moe, "qwen3_vl_moe": _qwen3_vl_moe}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_padding_leaves_every_family_aux_loss_unchanged(family):
    """The same two documents, unpadded and padded to 32 tokens: with the collate's ``token_mask`` every family's
    aux loss (the MTP layer's included) is the unpadded one; without it the padding would change it."""
    torch.manual_seed(0)
    model = FAMILIES[family]().build()
    model.init_weights()
    rng, high = np.random.default_rng(0), min(model.config.vocab_size, 500)  # text tokens only (no image ids)
    docs = [TokenDocument(key=f"d{i}", shard="s", input_ids=(ids := rng.integers(1, high, n)), labels=ids.copy())
            for i, n in enumerate((9, 14))]  # fmt: skip
    mtp = getattr(model, "mtp", None) is not None

    def aux(batch: dict, *, masked: bool = True) -> float:
        batch = add_mtp_targets(batch) if mtp else batch
        kw = {k: batch[k] for k in ("position_ids", "cu_seqlens", "cu_seqlens_host", "max_seqlen")}
        if masked:
            kw["token_mask"] = batch["token_mask"]
        if mtp:
            kw["mtp_input_ids"] = batch["mtp_input_ids"]
        with torch.no_grad():
            return model(batch["input_ids"], **kw).aux_loss.item()

    whole, padded = collate_packed(docs), collate_packed(docs, pad_to_multiple_of=32)
    assert whole["token_mask"].all() and whole["input_ids"].shape == (1, 23)
    assert padded["token_mask"].tolist() == [[True] * 23 + [False] * 9]
    want = aux(whole)
    assert abs(aux(padded) - want) <= 1e-7 * want, (aux(padded), want)
    assert abs(aux(padded, masked=False) - want) > 1e-4 * want  # the padding rows would count
