"""Multi-token prediction for Qwen3.5 (dense and MoE): forward parity with a reference written here, packed
rows vs documents run separately, and the HF key mapping (load from an HF folder, export, round trip).

Reference (source of truth: vLLM ``vllm/model_executor/models/qwen3_5_mtp.py``, ``Qwen3_5MultiTokenPredictor``
and ``Qwen3_5MTP.load_weights``): at position t,

    x = mtp.fc(cat([mtp.pre_fc_norm_embedding(embed(ids[t + 1])), mtp.pre_fc_norm_hidden(h[t])]))
    y = mtp.layers.0(x)                      # a full-attention Qwen3.5 decoder layer, positions of t
    logits = lm_head(mtp.norm(y))            # the target's own embed_tokens and lm_head

where ``h`` is the target model's output hidden state (after its final norm). The pieces are HF's own
modules (``Qwen3_5(Moe)DecoderLayer`` with ``layer_type="full_attention"``, ``Qwen3_5(Moe)RMSNorm``), with
weights written into the HF folder under the ``mtp.*`` names vLLM loads.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm

from hyper_parallel.data.packing import add_mtp_targets, shift_labels
from hyper_parallel.models import qwen3_5_moe_v2, qwen3_5_v2
from hyper_parallel.models.qwen3_5_v2.model import Qwen3_5Model
from hyper_parallel.hf import read_safetensors, write_safetensors
from tests.torch.ut.models.qwen3_5_v2 import test_model as dense_t
from tests.torch.ut.models.qwen3_5_moe_v2 import test_model as moe_t
from tests.torch.ut.hf_utils import randomize_

TOL = 1e-5
V = 128


class _HFMtp(torch.nn.Module):
    """The MTP block of the module docstring, from HF's own Qwen3.5 modules."""

    def __init__(self, hf_config, *, moe: bool, seed: int) -> None:
        super().__init__()
        cfg = copy.deepcopy(hf_config)
        full = cfg.layer_types.index("full_attention")
        layer_cls = Qwen3_5MoeDecoderLayer if moe else Qwen3_5DecoderLayer
        norm_cls = Qwen3_5MoeRMSNorm if moe else Qwen3_5RMSNorm
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = (norm_cls(H, eps=eps) for _ in range(3))
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        self.layers = torch.nn.ModuleList([layer_cls(cfg, layer_idx=full)])
        torch.manual_seed(seed)
        randomize_(self, seed)
        with torch.no_grad():  # zero-centred norms: scale 1 + w with w ~ 0.2 N
            for name, p in self.named_parameters():
                if name.endswith(("norm.weight", "layernorm.weight", "norm_embedding.weight", "norm_hidden.weight")):
                    p.sub_(1.0)

    def hf_keys(self) -> dict[str, torch.Tensor]:
        """``mtp.*`` keys as vLLM reads them: per-expert MoE weights, HF's ``shared_expert`` name."""
        out = {}
        for name, t in self.state_dict().items():
            if name.endswith("mlp.experts.gate_up_proj"):
                base, half = "mtp." + name[: -len("gate_up_proj")], t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{base}{e}.gate_proj.weight"] = t[e, :half].clone()
                    out[f"{base}{e}.up_proj.weight"] = t[e, half:].clone()
            elif name.endswith("mlp.experts.down_proj"):
                base = "mtp." + name[: -len("down_proj")]
                out.update({f"{base}{e}.down_proj.weight": t[e].clone() for e in range(t.shape[0])})
            else:
                out["mtp." + name] = t.clone()
        return out

    def forward(self, hf_model, ids: torch.Tensor) -> torch.Tensor:
        """MTP logits at positions ``0 .. T-2`` of one unpacked document per row."""
        inner = hf_model.model
        h = inner(input_ids=ids, use_cache=False).last_hidden_state  # after the final norm
        e = inner.embed_tokens(ids[:, 1:])
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(h[:, :-1])], dim=-1))
        pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        y = self.layers[0](x, position_embeddings=inner.rotary_emb(x, pos), attention_mask=None, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        return hf_model.lm_head(self.norm(y))


def _folder_with_mtp(tmp_path, *, moe: bool, seed: int = 0, **overrides):
    """An HF folder (CausalLM) whose safetensors also hold trained-looking ``mtp.*`` weights."""
    hf = (moe_t if moe else dense_t)._hf_model(seed, **overrides)
    ref = _HFMtp(hf.config, moe=moe, seed=seed + 7).eval()
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    sd = read_safetensors(folder)
    sd.update(ref.hf_keys())
    write_safetensors(sd, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    return hf, ref, folder


def _ours_from_folder(folder, *, moe: bool) -> Qwen3_5Model:
    # the flag turns the block on with the checkpoint's mtp_num_hidden_layers; mtp.* load into it
    return (qwen3_5_moe_v2 if moe else qwen3_5_v2).from_pretrained(folder, mtp=True).eval()


def _mtp_logits(model, ids: torch.Tensor, **batch) -> torch.Tensor:
    b = add_mtp_targets({"input_ids": ids, "labels": torch.full_like(ids, -100), **batch})
    out = model(ids, mtp_input_ids=b["mtp_input_ids"], **batch)
    return out.mtp_logits


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_mtp_forward_matches_reference(tmp_path, moe):
    hf, ref, folder = _folder_with_mtp(tmp_path, moe=moe)
    ours = _ours_from_folder(folder, moe=moe)
    assert not any(k.startswith("mtp.") for k in ours.hf_passthrough), "mtp keys must load into the block"
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(hf, ids)
        got = _mtp_logits(ours, ids)
        main = hf(input_ids=ids, use_cache=False).logits
        out = ours(ids, mtp_input_ids=add_mtp_targets({"input_ids": ids, "labels": ids})["mtp_input_ids"])
    err = (got[:, :-1] - want).abs().max().item()
    assert err <= TOL, err
    assert (out.logits - main).abs().max().item() <= TOL  # the trunk is unchanged by MTP
    assert want.abs().max().item() > 0.1  # the reference is not trivially small


def test_packed_rows_equal_documents_run_separately(tmp_path):
    """Three documents packed into one row give the MTP logits, targets and loss of each document run alone:
    the next-token ids and the targets are shifted per document (``add_mtp_targets``), never across a
    boundary (a shift over the whole row would give each document's last position the next document's
    second token as a target)."""
    _, _, folder = _folder_with_mtp(tmp_path, moe=False)
    ours = _ours_from_folder(folder, moe=False)
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, V, (1, n), generator=g) for n in (7, 12, 9)]
    bounds = [0, 7, 19, 28]
    packed = torch.cat(docs, dim=1)
    labels = torch.cat([torch.from_numpy(shift_labels(d[0].numpy())).view(1, -1) for d in docs], dim=1)
    cu = dict(cu_seqlens=torch.tensor(bounds, dtype=torch.int32), cu_seqlens_host=bounds, max_seqlen=12)
    with torch.no_grad():
        b = add_mtp_targets({"input_ids": packed, "labels": labels, **cu})
        got = ours(packed, mtp_input_ids=b["mtp_input_ids"], **cu).mtp_logits
        packed_sum = F.cross_entropy(got[0], b["mtp_labels"][0], ignore_index=-100, reduction="sum")
        packed_n = int((b["mtp_labels"] != -100).sum())
        alone_sum, alone_n = 0.0, 0
        for doc, lo, hi in zip(docs, bounds[:-1], bounds[1:]):
            d = add_mtp_targets({"input_ids": doc, "labels": labels[:, lo:hi]})
            alone = ours(doc, mtp_input_ids=d["mtp_input_ids"]).mtp_logits
            assert torch.equal(b["mtp_labels"][:, lo:hi], d["mtp_labels"]), (lo, hi)
            valid = d["mtp_labels"][0] != -100
            err = (got[0, lo:hi][valid] - alone[0][valid]).abs().max().item()
            assert err <= TOL, (lo, hi, err)
            alone_sum += F.cross_entropy(alone[0], d["mtp_labels"][0], ignore_index=-100, reduction="sum").item()
            alone_n += int(valid.sum())
    assert packed_n == alone_n == sum(n - 2 for n in (7, 12, 9))
    assert abs(packed_sum.item() - alone_sum) <= TOL * alone_n, (packed_sum.item(), alone_sum)


