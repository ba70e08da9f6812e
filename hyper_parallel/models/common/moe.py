"""Mixture of experts: ``Router`` (top-k gate), ``GroupedExperts`` (SwiGLU experts) and ``MoE``.

Shape suffixes: B batch, T tokens (B*seq flattened), D model dim, E experts, F expert hidden dim,
K experts per token (top-k), S = T*K routed slots, G expert groups, R LoRA rank, A adapter stacks (E, or 1
with ``share_experts``), I / O input / output features of one projection.

Numerics follow HF Glm4MoeLite (``Glm4MoeLiteMoE``): fp32 router; sigmoid scores; the correction
bias only steers the selection; group-limited top-k; weights are the un-biased scores, optionally
normalised, times ``route_scale``; the K expert outputs are summed in fp32; the shared expert is
added unweighted on the same input.

Qwen3.5-MoE (``Qwen3_5MoeSparseMoeBlock``) is the same block with ``score_func="softmax"`` (top-k of the
probabilities, always renormalised), no correction bias, and a shared expert scaled by
``sigmoid(shared_expert_gate(x))``. ``router_aux_loss_coef > 0`` adds the Switch load-balancing loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.flops import matmul_flops
from hyper_parallel.models.common.grouped_mm import GroupedMMImpl, grouped_linear
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.lora import LoRA, init_lora_A_
from hyper_parallel.models.common.token_dispatcher import LocalTokenDispatcher, count_tokens_per_expert
from hyper_parallel.protocols.module import Module
from hyper_parallel.protocols.param_init import NormalInit, ParamInit
from hyper_parallel.protocols.sharding import local_shard

__all__ = ["GroupedExperts", "LoadBalanceStats", "MoE", "Router", "load_balancing_loss"]


class Router(Module):
    """Token-choice top-k gate: ``weight [E, D]`` (no bias) plus the ``e_score_correction_bias [E]`` buffer.

    ``forward(x_TD) -> (topk_idx_TK int64, topk_w_TK fp32)``.

    The gate runs in fp32 whatever the activation dtype. With ``keep_fp32`` (default), casting the
    model (``.to(torch.bfloat16)``, ``.half()``) leaves ``weight`` and the bias in fp32 and only moves
    them between devices, like HF's ``_keep_in_fp32_modules_strict``. FSDP2 mixed precision casts
    parameters on its own, outside this hook: shard the router with an fp32 ``param_dtype`` to keep it
    exact there.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        top_k: int
        """Experts per token (HF ``num_experts_per_tok``)."""
        score_func: Literal["sigmoid", "softmax"] = "sigmoid"
        """Score of each expert from its logit: sigmoid (DeepSeek-V3, GLM) or softmax over experts."""
        n_group: int = 1
        """Expert groups for group-limited routing (HF ``n_group``); 1 disables it."""
        topk_group: int = 1
        """Groups a token may route to (HF ``topk_group``). A group's score is the sum of its top-2
        biased scores (sigmoid) or its best score (softmax)."""
        norm_topk_prob: bool = True
        """Normalise the K weights of a token to sum to 1 (before ``route_scale``)."""
        route_scale: float = 1.0
        """Multiplies the routing weights (HF ``routed_scaling_factor``)."""
        use_bias_correction: bool = True
        """Keep the fp32 ``e_score_correction_bias`` buffer, added to the scores for expert selection
        only (DeepSeek-V3 aux-loss-free balancing; HF Glm4MoeLite always has it)."""
        keep_fp32: bool = True
        """Keep ``weight`` and the bias fp32 when the model is cast to another dtype."""
        param_init: ParamInit.Config | None = field(default_factory=NormalInit.Config)
        """Initialiser of ``weight`` (HF: normal(0, 0.02)); the bias starts at 0."""

    def __init__(self, config: Config, *, dim: int, num_experts: int) -> None:
        super().__init__(config)
        _validate_router(config, num_experts)
        self.dim, self.num_experts = dim, num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, dim, dtype=torch.float32))
        if config.use_bias_correction:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(topk_idx_TK, topk_w_TK, scores_TE)``: the choice, its fp32 weights and every expert's fp32 score.

        Always called as ``gate(x)``, never through a helper method: FSDP's unshard and the declared
        input placements are module hooks that only run on ``__call__``.
        """
        cfg = self.config
        logits_TE = F.linear(x_TD.float(), self.weight.float())
        scores_TE = logits_TE.sigmoid() if cfg.score_func == "sigmoid" else logits_TE.softmax(dim=-1)
        choice_TE = scores_TE
        if self.e_score_correction_bias is not None:
            choice_TE = scores_TE + self.e_score_correction_bias.float()
        if cfg.topk_group < cfg.n_group:
            choice_TE = self._mask_groups(choice_TE)
        topk_idx_TK = torch.topk(choice_TE, k=cfg.top_k, dim=-1, sorted=False).indices
        # Gradients reach the gate only through the weights: the selection is discrete.
        topk_w_TK = scores_TE.gather(1, topk_idx_TK)
        if cfg.norm_topk_prob:
            topk_w_TK = topk_w_TK / (topk_w_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx_TK, topk_w_TK * cfg.route_scale, scores_TE

    def _mask_groups(self, choice_TE: torch.Tensor) -> torch.Tensor:
        """Keep the ``topk_group`` best groups of each token; other experts get -inf (as HF)."""
        cfg = self.config
        num_tokens, group_size = choice_TE.shape[0], self.num_experts // cfg.n_group
        choice_TGE = choice_TE.view(num_tokens, cfg.n_group, group_size)
        if cfg.score_func == "sigmoid":
            group_score_TG = choice_TGE.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_score_TG = choice_TGE.amax(dim=-1)
        group_idx = torch.topk(group_score_TG, k=cfg.topk_group, dim=-1, sorted=False).indices
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, group_idx, True)
        keep_TE = keep_TG.unsqueeze(-1).expand(-1, -1, group_size).reshape(num_tokens, self.num_experts)
        return choice_TE.masked_fill(~keep_TE, float("-inf"))

    @torch.no_grad()
    def init_own_weights(self) -> None:
        super().init_own_weights()
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Router:
        if not self.config.keep_fp32:
            return super()._apply(fn, recurse)

        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if t.dtype == torch.float32 and out.dtype != torch.float32:
                return t.to(device=out.device)  # take the device move only, never round the values
            return out

        return super()._apply(keep_fp32, recurse)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"dim={self.dim}, num_experts={self.num_experts}, top_k={c.top_k}, score_func={c.score_func}, "
            f"n_group={c.n_group}, topk_group={c.topk_group}, route_scale={c.route_scale}"
        )


def _validate_router(config: Router.Config, num_experts: int) -> None:
    def fail(msg: str) -> None:
        raise ValueError(f"Router.Config: {msg}")

    if num_experts < 1:
        fail(f"num_experts={num_experts} must be >= 1")
    if config.n_group < 1 or num_experts % config.n_group:
        fail(f"n_group={config.n_group} must be >= 1 and divide num_experts={num_experts}")
    if not 1 <= config.topk_group <= config.n_group:
        fail(f"topk_group={config.topk_group} must be in [1, n_group={config.n_group}]")
    group_size = num_experts // config.n_group
    if config.score_func == "sigmoid" and config.topk_group < config.n_group and group_size < 2:
        fail(
            f"group-limited sigmoid routing scores a group by its top-2 experts: num_experts/n_group = "
            f"{num_experts}/{config.n_group} must be >= 2 (lower n_group)"
        )
    reachable = config.topk_group * group_size
    if not 1 <= config.top_k <= reachable:
        fail(
            f"top_k={config.top_k} must be in [1, topk_group * num_experts / n_group = {reachable}] "
            "(the experts of the selected groups)"
        )
    if config.score_func not in ("sigmoid", "softmax"):
        fail(f"score_func={config.score_func!r} must be 'sigmoid' or 'softmax'")


@dataclass(frozen=True, slots=True)
class LoadBalanceStats:
    """Router statistics of MoE forwards, pooled over layers the way HF ``load_balancing_loss_func`` does.

    HF concatenates every layer's router logits and computes ONE Switch loss
    ``E * sum_e f_e * P_e`` over all ``layers x tokens`` rows, which is not the sum of per-layer losses.
    So each MoE stores these sums, ``+`` pools them across layers and :meth:`loss` takes the product once.

    HF pools the whole batch's rows (the micro-batch here). When the layout splits those rows over ranks
    (context parallel's pieces, tensor parallel's sequence shards), ``pool`` sums the statistics over them
    before the product (``distributed/token_split.py``), so every layout computes the one-process loss.

    Padding rows are left out when a token mask is given (HF's masked branch, ``attention_mask``): each row's
    routed slots and probabilities are weighted by its mask and ``rows`` counts the masked-in rows only. Layouts
    pad rows differently (context parallel to ``2 x cp``), so only then is the loss the same on every layout.
    """

    tokens_E: torch.Tensor
    """fp32 ``[E]``: routed (top-k) slots per expert, summed over rows (the choice: no gradient)."""
    probs_E: torch.Tensor
    """fp32 ``[E]``: routing probability per expert, summed over rows (the router's gradient flows here)."""
    rows: int | torch.Tensor
    """Rows (token x layer) summed in: an int, or with a token mask the fp32 0-dim count of the rows it keeps
    (a tensor: no device->host sync)."""
    coef: float
    """``router_aux_loss_coef`` the loss is multiplied by."""
    pool: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Differentiable sum over the ranks that split the forward's rows (set by the parallelize path through
    ``MoE.set_token_split``); None: this rank holds them all."""

    @classmethod
    def from_router(
        cls,
        scores_TE: torch.Tensor,
        topk_idx_TK: torch.Tensor,
        *,
        coef: float,
        pool: Callable[[torch.Tensor], torch.Tensor] | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> LoadBalanceStats:
        """One layer's sums: ``scores_TE`` normalised to 1 per token (the softmax itself for softmax routers).

        ``token_mask`` (bool or 0/1, ``T`` entries): only the rows it keeps count, as HF ``load_balancing_loss_func``
        with an ``attention_mask`` (slots and probabilities weighted by the mask, rows = its sum).
        """
        num_tokens, num_experts = scores_TE.shape
        probs_TE = (scores_TE / scores_TE.sum(dim=-1, keepdim=True)).float()
        if token_mask is None:
            tokens_E = count_tokens_per_expert(topk_idx_TK, num_experts).to(torch.float32)
            return cls(tokens_E=tokens_E, probs_E=probs_TE.sum(dim=0), rows=num_tokens, coef=coef, pool=pool)
        w_T = _token_weights(token_mask, num_tokens)
        # 0/1 weights: the fp32 counts stay exact integers whatever the summation order
        w_S = w_T.repeat_interleave(topk_idx_TK.shape[-1])
        tokens_E = probs_TE.new_zeros(num_experts).scatter_add_(0, topk_idx_TK.reshape(-1), w_S)
        probs_E = (probs_TE * w_T.unsqueeze(-1)).sum(dim=0)
        return cls(tokens_E=tokens_E, probs_E=probs_E, rows=w_T.sum(), coef=coef, pool=pool)

    def __add__(self, other: LoadBalanceStats) -> LoadBalanceStats:
        if not isinstance(other, LoadBalanceStats):
            return NotImplemented
        if other.tokens_E.shape != self.tokens_E.shape or other.coef != self.coef or other.pool is not self.pool:
            raise ValueError(
                "load-balancing statistics pool over layers only with equal num_experts, router_aux_loss_coef and "
                f"rank pool (got E={self.tokens_E.numel()}/{other.tokens_E.numel()}, coef={self.coef}/{other.coef}, "
                f"pool={self.pool}/{other.pool})"
            )
        return LoadBalanceStats(
            tokens_E=self.tokens_E + other.tokens_E,
            probs_E=self.probs_E + other.probs_E,
            rows=self.rows + other.rows,
            coef=self.coef,
            pool=self.pool,
        )

    def loss(self) -> torch.Tensor:
        """``coef * E * sum_e (tokens_e / rows) * (probs_e / rows)``: a 0-dim fp32 tensor.

        With a ``pool`` the three sums are first summed over its ranks (one collective, every rank of the pool
        must call it): the loss is then the one-process loss, the same on each of them.
        """
        num_experts = self.tokens_E.numel()
        tokens_E, probs_E, rows = self.tokens_E, self.probs_E, self.rows
        if self.pool is not None:
            # Counts and rows need no gradient; the probability sums' gradient flows back to every rank's own.
            rows_1 = rows.reshape(1).to(probs_E) if torch.is_tensor(rows) else probs_E.new_full((1,), float(rows))
            pooled = self.pool(torch.cat([tokens_E, probs_E, rows_1]))
            tokens_E, probs_E, rows = pooled[:num_experts], pooled[num_experts:-1], pooled[-1]
        return self.coef * num_experts * ((tokens_E / rows) * (probs_E / rows)).sum()


def _token_weights(token_mask: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """fp32 ``[T]`` 0/1 weights of a token mask over ``num_tokens`` routed rows (any shape with that many entries)."""
    if token_mask.numel() != num_tokens:
        raise ValueError(
            f"token_mask has {token_mask.numel()} entries ({tuple(token_mask.shape)}) but the MoE routes {num_tokens} "
            "tokens: pass the mask of exactly the MoE's input tokens (under tensor parallel the MoE's sharding_config "
            "cuts it to the rank's sequence shard like the input)"
        )
    return token_mask.reshape(-1).to(torch.float32)


def load_balancing_loss(scores_TE: torch.Tensor, topk_idx_TK: torch.Tensor) -> torch.Tensor:
    """Switch load-balancing loss ``E * sum_e f_e * P_e`` of ONE layer (HF ``load_balancing_loss_func``
    given one layer's logits).

    ``f_e`` = routed slots of expert e per token (the choice, no gradient), ``P_e`` = mean routing
    probability of e (scores normalised to sum 1 per token: the softmax itself for a softmax router).
    A perfectly balanced router scores ``top_k``. A whole model pools layers: :class:`LoadBalanceStats`.
    """
    return LoadBalanceStats.from_router(scores_TE, topk_idx_TK, coef=1.0).loss()


class GroupedExperts(Module):
    """E SwiGLU experts, ``gate_up_proj [E, 2F, D]`` (rows ``[gate F | up F]``) and ``down_proj [E, D, F]``.

    ``forward(x_SD, num_tokens_per_expert_E) -> y_SD`` on rows already sorted by expert, one grouped
    matmul per projection. Under expert parallel the parameters are DTensors sharded on dim 0 and the
    forward runs on the local experts (``num_tokens_per_expert_E`` then counts local experts).

    With ``lora`` (``models/common/lora.py``) each fused weight gets an adapter stack: ``gate_up_proj_lora_A
    [A, R, D]``, ``gate_up_proj_lora_B [A, 2F, R]``, ``down_proj_lora_A [A, R, F]``, ``down_proj_lora_B [A, D, R]``,
    ``A = E`` (one adapter per expert, sharded with the experts under EP) or 1 (``share_experts``). Each adds
    ``scale * (x A_e^T) B_e^T`` through the same grouped matmul as the base (a stack of 1: a plain matmul over
    every row); gate and up share one ``A`` over the fused weight. No dropout (PEFT allows none here).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        hidden_dim: int
        """Hidden size F of each expert (HF ``moe_intermediate_size``)."""
        grouped_mm_impl: GroupedMMImpl = "auto"
        """Grouped matmul: 'grouped_mm' (torch kernel), 'loop' (one mm per expert) or 'auto' (the kernel
        when dtype/device/alignment allow it)."""
        param_init: ParamInit.Config | None = field(default_factory=NormalInit.Config)
        """Initialiser of ``gate_up_proj`` and ``down_proj`` (HF: normal(0, 0.02))."""
        lora: LoRA.Config | None = None
        """LoRA adapters on both fused weights (set by ``apply_lora`` from ``--lora.*``); None: none."""

    def __init__(self, config: Config, *, dim: int, num_experts: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(config)
        self.dim, self.num_experts = dim, num_experts
        hidden = config.hidden_dim
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden, dtype=dtype))
        lora = config.lora
        if lora is not None:
            if lora.dropout:
                raise ValueError(
                    f"GroupedExperts.Config.lora.dropout={lora.dropout}: the routed experts' adapters take no "
                    "dropout (PEFT refuses it on target_parameters); set it to 0 for the experts"
                )
            stacks, rank = 1 if lora.share_experts else num_experts, lora.rank
            self.gate_up_proj_lora_A = nn.Parameter(torch.empty(stacks, rank, dim, dtype=dtype))
            self.gate_up_proj_lora_B = nn.Parameter(torch.empty(stacks, 2 * hidden, rank, dtype=dtype))
            self.down_proj_lora_A = nn.Parameter(torch.empty(stacks, rank, hidden, dtype=dtype))
            self.down_proj_lora_B = nn.Parameter(torch.empty(stacks, dim, rank, dtype=dtype))

    def forward(self, x_SD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        impl = self.config.grouped_mm_impl
        # expert parallel shards experts on dim 0: compute on this rank's experts
        w_gate_up_E2FD, w_down_EDF = local_shard(self.gate_up_proj), local_shard(self.down_proj)
        # HF casts the input to the expert dtype (autocast does not cover grouped_mm).
        x_SD = x_SD.to(w_gate_up_E2FD.dtype)
        h_S2F = grouped_linear(x_SD, w_gate_up_E2FD, num_tokens_per_expert_E, impl)
        if self.config.lora is not None:
            h_S2F = h_S2F + self._lora(x_SD, "gate_up_proj", num_tokens_per_expert_E)
        gate_SF, up_SF = h_S2F.chunk(2, dim=-1)
        act_SF = F.silu(gate_SF) * up_SF
        y_SD = grouped_linear(act_SF, w_down_EDF, num_tokens_per_expert_E, impl)
        if self.config.lora is not None:
            y_SD = y_SD + self._lora(act_SF, "down_proj", num_tokens_per_expert_E)
        return y_SD

    def _lora(self, x_SI: torch.Tensor, weight: str, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """``scale * (x A_e^T) B_e^T`` of ``weight``'s adapter stack, each row with its expert's pair (``[S, O]``)."""
        lora, impl = self.config.lora, self.config.grouped_mm_impl
        a_ARI = local_shard(getattr(self, f"{weight}_lora_A"))
        b_AOR = local_shard(getattr(self, f"{weight}_lora_B"))
        if lora.share_experts:  # one pair for every expert: plain matmuls over all rows
            t_SR = F.linear(x_SI, a_ARI[0])
            return lora.scale * F.linear(t_SR, b_AOR[0])
        t_SR = grouped_linear(x_SI, a_ARI, num_tokens_per_expert_E, impl)
        return lora.scale * grouped_linear(t_SR, b_AOR, num_tokens_per_expert_E, impl)

    @torch.no_grad()
    def init_own_weights(self) -> None:
        # The base first (param_init on both fused weights), then the adapters as PEFT: A kaiming-uniform, B 0.
        init = self.config.param_init.build() if self.config.param_init is not None else None
        if init is not None:
            init(self.gate_up_proj)
            init(self.down_proj)
        if self.config.lora is not None:
            for weight in ("gate_up_proj", "down_proj"):
                init_lora_A_(getattr(self, f"{weight}_lora_A"))
                getattr(self, f"{weight}_lora_B").zero_()

    def extra_repr(self) -> str:
        out = f"num_experts={self.num_experts}, dim={self.dim}, hidden_dim={self.config.hidden_dim}"
        lora = self.config.lora
        if lora is not None:
            out += f", lora_rank={lora.rank}, lora_scale={lora.scale:g}, lora_share_experts={lora.share_experts}"
        return out


class MoE(Module):
    """Routed experts plus optional shared experts: ``out = sum_k w_k * expert_k(x) + s(x) * shared(x)``.

    ``s(x) = sigmoid(shared_expert_gate(x))`` when the gate is configured (Qwen3.5), else 1 (GLM).
    Children: ``gate`` (Router), ``experts`` (GroupedExperts), ``shared_experts`` (FeedForward or None),
    ``shared_expert_gate`` (Linear ``[1, D]`` or None), and ``dispatcher`` (a plain object;
    expert-parallel code replaces it). The non-persistent int64 buffer ``tokens_per_expert [E]``
    accumulates the routed counts of every forward, for load metrics and ``update_bias_correction``;
    read it with ``pop_tokens_per_expert``. With ``router_aux_loss_coef > 0`` every forward stores its
    router statistics in ``aux_loss`` (a :class:`LoadBalanceStats`; the block pops it and the decoder
    pools all layers into one loss, as HF does). When the layout splits a forward's rows over ranks, the
    parallelize path calls ``set_token_split(pool)`` and the statistics are summed over them before the
    product (``LoadBalanceStats.pool``). ``forward(x, token_mask=)``: positions where the mask is False (the
    batch's padding run) are routed like any token but count neither in the aux-loss statistics nor in
    ``tokens_per_expert``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        num_experts: int
        """Routed experts E (HF ``n_routed_experts``); the gate and the experts get it at build."""
        gate: Router.Config
        """Router (HF ``mlp.gate``)."""
        experts: GroupedExperts.Config
        """Routed experts (HF ``mlp.experts``)."""
        shared_experts: FeedForward.Config | None = None
        """Always-on expert (HF Glm ``mlp.shared_experts``, hidden ``moe_intermediate_size * n_shared_experts``;
        Qwen3.5 ``mlp.shared_expert``); None for none."""
        shared_expert_gate: Linear.Config | None = None
        """Scalar gate ``[1, D]`` of the shared expert, applied as ``sigmoid`` (HF Qwen3.5
        ``mlp.shared_expert_gate``); None adds the shared expert unweighted."""
        router_aux_loss_coef: float = 0.0
        """Weight of the Switch load-balancing loss stored in ``aux_loss`` each forward (HF
        ``router_aux_loss_coef``, used when ``output_router_logits``); 0 computes none."""

    def __init__(self, config: Config, *, dim: int) -> None:
        super().__init__(config)
        num_experts = config.num_experts
        self.gate = config.gate.build(dim=dim, num_experts=num_experts)
        self.experts = config.experts.build(dim=dim, num_experts=num_experts)
        self.shared_experts = config.shared_experts.build(dim=dim) if config.shared_experts is not None else None
        if config.shared_expert_gate is not None:
            if config.shared_experts is None:
                raise ValueError("MoE.Config.shared_expert_gate needs shared_experts (set both or neither)")
            self.shared_expert_gate = config.shared_expert_gate.build(in_features=dim, out_features=1)
        else:
            self.shared_expert_gate = None
        self.aux_loss: LoadBalanceStats | None = None
        self.token_split: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.dispatcher = LocalTokenDispatcher(num_experts)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def flops(self, tokens: int) -> float:
        """Training FLOPs of the matmuls over ``tokens`` tokens (``models/common/flops.py``): router, shared expert
        (and its gate) for every token, the routed experts at ``top_k / num_experts`` (dropless: every token, the
        padding included, visits exactly ``top_k`` of them)."""
        routed = matmul_flops(self.experts, tokens)
        return matmul_flops(self, tokens) - routed * (1.0 - self.config.gate.top_k / self.config.num_experts)

    def forward(self, x: torch.Tensor, *, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., D]`` -> ``[..., D]``; ``token_mask`` (bool, ``x.shape[:-1]``): False where a position is padding,
        left out of the router statistics (the routing itself is the same)."""
        x_TD = x.reshape(-1, x.shape[-1])
        topk_idx_TK, topk_w_TK, scores_TE = self.gate(x_TD)
        if self.config.router_aux_loss_coef > 0:
            # Sums, not a loss: HF pools the router statistics of all layers before the product.
            self.aux_loss = LoadBalanceStats.from_router(
                scores_TE, topk_idx_TK, coef=self.config.router_aux_loss_coef, pool=self.token_split,
                token_mask=token_mask,
            )  # fmt: skip
        self._record_load(topk_idx_TK, token_mask)
        x_SD, num_tokens_per_expert_E, state = self.dispatcher.dispatch(x_TD, topk_idx_TK, topk_w_TK)
        y_SD = self.experts(x_SD, num_tokens_per_expert_E)
        out_TD = self.dispatcher.combine(y_SD, state)
        if self.shared_experts is not None:
            shared_TD = self.shared_experts(x_TD)
            if self.shared_expert_gate is not None:
                shared_TD = shared_TD * torch.sigmoid(self.shared_expert_gate(x_TD))
            out_TD = out_TD + shared_TD
        return out_TD.view(x.shape)

    def set_token_split(self, pool: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Sum the aux-loss statistics with ``pool`` (a differentiable sum over the ranks that split each forward's
        rows: context parallel, tensor parallel's sequence shards) before the product; the parallelize path
        calls it (``distributed/token_split.py``)."""
        self.token_split = pool

    @torch.no_grad()
    def _record_load(self, topk_idx_TK: torch.Tensor, token_mask: torch.Tensor | None = None) -> None:
        # Activation checkpointing re-runs this forward inside backward (a graph task is then
        # running): count each token once. The check is a graph break under torch.compile, so
        # compiled code always counts; with AC every token is then counted exactly twice, which
        # leaves load fractions and the sign-based bias update unchanged.
        if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:
            num_experts = self.config.num_experts
            if token_mask is None:
                self.tokens_per_expert += count_tokens_per_expert(topk_idx_TK, num_experts)
                return
            keep_S = _token_weights(token_mask, topk_idx_TK.shape[0]).to(torch.int64)
            keep_S = keep_S.repeat_interleave(topk_idx_TK.shape[-1])
            self.tokens_per_expert.scatter_add_(0, topk_idx_TK.reshape(-1), keep_S)

    @torch.no_grad()
    def pop_tokens_per_expert(self) -> torch.Tensor:
        """The routed counts since the last call (int64 ``[E]``, this rank only), and reset them to 0."""
        counts = self.tokens_per_expert.clone()
        self.tokens_per_expert.zero_()
        return counts

    @torch.no_grad()
    def update_bias_correction(self, tokens_per_expert: torch.Tensor, rate: float) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): ``bias += rate * sign(mean_load - load)``.

        Under-loaded experts become more likely to be chosen. Pass counts summed over the data-parallel
        ranks so every rank applies the same update.
        """
        bias = self.gate.e_score_correction_bias
        if bias is None:
            raise ValueError("update_bias_correction needs the gate's `use_bias_correction=True`")
        load = tokens_per_expert.to(device=bias.device, dtype=torch.float32)
        bias.add_(torch.sign(load.mean() - load), alpha=rate)

    @torch.no_grad()
    def init_own_weights(self) -> None:
        super().init_own_weights()
        self.tokens_per_expert.zero_()
