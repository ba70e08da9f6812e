"""The MTP layer's router aux loss is not scaled by the MTP loss weight: it adds ``coef x`` its Switch loss
(transformers' ``load_balancing_loss_func`` is the oracle), whatever ``mtp.loss_weight`` is.
"""

from __future__ import annotations

import pytest
import torch


COEF = 0.01


def _moe_with_mtp(loss_weight: float):
    from tests.torch.st.qwen3_5_jobs import tiny_config

    torch.manual_seed(0)
    model = tiny_config(mtp_num_hidden_layers=1, mtp_loss_weight=loss_weight, router_aux_loss_coef=COEF).build()
    model.init_weights()
    return model


@pytest.mark.parametrize("loss_weight", [0.1, 0.5])
def test_mtp_router_aux_loss_has_the_full_coefficient(loss_weight):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    from hyper_parallel.data.packing import add_mtp_targets

    model = _moe_with_mtp(loss_weight)
    gate = model.mtp.layers[0].mlp.gate
    seen = []
    handle = gate.register_forward_hook(lambda mod, args, out: seen.append(out[2].detach()))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=g)
    batch = add_mtp_targets(
        {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(24)[None],
         "cu_seqlens": torch.tensor([0, 10, 24], dtype=torch.int32), "max_seqlen": 14}  # fmt: skip
    )
    kw = dict(position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"])
    with torch.no_grad():
        trunk = model(ids, **kw).aux_loss  # without MTP inputs: the trunk's aux loss only
        assert not seen
        both = model(ids, **kw, mtp_input_ids=batch["mtp_input_ids"]).aux_loss
    handle.remove()
    (scores_TE,) = seen
    # HF's Switch loss of that one layer (its softmax of log(p) is p: our router's own probabilities)
    switch = load_balancing_loss_func((scores_TE.log(),), num_experts=scores_TE.shape[-1], top_k=gate.config.top_k)
    assert switch > 0
    torch.testing.assert_close(both - trunk, COEF * switch, rtol=1e-5, atol=1e-9)
