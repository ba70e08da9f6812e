"""Jobs the system tests run on gloo workers (see ``harness.py``): a tiny GlmImageMoe with images,
trained a few steps under one parallel layout, and the same steps in one process for reference.

Every layout reads the same global batches: ``GLOBAL_ROWS`` packed rows of ``SEQ`` tokens per step.
A data-parallel rank takes its slice of rows; a context-parallel rank then takes its chunk of every
row. The loss of a rank is ``sum of its token CE / global token count``; gradients are summed over
ranks, so every layout computes the same global token mean as the single process.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_parallel.components.loss import CrossEntropyLoss
from hyper_parallel.config import ActivationCheckpointConfig, CompileConfig, ParallelismConfig, TrainingConfig
from hyper_parallel.distributed.context_parallel import split_batch_for_cp
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.utils import clip_grad_norm_
from hyper_parallel.models.glm_image_moe_v2.model import GlmImageMoeModel, glm_image_moe_config
from hyper_parallel.models.glm_image_moe_v2.parallelize import parallelize_glm_image_moe
from tests.torch.st.grad_check import whole_grads

VOCAB, CODEBOOK, PLACEHOLDER = 64, 32, 63
GLOBAL_ROWS, SEQ = 8, 16
SEED, LR, MAX_NORM = 1234, 0.3, 0.5


def tiny_config(**overrides: Any) -> GlmImageMoeModel.Config:
    """3 layers (dense, MoE, MoE), MLA with q-LoRA, 8 experts top-2 + a shared expert, 32-code VQ."""
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, codebook_size=CODEBOOK, vq_embed_dim=8,
        placeholder_token_id=PLACEHOLDER, routed_scaling_factor=1.8,
    )  # fmt: skip
    kwargs.update(overrides)
    return glm_image_moe_config(**kwargs)


def build_model(**overrides: Any) -> GlmImageMoeModel:
    """The same initial weights on every rank and in the reference (seeded CPU init)."""
    torch.manual_seed(SEED)
    model = tiny_config(**overrides).build()
    model.init_weights()
    with torch.no_grad():  # a non-zero correction bias exercises the biased selection
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(7)) * 0.01)
    return model


def _row(rng: random.Random) -> dict[str, list[int]]:
    """One packed row of SEQ tokens: documents of 3-10 tokens, most with an image span of placeholders."""
    ids, labels, pos, codes, doc_starts = [], [], [], [], []
    while len(ids) < SEQ:
        room = SEQ - len(ids)
        n = room if room < 4 else rng.randint(3, min(room, 10))
        # Learnable: text counts up from a random start, image codes count up from a random code.
        first = rng.randrange(VOCAB - 1)
        doc = [(first + j) % (VOCAB - 1) for j in range(n)]
        doc_codes: list[int | None] = [None] * n
        if n >= 5 and rng.random() < 0.7:
            start, length, code = rng.randint(1, n - 3), rng.randint(2, 3), rng.randrange(CODEBOOK)
            for j in range(start, min(start + length, n)):
                doc[j], doc_codes[j] = PLACEHOLDER, (code + j - start) % CODEBOOK
        doc_starts.append(len(ids))
        for j in range(n):
            ids.append(doc[j])
            pos.append(j)
            if doc_codes[j] is not None:
                codes.append(doc_codes[j])
            if j + 1 < n:
                nxt = doc[j + 1]
                labels.append(doc_codes[j + 1] + VOCAB if nxt == PLACEHOLDER else nxt)
            else:
                labels.append(-100)
    return {"ids": ids, "labels": labels, "pos": pos, "codes": codes, "starts": doc_starts}


def global_rows(step: int) -> list[dict[str, list[int]]]:
    rng = random.Random(1000 + step)
    return [_row(rng) for _ in range(GLOBAL_ROWS)]


def micro_batch(rows: list[dict[str, list[int]]]) -> dict[str, Any]:
    """The batch contract for ``rows`` (``[len(rows), SEQ]``, cu_seqlens over the flattened stream)."""
    ids = torch.tensor([r["ids"] for r in rows])
    cu = [b * SEQ + s for b, r in enumerate(rows) for s in r["starts"]] + [len(rows) * SEQ]
    flat = ids.reshape(-1)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    return {
        "input_ids": ids,
        "labels": torch.tensor([r["labels"] for r in rows]),
        "position_ids": torch.tensor([r["pos"] for r in rows]),
        "cu_seqlens": cu_t,
        "max_seqlen": int((cu_t[1:] - cu_t[:-1]).max()),
        "visual_indices": (flat == PLACEHOLDER).nonzero().squeeze(-1),
        "vq_codes": torch.tensor([c for r in rows for c in r["codes"]], dtype=torch.long),
    }


def global_token_count(step: int) -> int:
    return sum(sum(1 for t in r["labels"] if t != -100) for r in global_rows(step))


@dataclasses.dataclass
class Layout:
    """One parallel layout of the tests."""

    world: int
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    sp: bool = True
    loss_parallel: bool = True
    ac: str = "none"
    param_dtype: str = "float32"

    def __str__(self) -> str:
        degrees = (("rep", self.dp_replicate), ("cp", self.cp), ("tp", self.tp), ("ep", self.ep))
        parts = [f"{k}{v}" for k, v in degrees if v > 1]
        parts += [] if self.sp or self.tp == 1 else ["noSP"]
        parts += [] if self.loss_parallel or self.tp == 1 else ["noLP"]
        parts += [] if self.ac == "none" else [f"ac_{self.ac}"]
        parts += [] if self.param_dtype == "float32" else [self.param_dtype]
        return f"w{self.world}" + ("-" + "-".join(parts) if parts else "-fsdp")

    def parallelism(self) -> ParallelismConfig:
        return ParallelismConfig(
            data_parallel_replicate_degree=self.dp_replicate,
            data_parallel_shard_degree=self.dp_shard,
            context_parallel_degree=self.cp,
            tensor_parallel_degree=self.tp,
            expert_parallel_degree=self.ep,
            enable_sequence_parallel=self.sp,
            enable_loss_parallel=self.loss_parallel,
        )


def forward_loss(model, mb: dict[str, Any], num_tokens: int, loss_fn: CrossEntropyLoss) -> torch.Tensor:
    logits = model(
        mb["input_ids"],
        position_ids=mb["position_ids"],
        cu_seqlens=mb["cu_seqlens"],
        max_seqlen=mb["max_seqlen"],
        visual_indices=mb["visual_indices"],
        vq_codes=mb["vq_codes"],
    )
    return loss_fn(logits, mb["labels"], num_tokens=num_tokens)


def make_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum: the update is proportional to the (clipped) gradient, so a wrong gradient
    scale or a wrong clip shows in the loss (Adam would normalise either away)."""
    return torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=False)


