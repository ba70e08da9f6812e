"""Jobs of the context-parallel-beyond-the-heads tests (gloo workers, see ``harness.py``).

A tiny Qwen3.5-MoE (3 Gated DeltaNet + 1 gated attention layer) whose heads are fewer than the CP degree,
so attention gathers K/V and DeltaNet passes its recurrent state (``context_parallel.apply_context_parallel``),
on packed rows whose documents straddle every piece boundary (one document crosses a whole row) or start exactly
on one. One forward/backward per layout; each rank returns its logits placed at their global positions and every
parameter gradient, whole. The single-process run is the reference. ``slow`` runs use a slow DeltaNet decay
(``SLOW_DECAY``), so the state a piece hands on through a document that crosses it whole (``M S_in``) is not ~0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_parallel.components.loss import CrossEntropyLoss
from hyper_parallel.config import ActivationCheckpointConfig, CompileConfig, TrainingConfig
from hyper_parallel.distributed.context_parallel import all_gather_cp, split_batch_for_cp
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.models.common.attention import CPShard
from hyper_parallel.models.common.gated_deltanet import GatedDeltaNet
from hyper_parallel.models.qwen3_5_moe_v2.model import qwen3_5_moe_config
from hyper_parallel.models.qwen3_5_moe_v2.parallelize import parallelize_qwen3_5_moe
from hyper_parallel.protocols.model import split_output
from tests.torch.st.glm_jobs import Layout
from tests.torch.st.grad_check import whole_grads

VOCAB, SEQ, SEED = 64, 64, 4321
# Document lengths of the two rows (sum SEQ each): short documents, a 1-token one, documents that cross
# pieces of every CP degree up to 8 (balanced: 16 pieces of 4 tokens), documents that start exactly on a piece
# boundary of every degree (16 and 48; the pieces on either side belong to different ranks); row 1 is one document.
DOCS = ([16, 5, 1, 26, 9, 7], [64])
# Per-step DeltaNet decay exp(-exp(A_log) softplus(a + dt_bias)) ~ 0.998 (the HF init's is ~e^-10): the state
# survives a whole row, so a piece's incoming state through a document crossing it whole really matters.
SLOW_DECAY = {"A_log": -4.0, "dt_bias": -2.0}


def tiny_config(n_kv_heads: int = 1, chunk_size: int = 8):
    """4 layers; 2 query heads and ``n_kv_heads`` K/V heads, DeltaNet Hk 2 / Hv 4, 4 experts top-2. DeltaNet
    chunks of 8 tokens, so a piece holds several chunks and a document several pieces."""
    cfg = qwen3_5_moe_config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=n_kv_heads,
        head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, rope_theta=1e4, partial_rotary_factor=0.5, mrope_section=(1, 1, 0),
    )  # fmt: skip
    for layer in cfg.layers:
        if isinstance(layer.self_attn, GatedDeltaNet.Config):
            layer.self_attn.delta_rule.chunk_size = chunk_size
    return cfg


def batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, VOCAB, (len(DOCS), SEQ), generator=g)
    pos, starts = [], []
    for b, lengths in enumerate(DOCS):
        assert sum(lengths) == SEQ
        row, at = [], 0
        for n in lengths:
            starts.append(b * SEQ + at)
            row += list(range(n))
            at += n
        pos.append(row)
    cu = torch.tensor(starts + [len(DOCS) * SEQ], dtype=torch.int32)
    labels = ids.roll(-1, 1)
    labels[torch.tensor(pos).roll(-1, 1) == 0] = -100  # no target across a document end
    return {
        "input_ids": ids, "labels": labels, "position_ids": torch.tensor(pos), "cu_seqlens": cu,
        "max_seqlen": int((cu[1:] - cu[:-1]).max()), "cu_seqlens_host": cu.tolist(),
    }  # fmt: skip


def _step(model, mb: dict[str, Any], num_tokens: int, loss_parallel: bool) -> torch.Tensor:
    loss_fn = CrossEntropyLoss.Config().build()
    with CrossEntropyLoss.parallel_context(enabled=loss_parallel):
        out = model(
            mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"],
            max_seqlen=mb["max_seqlen"], cu_seqlens_host=mb["cu_seqlens_host"],
        )  # fmt: skip
        logits, _ = split_output(out)
        loss_fn(logits, mb["labels"], num_tokens=num_tokens).backward()
    return logits


def _model(n_kv_heads: int, chunk_size: int = 8, *, slow: bool = False):
    torch.manual_seed(SEED)
    model = tiny_config(n_kv_heads, chunk_size).build()
    model.init_weights()
    if slow:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, GatedDeltaNet):
                    for name, value in SLOW_DECAY.items():
                        getattr(module, name).fill_(value)
    return model


def reference_job(n_kv_heads: int = 1, slow: bool = False) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    model = _model(n_kv_heads, slow=slow)
    mb = batch()
    logits = _step(model, mb, int((mb["labels"] != -100).sum()), False)
    return {"logits": logits.detach(), "grads": whole_grads(model)}


def layouts_job(
    layouts: list[Layout], n_kv_heads: int = 1, mutated: tuple[Layout, ...] = (), slow: tuple[Layout, ...] = ()
) -> dict[str, Any]:
    """Each layout in turn, then each of ``mutated`` (keyed ``"mutated " + layout``: the incoming DeltaNet state of
    every piece dropped), then each of ``slow`` with the slow decay (``"slow " + layout``) and again without the
    state passed through whole pieces (``"slow mutated " + layout``: ``M S_in`` dropped): logits at global
    positions (gathered over dp x cp) and every whole gradient."""
    torch.use_deterministic_algorithms(True)
    out = {}
    runs = [(x, "", None) for x in layouts] + [(x, "mutated ", "all") for x in mutated]
    runs += [(x, p, drop) for x in slow for p, drop in (("slow ", None), ("slow mutated ", "transition"))]
    for layout, prefix, drop in runs:
        model = _model(n_kv_heads, slow=prefix.startswith("slow"))
        pd = ParallelDims.from_config(layout.parallelism(), dist.get_world_size())
        pd.build_mesh("cpu")
        parallelize_qwen3_5_moe(
            model, parallel_dims=pd, training=TrainingConfig(), parallelism=layout.parallelism(),
            ac_config=ActivationCheckpointConfig(mode=layout.ac), compile_config=CompileConfig(),
        )  # fmt: skip
        shard: CPShard = model.cp_shard
        if drop is not None:
            _drop_state_passing(model, drop)
        full = batch()
        num_tokens = int((full["labels"] != -100).sum())
        dp, dp_rank = pd.dp, pd.mesh_coordinate("dp") if pd.dp > 1 else 0
        per = len(DOCS) // dp
        rows = slice(dp_rank * per, (dp_rank + 1) * per)
        first, last = dp_rank * per * SEQ, (dp_rank + 1) * per * SEQ
        cu = [s - first for s in full["cu_seqlens_host"] if first <= s <= last]
        mine = {k: full[k][rows] for k in ("input_ids", "labels", "position_ids")}
        mine |= {"cu_seqlens": torch.tensor(cu, dtype=torch.int32), "cu_seqlens_host": cu,
                 "max_seqlen": full["max_seqlen"]}  # fmt: skip
        mb = split_batch_for_cp(mine, shard.rank, shard.size, balanced=shard.balanced)
        logits = _step(model, mb, num_tokens, pd.loss_parallel_enabled).detach()
        if isinstance(logits, DTensor):  # loss parallel: vocab-sharded
            logits = logits.full_tensor()
        # place this rank's tokens at their global positions, then sum over the dp x cp ranks
        placed = torch.zeros(len(DOCS), SEQ, logits.shape[-1])
        idx = torch.cat([torch.arange(lo, hi) for lo, hi in shard.ranges(SEQ // shard.size)])
        placed[rows, idx] = logits
        if pd.tp_enabled:  # every tp rank holds the same logits: count them once
            placed /= pd.tp
        dist.all_reduce(placed)
        key = prefix + str(layout)
        out[key] = {"logits": placed, "grads": whole_grads(model), "balanced": shard.balanced,
                    "forms": sorted(set(model.cp_plan.values()))}  # fmt: skip
    return out


def _drop_state_passing(model, part: str = "all") -> None:
    """The mutation: every piece's DeltaNet rule restarts from a zero state (``part="all"``: the cross-piece
    composition is skipped), or gets only the previous piece's zero-start state (``"transition"``: the term
    ``M S_in`` of a piece one document crosses whole is dropped), by handing the core a shard whose gather zeroes
    those parts of the summaries ``[S_zero | M]``."""
    for module in model.modules():
        if getattr(module, "cp_state_passing", False):

            def zero_states(m, args, kwargs):
                shard = kwargs["cp"]
                group = shard.all_gather.keywords["group"]

                def gather(x, dv=m.head_v_dim):
                    g = all_gather_cp(x, group)
                    # summaries are [np, B, Hv, Dk, Dv + Dk] (6-D once gathered); conv tails are 5-D
                    if g.dim() != 6:
                        return g
                    return g * 0 if part == "all" else torch.cat([g[..., :dv], g[..., dv:] * 0], dim=-1)

                return args, {**kwargs, "cp": CPShard(rank=shard.rank, size=shard.size, balanced=shard.balanced,
                                                      all_gather=gather)}  # fmt: skip

            module.register_forward_pre_hook(zero_states, with_kwargs=True)
