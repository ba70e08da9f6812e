"""Multi-token prediction for GlmImageMoe with the GLM-4.7-Flash nextn layer: forward parity with a reference
written here (text, and image-code positions), the nextn keys of an HF folder loaded into the block, and the
export (trained keys under their HF names, exact round trip, transformers loads the text export unchanged).

Reference (source of truth: vLLM ``vllm/model_executor/models/glm4_moe_lite_mtp.py``,
``Glm4MoeLiteMultiTokenPredictorLayer``; DeepSeek-V3's ``deepseek_mtp.py`` is the same): the nextn layer is
``model.layers.{num_hidden_layers}`` with, at position t,

    e = embed(ids[t + 1]), zeroed at position 0
    x = eh_proj(cat([enorm(e), hnorm(h[t])]))       # h: the target's output hidden state (after its final norm)
    y = mtp_block(x)                                # a Glm4MoeLiteDecoderLayer (MLA + MoE) at that index
    logits = head(shared_head.norm(y))              # the target's head (the copies on disk are the same)

built from HF's own ``Glm4MoeLiteDecoderLayer`` / ``Glm4MoeLiteRMSNorm``. What MTP means at image-code
positions: the embedding of the next token is, where that token is an image code, the same projected
codebook vector the trunk embeds there (the project's image path, docs/design.md section 4), and the MTP
head predicts the token two ahead over the joint text + image-code vocabulary, i.e. inside an image the code
after the next one in raster order (label ``code + lang_vocab_size``).
"""

from __future__ import annotations

import copy
import json

import torch
import torch.nn.functional as F
from transformers import Glm4MoeLiteForCausalLM
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteDecoderLayer, Glm4MoeLiteRMSNorm

from hyper_parallel.data.packing import add_mtp_targets
from hyper_parallel.models.glm_image_moe_v2 import from_pretrained, save_pretrained
from hyper_parallel.hf import load_hf_weights
from hyper_parallel.models.glm_image_moe_v2.state_dict import GlmImageMoeStateDictAdapter
from hyper_parallel.hf import read_safetensors, write_safetensors
from tests.torch.ut.hf_utils import randomize_, tiny_lite_config

V = 256
TOL = 1e-5
PLACEHOLDER = V - 1  # what a glm4_moe_lite folder gets