def _train(model, steps: int, pd: ParallelDims | None, *, start: int = 0, opt=None):
    """Steps ``start .. start+steps-1`` of the shared schedule; returns (losses/grad norms, optimizer)."""
    loss_fn = CrossEntropyLoss.Config().build()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = opt or make_optimizer(params)
    dp, dp_rank = (pd.dp, pd.mesh_coordinate("dp")) if pd else (1, 0)
    cp, cp_rank = (pd.cp, pd.mesh_coordinate("cp")) if pd else (1, 0)
    loss_parallel = pd is not None and pd.loss_parallel_enabled
    losses, norms, first_grads = [], [], {}
    for step in range(start, start + steps):
        rows = global_rows(step)
        per = len(rows) // dp
        mb = split_batch_for_cp(
            micro_batch(rows[dp_rank * per : (dp_rank + 1) * per]), cp_rank, cp,
            split_inputs=GlmImageMoeModel.split_inputs_for_cp, model_keys=GlmImageMoeModel.input_keys,
        )  # fmt: skip
        opt.zero_grad()
        with CrossEntropyLoss.parallel_context(loss_parallel):
            loss = forward_loss(model, mb, global_token_count(step), loss_fn)
            loss.backward()
        if step == start:
            first_grads = whole_grads(model)
        total = loss.detach().clone()
        if pd is not None and pd.dp * pd.cp > 1:
            dist.all_reduce(total, group=pd.mesh("dp_cp").get_group())
        norm = clip_grad_norm_(params, MAX_NORM)
        opt.step()
        losses.append(total.item())
        norms.append(norm.item())
    return {"losses": losses, "grad_norms": norms, "first_grads": first_grads}, opt


def reference_job(steps: int) -> dict[str, list[float]]:
    """The single-process run every layout is compared with (no parallelize at all)."""
    torch.use_deterministic_algorithms(True)
    return _train(build_model(), steps, None)[0]


def parallelize(model, layout: Layout) -> ParallelDims:
    pd = ParallelDims.from_config(layout.parallelism(), dist.get_world_size())
    pd.build_mesh("cpu")
    parallelize_glm_image_moe(
        model,
        parallel_dims=pd,
        training=TrainingConfig(mixed_precision_param=layout.param_dtype),
        parallelism=layout.parallelism(),
        ac_config=ActivationCheckpointConfig(mode=layout.ac, selective_every_n_layers=2),
        compile_config=CompileConfig(),
    )
    return pd


