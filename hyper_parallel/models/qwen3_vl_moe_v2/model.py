"""Qwen3-VL(-MoE) and Qwen3.5(-MoE) vision-language models: ``VisionTower`` + a text ``Decoder``.

Legend: B batch, T tokens, D text hidden size, M merged visual tokens of the batch (all images).

    h_BTD          = embed_tokens(input_ids);  h[image tokens] = visual.merger(pixels)      (in sequence order)
    layer i:  h    = layer_i(h, M-RoPE positions [3, B, T])
              h[image tokens] += deepstack[i]          for i < len(deepstack)   (Qwen3-VL only)
    logits         = lm_head(norm(h))

One package, four text families (``text_family``; the layers' configs say which, nothing else is stored):

- ``qwen3_vl_moe`` (HF ``Qwen3VLMoeForConditionalGeneration``): GQA with Llama-style q/k RMSNorm, full-rotary
  interleaved M-RoPE, softmax top-k router always renormalised, dense SwiGLU layers from ``mlp_only_layers``
  / ``decoder_sparse_step``, deepstack mergers in the tower.
- ``qwen3_vl`` (HF ``Qwen3VLForConditionalGeneration``, the dense 2B-32B releases): the same layers with a
  dense SwiGLU MLP in every one (Qwen3 text layers), the same tower with deepstack, tied embeddings for the
  2B / 4B sizes. A tree with no MoE layer is this family, unless it was read from a ``qwen3_vl_moe`` folder
  (``hf_extra``), which it is then written back as.
- ``qwen3_5_moe`` (HF ``Qwen3_5MoeForConditionalGeneration``): the Qwen3.5-MoE hybrid stack (Gated DeltaNet
  / gated attention, zero-centred norms, shared expert), no deepstack.
- ``qwen3_5`` (HF ``Qwen3_5ForConditionalGeneration``, the dense 0.8B-27B releases): the same hybrid stack
  with dense SwiGLU MLPs (``mlp.gate_proj/up_proj/down_proj``), tied embeddings for the small sizes, the
  same tower and MTP block as the MoE one.

M-RoPE positions: when ``position_ids`` is None they are computed per document (HF ``get_rope_index``;
in packed rows every document restarts at 0). A micro-batch without images still runs the tower on one
``m x m`` dummy patch grid and adds ``0 *`` its output, so every rank calls the same FSDP units (and the
gradients of the tower are exact zeros rather than missing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

import numpy as np
import torch
import tyro

from hyper_parallel.data.vision_language.mrope import mrope_position_ids
from hyper_parallel.models.common.attention import AttentionMeta, CPShard, VarlenAttention
from hyper_parallel.models.common.block import TransformerBlock, combine_aux_losses
from hyper_parallel.models.common.decoder import OFF_CLI, Decoder
from hyper_parallel.models.common.embedding import Embedding
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.gated_attention import GatedAttention
from hyper_parallel.models.common.gated_deltanet import GatedDeltaNet
from hyper_parallel.models.common.gqa import GQAttention
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.moe import GroupedExperts, MoE, Router
from hyper_parallel.models.common.mtp import MTP
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.models.common.rope import RoPE
from hyper_parallel.models.qwen3_5_v2.model import MTP_LOSS_WEIGHT, qwen3_5_config, qwen3_5_with_mtp
from hyper_parallel.models.qwen3_vl_moe_v2.vision import VisionGrid, VisionPlan, VisionTower, vision_tower_config
from hyper_parallel.protocols.model import ModelOutput
from hyper_parallel.protocols.param_init import NormalInit

__all__ = [
    "MTP_LOSS_WEIGHT",
    "QWEN3_5_FAMILIES",
    "Qwen3VlMoeModel",
    "TextFamily",
    "qwen3_5_moe_vl_config",
    "qwen3_5_vl_config",
    "qwen3_vl_config",
    "qwen3_vl_moe_config",
    "text_family_of",
]

# MTP_LOSS_WEIGHT (0.1): the MTP block of the Qwen3.5-MoE VL model is the Qwen3.5-MoE one (qwen3_5_moe_vl_config);
# Megatron-Bridge's Qwen3.5 VL bridge uses the same value (qwen_vl/qwen35_vl_bridge.py). Qwen3-VL-MoE has no MTP.

TextFamily = Literal["qwen3_vl_moe", "qwen3_vl", "qwen3_5_moe", "qwen3_5"]
QWEN3_5_FAMILIES: tuple[TextFamily, ...] = ("qwen3_5_moe", "qwen3_5")
"""The text families whose layers are the Qwen3.5 hybrid stack (their HF text part is ``qwen3_5_v2``'s)."""


PIXEL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
"""The batch's visual inputs (the vision-language collate's)."""
HOST_KEYS = ("visual_tokens", "visual_index")
"""The visual host facts ``Qwen3VlMoeModel.host_inputs`` adds to a host batch."""


@dataclass(frozen=True, slots=True)
class VisualTokens:
    """Host facts of one micro-batch's visual inputs, made on the host by ``Qwen3VlMoeModel.host_inputs`` (before
    the context-parallel split and the device copy), so the forward never reads its geometry back from the device.
    Python facts only (a dataclass is left alone by the trainer's device copy and by FSDP's input moves); the
    per-token tables travel as ONE int64 tensor, ``visual_index`` (one host-to-device copy per micro-batch), laid
    out as :meth:`unpack` reads it."""

    plan: VisionPlan
    """The tower's geometry: the images' grids, then the videos' (the dummy ``m x m`` grid without pixels)."""
    real: bool
    """False: the micro-batch has no pixels (the tower runs on the dummy grid and its output is added times 0)."""
    rows: int
    """B: rows of the micro-batch."""
    seqlen: int
    """T: tokens per row of the whole micro-batch (before the CP split)."""
    after_pieces: int = 0
    """K: sequence pieces of this context-parallel rank (0 without CP: ``visual_index`` has no ``after`` part)."""

    def pack(self, tables: torch.Tensor, positions: torch.Tensor, after: torch.Tensor | None = None) -> torch.Tensor:
        """int64 ``[5N | F+1 | 2n | B*K]``: the tower's tables, its frame boundaries, the visual positions and (under
        CP) the feature after each local piece."""
        parts = [tables.reshape(-1), self.plan.cu_seqlens_cpu.to(torch.int64), positions.reshape(-1)]
        if after is not None:
            parts.append(after.reshape(-1))
        return torch.cat(parts)

    def unpack(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(tables [5, N], cu_seqlens int64 [F+1], positions [2, n], after [B, K] or None)``: views of
        ``index`` (host or device), cut at host offsets (no sync)."""
        N, F1, BK = self.plan.num_patches, len(self.plan.cu_seqlens), self.rows * self.after_pieces
        n2 = index.shape[0] - 5 * N - F1 - BK
        tables, cu, positions, after = torch.split(index, [5 * N, F1, n2, BK])
        return (tables.view(5, N), cu, positions.view(2, n2 // 2),
                after.view(self.rows, self.after_pieces) if self.after_pieces else None)


class _Embedded(NamedTuple):
    """The trunk's input embeddings and what the layers and the MTP block need of the visual path."""

    h: torch.Tensor
    """``[B, T, D]``: token embeddings, visual features at the visual tokens."""
    idx: torch.Tensor | None
    """Flat indices of the visual tokens (None: the micro-batch has none)."""
    deep: list[torch.Tensor]
    """Deepstack features, one ``[n, D]`` per level, at ``idx``."""
    after: torch.Tensor | None
    """``[B, K, D]``: for each of this rank's ``K`` sequence pieces of every row, the visual feature of the token
    right after the piece when that token (the next piece's first) is visual, else zeros; None without MTP
    inputs or without visual tokens. Without context parallel ``K = 1`` and no token follows a row."""


def text_family_of(config: Decoder.Config) -> TextFamily:
    """``qwen3_5_moe`` / ``qwen3_5`` when the layers are Qwen3.5 mixers (gated attention / Gated DeltaNet) with
    MoE / dense MLPs, else (GQA layers) ``qwen3_vl_moe`` / ``qwen3_vl`` with / without an MoE layer.

    A ``Qwen3VlMoeModel.Config`` read from a ``qwen3_vl_moe`` folder whose layers are all dense (every layer in
    ``mlp_only_layers``) stays ``qwen3_vl_moe``: see ``Qwen3VlMoeModel.Config.text_family``."""
    moe = any(isinstance(layer.mlp, MoE.Config) for layer in config.layers)
    mixers = (GatedAttention.Config, GatedDeltaNet.Config)
    if not any(isinstance(layer.self_attn, mixers) for layer in config.layers):
        return "qwen3_vl_moe" if moe else "qwen3_vl"
    return "qwen3_5_moe" if moe else "qwen3_5"


class Qwen3VlMoeModel(Decoder):
    """A vision-language MoE model; ``model(input_ids, pixel_values=, image_grid_thw=)`` returns logits."""

    input_keys: ClassVar[tuple[str, ...]] = (*PIXEL_KEYS, *HOST_KEYS)

    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        visual: Annotated[VisionTower.Config, tyro.conf.Suppress, OFF_CLI]
        """The vision tower (its output width is the text ``dim``); a run file can still set its fields."""
        image_token_id: int
        """Placeholder id of one merged visual token (HF ``image_token_id``)."""
        vision_start_token_id: int
        """Id of the token before every image (HF ``vision_start_token_id``)."""
        vision_end_token_id: int
        """Id of the token after every image (HF ``vision_end_token_id``)."""
        video_token_id: int = -1
        """Placeholder id of one merged video token (HF ``video_token_id``); -1: the model takes no video."""
        freeze_vision: bool = False
        """Keep the vision tower frozen: no gradient, never updated, ignored by FSDP (whole on every rank)."""
        freeze_text: bool = False
        """Keep the text decoder (embeddings, layers, norm, head) frozen: train the vision tower only."""
        max_position_embeddings: int = 262144
        """Longest position the checkpoint was trained for (kept for the HF config)."""
        hf_extra: Annotated[dict[str, Any], tyro.conf.Suppress] = field(default_factory=dict)
        """HF config fields not modelled here, written back unchanged on export."""

        @property
        def text_family(self) -> TextFamily:
            """Which HF text model the layers are (see the module docstring); an all-dense tree read from a
            ``qwen3_vl_moe`` folder stays that folder's family (written back as it was read)."""
            family = text_family_of(self)
            if family == "qwen3_vl" and self.hf_extra.get("top", {}).get("model_type") == "qwen3_vl_moe":
                return "qwen3_vl_moe"
            return family

        def mtp_block(self) -> MTP.Config:
            """``use_mtp=True``: the Qwen3.5(-MoE) MTP block (``qwen3_5_with_mtp``); Qwen3-VL-MoE has none."""
            if self.text_family not in QWEN3_5_FAMILIES:
                return Decoder.Config.mtp_block(self)
            return qwen3_5_with_mtp(self.without_options()).mtp

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.visual = config.visual.build(out_dim=config.dim)
        n_deep = len(config.visual.deepstack_visual_indexes)
        if n_deep > len(config.layers):
            raise ValueError(
                f"{n_deep} deepstack levels but only {len(config.layers)} text layers: shorten "
                "visual.deepstack_visual_indexes"
            )
        self.hf_passthrough: dict = {}
        """HF keys we do not model (e.g. ``mtp.*``), written back unchanged by save_pretrained."""
        self.cp_shard: CPShard | None = None
        """Context parallel (set by ``apply_context_parallel``): which pieces of every row this rank holds (one
        contiguous chunk, or two pieces in the balanced order) and the CP group's differentiable all-gather."""
        self.hf_experts_layout: str = "memory"
        """Fused-expert layout of the HF folder this model was loaded from (``hub`` or ``memory``), written back."""
        self._apply_freeze()

    def _apply_freeze(self) -> None:
        c = self.config
        if c.freeze_vision and self.visual is not None:  # None: a later pipeline stage
            self.visual.requires_grad_(False)
        if c.freeze_text:
            for module in (self.embed_tokens, self.layers, self.norm, self.lm_head):
                if module is not None:
                    module.requires_grad_(False)

    def init_weights(self) -> None:  # keep frozen parts frozen after a re-init
        super().init_weights()
        self._apply_freeze()

    # ---- vision ----------------------------------------------------------------------------------

    def input_flops(self, batch: Mapping[str, Any]) -> float:
        """The vision tower on the micro-batch's images and videos (one call, as ``_vision`` runs it; the dummy
        ``m x m`` grid of a text-only batch); 0 on a pipeline stage without the tower."""
        if self.visual is None:
            return 0.0
        grids = []
        for key, pixels in (("image_grid_thw", "pixel_values"), ("video_grid_thw", "pixel_values_videos")):
            grid = batch.get(key)
            if grid is not None and batch.get(pixels) is not None and grid.numel() > 0:
                grids += grid.reshape(-1, 3).tolist()
        m = self.visual.config.spatial_merge_size
        return self.visual.flops(grids or [[1, m, m]])

    def host_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The micro-batch's visual host facts, made on the host from the host batch (the trainer calls this before
        the context-parallel split and the device copy; a direct ``forward`` call without them makes them from its
        inputs, reading the ids and grids back once). Keys (all in ``input_keys``):

        - ``visual_tokens``: :class:`VisualTokens` (Python facts: the tower's :class:`VisionPlan`, ``[B, T]``);
        - ``visual_index``: int64, ``VisualTokens.pack`` of the tower's per-patch tables (``VisionPlan.tables``),
          its frame boundaries, and the visual positions ``[2, n]``: flat ``B*T`` position of every visual token
          (image tokens, then video tokens, in sequence order) and the row of its feature in the tower's output.

        Raises when the placeholders of ``input_ids`` and the grids disagree (each image/video needs
        ``t*h*w/merge_size**2`` placeholders)."""
        c = self.config
        m = c.visual.spatial_merge_size
        input_ids = batch["input_ids"]
        B, T = input_ids.shape
        grids: list[list[int]] = []
        counts = {"image": 0, "video": 0}
        for what, pixels_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                           ("video", "pixel_values_videos", "video_grid_thw")):  # fmt: skip
            pv, grid = batch.get(pixels_key), batch.get(grid_key)
            if pv is not None and grid is not None and grid.numel() > 0:  # as _vision: both present, not empty
                g = grid.reshape(-1, 3).tolist()  # a host tensor (the trainer's batch): no device sync
                grids += g
                counts[what] = sum(t * h * w for t, h, w in g) // (m * m)
        real = bool(grids)
        plan = VisionPlan.from_grids(grids if real else [[1, m, m]], m)
        if not real:
            positions = torch.zeros(2, 0, dtype=torch.int64)  # host (no device=)
        else:
            if counts["video"] and c.video_token_id < 0:
                raise ValueError("got pixel_values_videos but the model has no video_token_id (Config.video_token_id)")
            ids = input_ids.detach().cpu().numpy().reshape(-1)
            flat = []
            for what, token in (("image", c.image_token_id), ("video", c.video_token_id)):
                found = np.flatnonzero(ids == token) if token >= 0 else np.zeros(0, np.int64)
                if len(found) != counts[what]:
                    key = f"{what}_grid_thw"
                    raise ValueError(
                        f"input_ids hold {len(found)} {what} tokens (id {token}) but {key} "
                        f"{batch.get(key).tolist() if batch.get(key) is not None else None} gives {counts[what]} "
                        f"merged visual tokens: each {what} needs t*h*w/merge_size**2 placeholders"
                    )
                flat.append(found)
            pos = np.concatenate(flat).astype(np.int64)
            positions = torch.as_tensor(np.stack([pos, np.arange(len(pos), dtype=np.int64)]))
        tokens = VisualTokens(plan=plan, real=real, rows=B, seqlen=T)
        return {"visual_tokens": tokens, "visual_index": tokens.pack(plan.tables(), positions)}

    @classmethod
    def split_inputs_for_cp(
        cls, inputs: Mapping[str, Any], *, ranges: Sequence[tuple[int, int]], seqlen: int
    ) -> dict[str, Any]:
        """This CP rank's visual inputs: the pixels and grids whole (the tower runs on every image on every CP
        rank); in ``visual_index`` the visual positions renumbered to the rank's local row (its pieces ``ranges``,
        concatenated) with the feature row of each of its visual tokens, and ``[B, K]``: for each of its ``K``
        pieces of every row, the feature row of the token right after the piece when that token is visual, else -1
        (the MTP input of the piece's last position). All on the host, from the whole batch: no exchange."""
        out = super().split_inputs_for_cp(inputs, ranges=ranges, seqlen=seqlen)
        tokens, index = inputs.get("visual_tokens"), inputs.get("visual_index")
        if tokens is None or index is None:
            return out
        tables, _, positions, _ = tokens.unpack(index)
        flat, feature = positions[0], positions[1]
        row, col = flat // seqlen, flat % seqlen
        local_len = sum(hi - lo for lo, hi in ranges)
        local = torch.full_like(flat, -1)
        offset = 0
        for lo, hi in ranges:
            local = torch.where((col >= lo) & (col < hi), row * local_len + offset + col - lo, local)
            offset += hi - lo
        keep = local >= 0
        feature_at = torch.full((tokens.rows * seqlen,), -1, dtype=torch.int64)
        feature_at[flat] = feature
        nxt = torch.tensor([[b * seqlen + hi if hi < seqlen else -1 for _, hi in ranges] for b in range(tokens.rows)],
                           dtype=torch.int64).reshape(tokens.rows, len(ranges))  # fmt: skip
        after = torch.where(nxt >= 0, feature_at[nxt.clamp(min=0)], -1)
        tokens = replace(tokens, after_pieces=len(ranges))
        out["visual_tokens"] = tokens
        out["visual_index"] = tokens.pack(tables, torch.stack([local[keep], feature[keep]]), after)
        return out

    def _visual_inputs(
        self, input_ids: torch.Tensor, inputs: dict[str, Any]
    ) -> tuple[VisualTokens, VisionGrid, torch.Tensor, torch.Tensor | None]:
        """``(host facts, the tower's device geometry, visual positions [2, n], after [B, K] or None)`` from the
        forward's inputs; a direct call without the host facts makes them here (reads ids and grids back)."""
        if inputs.get("visual_tokens") is None:
            inputs = {**inputs, **self._host_inputs_of_direct_call(input_ids, inputs)}
        tokens: VisualTokens = inputs["visual_tokens"]
        tables, cu, positions, after = tokens.unpack(inputs["visual_index"].to(input_ids.device, non_blocking=True))
        grid = VisionGrid.from_plan(tokens.plan, tables, cu.to(torch.int32))
        return tokens, grid, positions, after

    def _host_inputs_of_direct_call(self, input_ids: torch.Tensor, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """``host_inputs`` of a direct call's device inputs: ids and grids read back in ONE copy (the only sync of
        such a forward; the trainer's batches bring the host facts)."""
        if not _has_pixels(inputs):  # the dummy grid: nothing to read
            return self.host_inputs({"input_ids": input_ids})
        if self.cp_shard is not None:
            raise ValueError(
                "context parallel needs the batch's visual host facts: call model.host_inputs(batch) on the whole "
                "host batch before split_batch_for_cp (the trainer does)"
            )
        host = dict(_read_back({"input_ids": input_ids, "image_grid_thw": inputs.get("image_grid_thw"),
                                "video_grid_thw": inputs.get("video_grid_thw")}))  # fmt: skip
        host.update(pixel_values=inputs.get("pixel_values"), pixel_values_videos=inputs.get("pixel_values_videos"))
        return self.host_inputs(host)

    def _vision(
        self, grid: VisionGrid, real: bool, device: torch.device, pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(merged [M, D], deepstack features)`` of the micro-batch's pixels on ``grid``; ``real`` False = the dummy
        grid of a text-only batch (zero pixels).

        Images and videos go through the tower in ONE call (images first): frames attend only within
        themselves, so this equals HF's two calls, and every rank runs the same FSDP units once per step
        whatever its micro-batch holds."""
        dtype = self.visual.patch_embed.proj.weight.dtype
        if real:  # the tower runs in its own dtype (full precision when frozen)
            pixels = [pv.to(dtype) for pv in (pixel_values, pixel_values_videos) if pv is not None and pv.numel() > 0]
            return self.visual(torch.cat(pixels) if len(pixels) > 1 else pixels[0], grid)
        dummy = torch.zeros(grid.num_patches, self.visual.patch_dim, device=device, dtype=dtype)
        return self.visual(dummy, grid)

    def embed(
        self,
        input_ids: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        **host: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """``(h [B, T, D], flat visual-token indices or None, deepstack features)``.

        Image tokens carry the merger output of the images, video tokens that of the videos (each in
        sequence order, HF's ``masked_scatter``); the deepstack features follow the same indices. ``host``: the
        batch's visual host facts (``host_inputs``), else made here."""
        e = self._embed(input_ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                        pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw, **host)  # fmt: skip
        return e.h, e.idx, e.deep

    def _embed(
        self,
        input_ids: torch.Tensor,
        *,
        mtp_input_ids: torch.Tensor | None = None,
        **inputs: Any,
    ) -> _Embedded:
        """``embed``, plus (given ``mtp_input_ids``) the visual features of the tokens right after this rank's
        sequence pieces (``_Embedded.after``). Sync-free with the host facts: the visual-token positions and the
        tower's geometry come from the host; nothing is read back from the device."""
        h_BTD = self.embed_tokens(input_ids)
        B, T, D = h_BTD.shape
        tokens, grid, pos, after_BK = self._visual_inputs(input_ids, inputs)
        merged, deep = self._vision(grid, tokens.real, h_BTD.device, inputs.get("pixel_values"),
                                    inputs.get("pixel_values_videos"))  # fmt: skip
        if not tokens.real:  # zero contribution, but the tower and its FSDP units still ran on every rank
            zero = merged.sum() + sum((d.sum() for d in deep), merged.new_zeros(()))
            return _Embedded(h_BTD + 0.0 * zero.to(h_BTD.dtype), None, [], None)
        shard = self.cp_shard
        after_BKD = None
        if mtp_input_ids is not None:  # the visual feature of the token after each local piece (zeros: none)
            n_local = 1 if shard is None else len(shard.pieces_of(shard.rank))
            after_BKD = h_BTD.new_zeros(B, n_local, D)
            if after_BK is not None:
                feature_BKD = merged[after_BK.clamp(min=0)].to(h_BTD.dtype)
                after_BKD = torch.where((after_BK >= 0).unsqueeze(-1), feature_BKD, after_BKD)
        idx, rows = pos[0], pos[1]
        if shard is not None or rows.numel() != merged.shape[0]:  # this rank's visual tokens only (shapes: no sync)
            merged, deep = merged[rows], [d[rows] for d in deep]
        h = h_BTD.reshape(B * T, D).index_copy(0, idx, merged.to(h_BTD.dtype)).view(B, T, D)
        return _Embedded(h, idx, [d.to(h_BTD.dtype) for d in deep], after_BKD)

    # ---- positions -------------------------------------------------------------------------------

    def mrope_positions(
        self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
        cu_seqlens: torch.Tensor | Sequence[int] | None, video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """int64 ``[3, B, T]`` M-RoPE positions, per document (rows, or ``cu_seqlens`` documents of the flat stream),
        computed on the host (device inputs are read back: the collate gives the batch's ``position_ids``)."""
        B, T = input_ids.shape
        ids = input_ids.reshape(-1).cpu().numpy()
        c = self.config

        def as_grids(g: torch.Tensor | None) -> np.ndarray:
            return np.zeros((0, 3), np.int64) if g is None else g.cpu().numpy().reshape(-1, 3)

        grids, videos = as_grids(image_grid_thw), as_grids(video_grid_thw)
        video_id = c.video_token_id if c.video_token_id >= 0 else None
        if cu_seqlens is None:
            bounds = list(range(0, B * T + 1, T))
        else:
            bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        out = np.empty((3, B * T), np.int64)
        is_image = ids == c.image_token_id
        is_video = ids == c.video_token_id if video_id is not None else np.zeros_like(is_image)
        used = used_frames = used_videos = 0
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            doc, vdoc = is_image[lo:hi], is_video[lo:hi]
            runs = int(doc[0]) + int(np.count_nonzero(doc[1:] & ~doc[:-1])) if hi > lo else 0
            frames = int(vdoc[0]) + int(np.count_nonzero(vdoc[1:] & ~vdoc[:-1])) if hi > lo else 0
            n_videos = acc = 0  # the videos whose frame groups (one token run each) this document holds
            while acc < frames and used_videos + n_videos < len(videos):
                acc += int(videos[used_videos + n_videos, 0])
                n_videos += 1
            out[:, lo:hi] = mrope_position_ids(
                ids[lo:hi], grids[used : used + runs], image_token_id=c.image_token_id,
                merge_size=c.visual.spatial_merge_size, video_grid_thw=videos[used_videos : used_videos + n_videos],
                video_token_id=video_id,
            )  # fmt: skip
            used += runs
            used_frames += frames
            used_videos += n_videos
        if used != len(grids) or used_videos != len(videos):
            raise ValueError(
                f"input_ids hold {used} image-token run(s) and {used_frames} video frame group(s), but image_grid_thw "
                f"has {len(grids)} image(s) and video_grid_thw {len(videos)} video(s)"
            )
        return torch.as_tensor(out).view(3, B, T).to(input_ids.device)

    # ---- forward ---------------------------------------------------------------------------------

    def pipeline_first_stage_layers(self) -> int:
        """The deepstack layers (the tower's intermediate features join after them) sit on stage 0."""
        return len(self.config.visual.deepstack_visual_indexes)

    def stage_inputs(
        self,
        input_ids: torch.Tensor,
        *,
        mtp_input_ids: torch.Tensor | None,
        **inputs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """Text + visual embeddings, the MTP input, and the deepstack additions after the first layers: ``forward``'s
        first step, and pipeline stage 0's (its deepstack layers all on stage 0: ``pipeline_first_stage_layers``).
        ``inputs``: the batch's ``input_keys`` (pixels, grids and the visual host facts); others are ignored."""
        mtp = self.config.mtp is not None and mtp_input_ids is not None
        visual = {k: inputs[k] for k in self.input_keys if k in inputs}
        h, idx, deep, after = self._embed(input_ids, mtp_input_ids=mtp_input_ids if mtp else None, **visual)
        mtp_embeds = self._embed_next_tokens_with_visuals(mtp_input_ids, h, after) if mtp else None
        B, T, D = h.shape

        def after_layer(i: int, h_BTD: torch.Tensor) -> torch.Tensor:
            if i < len(deep):
                return h_BTD.reshape(B * T, D).index_add(0, idx, deep[i]).view(B, T, D)
            return h_BTD

        return h, mtp_embeds, after_layer

    def forward(
        self,
        input_ids: torch.Tensor,
        *carry: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cu_seqlens_host: Sequence[int] | None = None,
        mtp_input_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        visual_tokens: VisualTokens | None = None,
        visual_index: torch.Tensor | None = None,
    ) -> torch.Tensor | ModelOutput:
        """``[B, T]`` ids (+ ``pixel_values [N, P]``, ``image_grid_thw [n, 3]``) -> logits ``[B, T, vocab]``.
        ``token_mask``: the batch's (False on padding, left out of the MoE router statistics; ``Decoder.forward``).

        ``position_ids``: ``[3, B, T]`` M-RoPE rows (or ``[B, T]``); None computes them from the grids.
        ``visual_tokens``, ``visual_index``: the batch's visual host facts (``host_inputs``; the trainer adds them on
        the host): with them (and ``position_ids``) the forward never syncs with the device; without them a direct
        call reads ``input_ids`` and the grids back once (one copy) to make them.
        Returns ``ModelOutput(logits, aux_loss)`` when an MoE layer produced an auxiliary loss, and
        ``ModelOutput(logits, aux_loss, mtp_logits)`` with an MTP block (Qwen3.5-MoE VL) and ``mtp_input_ids``.
        A pipeline stage runs ``Decoder.forward_stage`` (every stage needs the batch's ``position_ids``).
        """
        visual = dict(
            pixel_values=pixel_values, image_grid_thw=image_grid_thw, pixel_values_videos=pixel_values_videos,
            video_grid_thw=video_grid_thw, visual_tokens=visual_tokens, visual_index=visual_index,
        )  # fmt: skip
        if self.pipeline_stage is not None:
            if position_ids is None:
                raise ValueError("a pipeline stage needs the batch's M-RoPE position_ids: later stages hold no input_ids")
            return self.forward_stage(
                input_ids, *carry, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                cu_seqlens_host=cu_seqlens_host, mtp_input_ids=mtp_input_ids, token_mask=token_mask, **visual,
            )  # fmt: skip
        if self.cp_shard is None and (position_ids is None or (visual_tokens is None and _has_pixels(visual))):
            # A direct call: ids, grids (and boundaries) read back to the host in one copy; the trainer's batches
            # bring the M-RoPE rows (collate) and the host facts (host_inputs).
            bounds = None if cu_seqlens_host is not None or cu_seqlens is None else cu_seqlens
            host = _read_back({"input_ids": input_ids, "image_grid_thw": image_grid_thw,
                               "video_grid_thw": video_grid_thw, "cu_seqlens": bounds})  # fmt: skip
            if position_ids is None:
                cu_host = cu_seqlens_host if cu_seqlens_host is not None else host["cu_seqlens"]
                position_ids = self.mrope_positions(
                    host["input_ids"], host["image_grid_thw"], cu_host, host["video_grid_thw"]
                ).to(input_ids.device)
            if visual_tokens is None:
                visual.update(self.host_inputs({**host, "pixel_values": pixel_values,
                                                "pixel_values_videos": pixel_values_videos}))  # fmt: skip
        h, mtp_embeds, after_layer = self.stage_inputs(  # the MTP input before the layers: h is still the embedding
            input_ids, mtp_input_ids=mtp_input_ids, **visual
        )
        meta = AttentionMeta(
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host, token_mask=token_mask
        )
        auxes = []
        for i, layer in enumerate(self.layers):
            h = layer(h, position_ids=position_ids, meta=meta)
            auxes.append(layer.pop_aux_loss())  # read right after the layer (activation checkpointing recomputes)
            h = after_layer(i, h)  # deepstack: the tower's intermediate features join after the first layers
        aux_loss = combine_aux_losses(auxes)
        if mtp_embeds is not None:
            return self.head_with_mtp(h, aux_loss, mtp_embeds, position_ids=position_ids, meta=meta)
        logits = self.head(h)
        return logits if aux_loss is None else ModelOutput(logits, aux_loss)

    def _embed_next_tokens_with_visuals(
        self, mtp_input_ids: torch.Tensor, h_BTD: torch.Tensor, after_BKD: torch.Tensor | None
    ) -> torch.Tensor:
        """MTP input: the embedding of every position's next token; where that token is an image/video token,
        the merged visual feature the trunk put there (vLLM's Qwen3.5 drafter merges its ``inputs_embeds`` with
        the image features like the target). ``h_BTD``: the trunk's input embeddings; ``after_BKD``: the visual
        features of the tokens right after each local sequence piece (``_Embedded.after``; None: the
        micro-batch has no visual token).

        ``mtp_input_ids[q]`` is the id of token ``q + 1`` when it is in ``q``'s document (else negative), so it
        says where the next token is visual. Its input row is ``h[q + 1]`` inside a piece; at a piece's last
        position token ``q + 1`` opens the next piece, held by another context-parallel rank, whose feature
        this rank's copy of the vision tower also made (the tower runs on every image on every CP rank). So no
        exchange: a differentiable all-gather of the pieces' first rows was tried and deadlocked, its backward
        running before FSDP's backward-prefetch all-gather on one rank and after it on the other. The gradient
        reaches this rank's tower; FSDP sums the tower's gradients over the CP ranks."""
        e_BTD = self.embed_next_tokens(mtp_input_ids)
        if after_BKD is None:
            return e_BTD
        c = self.config
        next_visual = mtp_input_ids == c.image_token_id
        if c.video_token_id >= 0:
            next_visual = next_visual | (mtp_input_ids == c.video_token_id)
        B, T, D = e_BTD.shape
        n_local = after_BKD.shape[1]
        h_BKnD = h_BTD.reshape(B, n_local, T // n_local, D)  # the local pieces of every row
        next_BTD = torch.cat([h_BKnD[:, :, 1:], after_BKD.unsqueeze(2)], dim=2).reshape(B, T, D)
        return torch.where(next_visual.unsqueeze(-1), next_BTD.to(e_BTD.dtype), e_BTD)


def _has_pixels(inputs: Mapping[str, Any]) -> bool:
    """Whether the inputs hold pixels with their grids (as ``host_inputs`` and ``_vision`` decide)."""
    pairs = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))
    return any(inputs.get(pv) is not None and inputs.get(g) is not None and inputs[g].numel() > 0 for pv, g in pairs)


def _read_back(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """Host copies of small integer device tensors in ONE device-to-host copy (one sync): flattened into one int64
    tensor, copied, cut back into their shapes."""
    present = {k: t for k, t in tensors.items() if t is not None}
    if not present:
        return dict(tensors)
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in present.values()]).cpu()
    pieces = torch.split(flat, [t.numel() for t in present.values()])
    out = {k: p.view(t.shape) for (k, t), p in zip(present.items(), pieces)}
    return {k: out.get(k) for k in tensors}


# ---- builders --------------------------------------------------------------------------------------


def _linear(std: float, bias: bool = False) -> Linear.Config:
    return Linear.Config(bias=bias, param_init=NormalInit.Config(std=std))


def qwen3_vl_moe_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int | None = None,
    intermediate_size: int,
    num_experts: int,
    num_experts_per_tok: int,
    moe_intermediate_size: int,
    decoder_sparse_step: int = 1,
    mlp_only_layers: Sequence[int] = (),
    router_aux_loss_coef: float = 0.0,
    rope_theta: float = 5e6,
    partial_rotary_factor: float = 1.0,
    mrope_section: Sequence[int] = (24, 20, 20),
    rms_norm_eps: float = 1e-6,
    attention_bias: bool = False,
    initializer_range: float = 0.02,
    pad_token_id: int | None = None,
    max_position_embeddings: int = 262144,
    grouped_mm_impl: str = "auto",
    attention_backend: Literal["auto", "sdpa", "flash"] = "auto",
    vision: dict[str, Any],
    image_token_id: int,
    vision_start_token_id: int,
    vision_end_token_id: int,
    video_token_id: int = -1,
    freeze_vision: bool = False,
    freeze_text: bool = False,
    tie_word_embeddings: bool = False,
    hf_extra: dict[str, Any] | None = None,
) -> Qwen3VlMoeModel.Config:
    """The Qwen3-VL-MoE config tree from HF-style text hyper-parameters and ``vision`` (``vision_tower_config`` kwargs).

    Layer ``i`` is an MoE iff ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0`` (HF).
    """
    head_dim = head_dim or hidden_size // num_attention_heads
    std = initializer_range

    def norm() -> RMSNorm.Config:
        return RMSNorm.Config(eps=rms_norm_eps)

    def mlp(i: int) -> FeedForward.Config | MoE.Config:
        if i in set(mlp_only_layers) or num_experts <= 0 or (i + 1) % decoder_sparse_step:
            return FeedForward.Config(
                hidden_dim=intermediate_size, gate_proj=_linear(std), up_proj=_linear(std), down_proj=_linear(std)
            )
        return MoE.Config(
            num_experts=num_experts,
            gate=Router.Config(top_k=num_experts_per_tok, score_func="softmax", norm_topk_prob=True,
                               use_bias_correction=False, param_init=NormalInit.Config(std=std)),
            experts=GroupedExperts.Config(hidden_dim=moe_intermediate_size, grouped_mm_impl=grouped_mm_impl,
                                          param_init=NormalInit.Config(std=std)),
            shared_experts=None,
            router_aux_loss_coef=router_aux_loss_coef,
        )  # fmt: skip

    def attn() -> GQAttention.Config:
        return GQAttention.Config(
            n_heads=num_attention_heads, n_kv_heads=num_key_value_heads, head_dim=head_dim,
            q_proj=_linear(std, attention_bias), k_proj=_linear(std, attention_bias),
            v_proj=_linear(std, attention_bias), o_proj=_linear(std, attention_bias),
            q_norm=norm(), k_norm=norm(),
            rope=RoPE.Config(theta=rope_theta, layout="half", partial_rotary_factor=partial_rotary_factor,
                             mrope_section=tuple(mrope_section)),
            inner_attention=VarlenAttention.Config(backend=attention_backend),
        )  # fmt: skip

    layers = [
        TransformerBlock.Config(self_attn=attn(), mlp=mlp(i), input_layernorm=norm(), post_attention_layernorm=norm())
        for i in range(num_hidden_layers)
    ]
    return Qwen3VlMoeModel.Config(
        vocab_size=vocab_size,
        dim=hidden_size,
        layers=layers,
        embed_tokens=Embedding.Config(padding_idx=pad_token_id, param_init=NormalInit.Config(std=std)),
        norm=norm(),
        lm_head=_linear(std),
        visual=vision_tower_config(**vision),
        image_token_id=image_token_id,
        vision_start_token_id=vision_start_token_id,
        vision_end_token_id=vision_end_token_id,
        video_token_id=video_token_id,
        freeze_vision=freeze_vision,
        freeze_text=freeze_text,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        hf_extra=dict(hf_extra or {}),
    )


def qwen3_vl_config(*, intermediate_size: int, **kwargs: Any) -> Qwen3VlMoeModel.Config:
    """The Qwen3-VL dense config tree (``Qwen3VLForConditionalGeneration``): ``qwen3_vl_moe_config`` with no
    expert (a dense SwiGLU MLP of ``intermediate_size`` in every layer, Qwen3 text layers); the other kwargs
    are ``qwen3_vl_moe_config``'s (give ``tie_word_embeddings=True`` for the 2B / 4B releases)."""
    return qwen3_vl_moe_config(
        intermediate_size=intermediate_size, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, **kwargs
    )


def qwen3_5_moe_vl_config(**kwargs: Any) -> Qwen3VlMoeModel.Config:
    """The Qwen3.5-MoE VL config tree: ``qwen3_5_moe_config(**text)`` layers + the tower (no deepstack)."""
    from hyper_parallel.models.qwen3_5_moe_v2.model import qwen3_5_moe_config

    return qwen3_5_family_vl_config(qwen3_5_moe_config, **kwargs)


def qwen3_5_vl_config(**kwargs: Any) -> Qwen3VlMoeModel.Config:
    """The Qwen3.5 dense VL config tree (``Qwen3_5ForConditionalGeneration``): ``qwen3_5_config(**text)``
    layers (give ``intermediate_size``; dense SwiGLU MLPs) + the tower (no deepstack)."""
    return qwen3_5_family_vl_config(qwen3_5_config, **kwargs)


def qwen3_5_family_vl_config(
    text_builder: Any,
    *,
    vision: dict[str, Any],
    image_token_id: int,
    vision_start_token_id: int,
    vision_end_token_id: int,
    video_token_id: int = -1,
    freeze_vision: bool = False,
    freeze_text: bool = False,
    tie_word_embeddings: bool = False,
    hf_extra: dict[str, Any] | None = None,
    **text: Any,
) -> Qwen3VlMoeModel.Config:
    """A Qwen3.5-family VL tree: the layers, embedding, norm, head and MTP block of ``text_builder(**text)``
    (the text family's own builder: the decoder is a part, not a copy) + the tower (no deepstack)."""
    if vision.get("deepstack_visual_indexes"):
        raise ValueError("Qwen3.5 has no deepstack: leave vision deepstack_visual_indexes empty")
    t = text_builder(**text, tie_word_embeddings=tie_word_embeddings)
    return vl_config_from_text(
        t, vision=vision_tower_config(**vision), image_token_id=image_token_id,
        vision_start_token_id=vision_start_token_id, vision_end_token_id=vision_end_token_id,
        video_token_id=video_token_id, freeze_vision=freeze_vision, freeze_text=freeze_text,
        hf_extra=dict(hf_extra or {}),
    )  # fmt: skip


def vl_config_from_text(
    t: Decoder.Config, *, vision: VisionTower.Config, hf_extra: dict[str, Any], **vl: Any
) -> Qwen3VlMoeModel.Config:
    """The VL tree of a text decoder config ``t`` (its layers, embedding, norm, head, tying and MTP block)
    with the tower ``vision`` and the VL fields ``vl`` (token ids, freezing)."""
    return Qwen3VlMoeModel.Config(
        vocab_size=t.vocab_size,
        dim=t.dim,
        layers=t.layers,
        embed_tokens=t.embed_tokens,
        norm=t.norm,
        lm_head=t.lm_head,
        max_position_embeddings=t.max_position_embeddings,
        visual=vision,
        tie_word_embeddings=t.tie_word_embeddings,
        hf_extra=hf_extra,
        mtp=t.mtp,  # mtp_num_hidden_layers in the text kwargs: the Qwen3.5 MTP block (vLLM qwen3_5_mtp.py)
        **vl,
    )
