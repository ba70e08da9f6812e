"""HF folders read lazily and per shard (``hf/storage.py``): every lazy conversion reads any box
exactly as the eager tensor op would; ``from_pretrained`` through the lazy path equals the eager
conversion of the whole folder (DeltaNet row regrouping, per-expert -> fused experts, Qwen3-VL-MoE hub
layout); passthrough keys stay lazy and survive an export, also into the folder they were read from; and
every kind of broken folder gets an error that names the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hyper_parallel.hf import storage as hf_storage
from hyper_parallel.hf import CheckpointKeyError, model_state_dict
from hyper_parallel.hf.storage import HFCheckpointError, HFFolder, HFTensor, StoredTensor
from hyper_parallel.hf.storage import read_safetensors, write_safetensors


def _boxes(shape: tuple[int, ...], gen: torch.Generator, n: int = 12):
    for _ in range(n):
        box = []
        for d in shape:
            a = int(torch.randint(0, d, (1,), generator=gen))
            b = int(torch.randint(a + 1, d + 1, (1,), generator=gen))
            box.append(slice(a, b))
        yield tuple(box)


def test_lazy_conversions_read_any_box_like_the_eager_ops(tmp_path):
    gen = torch.Generator().manual_seed(0)
    ts = {f"e{i}": torch.randn(6, 5, generator=gen) for i in range(4)} | {"w": torch.randn(4, 3, 5, generator=gen)}
    ts["conv"] = torch.randn(10, 1, 3, generator=gen)
    save_file(ts, str(tmp_path / "a.safetensors"))
    lazy = HFFolder.open(tmp_path / "a.safetensors").tensors
    assert all(isinstance(t, StoredTensor) for t in lazy.values())

    def regroup(rows: torch.Tensor) -> torch.Tensor:  # a DeltaNet-like row regrouping: [Q|K|V] -> per group
        q, k, v = rows.split([2, 2, 6])
        return torch.cat([q.reshape(2, 1, *rows.shape[1:]), k.reshape(2, 1, *rows.shape[1:]),
                          v.reshape(2, 3, *rows.shape[1:])], dim=1).reshape(rows.shape)  # fmt: skip

    cases = {
        "stack+cat": (
            hf_storage.cat([hf_storage.stack([lazy["e0"], lazy["e1"]]), hf_storage.stack([lazy["e2"], lazy["e3"]])], 1),
            torch.cat([torch.stack([ts["e0"], ts["e1"]]), torch.stack([ts["e2"], ts["e3"]])], 1),
        ),
        "transpose": (lazy["w"].transpose(1, 2), ts["w"].transpose(1, 2)),
        "reshape rows": (lazy["w"].reshape(4, -1), ts["w"].reshape(4, -1)),
        "reshape all": (lazy["w"].reshape(6, 10), ts["w"].reshape(6, 10)),
        "permute rows": (hf_storage.permute_rows(lazy["conv"], regroup), regroup(ts["conv"])),
    }
    for name, (node, want) in cases.items():
        assert isinstance(node, HFTensor) and tuple(node.shape) == tuple(want.shape), name
        assert torch.equal(node.read(), want), name
        for box in _boxes(tuple(want.shape), gen):
            assert torch.equal(node.read(box), want[box]), (name, box)
    assert hf_storage.equal(cases["transpose"][0], cases["transpose"][0])
    assert not hf_storage.equal(lazy["e0"], lazy["e1"])


def test_load_tensor_fills_a_block_at_an_offset(tmp_path):
    save_file({"h": torch.arange(12.0).view(3, 4)}, str(tmp_path / "h.safetensors"))
    head = HFFolder.open(tmp_path / "h.safetensors").tensors["h"]
    dst = torch.full((5, 4), -1.0)
    hf_storage.load_tensor_(dst, head, offset=(0, 0))
    assert torch.equal(dst[:3], torch.arange(12.0).view(3, 4)) and (dst[3:] == -1).all()
    with pytest.raises(ValueError, match="does not fit"):
        hf_storage.load_tensor_(dst, head)  # no offset: the shapes must be equal


# ---- whole models through from_pretrained -------------------------------------------------------


def _qwen_folder(path: Path, *, vl: bool = False) -> Path:
    from tests.torch.ut.models.qwen3_5_moe_v2.test_model import _hf_model, _hf_vl_model

    model = _hf_vl_model() if vl else _hf_model()
    model.save_pretrained(path)
    return path


def _eager(folder: Path, model) -> dict[str, torch.Tensor]:
    """The whole folder read into memory and converted by the adapter at once (the pre-sharding path)."""
    from hyper_parallel.models.qwen3_5_moe_v2 import Qwen3_5MoeStateDictAdapter

    result = Qwen3_5MoeStateDictAdapter(model.config).from_hf_checked(read_safetensors(folder))
    return result.state_dict


def test_from_pretrained_lazy_equals_the_eager_conversion(tmp_path):
    from hyper_parallel.models.qwen3_5_moe_v2 import from_pretrained

    folder = _qwen_folder(tmp_path / "hf")
    model = from_pretrained(folder)
    eager = _eager(folder, model)
    ours = model_state_dict(model)
    assert eager.keys() <= ours.keys()
    for key, t in eager.items():
        assert torch.equal(ours[key], t), key


def test_hub_fused_experts_read_lazily_equal_the_eager_transpose(tmp_path):
    """Qwen3-VL-MoE 'hub' checkpoints store fused experts transposed: a lazy read of any shard box equals the
    eager transpose."""
    from hyper_parallel.models.qwen3_vl_moe_v2 import Qwen3VlMoeStateDictAdapter, config_from_hf
    from tests.torch.ut.models.qwen3_vl_moe_v2.test_model import _vl_moe_hf

    cfg = config_from_hf(_vl_moe_hf().config.to_dict())
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in cfg.build().state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    ours = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    adapter = Qwen3VlMoeStateDictAdapter(cfg, experts_layout="hub")
    write_safetensors(adapter.to_hf(ours), tmp_path, max_shard_size="50KB")
    lazy, _ = adapter.from_hf_checked(dict(HFFolder.open(tmp_path).tensors), shapes)
    fused = [k for k in lazy if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert fused
    for key in fused:
        assert isinstance(lazy[key], HFTensor)
        for box in _boxes(tuple(shapes[key]), gen, n=4):
            assert torch.equal(lazy[key].read(box), ours[key][box]), key


def test_passthrough_stays_lazy_and_survives_an_export_into_its_own_folder(tmp_path):
    from hyper_parallel.models.qwen3_5_moe_v2 import from_pretrained, save_pretrained

    folder = _qwen_folder(tmp_path / "vl", vl=True)
    sd = read_safetensors(folder)
    sd["mtp.fc.weight"] = torch.randn(32, 64)
    write_safetensors(sd, folder, max_shard_size="100KB")
    model = from_pretrained(folder)
    kept = model.hf_passthrough
    assert kept and all(isinstance(t, HFTensor) for t in kept.values())  # references, not data
    save_pretrained(model, folder, max_shard_size="100KB")  # over the files the references point into
    again = read_safetensors(folder)
    assert again.keys() == sd.keys()
    for k in sd:
        assert torch.equal(again[k], sd[k]), k


# ---- broken folders: every error names the file ---------------------------------------------------


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good") / "hf"
    from hyper_parallel.models.qwen3_5_moe_v2 import from_pretrained, save_pretrained

    src = _qwen_folder(path.parent / "src")
    save_pretrained(from_pretrained(src), path, max_shard_size="60KB")
    return path


def _copy(good: Path, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    return bad, json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]


def _load(path: Path):
    from hyper_parallel.models.qwen3_5_moe_v2 import from_pretrained

    return from_pretrained(path)


def test_truncated_shard_names_the_file(good_folder, tmp_path):
    bad, weight_map = _copy(good_folder, tmp_path)
    victim = bad / sorted(set(weight_map.values()))[1]
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(HFCheckpointError, match=f"{victim}.*truncated"):
        _load(bad)


def test_garbage_shard_names_the_file(good_folder, tmp_path):
    bad, weight_map = _copy(good_folder, tmp_path)
    victim = bad / sorted(set(weight_map.values()))[0]
    victim.write_bytes(torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0)).byte().numpy().tobytes())
    with pytest.raises(HFCheckpointError, match=f"{victim}: not a readable safetensors file"):
        _load(bad)


def test_missing_shard_named_in_the_index(good_folder, tmp_path):
    bad, weight_map = _copy(good_folder, tmp_path)
    victim = bad / sorted(set(weight_map.values()))[-1]
    victim.unlink()
    with pytest.raises(HFCheckpointError, match=f"names shard file.*{victim}"):
        _load(bad)


def test_index_and_shard_that_disagree(good_folder, tmp_path):
    bad, weight_map = _copy(good_folder, tmp_path)
    names = sorted(set(weight_map.values()))
    shutil.copy(bad / names[0], bad / names[1])  # file 2 replaced by file 1: the index's keys are not there
    with pytest.raises(HFCheckpointError, match=f"{bad / names[1]}: the index puts"):
        _load(bad)


def _rewrite(bad: Path, weight_map: dict[str, str], key: str, value: torch.Tensor) -> Path:
    f = bad / weight_map[key]
    tensors = {k: t.read() for k, t in HFFolder.open(f).tensors.items()}
    tensors[key] = value
    save_file(tensors, str(f), metadata={"format": "pt"})
    return f


def test_dtype_mismatch_names_the_key_and_file(good_folder, tmp_path):
    bad, weight_map = _copy(good_folder, tmp_path)
    key = "model.layers.1.post_attention_layernorm.weight"
    f = _rewrite(bad, weight_map, key, torch.ones(32, dtype=torch.int32))
    with pytest.raises(CheckpointKeyError, match=f"dtype: layers.1.post_attention_layernorm.weight is torch.int32 \\(in {f}\\)"):
        _load(bad)


def test_shape_mismatch_names_the_key_and_file(good_folder, tmp_path):
    bad, weight_map = _copy(good_folder, tmp_path)
    key = "model.layers.2.mlp.shared_expert.down_proj.weight"
    f = _rewrite(bad, weight_map, key, torch.zeros(32, 7))
    with pytest.raises(CheckpointKeyError, match=f"shape: layers.2.mlp.shared_experts.down_proj.weight is \\[32, 7\\] \\(in {f}\\)"):
        _load(bad)


def test_export_rounds_keep_each_ranks_order_and_give_each_rank_one_tensor():
    # the sharded export's schedule (save_converted): keys of 4 ranks, some for two ranks at once
    g = torch.Generator().manual_seed(0)
    order = [f"k{i:02d}" for i in range(40)]
    dests = {}
    for k in order:
        first = int(torch.randint(4, (1,), generator=g))
        dests[k] = (first,) if torch.rand(1, generator=g) > 0.15 else tuple(sorted({first, (first + 1) % 4}))
    rounds = hf_storage._rounds(order, dests)
    assert sorted(k for r in rounds for k in r) == order  # every key once
    for r in rounds:
        ranks = [d for k in r for d in dests[k]]
        assert len(ranks) == len(set(ranks)), r  # a rank assembles one tensor per exchange
        assert len(r) == 1 or all(len(dests[k]) == 1 for k in r), r  # a key for several ranks goes alone
    for rank in range(4):  # each rank meets its keys in the plan's order (its files fill one after another)
        seen = [k for r in rounds for k in r if rank in dests[k]]
        assert seen == [k for k in order if rank in dests[k]], rank
    assert len(rounds) < len(order)  # ranks do go together