def layout_job(layout: Layout, steps: int) -> dict[str, Any]:
    """Train ``steps`` under ``layout``; rank 0 reports losses, grad norms and the codebook checks."""
    torch.use_deterministic_algorithms(True)
    model = build_model()
    codebook0 = model.vq_codebook.weight.detach().clone()
    proj0 = model.vq_to_llm_proj.weight.detach().clone()
    pd = parallelize(model, layout)
    attention_calls = [0] * len(model.layers)  # recomputation under AC calls the attention again in backward
    for i, layer in enumerate(model.layers):

        def count(*_: Any, i: int = i) -> None:
            attention_calls[i] += 1

        layer.self_attn.register_forward_pre_hook(count)
    out, _ = _train(model, steps, pd)
    out["attention_calls"] = attention_calls
    # The frozen codebook: a plain tensor, unchanged, bit-identical on every rank; the projection trained.
    cb = model.vq_codebook.weight
    gathered = [torch.empty_like(cb) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, cb.detach().contiguous())
    proj = model.vq_to_llm_proj.weight
    proj_full = proj.full_tensor() if isinstance(proj, DTensor) else proj.detach()
    out.update(
        codebook_is_plain=not isinstance(cb, DTensor),
        codebook_grad_is_none=cb.grad is None,
        codebook_identical=all(torch.equal(g, gathered[0]) for g in gathered),
        codebook_unchanged=torch.equal(cb.detach(), codebook0),
        proj_changed=(proj_full - proj0).abs().max().item(),
    )
    return out


def dcp_save_job(layout: Layout, steps: int, checkpoint_dir: str) -> dict[str, Any]:
    """Train ``steps`` under ``layout`` and save model + optimizer with DCP (sharded, per-rank files)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    torch.use_deterministic_algorithms(True)
    model = build_model()
    pd = parallelize(model, layout)
    out, opt = _train(model, steps, pd)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=checkpoint_dir)
    return out


def dcp_load_job(layout: Layout, start: int, steps: int, checkpoint_dir: str) -> dict[str, Any]:
    """Build on the meta device (the trainer's path), load the DCP checkpoint under ``layout``, train on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    torch.use_deterministic_algorithms(True)
    with torch.device("meta"):
        model = tiny_config().build()
    pd = parallelize(model, layout)
    model.to_empty(device="cpu")
    with torch.no_grad():  # non-persistent state is not in a checkpoint: RoPE tables, load counters
        for module in model.modules():
            if type(module).__name__ == "RoPE":
                module.init_own_weights()
            if hasattr(module, "tokens_per_expert"):
                module.tokens_per_expert.zero_()
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    out, _ = _train(model, steps, pd, start=start, opt=opt)
    return out


def trainer_job(parallelism: dict[str, Any], steps: int, dump_folder: str, data_path: str) -> dict[str, Any]:
    """The debug recipe through the real Trainer (meta init, DirectToken shards at ``data_path``)."""
    from hyper_parallel.models.glm_image_moe_v2.config_registry import glm_image_moe_debug
    from hyper_parallel.trainer import Trainer

    cfg = glm_image_moe_debug()
    cfg.training.steps = steps
    cfg.parallelism = ParallelismConfig(**parallelism)
    cfg.data.path = data_path
    cfg.data.max_tokens_per_microbatch = 256
    cfg.data.global_batch_tokens = 0  # one packed micro-batch per data-parallel rank and step
    # Sequence parallel splits every (context-parallel) chunk over tp ranks: pad to a multiple of cp x tp.
    cfg.data.pad_to_multiple_of = parallelism.get("context_parallel_degree", 1) * parallelism.get(
        "tensor_parallel_degree", 1
    )
    cfg.checkpoint.enable = False
    cfg.checkpoint.export_hf = False
    cfg.metrics.log_freq = 1
    cfg.metrics.plot_loss = False
    cfg.dump_folder = dump_folder
    trainer = Trainer(cfg)
    summary = trainer.train()
    cb = trainer.model.vq_codebook.weight
    gathered = [torch.empty_like(cb) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, cb.detach().contiguous())
    summary.update(
        codebook_is_plain=not isinstance(cb, DTensor),
        codebook_identical=all(torch.equal(g, gathered[0]) for g in gathered),
        parallel_dims=str(trainer.parallel_dims),
    )
    trainer.close()  # its meshes' groups; the pool's default group stays (the trainer did not create it)
    return summary
