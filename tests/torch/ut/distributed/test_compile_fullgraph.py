"""Every family's blocks compile to ONE graph (``fullgraph=True``) under activation checkpointing, equal eager,
and do not recompile when the packing changes (DESIGN section 12, issue 43 "blocks that compile whole").

One tiny block per family/mixer (MLA + MoE, gated attention + MoE, Gated DeltaNet, the VL vision block), taken
from the family's debug recipe, is prepared as ``parallelize_decoder`` does (activation checkpointing, then
``apply_compile``; FSDP is left out: one process; the CLI test and the system test cover it):

- ``selective`` (every 2nd layer, MLA + MoE): of two copies the first runs under ``torch.utils.checkpoint``,
  the second does not, so both compiled forwards are checked; the other blocks run ``full`` (one copy);
- three packings (other token counts, document counts, image grids): the compiled frames after the first
  must not grow (``dynamic=True`` and host metadata as CPU tensors, not Python lists);
- loss, the input gradient, every parameter gradient, the MoE router statistics (a side effect of the
  checkpointed forward) and its expert counts equal the eager, un-checkpointed copy (``aot_eager``; MoE blocks
  in bf16, whose grouped_mm is the only expert kernel inside a graph, the others fp32).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch._dynamo.utils import counters

from hyper_parallel.config.training import ActivationCheckpointConfig, CompileConfig
from hyper_parallel.distributed.activation_checkpoint import apply_activation_checkpointing, is_checkpointed
from hyper_parallel.distributed.compile import apply_compile
from hyper_parallel.models.common.attention import AttentionMeta
from hyper_parallel.models.common.block import combine_aux_losses
from tests.torch.st.launch import run, train_command

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
B = 2
PACKINGS = [  # documents per row (each row sums to T); T changes too
    [[9, 15], [24]],
    [[5, 5, 22], [16, 16]],
    [[40], [1, 13, 26]],
]
GRIDS = [  # vision: (t, h, w) patch grids per forward (multiples of the 2x2 merge)
    [(1, 4, 6)],  # 24 patches: not the head dim (16), which dynamo would pin as the same symbol
    [(1, 2, 6), (1, 4, 2)],
    [(2, 2, 4)],
]


def _recipe_model(recipe: Callable):
    torch.manual_seed(0)
    model = recipe().model.build()
    model.init_weights()
    return model


def _decoder_block(recipe: Callable, mixer: str, mlp: str) -> torch.nn.Module:
    model = _recipe_model(recipe)
    for layer in model.layers:
        if (type(layer.self_attn).__name__, type(layer.mlp).__name__) == (mixer, mlp):
            return layer
    raise AssertionError(f"{recipe.__name__} has no {mixer} + {mlp} layer")


# MoE blocks in bf16: under torch.compile grouped_mm takes bf16 only, and fp32 experts run a per-expert loop
# outside the graph (``grouped_mm.py``); the acceptance runs are bf16
def _glm():
    from hyper_parallel.models.glm_image_moe_v2.config_registry import glm_image_moe_debug

    return _decoder_block(glm_image_moe_debug, "MLAttention", "MoE").to(torch.bfloat16)


def _qwen_attention():
    from hyper_parallel.models.qwen3_5_moe_v2.config_registry import qwen3_5_moe_debug

    return _decoder_block(qwen3_5_moe_debug, "GatedAttention", "MoE").to(torch.bfloat16)


def _qwen_deltanet():
    from hyper_parallel.models.qwen3_5_v2.config_registry import qwen3_5_debug

    return _decoder_block(qwen3_5_debug, "GatedDeltaNet", "FeedForward")


def _prepare(stack: torch.nn.ModuleList, mode: str) -> None:
    apply_activation_checkpointing(stack, ActivationCheckpointConfig(mode=mode, selective_every_n_layers=2))
    apply_compile(stack, CompileConfig(enable=True, backend="aot_eager", fullgraph=True))


def _decoder_step(stack: torch.nn.ModuleList, docs: list[list[int]]) -> dict:
    T = sum(docs[0])
    lengths = [n for row in docs for n in row]
    host = torch.tensor([0, *lengths]).cumsum(0).tolist()
    meta = AttentionMeta(cu_seqlens=torch.tensor(host, dtype=torch.int32), max_seqlen=max(lengths), cu_seqlens_host=host)
    w = stack[0].input_layernorm.weight
    h = torch.randn(B, T, w.shape[0], generator=torch.Generator().manual_seed(T)).to(w.dtype).requires_grad_()
    out, auxes = h, []
    for layer in stack:
        out = layer(out, position_ids=meta.position_ids(B, T), meta=meta)
        auxes.append(layer.pop_aux_loss())
    aux = combine_aux_losses(auxes)
    loss = out.float().pow(2).mean() + (aux if aux is not None else 0.0)
    loss.backward()
    counts = [m.pop_tokens_per_expert() for m in stack.modules() if hasattr(m, "pop_tokens_per_expert")]
    return _result(stack, loss, h.grad, aux, counts)


def _vision_step(tower: torch.nn.Module, grids: list[tuple[int, int, int]]) -> dict:
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, tower.patch_dim, generator=torch.Generator().manual_seed(n)).requires_grad_()
    merged, deepstack = tower(pixels, grids)
    loss = merged.pow(2).mean() + sum(d.pow(2).mean() for d in deepstack)
    loss.backward()
    return _result(tower, loss, pixels.grad, None, [])


def _result(module, loss, input_grad, aux, counts) -> dict:
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    aux = None if aux is None else aux.detach()
    return {"loss": loss.detach(), "input_grad": input_grad, "aux": aux, "counts": counts, "grads": grads}


def _assert_equal(got: dict, ref: dict) -> None:
    tol = TOL[ref["input_grad"].dtype]
    assert abs(got["loss"].item() - ref["loss"].item()) <= tol * max(1.0, abs(ref["loss"].item()))
    assert (got["input_grad"].float() - ref["input_grad"].float()).abs().max().item() <= tol
    assert (got["aux"] is None) == (ref["aux"] is None)
    if ref["aux"] is not None:  # the checkpointed forward's side effect reached the decoder
        assert abs(got["aux"].item() - ref["aux"].item()) <= tol
    for a, b in zip(got["counts"], ref["counts"], strict=True):  # each token counted once, as eager
        assert torch.equal(a, b), (a, b)
    # parameter names: the compiled copies keep the eager FQNs (checkpointing swaps classes, adds no module)
    assert got["grads"].keys() == ref["grads"].keys()
    worst = max((got["grads"][k].float() - ref["grads"][k].float()).abs().max().item() for k in ref["grads"])
    assert worst <= tol, worst


def _check(stack: torch.nn.Module, blocks: torch.nn.ModuleList, mode: str, step: Callable, inputs: list) -> None:
    eager = copy.deepcopy(stack)
    torch._dynamo.reset()
    counters.clear()
    _prepare(blocks, mode)
    assert [is_checkpointed(b) for b in blocks] == ([True, False] if mode == "selective" else [True])
    frames = []
    try:
        for x in inputs:
            got = step(stack, x)
            frames.append(counters["stats"]["unique_graphs"])
            _assert_equal(got, step(eager, x))
    finally:
        torch._dynamo.reset()
    # one frame per compiled forward (checkpointed and plain under selective), none for a new packing
    assert frames == [1 if mode == "full" else 2] * len(inputs), frames
    assert not counters["graph_break"], dict(counters["graph_break"])


DECODER_BLOCKS = [  # selective once (both compiled forwards); full elsewhere (one graph: the suite's time)
    pytest.param(_glm, "selective", id="mla_moe-selective"),
    pytest.param(_qwen_attention, "full", id="gated_attention_moe-full"),
    pytest.param(_qwen_deltanet, "full", id="deltanet-full"),
]


def _stack(block: torch.nn.Module, mode: str) -> torch.nn.ModuleList:
    """Two copies under selective (checkpointed + plain), one under full."""
    return torch.nn.ModuleList([block, copy.deepcopy(block)] if mode == "selective" else [block])


@pytest.mark.parametrize("block,mode", DECODER_BLOCKS)
def test_decoder_block_compiles_whole(block, mode):
    stack = _stack(block(), mode)
    _check(stack, stack, mode, _decoder_step, PACKINGS)


def test_vision_block_compiles_whole():
    from hyper_parallel.models.qwen3_vl_moe_v2.config_registry import qwen3_vl_moe_debug

    tower = _recipe_model(qwen3_vl_moe_debug).visual
    tower.blocks = _stack(tower.blocks[0], "full")  # the deepstack taps of later blocks go with them
    _check(tower, tower.blocks, "full", _vision_step, GRIDS)


def test_cli_fullgraph_bf16_fsdp(tmp_path, monkeypatch):
    """The acceptance command, shortened: bf16 FSDP (one rank), full AC, fullgraph ``aot_eager``, 2 steps."""
    args = ["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--training.mixed_precision_param",
            "bfloat16", "--activation_checkpoint.mode", "full", "--compile.enable", "--compile.backend", "aot_eager",
            "--compile.fullgraph", "--training.steps", "2", "--metrics.log_freq", "1", "--checkpoint.no_enable",
            "--checkpoint.no_export_hf", "--dump_folder", str(tmp_path)]  # fmt: skip
    monkeypatch.setenv("TORCH_LOGS", "recompiles")
    log = run(train_command(args, nproc=1), timeout=600)
    # dense and MoE blocks: one compile each; a new packing in step 2 recompiles nothing
    assert log.count("Recompiling function") <= 1, log[-4000:]
