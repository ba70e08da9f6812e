"""GLM-4.7-Flash's nextn (MTP) layer with MTP OFF: a Glm4MoeLite folder's ``model.layers.{num_hidden_layers}.*``
keys are kept as lazy passthrough, written back unchanged by the export (GlmImageMoe format: under
``model.language_model.``; ``text_only``: under ``model.``), and a later run with MTP on loads them from that
export into the MTP block (the weights equal the folder's; the MTP logits equal those of the original folder
loaded with MTP on). Before, the adapter dropped them on load and the export had no nextn layer."""

from __future__ import annotations

import json

import torch
from transformers import Glm4MoeLiteForCausalLM

from hyper_parallel.data.packing import add_mtp_targets
from hyper_parallel.models.glm_image_moe_v2 import from_pretrained, save_pretrained
from hyper_parallel.hf import read_safetensors, write_safetensors
from hyper_parallel.hf.storage import HFTensor
from tests.torch.ut.hf_utils import randomize_, tiny_lite_config
from tests.torch.ut.models.glm_image_moe_v2.test_mtp import _HFNextn

L = 3  # tiny_lite_config's num_hidden_layers: the nextn layer's index
IMAGE_PART = dict(codebook_size=24, vq_embed_dim=12, image_path=True)  # a text-only folder: a small image part grown
# our MTP block <-> the nextn layer's names (vLLM glm4_moe_lite_mtp.py); the layer's own keys keep their names
_NEXTN = {"pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "fc": "eh_proj", "norm": "shared_head.norm"}


def _nextn_folder(tmp_path):
    """A Glm4MoeLite folder with a nextn layer (and DeepSeek-style copies of the embedding and head in it)."""
    hf = Glm4MoeLiteForCausalLM(tiny_lite_config())
    randomize_(hf, 0)
    folder = tmp_path / "flash"
    hf.save_pretrained(folder)
    sd = read_safetensors(folder)
    sd.update(_HFNextn(hf.config, seed=11).hf_keys())
    sd[f"model.layers.{L}.embed_tokens.weight"] = torch.randn(sd["model.embed_tokens.weight"].shape)  # stale copies
    sd[f"model.layers.{L}.shared_head.head.weight"] = torch.randn(sd["lm_head.weight"].shape)
    write_safetensors(sd, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, {k: v for k, v in sd.items() if k.startswith(f"model.layers.{L}.")}


def _nextn_name(ours: str) -> str:
    """Our ``mtp.*`` name -> the nextn layer's key suffix (fused experts: the name of the stacked keys)."""
    head, _, rest = ours[len("mtp.") :].partition(".")
    if head == "layers":
        return rest.partition(".")[2]
    return f"{_NEXTN[ours[len('mtp.') : -len('.weight')]]}.weight"


def _assert_block_equals_folder(model, nextn: dict[str, torch.Tensor]) -> None:
    n = 0
    for name, p in model.named_parameters():
        if not name.startswith("mtp."):
            continue
        rest = _nextn_name(name)
        base = f"model.layers.{L}."
        if rest == "mlp.experts.gate_up_proj":
            for e in range(p.shape[0]):
                gate, up = (nextn[f"{base}mlp.experts.{e}.{proj}.weight"] for proj in ("gate_proj", "up_proj"))
                want = torch.cat([gate, up])
                assert torch.equal(p[e], want), (name, e)
        elif rest == "mlp.experts.down_proj":
            for e in range(p.shape[0]):
                assert torch.equal(p[e], nextn[f"{base}mlp.experts.{e}.down_proj.weight"]), (name, e)
        else:
            assert torch.equal(p, nextn[base + rest]), name
        n += 1
    assert n > 10, n


def _mtp_logits(model) -> torch.Tensor:
    ids = torch.randint(0, 255, (2, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(ids, mtp_input_ids=add_mtp_targets({"input_ids": ids, "labels": ids})["mtp_input_ids"]).mtp_logits


def test_mtp_off_keeps_the_nextn_layer_and_mtp_on_loads_it_from_the_export(tmp_path):
    folder, nextn = _nextn_folder(tmp_path)
    torch.manual_seed(0)
    off = from_pretrained(folder, **IMAGE_PART)
    assert off.config.mtp is None and not any(n.startswith("mtp.") for n, _ in off.named_parameters())
    assert sorted(off.hf_passthrough) == sorted(nextn)  # every key of the layer, the stale copies included
    assert all(isinstance(t, HFTensor) for t in off.hf_passthrough.values())  # lazy: read again on export

    save_pretrained(off, tmp_path / "img")
    save_pretrained(off, tmp_path / "text", text_only=True)
    for export, prefix in ((tmp_path / "img", "model.language_model."), (tmp_path / "text", "model.")):
        disk = read_safetensors(export)
        written = {k: v for k, v in disk.items() if k.startswith(f"{prefix}layers.{L}.")}
        assert len(written) == len(nextn), (export.name, sorted(set(disk) - set(nextn))[:5])
        for key, want in nextn.items():
            got = disk[prefix + key[len("model.") :]]
            assert got.dtype == want.dtype and torch.equal(got, want), (export.name, key)
        cfg = json.loads((export / "config.json").read_text())
        assert (cfg if export.name == "text" else cfg["text_config"])["num_nextn_predict_layers"] == 1

    torch.manual_seed(0)
    reference = from_pretrained(folder, mtp=True, **IMAGE_PART).eval()  # the original folder with MTP on
    for export in (tmp_path / "img", tmp_path / "text"):
        torch.manual_seed(0)
        on = from_pretrained(export, mtp=True, **({} if export.name == "img" else IMAGE_PART)).eval()
        assert not on.hf_passthrough or not any(f"layers.{L}." in k for k in on.hf_passthrough)
        _assert_block_equals_folder(on, nextn)
        assert torch.equal(_mtp_logits(on), _mtp_logits(reference)), export.name


def test_passthrough_nextn_layer_survives_a_second_round_trip(tmp_path):
    """GlmImageMoe export -> load with MTP off -> export again: the same bytes, under the same names."""
    folder, nextn = _nextn_folder(tmp_path)
    save_pretrained(from_pretrained(folder, **IMAGE_PART), tmp_path / "one")
    again = from_pretrained(tmp_path / "one")
    assert sorted(again.hf_passthrough) == sorted("model.language_model." + k[len("model.") :] for k in nextn)
    save_pretrained(again, tmp_path / "two")
    one, two = read_safetensors(tmp_path / "one"), read_safetensors(tmp_path / "two")
    assert sorted(one) == sorted(two)
    for key, value in one.items():
        assert torch.equal(two[key], value), key
