"""HF I/O of the Qwen3.5-MoE VL model's MTP block (``qwen3_vl_moe_v2``): a model built from a recipe with MTP
exports ``mtp.*`` plus ``text_config.mtp_num_hidden_layers`` (the released Qwen3.5-MoE VL folders' key, which
vLLM's ``Qwen3_5MultiTokenPredictor`` reads), ``from_pretrained(path, mtp=True)`` loads it back with equal MTP
logits, transformers loads the export with unchanged logits (it ignores ``mtp.*``), a run with MTP off keeps
the keys byte for byte, and the trainer's ``--checkpoint.export_hf`` of the VL MTP recipe writes the count."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hyper_parallel.config import ConfigManager  # noqa: E402
from hyper_parallel.data.packing import add_mtp_targets  # noqa: E402
from hyper_parallel.models.qwen3_vl_moe_v2 import from_pretrained, save_pretrained  # noqa: E402
from hyper_parallel.models.qwen3_vl_moe_v2.config_registry import (  # noqa: E402
    qwen3_5_moe_vl_debug,
    qwen3_5_moe_vl_mtp_debug,
)
from hyper_parallel.hf import read_safetensors  # noqa: E402
from hyper_parallel.hf.convert import full_tensor  # noqa: E402
from hyper_parallel.hf.storage import HFTensor  # noqa: E402

IMG, VS, VE = 512, 513, 514  # the VL debug recipes' toy ids
TOL = 1e-5


def _batch() -> dict[str, torch.Tensor]:
    grid = torch.tensor([[1, 4, 4], [1, 4, 6]])  # 4 and 6 merged tokens
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[1, 2, VS] + [IMG] * 4 + [VE, 7, 8, VS] + [IMG] * 6 + [VE, 9, 10]])
    mtp_ids = add_mtp_targets({"input_ids": ids, "labels": ids})["mtp_input_ids"]
    return dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mtp_input_ids=mtp_ids)


def _run(model, b: dict[str, torch.Tensor]):
    with torch.no_grad():
        return model(b["input_ids"], pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"],
                     mtp_input_ids=b["mtp_input_ids"])  # fmt: skip


def _trained(config) -> torch.nn.Module:
    torch.manual_seed(0)
    model = config.build()
    model.init_weights()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # every weight "trained": off the seeded init a reload would otherwise reproduce
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return model.eval()


def test_recipe_mtp_export_loads_back_with_equal_mtp_logits(tmp_path):
    model = _trained(qwen3_5_moe_vl_mtp_debug().model)
    save_pretrained(model, tmp_path / "export")
    hf_config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert hf_config["model_type"] == "qwen3_5_moe"
    assert hf_config["text_config"]["mtp_num_hidden_layers"] == 1
    disk = read_safetensors(tmp_path / "export")
    assert torch.equal(disk["mtp.fc.weight"], model.mtp.fc.weight)
    assert torch.equal(disk["mtp.pre_fc_norm_embedding.weight"], model.mtp.pre_fc_norm_embedding.weight)
    down = model.mtp.layers[0].mlp.experts.down_proj
    assert torch.equal(disk["mtp.layers.0.mlp.experts.1.down_proj.weight"], down[1])

    back = from_pretrained(tmp_path / "export", mtp=True).eval()
    assert back.config.mtp is not None and not back.hf_passthrough
    mine = model.state_dict()
    for key, value in back.state_dict().items():
        assert torch.equal(value, mine[key]), key
    b = _batch()
    out, again = _run(model, b), _run(back, b)
    assert torch.equal(again.mtp_logits, out.mtp_logits) and torch.equal(again.logits, out.logits)

    # transformers ignores mtp.* and computes our trunk's logits
    hf_cls = transformers.Qwen3_5MoeForConditionalGeneration
    hf = hf_cls.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    hf.config._attn_implementation = "sdpa"
    with torch.no_grad():
        hf_logits = hf(input_ids=b["input_ids"], pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"],
                       mm_token_type_ids=(b["input_ids"] == IMG).int(), use_cache=False).logits  # fmt: skip
    err = (hf_logits - out.logits).abs().max().item()
    assert err <= TOL, err


def test_mtp_off_keeps_the_keys_byte_for_byte_and_mtp_on_loads_them(tmp_path):
    model = _trained(qwen3_5_moe_vl_mtp_debug().model)
    save_pretrained(model, tmp_path / "export")
    assert from_pretrained(tmp_path / "export", mtp=None).config.mtp is not None  # None: as the folder says (MTP 1)
    off = from_pretrained(tmp_path / "export", mtp=False)
    assert off.config.mtp is None
    kept = {k: v for k, v in off.hf_passthrough.items() if k.startswith("mtp.")}
    assert kept and all(isinstance(t, HFTensor) for t in kept.values())  # lazy: read again on export
    save_pretrained(off, tmp_path / "again")
    first, second = read_safetensors(tmp_path / "export"), read_safetensors(tmp_path / "again")
    assert sorted(second) == sorted(first)
    for key in first:
        assert torch.equal(second[key], first[key]), key
    assert json.loads((tmp_path / "again" / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    back = from_pretrained(tmp_path / "again", mtp=True).eval()
    b = _batch()
    assert torch.equal(_run(back, b).mtp_logits, _run(model, b).mtp_logits)
    # stale mtp.* references beside a live block: the block's (trained) weights are the ones written
    back.hf_passthrough.update(kept)
    with torch.no_grad():
        back.mtp.fc.weight.add_(1.0)
    save_pretrained(back, tmp_path / "live")
    assert torch.equal(read_safetensors(tmp_path / "live")["mtp.fc.weight"], back.mtp.fc.weight)


def test_mtp_flag_on_a_folder_without_an_mtp_block_names_the_key(tmp_path):
    save_pretrained(_trained(qwen3_5_moe_vl_debug().model), tmp_path / "plain")
    assert "mtp_num_hidden_layers" not in json.loads((tmp_path / "plain" / "config.json").read_text())["text_config"]
    with pytest.raises(ValueError, match="mtp_num_hidden_layers"):
        from_pretrained(tmp_path / "plain", mtp=True)
    assert from_pretrained(tmp_path / "plain").config.mtp is None


def test_trainer_export_of_the_vl_mtp_recipe_writes_the_count(tmp_path):
    """The recipe / CLI path: ``--checkpoint.export_hf`` of a VL run with MTP on loads back with its MTP."""
    cfg = ConfigManager().parse_args([
        "--module", "qwen3_vl_moe", "--config", "qwen3_5_moe_vl_mtp_debug", "--training.steps", "1",
        "--data.max_tokens_per_microbatch", "256", "--data.global_batch_tokens", "256", "--checkpoint.no_enable",
        "--checkpoint.export_hf", "--dump_folder", str(tmp_path),
    ])  # fmt: skip
    trainer = cfg.build()
    try:
        trainer.train()
        state = trainer.model.state_dict()
        trained = {k: full_tensor(v).detach().clone() for k, v in state.items() if k.startswith("mtp.")}
    finally:
        trainer.close()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    back = from_pretrained(tmp_path / "hf", mtp=True)
    loaded = {k: v for k, v in back.state_dict().items() if k.startswith("mtp.")}
    assert sorted(loaded) == sorted(trained) and trained
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), key


def test_qwen3_vl_moe_mtp_block_round_trips_at_the_top_level(tmp_path):
    """Qwen3-VL-MoE ships no MTP block; one trained here is written as top-level ``mtp.*`` (our names, like
    Qwen3.5's), never under ``model.language_model.``, and loads back exactly."""
    from hyper_parallel.models.qwen3_5_v2.model import qwen3_5_with_mtp
    from hyper_parallel.models.qwen3_vl_moe_v2.config_registry import qwen3_vl_moe_debug

    model = _trained(qwen3_5_with_mtp(qwen3_vl_moe_debug().model))
    save_pretrained(model, tmp_path / "export")
    disk = read_safetensors(tmp_path / "export")
    assert torch.equal(disk["mtp.fc.weight"], model.mtp.fc.weight)
    assert not any(k.startswith("model.language_model.mtp") for k in disk)
    back = from_pretrained(tmp_path / "export", mtp=True)
    mine = model.state_dict()
    for key, value in back.state_dict().items():
        assert torch.equal(value, mine[key]), key
