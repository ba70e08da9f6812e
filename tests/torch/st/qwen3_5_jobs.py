"""Jobs of the Qwen3.5-MoE layout tests (gloo workers, see ``harness.py``): a tiny hybrid model (3 Gated
DeltaNet + 1 gated-attention layer, an MoE with a gated shared expert in every layer) trained a few steps
under several parallel layouts in ONE launch, and the same steps in one process for reference.

Every layout reads the same global batches: ``GLOBAL_ROWS`` packed rows of ``SEQ`` tokens of text
documents per step (the DeltaNet state and conv window restart at each document). A data-parallel rank
takes its slice of rows, a context-parallel rank a chunk of every row; its loss is ``sum of its token CE /
global token count`` and gradients are summed over ranks, so every layout computes the single process's global token mean. The Switch aux loss is off
(``router_aux_loss_coef = 0``): it is a per-rank statistic (pooled over the rank's tokens), so a
data-parallel layout changes it by design.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.components.loss import CrossEntropyLoss
from hyper_parallel.config import ActivationCheckpointConfig, CompileConfig, TrainingConfig
from hyper_parallel.distributed.context_parallel import split_batch_for_cp
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.utils import clip_grad_norm_
from hyper_parallel.models.qwen3_5_moe_v2.model import Qwen3_5MoeModel, qwen3_5_moe_config
from hyper_parallel.models.qwen3_5_moe_v2.parallelize import parallelize_qwen3_5_moe
from hyper_parallel.models.qwen3_5_v2.model import Qwen3_5Model, qwen3_5_config
from hyper_parallel.models.qwen3_5_v2.parallelize import parallelize_qwen3_5
from hyper_parallel.protocols.model import split_output
from tests.torch.st.glm_jobs import Layout
from tests.torch.st.grad_check import whole_grads

VOCAB = 64
GLOBAL_ROWS, SEQ = 8, 16
SEED, LR, MAX_NORM = 1234, 0.3, 0.5


def tiny_config(**overrides: Any) -> Qwen3_5MoeModel.Config:
    """4 layers (DeltaNet x3, gated attention), Hk 2 / Hv 4, 8 experts top-2 + a gated shared expert."""
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, rope_theta=1e4, partial_rotary_factor=0.5, mrope_section=(1, 1, 0),
    )  # fmt: skip
    kwargs.update(overrides)
    return qwen3_5_moe_config(**kwargs)


def tiny_dense_config() -> Qwen3_5Model.Config:
    """The dense family: the same mixers (DeltaNet x3, gated attention), a SwiGLU MLP in every layer; Hk 4 /
    Hv 8 and 8 q / 4 kv heads, so TP 2 x CP 2 splits every mixer's heads twice."""
    return qwen3_5_config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
        linear_value_head_dim=4, intermediate_size=48, rope_theta=1e4, partial_rotary_factor=0.5,
        mrope_section=(1, 1, 0),
    )  # fmt: skip


def build_model(family: str = "moe") -> Qwen3_5MoeModel | Qwen3_5Model:
    """The same initial weights on every rank and in the reference (seeded CPU init); ``family`` is
    ``moe`` (``qwen3_5_moe``) or ``dense`` (``qwen3_5``)."""
    torch.manual_seed(SEED)
    model = (tiny_config() if family == "moe" else tiny_dense_config()).build()
    model.init_weights()
    return model


def _row(rng: random.Random) -> dict[str, list[int]]:
    """One packed row of SEQ tokens: documents of 3-10 tokens that count up from a random start (learnable)."""
    ids, labels, pos, starts = [], [], [], []
    while len(ids) < SEQ:
        room = SEQ - len(ids)
        n = room if room < 4 else rng.randint(3, min(room, 10))
        first = rng.randrange(VOCAB)
        doc = [(first + j) % VOCAB for j in range(n)]
        starts.append(len(ids))
        ids += doc
        pos += list(range(n))
        labels += doc[1:] + [-100]
    return {"ids": ids, "labels": labels, "pos": pos, "starts": starts}


def global_rows(step: int) -> list[dict[str, list[int]]]:
    rng = random.Random(1000 + step)
    return [_row(rng) for _ in range(GLOBAL_ROWS)]