class _HFNextn(torch.nn.Module):
    def __init__(self, hf_config, *, seed: int) -> None:
        super().__init__()
        cfg = copy.deepcopy(hf_config)
        L = cfg.num_hidden_layers
        cfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["sparse"]  # vLLM: the nextn layer is an MoE layer
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm, self.shared_head_norm = (Glm4MoeLiteRMSNorm(H, eps=eps) for _ in range(3))
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.block = Glm4MoeLiteDecoderLayer(cfg, layer_idx=L)
        self.L = L
        randomize_(self, seed)

    def hf_keys(self, prefix: str = "model.") -> dict[str, torch.Tensor]:
        base = f"{prefix}layers.{self.L}."
        out = {
            base + "enorm.weight": self.enorm.weight,
            base + "hnorm.weight": self.hnorm.weight,
            base + "eh_proj.weight": self.eh_proj.weight,
            base + "shared_head.norm.weight": self.shared_head_norm.weight,
        }
        for name, t in self.block.state_dict().items():
            if name.endswith("mlp.experts.gate_up_proj"):
                half = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{base}mlp.experts.{e}.gate_proj.weight"] = t[e, :half]
                    out[f"{base}mlp.experts.{e}.up_proj.weight"] = t[e, half:]
            elif name.endswith("mlp.experts.down_proj"):
                out.update({f"{base}mlp.experts.{e}.down_proj.weight": t[e] for e in range(t.shape[0])})
            else:
                out[base + name] = t
        return {k: v.detach().clone() for k, v in out.items()}

    def forward(self, backbone, emb: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """MTP logits at positions 0 .. T-2 of one document per row, from the trunk's input embeddings."""
        h = backbone(inputs_embeds=emb, use_cache=False).last_hidden_state
        e = emb[:, 1:].clone()
        e[:, 0] = 0  # vLLM: inputs_embeds[positions == 0] = 0
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h[:, :-1])], dim=-1))
        pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        y = self.block(x, position_embeddings=backbone.rotary_emb(x, pos), attention_mask=None, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        return F.linear(self.shared_head_norm(y), head_weight)


def _setup(tmp_path):
    torch.manual_seed(0)
    hf = Glm4MoeLiteForCausalLM(tiny_lite_config()).eval()
    randomize_(hf, 0)
    ref = _HFNextn(hf.config, seed=11).eval()
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    sd = read_safetensors(folder)
    sd.update(ref.hf_keys())
    sd[f"model.layers.{ref.L}.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()  # DeepSeek-style copies
    sd[f"model.layers.{ref.L}.shared_head.head.weight"] = sd["lm_head.weight"].clone()
    write_safetensors(sd, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    # the flag turns the nextn block on with the checkpoint's num_nextn_predict_layers (the reader's choices:
    # an MoE layer like the last ones, position 0 zeroed); a text-only folder: a small image part
    ours = from_pretrained(folder, mtp=True, codebook_size=24, vq_embed_dim=12, image_path=True).eval()
    assert ours.config.mtp is not None and ours.config.mtp.zero_embedding_at_document_start
    result = GlmImageMoeStateDictAdapter(ours.config).from_hf_checked(read_safetensors(folder))
    return hf, ref, ours, result, folder


def _image_batch():
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V - 1, (1, 16), generator=g)
    ids[0, 5:11] = PLACEHOLDER  # a 2x3 image: positions 5..10
    codes = torch.randint(0, 24, (6,), generator=g)
    return ids, torch.arange(5, 11), codes


def test_nextn_forward_matches_reference_text_and_image_codes(tmp_path):
    hf, ref, ours, result, _ = _setup(tmp_path)
    assert sorted(k.split(".", 3)[-1] for k in result.ignored) == ["embed_tokens.weight", "shared_head.head.weight"]
    with torch.no_grad():
        # text only: the whole reference is HF's
        ids = torch.randint(0, V - 1, (2, 14), generator=torch.Generator().manual_seed(3))
        b = add_mtp_targets({"input_ids": ids, "labels": ids})
        out = ours(ids, mtp_input_ids=b["mtp_input_ids"])
        want = ref(hf.model, hf.model.embed_tokens(ids), hf.lm_head.weight)
        err = (out.mtp_logits[:, :-1, :V] - want).abs().max().item()
        assert err <= TOL, err
        # image codes: the trunk and the MTP embed the same projected codebook vectors (project-defined part)
        ids, vis, codes = _image_batch()
        b = add_mtp_targets({"input_ids": ids, "labels": ids})
        out = ours(ids, visual_indices=vis, vq_codes=codes, mtp_input_ids=b["mtp_input_ids"])
        emb = hf.model.embed_tokens(ids).clone()
        emb[0, vis] = ours.vq_to_llm_proj(F.normalize(ours.vq_codebook.weight[codes], dim=-1))
        want = ref(hf.model, emb, ours.lm_head.weight)  # the joint head: text rows from HF, image rows ours
        err = (out.mtp_logits[:, :-1] - want).abs().max().item()
        assert err <= TOL, err
        # without the image vectors at the positions before an image token the MTP input would differ
        text_only = ref(hf.model, hf.model.embed_tokens(ids), ours.lm_head.weight)
        assert (out.mtp_logits[:, 4:10] - text_only[:, 4:10]).abs().max() > 1e-3


def test_nextn_keys_export_under_hf_names_and_round_trip(tmp_path):
    hf, ref, ours, _, folder = _setup(tmp_path)
    with torch.no_grad():  # "train" the block: every MTP weight differs from what was loaded
        for name, p in ours.named_parameters():
            if name.startswith("mtp."):
                p.add_(0.01 * torch.randn_like(p))
    save_pretrained(ours, tmp_path / "text", text_only=True)
    disk = read_safetensors(tmp_path / "text")
    L = ref.L
    assert torch.equal(disk[f"model.layers.{L}.eh_proj.weight"], ours.mtp.fc.weight)
    assert torch.equal(disk[f"model.layers.{L}.enorm.weight"], ours.mtp.pre_fc_norm_embedding.weight)
    assert torch.equal(disk[f"model.layers.{L}.shared_head.norm.weight"], ours.mtp.norm.weight)
    down = ours.mtp.layers[0].mlp.experts.down_proj
    assert torch.equal(disk[f"model.layers.{L}.mlp.experts.1.down_proj.weight"], down[1])
    assert torch.equal(disk[f"model.layers.{L}.shared_head.head.weight"], ours.lm_head.weight[:V])
    assert json.loads((tmp_path / "text" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    # transformers ignores layer L and gives our trunk's logits
    back = Glm4MoeLiteForCausalLM.from_pretrained(tmp_path / "text").eval()
    ids = torch.randint(0, V - 1, (2, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert (back(input_ids=ids, use_cache=False).logits - ours(ids)[..., :V]).abs().max().item() <= TOL
    # the GlmImageMoe export reloads into an equal model (trained MTP keys exactly)
    save_pretrained(ours, tmp_path / "img")
    again = ours.config.build()
    again.init_weights()
    load_hf_weights(again, tmp_path / "img")
    mine = ours.state_dict()
    for key, value in again.state_dict().items():
        assert torch.equal(value, mine[key]), key
