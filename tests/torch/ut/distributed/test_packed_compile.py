"""torch.compile + activation checkpointing over packed micro-batches whose document boundaries change
every step: recompiles stay bounded and compiled == eager.

The decoder layers of a debug-size GlmImageMoe (one dense, one MoE layer) are compiled per layer and
checkpointed, as ``parallelize`` does (FSDP is left out: one process). Two warm-up steps (the second
makes ``cu_seqlens`` dynamic: one recompile), then steps with other document counts, one document per
row, and new lengths must compile nothing new (``torch._dynamo`` frame counter).

The backend is ``aot_eager``: recompiles are decided by dynamo's guards, and AOTAutograd + checkpoint
still run; inductor's C++ compilation of these graphs takes 1-2 minutes on 2 shared cores. Set
``HP_TEST_INDUCTOR=1`` to run the bf16 case with inductor too.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch._dynamo.utils import counters

from hyper_parallel.config.training import ActivationCheckpointConfig, CompileConfig
from hyper_parallel.distributed.activation_checkpoint import apply_activation_checkpointing
from hyper_parallel.distributed.compile import apply_compile
from hyper_parallel.models.common.attention import AttentionMeta
from hyper_parallel.models.glm_image_moe_v2.model import glm_image_moe_config

B, T = 2, 64
# documents per row (each row sums to T); the first two steps are warm-up
STEPS = [
    [[40, 24], [64]],
    [[20, 20, 24], [30, 34]],
    [[10, 10, 10, 10, 24], [7, 57]],
    [[64], [64]],  # one document per row
    [[1, 63], [16, 16, 16, 16]],
    [[33, 31], [5, 9, 11, 13, 26]],
]
WARMUP = 2


def _layers(dtype: torch.dtype) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    model = glm_image_moe_config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=2,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        codebook_size=256, vq_embed_dim=32, placeholder_token_id=511, mlp_layer_types=["dense", "sparse"],
    ).build()  # fmt: skip
    model.init_weights()
    return model.layers.to(dtype)


def _step(layers, docs, dtype):
    lengths = [n for row in docs for n in row]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    meta = AttentionMeta(cu_seqlens=cu, max_seqlen=max(lengths), cu_seqlens_host=cu.tolist())
    pos = meta.position_ids(B, T)
    h = torch.randn(B, T, 64, generator=torch.Generator().manual_seed(len(lengths)), dtype=dtype)
    h.requires_grad_()
    out = h
    for layer in layers:
        out = layer(out, position_ids=pos, meta=meta)
    loss = out.float().pow(2).mean()
    loss.backward()
    grads = [p.grad.detach().clone() for p in layers.parameters() if p.grad is not None]
    layers.zero_grad(set_to_none=True)
    return loss.detach(), h.grad, grads


BACKENDS = [
    pytest.param("aot_eager", torch.float32, id="aot_eager-fp32"),  # MoE runs the per-expert loop: graph breaks
    pytest.param("aot_eager", torch.bfloat16, id="aot_eager-bf16"),  # MoE runs grouped_mm inside the graph
    pytest.param(
        "inductor", torch.bfloat16, id="inductor-bf16",
        marks=[
            pytest.mark.slow,
            pytest.mark.skipif(os.environ.get("HP_TEST_INDUCTOR") != "1", reason="set HP_TEST_INDUCTOR=1 (slow)"),
        ],
    ),
]  # fmt: skip


@pytest.mark.parametrize("backend,dtype", BACKENDS)
def test_changing_document_boundaries_do_not_recompile(backend, dtype):
    eager = _layers(dtype)
    compiled = copy.deepcopy(eager)
    apply_activation_checkpointing(compiled, ActivationCheckpointConfig(mode="full"))
    apply_compile(compiled, CompileConfig(enable=True, backend=backend))
    torch._dynamo.reset()
    counters.clear()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    frames = []
    try:
        for docs in STEPS:
            loss, h_grad, grads = _step(compiled, docs, dtype)
            frames.append(counters["frames"]["total"])
            loss_ref, h_grad_ref, grads_ref = _step(eager, docs, dtype)
            assert abs(loss.item() - loss_ref.item()) <= tol * max(1.0, abs(loss_ref.item()))
            assert (h_grad.float() - h_grad_ref.float()).abs().max().item() <= tol
            assert len(grads) == len(grads_ref)
            assert max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, grads_ref)) <= tol
    finally:
        torch._dynamo.reset()
    assert frames[0] > 0, "nothing was compiled"
    # after warm-up, new boundaries (other counts, one document per row, other lengths) compile nothing
    assert frames[WARMUP - 1:] == [frames[WARMUP - 1]] * (len(STEPS) - WARMUP + 1), frames