def micro_batch(rows: list[dict[str, list[int]]]) -> dict[str, Any]:
    """The batch contract for ``rows`` (``[len(rows), SEQ]``, cu_seqlens over the flattened stream)."""
    starts = [b * SEQ + s for b, r in enumerate(rows) for s in r["starts"]]
    cu = torch.tensor(starts + [len(rows) * SEQ], dtype=torch.int32)
    return {
        "input_ids": torch.tensor([r["ids"] for r in rows]),
        "labels": torch.tensor([r["labels"] for r in rows]),
        "position_ids": torch.tensor([r["pos"] for r in rows]),
        "cu_seqlens": cu,
        "max_seqlen": int((cu[1:] - cu[:-1]).max()),
    }


def global_token_count(step: int) -> int:
    return sum(sum(1 for t in r["labels"] if t != -100) for r in global_rows(step))


def _train(model, steps: int, pd: ParallelDims | None) -> dict[str, list[float]]:
    loss_fn = CrossEntropyLoss.Config().build()
    params = [p for p in model.parameters() if p.requires_grad]
    # SGD with momentum: a wrong gradient scale or clip shows in the loss (Adam would normalise it away).
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=False)
    dp, dp_rank = (pd.dp, pd.mesh_coordinate("dp")) if pd else (1, 0)
    cp, cp_rank = (pd.cp, pd.mesh_coordinate("cp")) if pd else (1, 0)
    losses, norms, first_grads = [], [], {}
    for step in range(steps):
        rows = global_rows(step)
        per = len(rows) // dp
        # a context-parallel rank takes a chunk of every row; cu_seqlens stay global
        mb = split_batch_for_cp(micro_batch(rows[dp_rank * per : (dp_rank + 1) * per]), cp_rank, cp)
        opt.zero_grad()
        with CrossEntropyLoss.parallel_context(enabled=pd is not None and pd.loss_parallel_enabled):
            out = model(
                mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"],
                max_seqlen=mb["max_seqlen"],
            )  # fmt: skip
            logits, aux = split_output(out)
            assert aux is None  # router_aux_loss_coef = 0 (see the module docstring)
            loss = loss_fn(logits, mb["labels"], num_tokens=global_token_count(step))
            loss.backward()
        if step == 0:
            first_grads = whole_grads(model)
        total = loss.detach().clone()
        if pd is not None and pd.dp * pd.cp > 1:
            dist.all_reduce(total, group=pd.mesh("dp_cp").get_group())
        norms.append(clip_grad_norm_(params, MAX_NORM).item())
        opt.step()
        losses.append(total.item())
    return {"losses": losses, "grad_norms": norms, "first_grads": first_grads}


def reference_job(steps: int, family: str = "moe") -> dict[str, list[float]]:
    """The single-process run every layout is compared with (no parallelize at all)."""
    torch.use_deterministic_algorithms(True)
    return _train(build_model(family), steps, None)


def layouts_job(layouts: list[Layout], steps: int, family: str = "moe") -> dict[str, dict[str, Any]]:
    """Train ``steps`` under each of ``layouts`` (all of this launch's world size) in turn; rank 0's
    losses, grad norms, first-step gradients and per-layer mixer call counts (2 per step for a recomputed
    layer) by layout."""
    torch.use_deterministic_algorithms(True)
    out: dict[str, dict[str, Any]] = {}
    for layout in layouts:
        assert layout.world == dist.get_world_size(), layout
        model = build_model(family)
        pd = ParallelDims.from_config(layout.parallelism(), dist.get_world_size())
        pd.build_mesh("cpu")
        (parallelize_qwen3_5_moe if family == "moe" else parallelize_qwen3_5)(
            model,
            parallel_dims=pd,
            training=TrainingConfig(mixed_precision_param=layout.param_dtype),
            parallelism=layout.parallelism(),
            ac_config=ActivationCheckpointConfig(mode=layout.ac, selective_every_n_layers=2),
            compile_config=CompileConfig(),
        )
        calls = [0] * len(model.layers)
        for i, layer in enumerate(model.layers):

            def count(*_: Any, i: int = i) -> None:
                calls[i] += 1

            layer.self_attn.register_forward_pre_hook(count)
        result = _train(model, steps, pd)
        result["mixer_calls"] = calls
        result["parallel_dims"] = str(pd)
        out[str(layout)] = result
    return out
