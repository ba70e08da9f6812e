"""``Decoder``: a decoder-only LM (HF ``Glm4MoeLiteModel`` + ``lm_head``) built from ``TransformerBlock``s.

The forward is split into overridable steps so a subclass replaces only what differs (GlmImageMoe
replaces ``embed`` with the text + VQ-image embedding):

    logits = head(forward_layers(embed(input_ids), position_ids=..., cu_seqlens=..., max_seqlen=...))

Each layer's token mixer owns its RoPE (if any); packed documents (``cu_seqlens`` over the flattened
``B*T`` stream) never attend to each other. When a layer's MLP has an auxiliary loss (MoE load
balancing), ``forward`` returns ``ModelOutput(logits, aux_loss)``: per-layer losses summed, MoE router
statistics pooled over all layers first (as HF). Each layer's is read right after its forward, so
recomputation under activation checkpointing cannot count it twice.

Tied embeddings (``tie_word_embeddings``, HF's flag of the same name): ``lm_head.weight`` IS
``embed_tokens.weight``, one ``nn.Parameter`` registered under both names, so the optimizer, FSDP (the
embedding and the head form one FSDP unit), tensor parallel (both are ``Shard(0)`` over the vocabulary)
and DCP see a single tensor. The table is initialised once, by the embedding (its padding row stays zero).

Model-level options (``Config.rope_theta``, ``rms_norm_eps``, ``router_aux_loss_coef``, ``use_mtp``,
``mtp_loss_weight``, ``freeze``; None = as the layer tree says): one field each, pushed into every layer it
reaches when the Config is constructed (on copies of the child configs), so the CLI flag, the run-file key and
``dataclasses.replace`` give the same tree; ``option_values()`` reads them back. The per-layer tree itself is
off the command line (``OFF_CLI``); run files still reach it.

Pipeline parallel (``restrict_to_stage``, ``forward_stage``): a stage is this same model with only its layers
(``layers.{i}`` keep their numbers, so checkpoints and HF files map as without pipeline parallel) and, on the first
stage, the input side (every child but the layers and the output side: embeddings, a VQ path, a vision tower), on
the last the output side (final norm, LM head, MTP block). Between stages travel the hidden states, the MTP
block's input embeddings (made on stage 0 from the embedding table) and the running MoE router statistics, so
the last stage computes exactly the model's loss terms.

Multi-token prediction (``Config.mtp``, off by default; ``models/common/mtp.py``): given
``mtp_input_ids`` (the next token of every position, per document, from the data side), ``forward``
also runs the MTP block on the final-normed hidden states and the shared ``lm_head`` and returns
``ModelOutput(logits, aux_loss, mtp_logits)``. Without ``mtp_input_ids`` the model computes exactly
what it computes without an MTP block.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, ClassVar

import torch
import tyro

from hyper_parallel.config.errors import ConfigError
from hyper_parallel.models.common.attention import AttentionMeta
from hyper_parallel.models.common.block import TransformerBlock, combine_aux_losses
from hyper_parallel.models.common.embedding import Embedding
from hyper_parallel.models.common.flops import document_lengths, matmul_flops
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.moe import LoadBalanceStats, MoE
from hyper_parallel.models.common.mtp import MTP
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.models.common.rope import RoPE
from hyper_parallel.protocols.model import BaseModel, ModelOutput
from hyper_parallel.protocols.module import Module, ModuleList, _init_child, unwrapped_name
from hyper_parallel.protocols.param_init import ParamInit
from hyper_parallel.protocols.pipeline_stage import StageCosts, StageSpan

__all__ = ["MODEL_OPTIONS", "OFF_CLI", "Decoder"]

MODEL_OPTIONS = ("rope_theta", "rms_norm_eps", "router_aux_loss_coef", "use_mtp", "mtp_loss_weight", "freeze")
"""The model-level option fields of ``Decoder.Config`` (one CLI flag each; None = as the layer tree says)."""

_TEXT_TREE = ("embed_tokens", "layers", "norm", "lm_head", "mtp")
"""The Decoder's own sub-configs: the options reach these (not a subclass's vision tower or VQ codebook)."""


def _not_from_cli(args: list[str]) -> Any:
    raise ConfigError(f"{args}: the model's per-layer tree is not a command-line option; set it from a run file")


OFF_CLI = tyro.constructors.PrimitiveConstructorSpec(
    nargs=1, metavar="TREE", instance_from_str=_not_from_cli, is_instance=lambda _: True, str_from_instance=lambda _: []
)
"""tyro marker, beside ``tyro.conf.Suppress``, of a sub-config tyro neither lists nor walks: the per-layer tree is
the constructor, not the CLI, and the recipe's value passes through as it is (walking a 40-layer tree took tyro
seconds). Run files still reach it (``apply_overrides`` works on the tree)."""

_TREE_OPTIONS: dict[str, tuple[type | None, str]] = {
    "rope_theta": (RoPE.Config, "theta"),
    "rms_norm_eps": (None, "eps"),  # every norm (a config with an ``eps``) but the family's fixed ones
    "router_aux_loss_coef": (MoE.Config, "router_aux_loss_coef"),
    "mtp_loss_weight": (MTP.Config, "loss_weight"),
}
"""Option -> (the configs it sets, their field): the options pushed into the tree."""


class Decoder(BaseModel):
    """Token embedding, a stack of blocks, final norm and the LM head (tied to the embedding or not)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        """A decoder-only LM. The per-layer tree (``layers``, ``norm``, ``mtp`` ...) is the constructor and is
        not on the command line; the fields people change are one model-level option each (``rope_theta``,
        ``rms_norm_eps``, ``router_aux_loss_coef``, ``use_mtp``, ``mtp_loss_weight``, ``freeze``), pushed into
        every layer when the Config is constructed. A single layer can still be changed from a run file
        (``[model.layers.3.mlp] num_experts = 8``): an option, when set, wins over such per-layer values."""

        vocab_size: int
        """Rows of the embedding table and of the LM head."""
        dim: int
        """Model (hidden) dimension, handed to every child at build time."""
        layers: Annotated[list[TransformerBlock.Config], tyro.conf.Suppress, OFF_CLI]
        """One config per decoder layer (``layers.{i}``); layers may use different token mixers."""
        embed_tokens: Annotated[Embedding.Config, tyro.conf.Suppress, OFF_CLI] = field(default_factory=Embedding.Config)
        """Token embedding ``[vocab_size, dim]``."""
        norm: Annotated[Module.Config, tyro.conf.Suppress, OFF_CLI] = field(default_factory=RMSNorm.Config)
        """Final norm."""
        lm_head: Annotated[Linear.Config, tyro.conf.Suppress, OFF_CLI] = field(default_factory=Linear.Config)
        """Output projection ``[vocab_size, dim]``."""
        tie_word_embeddings: bool = False
        """Share one weight between ``embed_tokens`` and ``lm_head`` (HF ``tie_word_embeddings``)."""
        mtp: Annotated[MTP.Config | None, tyro.conf.Suppress, OFF_CLI] = None
        """Multi-token prediction block (``mtp.*``), None = off; it shares ``embed_tokens`` and ``lm_head``.
        Switched with ``use_mtp``, weighted with ``mtp_loss_weight``."""
        param_init: Annotated[ParamInit.Config | None, tyro.conf.Suppress, OFF_CLI] = None
        """Initialiser of the model's own direct parameters (a decoder has none: each child has its own)."""
        rope_theta: float | None = None
        """RoPE base of every rotary layer, the MTP layer's included (HF ``rope_theta``); None: as the layers say."""
        rms_norm_eps: float | None = None
        """Eps of every norm HF's ``rms_norm_eps`` reaches: the layers' norms, the final norm and the MTP block's
        (the family's fixed-eps norms excepted, e.g. GLM's ``q_a_layernorm`` / ``kv_a_layernorm`` stay 1e-6);
        None: as the layers say."""
        router_aux_loss_coef: float | None = None
        """Weight of the MoE load-balancing loss of every MoE layer, the MTP layer's included (HF
        ``router_aux_loss_coef``; 0 computes none); None: as the layers say."""
        use_mtp: bool | None = None
        """True: add the family's multi-token-prediction block when the tree has none (its loss weight the
        family's default unless ``mtp_loss_weight`` is set); False: remove it; None: as the tree says."""
        mtp_loss_weight: float | None = None
        """Weight of the MTP loss (``mtp.loss_weight``), applied whenever the model has an MTP block (from the
        recipe, ``use_mtp`` or a folder that ships one); None: as the tree says."""
        freeze: tuple[str, ...] | None = None
        """Parameters kept frozen (``requires_grad=False``, so no optimizer state): fnmatch patterns over
        parameter names, e.g. ``'embed_tokens.*' 'layers.0.*'``; each must match a parameter. None: none."""

        fixed_eps_norms: ClassVar[tuple[str, ...]] = ()
        """fnmatch patterns over config paths of the norms ``rms_norm_eps`` does not reach (the family's HF model
        gives them a fixed eps)."""

        def __post_init__(self) -> None:
            self._apply_options()

        def build(self, **runtime_objects: Any) -> Decoder:
            """Build the model, then freeze the parameters ``freeze`` names."""
            model = BaseModel.Config.build(self, **runtime_objects)
            model.apply_freeze()
            return model

        def mtp_block(self) -> MTP.Config:
            """The family's MTP block for this trunk (what ``use_mtp=True`` adds), with the family's default
            loss weight; families with an MTP block override this."""
            raise ConfigError(
                f"model.use_mtp=True, but {type(self).__qualname__} has no multi-token-prediction block: "
                "leave model.use_mtp unset (or false)"
            )

        def without_options(self) -> Decoder.Config:
            """This config with every model-level option unset (the tree as it is): what a family's MTP builder
            is handed, so building the block does not re-enter ``mtp_block``."""
            return dataclasses.replace(self, **{name: None for name in MODEL_OPTIONS})

        def option_values(self) -> dict[str, Any]:
            """The effective value of every model-level option, read from the tree (``MODEL_OPTIONS`` order).

            A tree option reads as its one value across the configs it reaches, None when it reaches none
            (a model without RoPE, MoE or MTP), or a tuple of the distinct values in tree order when the
            layers disagree. ``use_mtp`` is whether the tree has an MTP block; ``freeze`` the patterns (() for none).
            """
            values: dict[str, Any] = {}
            for name, (_, attr) in _TREE_OPTIONS.items():
                seen = []
                for cfg in self._option_targets(name):
                    if getattr(cfg, attr) not in seen:
                        seen.append(getattr(cfg, attr))
                values[name] = None if not seen else seen[0] if len(seen) == 1 else tuple(seen)
            values["use_mtp"] = self.mtp is not None
            values["freeze"] = tuple(self.freeze or ())
            return {name: values[name] for name in MODEL_OPTIONS}

        def _text_configs(self) -> Iterator[tuple[str, Module.Config]]:
            """``(path, config)`` of every config of the Decoder's own tree (``_TEXT_TREE``), roots included."""
            for root in _TEXT_TREE:
                value = getattr(self, root)
                items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
                items = [(root if i is None else f"{root}.{i}", v) for i, v in items]
                for path, item in items:
                    if isinstance(item, Module.Config):
                        yield path, item
                        for sub, cfg, _, _ in item.traverse(_prefix=path):
                            yield sub, cfg

        def _option_targets(self, name: str) -> list[Module.Config]:
            """The configs a tree option (``_TREE_OPTIONS``) sets."""
            kind, attr = _TREE_OPTIONS[name]
            out = []
            for path, cfg in self._text_configs():
                if kind is None:  # a norm: any config with an ``eps``, unless the family fixes it
                    if attr in {f.name for f in fields(cfg)} and not any(
                        fnmatch.fnmatchcase(path, p) for p in self.fixed_eps_norms
                    ):
                        out.append(cfg)
                elif isinstance(cfg, kind):
                    out.append(cfg)
            return out

        def _apply_options(self) -> None:
            # Options arrive from the CLI, a run file or dataclasses.replace: check and normalise them first.
            for name in _TREE_OPTIONS:
                value = getattr(self, name)
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ConfigError(f"model.{name} must be a number, got {value!r}")
                positive = name in ("rope_theta", "rms_norm_eps")
                if value < 0 or (positive and value == 0):
                    raise ConfigError(f"model.{name}={value} must be {'> 0' if positive else '>= 0'}")
                setattr(self, name, float(value))
            if self.use_mtp is not None and not isinstance(self.use_mtp, bool):
                raise ConfigError(f"model.use_mtp must be true or false, got {self.use_mtp!r}")
            if isinstance(self.freeze, str):
                self.freeze = (self.freeze,)
            if self.freeze is not None:
                self.freeze = tuple(self.freeze)
                if not all(isinstance(p, str) and p for p in self.freeze):
                    raise ConfigError(f"model.freeze must be parameter-name patterns, got {self.freeze!r}")
            if self.use_mtp is False and self.mtp is not None:
                self.mtp = None
            elif self.use_mtp and self.mtp is None:
                self.mtp = self.mtp_block()  # built from copies of the trunk's configs
            changes = [name for name in _TREE_OPTIONS if self._differs(name)]
            if not changes:
                return
            # Set on copies: recipes, tyro and dataclasses.replace may share child configs between Configs.
            for root in _TEXT_TREE:
                setattr(self, root, copy.deepcopy(getattr(self, root)))
            for name in changes:
                for cfg in self._option_targets(name):
                    setattr(cfg, _TREE_OPTIONS[name][1], getattr(self, name))

        def _differs(self, name: str) -> bool:
            """Whether tree option ``name`` is set and some config it reaches holds another value."""
            value, attr = getattr(self, name), _TREE_OPTIONS[name][1]
            return value is not None and any(getattr(cfg, attr) != value for cfg in self._option_targets(name))

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if not config.layers:
            raise ValueError("Decoder.Config.layers is empty: give at least one TransformerBlock.Config")
        self.embed_tokens = config.embed_tokens.build(num_embeddings=config.vocab_size, embedding_dim=config.dim)
        self.layers = ModuleList([layer.build(dim=config.dim) for layer in config.layers])
        self.norm = config.norm.build(dim=config.dim)
        self.lm_head = config.lm_head.build(in_features=config.dim, out_features=self.lm_head_out_features())
        if config.tie_word_embeddings:
            self._tie_lm_head()
        self.mtp = config.mtp.build(dim=config.dim) if config.mtp is not None else None
        self.pipeline_stage: StageSpan | None = None
        """The pipeline stage this model is (``restrict_to_stage``); None: the whole model."""
        self.pipeline_full_shapes: dict[str, torch.Size] = {}
        """A stage's: our key -> shape of every state-dict entry of the WHOLE model (an HF load converts the whole
        folder, then keeps this stage's keys)."""

    def _tie_lm_head(self) -> None:
        """Make ``lm_head.weight`` the embedding's parameter (one tensor under two names)."""
        head, table = self.lm_head, self.embed_tokens
        if head.weight.shape != table.weight.shape or head.bias is not None:
            raise ValueError(
                f"tie_word_embeddings=True needs an LM head of the embedding's shape {list(table.weight.shape)} and "
                f"no bias, but {type(self).__name__}'s head is {list(head.weight.shape)}"
                f"{' with a bias' if head.bias is not None else ''}: set tie_word_embeddings=False"
            )
        head.weight = table.weight

    def apply_freeze(self) -> None:
        """``requires_grad_(False)`` on every parameter a ``config.freeze`` pattern matches (``Config.build`` calls
        it once the whole model, subclass parts included, exists). A tied table is matched by either name."""
        patterns = self.config.freeze or ()
        params = dict(self.named_parameters(remove_duplicate=False))
        for pattern in patterns:
            hits = [name for name in params if fnmatch.fnmatchcase(name, pattern)]
            if not hits:
                close = ", ".join(list(params)[:3])
                raise ConfigError(
                    f"model.freeze pattern {pattern!r} matches no parameter of {type(self).__name__}: patterns are "
                    f"fnmatch over parameter names such as {close}, ... (e.g. 'embed_tokens.*', 'layers.0.*')"
                )
            for name in hits:
                params[name].requires_grad_(False)

    @property
    def tied_word_embeddings(self) -> bool:
        """Whether the head's weight is the embedding's (the same parameter)."""
        return self.lm_head.weight is self.embed_tokens.weight

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        # nn.Module._apply gives every module a NEW Parameter when a conversion cannot happen in place (meta ->
        # cpu in to_empty): the head would keep its own copy of the table. Share the embedding's again.
        out = super()._apply(fn, recurse)
        if self.config.tie_word_embeddings and self.lm_head.weight is not self.embed_tokens.weight:
            self.lm_head.weight = self.embed_tokens.weight
        return out

    @torch.no_grad()
    def init_weights(self) -> None:
        self.init_own_weights()
        for name, child in self.named_children():
            if name != "mtp":  # initialised last: switching MTP on leaves the rest's seeded init unchanged
                _init_child(child)
        if self.config.tie_word_embeddings:  # the head's init ran last on the shared table: the embedding's holds
            self.embed_tokens.init_own_weights()
        if self.mtp is not None:
            self.mtp.init_weights()

    def lm_head_out_features(self) -> int:
        """Rows of the LM head; a multimodal subclass adds its output vocabulary here."""
        return self.config.vocab_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` token ids -> ``[B, T, dim]`` hidden states (the step multimodal subclasses replace)."""
        return self.embed_tokens(input_ids)

    def embed_next_tokens(self, mtp_input_ids: torch.Tensor) -> torch.Tensor:
        """MTP input: embeddings of ``mtp_input_ids`` (the next token of every position); zeros where it is
        negative (the last position of a document has no next token). Multimodal subclasses add their
        features at the positions whose next token is an image token."""
        has_next = mtp_input_ids >= 0
        e_BTD = self.embed_tokens(mtp_input_ids.clamp(min=0))
        return torch.where(has_next.unsqueeze(-1), e_BTD, torch.zeros((), dtype=e_BTD.dtype, device=e_BTD.device))

    def mtp_active(self, mtp_input_ids: torch.Tensor | None) -> bool:
        """Whether this forward runs the MTP block (the model has one and was given its inputs)."""
        return self.mtp is not None and mtp_input_ids is not None

    def forward_layers(
        self,
        h_BTD: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cu_seqlens_host: Sequence[int] | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run every block; return the hidden states and the summed auxiliary loss (None when no layer has one).

        ``position_ids`` default: ``arange`` per row, or restarting per document. ``token_mask`` (bool ``[B, T]``,
        False on padding) keeps padding out of the MoE router statistics.
        """
        B, T, _ = h_BTD.shape
        meta = AttentionMeta(
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host, token_mask=token_mask
        )
        if position_ids is None:
            position_ids = meta.position_ids(B, T, device=h_BTD.device)
        auxes = []
        for layer in self.layers:
            h_BTD = layer(h_BTD, position_ids=position_ids, meta=meta)
            auxes.append(layer.pop_aux_loss())
        return h_BTD, combine_aux_losses(auxes)

    def head(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[B, T, dim]`` -> logits ``[B, T, vocab_size]``."""
        return self.lm_head(self.norm(h_BTD))

    def forward(
        self,
        input_ids: torch.Tensor,
        *carry: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cu_seqlens_host: Sequence[int] | None = None,
        mtp_input_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | ModelOutput | tuple[torch.Tensor, ...]:
        """``[B, T]`` ids -> logits ``[B, T, vocab_size]``; ``cu_seqlens`` (int32, flattened stream) packs documents;
        ``token_mask`` (bool ``[B, T]``, the batch's: False on the padding run) keeps padding out of the MoE router
        statistics (HF's ``attention_mask`` in ``load_balancing_loss_func``).

        Returns ``ModelOutput(logits, aux_loss)`` instead when a layer produced an auxiliary loss, and
        ``ModelOutput(logits, aux_loss, mtp_logits)`` when the model has an MTP block and ``mtp_input_ids``
        (``[B, T]``, the next token per position, negative where a document has none) are given.

        A pipeline stage (``restrict_to_stage``) runs ``forward_stage`` instead: on a later stage ``input_ids`` is
        the previous stage's hidden states and ``carry`` the rest of its outputs.
        """
        if self.pipeline_stage is not None:
            return self.forward_stage(input_ids, *carry, position_ids=position_ids, cu_seqlens=cu_seqlens,
                                      max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host,
                                      mtp_input_ids=mtp_input_ids, token_mask=token_mask)  # fmt: skip
        h = self.embed(input_ids)
        mtp_embeds = self.embed_next_tokens(mtp_input_ids) if self.mtp_active(mtp_input_ids) else None
        return self.forward_embedded(
            h,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            cu_seqlens_host=cu_seqlens_host,
            mtp_embeds=mtp_embeds,
            token_mask=token_mask,
        )

    def forward_embedded(
        self,
        h_BTD: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cu_seqlens_host: Sequence[int] | None = None,
        mtp_embeds: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | ModelOutput:
        """Layers and head on embedded inputs: logits, or ``ModelOutput`` when there is an aux loss or
        ``mtp_embeds`` (``embed_next_tokens``) are given to an MTP model."""
        if mtp_embeds is not None and position_ids is None:  # the MTP layer needs the trunk's positions
            meta = AttentionMeta(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host)
            position_ids = meta.position_ids(h_BTD.shape[0], h_BTD.shape[1], device=h_BTD.device)
        h, aux_loss = self.forward_layers(
            h_BTD, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
            cu_seqlens_host=cu_seqlens_host, token_mask=token_mask,
        )  # fmt: skip
        if mtp_embeds is None or self.mtp is None:
            logits = self.head(h)
            return logits if aux_loss is None else ModelOutput(logits, aux_loss)
        meta = AttentionMeta(
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host, token_mask=token_mask
        )
        return self.head_with_mtp(h, aux_loss, mtp_embeds, position_ids=position_ids, meta=meta)

    def head_with_mtp(
        self,
        h_BTD: torch.Tensor,
        aux_loss: torch.Tensor | None,
        mtp_embeds: torch.Tensor,
        *,
        position_ids: torch.Tensor,
        meta: AttentionMeta,
    ) -> ModelOutput:
        """``head`` plus the MTP block on the final-normed hidden states (vLLM's drafters take the target's
        normed output) and the shared ``lm_head``. The MTP layers' own aux loss (pooled apart from the trunk's
        layers) joins ``aux_loss`` as it is, with the full router coefficient: ``mtp.loss_weight`` weighs the MTP
        cross entropy only (Megatron: ``mtp_loss_scaling_factor`` scales the MTP loss in ``MTPLossAutoScaler``,
        while the MTP layer's router applies ``moe_aux_loss_coeff`` unscaled, ``moe/router.py``)."""
        mtp_cfg = self.config.mtp
        hn_BTD = self.norm(h_BTD)
        logits = self.lm_head(hn_BTD)
        if mtp_cfg.zero_embedding_at_document_start:  # vLLM glm4_moe_lite_mtp.py: inputs_embeds[positions == 0] = 0
            pos = position_ids if position_ids.ndim == 2 else position_ids[0]
            zero = torch.zeros((), dtype=mtp_embeds.dtype, device=mtp_embeds.device)
            mtp_embeds = torch.where((pos == 0).unsqueeze(-1), zero, mtp_embeds)
        y_BTD = self.mtp(hn_BTD, mtp_embeds, position_ids=position_ids, meta=meta)
        mtp_aux = self.mtp.pop_aux_loss()
        if mtp_aux is not None:
            aux_loss = mtp_aux if aux_loss is None else aux_loss + mtp_aux
        return ModelOutput(logits, aux_loss, self.lm_head(y_BTD))

    # ------------------------------------------------------------------ pipeline stages
    OUTPUT_SIDE: ClassVar[tuple[str, ...]] = ("norm", "lm_head", "mtp")
    """Children the last pipeline stage holds; every other child but ``layers`` is the input side (stage 0)."""

    def input_side(self) -> list[str]:
        """Names of the children stage 0 holds besides its layers (embeddings, a VQ path, a vision tower)."""
        return [n for n, _ in self.named_children() if n != "layers" and n not in self.OUTPUT_SIDE]

    def pipeline_first_stage_layers(self) -> int:
        """Layers that must sit on stage 0 because the input side feeds them directly (0 here)."""
        return 0

    def stage_costs(self, seq_len: int) -> StageCosts:
        """The split's cost facts (training FLOPs per token): ``6 x`` active parameters plus attention per layer;
        the input side's matmuls (not the embedding lookups) on stage 0; the head (twice with MTP) and the MTP
        block on the last stage. Works on a meta model."""
        def active(module: torch.nn.Module) -> float:
            total = float(sum(p.numel() for p in module.parameters()))
            for sub in module.modules():
                if isinstance(sub, MoE):
                    routed = sum(p.numel() for p in sub.experts.parameters())
                    total -= routed * (1.0 - sub.config.gate.top_k / sub.config.num_experts)
            return total

        layers = tuple(6.0 * active(layer) + layer.self_attn.flops_per_token(seq_len) for layer in self.layers)
        first = 0.0
        for name in self.input_side():
            child = getattr(self, name)
            if isinstance(child, torch.nn.Module) and not isinstance(child, (Embedding, torch.nn.Embedding)):
                first += 6.0 * active(child)
        head = 6.0 * self.lm_head.weight.numel()
        last = head
        if self.mtp is not None:
            last += head + 6.0 * active(self.mtp) + sum(layer.self_attn.flops_per_token(seq_len) for layer in self.mtp.layers)
        return StageCosts(layers, first=first, last=last, first_stage_min_layers=self.pipeline_first_stage_layers())

    def restrict_to_stage(self, span: StageSpan) -> None:
        """Make this (meta) model the pipeline stage ``span``: drop the other layers (the kept ones keep their
        numbers) and the input / output side the stage does not hold. Call before parallelizing."""
        if self.config.tie_word_embeddings and span.num_stages > 1:
            raise ConfigError(
                "tie_word_embeddings=True shares one weight between the embedding (first pipeline stage) and the LM "
                "head (last stage), which pipeline parallel does not support yet: set "
                "--parallelism.pipeline_parallel_degree 1"
            )
        self.pipeline_full_shapes = {unwrapped_name(k): v.shape for k, v in self.state_dict().items()}
        for i in range(len(self.config.layers)):
            if i not in span.layers:
                del self.layers._modules[str(i)]  # not ``del layers[i]``: that renumbers the rest
        drop = [*(() if span.is_first else self.input_side()), *(() if span.is_last else self.OUTPUT_SIDE)]
        for name in drop:
            setattr(self, name, None)
        self.pipeline_stage = span

    def stage_boundary_meta(
        self, tokens_BT: tuple[int, int], *, dtype: torch.dtype, sequence_shards: int, mtp: bool
    ) -> tuple[torch.Tensor, ...]:
        """Meta tensors of what crosses every stage boundary (``forward_stage``'s outputs before the last stage),
        for micro-batches of ``tokens_BT`` ids per rank: hidden states ``[B, T / sequence_shards, D]`` (sequence
        parallel keeps each tp rank's chunk), the aux statistics ``[2E + 2]`` fp32 when there is an aux loss, the
        MTP embeddings ``[B, T, D]`` (whole: the MTP block cuts them on entry) with ``mtp``."""
        B, T = tokens_BT
        D = self.config.dim
        out = [torch.empty(B, T // sequence_shards, D, dtype=dtype, device="meta")]
        aux = self._aux_moe_config()
        if aux is not None:
            out.append(torch.empty(2 * aux.num_experts + 2, dtype=torch.float32, device="meta"))
        if mtp and self.config.mtp is not None:
            out.append(torch.empty(B, T, D, dtype=dtype, device="meta"))
        return tuple(out)

    def pipeline_carries_aux(self) -> bool:
        """Whether the stages pass MoE router statistics on: a decoder layer's MoE has a load-balancing loss."""
        return self._aux_moe_config() is not None

    def _aux_moe_config(self) -> MoE.Config | None:
        moes = [layer.mlp for layer in self.config.layers if isinstance(layer.mlp, MoE.Config)]
        return next((m for m in moes if m.router_aux_loss_coef > 0), None)

    def stage_inputs(
        self, input_ids: torch.Tensor, *, mtp_input_ids: torch.Tensor | None, **inputs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """Stage 0's input side: ``(h, MTP input embeddings or None, after_layer)``; ``after_layer(i, h)`` (or None)
        is what the input side adds after decoder layer ``i`` (Qwen3-VL's deepstack). Families with more inputs
        override this."""
        del inputs
        mtp = self.embed_next_tokens(mtp_input_ids) if self.config.mtp is not None and mtp_input_ids is not None else None
        return self.embed(input_ids), mtp, None

    def forward_stage(
        self,
        x: torch.Tensor,
        *carry: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cu_seqlens_host: Sequence[int] | None = None,
        mtp_input_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        **inputs: Any,
    ) -> tuple[torch.Tensor, ...]:
        """One pipeline stage: ``x`` = token ids on stage 0 (its input side embeds them), else the previous
        stage's hidden states with ``carry`` = ``[aux statistics] [MTP embeddings]`` (as ``stage_outputs``
        ordered them). Returns the same tuple for the next stage, or on the last stage
        ``ModelOutput(logits, aux_loss, mtp_logits).as_stage_output()`` (a pipeline stage returns tensors only).

        The MoE router statistics travel as one fp32 vector ``[tokens_E | probs_E | rows | per-layer losses]``,
        each stage adding its layers' (summed over the ranks that split the tokens first); the last stage takes
        the Switch product once: the model's pooled loss, with the gradient reaching every stage's routers.
        """
        span = self.pipeline_stage
        meta = AttentionMeta(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host,
                             token_mask=token_mask)  # fmt: skip
        aux_cfg = self._aux_moe_config()
        mtp_on = self.config.mtp is not None and mtp_input_ids is not None
        after_layer = None
        if span.is_first:
            h_BTD, mtp_embeds, after_layer = self.stage_inputs(x, mtp_input_ids=mtp_input_ids,
                                                                position_ids=position_ids, cu_seqlens=cu_seqlens,
                                                                **inputs)  # fmt: skip
            aux_V = None
        else:
            rest = list(carry)
            h_BTD = x
            aux_V = rest.pop(0) if aux_cfg is not None else None
            mtp_embeds = rest.pop(0) if mtp_on else None
        B, T = h_BTD.shape[:2]
        if position_ids is None:
            position_ids = meta.position_ids(B, T, device=h_BTD.device)
        auxes = []
        for i, layer in zip(span.layers, self.layers, strict=True):
            h_BTD = layer(h_BTD, position_ids=position_ids, meta=meta)
            auxes.append(layer.pop_aux_loss())
            if after_layer is not None:
                h_BTD = after_layer(i, h_BTD)
        if aux_cfg is not None:
            aux_V = self._add_stage_aux(aux_V, auxes, aux_cfg.num_experts, h_BTD.device)
        elif any(a is not None for a in auxes):
            raise RuntimeError("an MoE layer produced an auxiliary loss the stage statistics do not carry")
        if not span.is_last:
            return (h_BTD, *([aux_V] if aux_V is not None else []), *([mtp_embeds] if mtp_on else []))
        aux_loss = None
        if aux_V is not None:
            E = aux_cfg.num_experts
            stats = LoadBalanceStats(tokens_E=aux_V[:E].detach(), probs_E=aux_V[E : 2 * E],
                                     rows=aux_V[2 * E].detach(), coef=aux_cfg.router_aux_loss_coef)  # fmt: skip
            aux_loss = stats.loss() + aux_V[2 * E + 1]
        if mtp_on:
            return self.head_with_mtp(h_BTD, aux_loss, mtp_embeds, position_ids=position_ids, meta=meta).as_stage_output()
        return ModelOutput(self.head(h_BTD), aux_loss).as_stage_output()

    @staticmethod
    def _add_stage_aux(
        aux_V: torch.Tensor | None, auxes: list[Any], num_experts: int, device: torch.device
    ) -> torch.Tensor:
        """The running statistics vector plus this stage's layers' (pooled over the token-splitting ranks)."""
        if aux_V is None:
            aux_V = torch.zeros(2 * num_experts + 2, dtype=torch.float32, device=device)
        for aux in auxes:
            if aux is None:
                continue
            if isinstance(aux, LoadBalanceStats):
                rows = aux.rows.reshape(1).float() if torch.is_tensor(aux.rows) else aux_V.new_full((1,), float(aux.rows))
                v = torch.cat([aux.tokens_E, aux.probs_E, rows])
                if aux.pool is not None:
                    v = aux.pool(v)
                aux_V = aux_V + torch.cat([v, aux_V.new_zeros(1)])
            else:  # a per-layer loss tensor: summed, as combine_aux_losses does
                aux_V = aux_V + torch.cat([aux_V.new_zeros(2 * num_experts + 1), aux.reshape(1).float()])
        return aux_V

    def training_flops(self, batch: Mapping[str, Any]) -> float:
        """Training FLOPs of one micro-batch (``models/common/flops.py``): the text model's matmuls over every position
        (layers with routed experts at top-k, final norm, head; the MTP block and the head once more when the model
        has one), each mixer over the batch's documents (``flops(doc_lens)``: attention causal within each
        document), plus ``input_flops`` (a subclass's image path). The embedding lookup is free."""
        tokens = batch["input_ids"].numel()
        lens = document_lengths(batch)
        text = [*self.layers, self.norm, self.lm_head]
        if self.mtp is not None:  # the MTP block, then the shared head a second time
            text += [self.mtp, self.lm_head]
        total = sum(_matmul_flops_top_k(m, tokens) for m in text)
        total += sum(layer.self_attn.flops(lens) for layer in self.all_layers())
        return total + self.input_flops(batch)

    def input_flops(self, batch: Mapping[str, Any]) -> float:
        """Training FLOPs of the input side beyond the token embedding (a vision tower, an image projection) for one
        micro-batch; 0 for a text model."""
        del batch
        return 0.0

    def all_layers(self) -> list[TransformerBlock]:
        """The decoder layers and the MTP block's layers (every FSDP / activation-checkpointing unit)."""
        return [*self.layers, *(self.mtp.layers if self.mtp is not None else ())]

    def active_params(self) -> int:
        """Parameters one token uses: all of them, routed experts counted at ``top_k / num_experts``."""
        active = float(sum(p.numel() for p in self.parameters()))
        for layer in self.all_layers():
            if isinstance(layer.mlp, MoE):
                routed = sum(p.numel() for p in layer.mlp.experts.parameters())
                active -= routed * (1.0 - layer.mlp.config.gate.top_k / layer.mlp.config.num_experts)
        return int(active)


def _matmul_flops_top_k(module: torch.nn.Module, tokens: int) -> float:
    """``matmul_flops`` of ``module`` with every MoE in it counted at top-k (``MoE.flops``)."""
    total = matmul_flops(module, tokens)
    for sub in module.modules():
        if isinstance(sub, MoE):
            total += sub.flops(tokens) - matmul_flops(sub, tokens)
    return total