def test_mtp_targets_per_document():
    ids = torch.arange(10).view(1, 10)
    labels = torch.tensor([[1, 2, 3, -100, 5, 6, -100, 8, -100, -100]])
    b = add_mtp_targets({"input_ids": ids, "labels": labels, "cu_seqlens_host": [0, 4, 7, 10]})
    assert b["mtp_input_ids"].tolist() == [[1, 2, 3, -1, 5, 6, -1, 8, 9, -1]]
    assert b["mtp_labels"].tolist() == [[2, 3, -100, -100, 6, -100, -100, -100, -100, -100]]
    rows = add_mtp_targets({"input_ids": torch.arange(6).view(2, 3), "labels": torch.arange(6).view(2, 3)})
    assert rows["mtp_input_ids"].tolist() == [[1, 2, -1], [4, 5, -1]]


def test_export_writes_trained_mtp_keys_and_round_trips(tmp_path):
    """Trained ``mtp.*`` weights are written under vLLM's names (per-expert, ``shared_expert``), reload into an
    equal model exactly, and transformers (which ignores ``mtp.*``) loads the export with unchanged logits."""
    from transformers import Qwen3_5MoeForCausalLM

    _, _, folder = _folder_with_mtp(tmp_path, moe=True)
    ours = _ours_from_folder(folder, moe=True)
    with torch.no_grad():  # "train" the block: every MTP weight moves away from what was loaded
        for name, p in ours.named_parameters():
            if name.startswith("mtp."):
                p.add_(0.01 * torch.randn_like(p))
    qwen3_5_moe_v2.save_pretrained(ours, tmp_path / "out")
    disk = read_safetensors(tmp_path / "out")
    experts = ours.mtp.layers[0].mlp.experts
    half = experts.gate_up_proj.shape[1] // 2
    assert torch.equal(disk["mtp.fc.weight"], ours.mtp.fc.weight)
    assert torch.equal(disk["mtp.pre_fc_norm_hidden.weight"], ours.mtp.pre_fc_norm_hidden.weight)
    assert torch.equal(disk["mtp.layers.0.mlp.experts.3.up_proj.weight"], experts.gate_up_proj[3, half:])
    assert torch.equal(
        disk["mtp.layers.0.mlp.shared_expert.down_proj.weight"], ours.mtp.layers[0].mlp.shared_experts.down_proj.weight
    )
    assert json.loads((tmp_path / "out" / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    again = _ours_from_folder(tmp_path / "out", moe=True)
    mine = ours.state_dict()
    for key, value in again.state_dict().items():
        assert torch.equal(value, mine[key]), key
    hf_back = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref_logits = ours(ids)
        ref_logits = ref_logits.logits if hasattr(ref_logits, "logits") else ref_logits
        assert (hf_back(input_ids=ids, use_cache=False).logits - ref_logits).abs().max().item() <= TOL
