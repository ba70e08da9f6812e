"""FP8 block-quantized releases load dequantized (issue 31 item 5).

An FP8-form folder is made here from an HF folder written by transformers (shrunk; dims that are not multiples
of 128, so every quantized weight has ragged edge blocks): each quantized module's full-precision weight (its
blocks scaled apart by powers of two, so a scale applied to the wrong block shows) is rounded to
``float8_e4m3fn`` per 128 x 128 block with a float32 ``weight_scale_inv`` beside it, the rest (embeddings,
norms, ``lm_head``, the router gate, the shared-expert gate, DeltaNet's small projections, the vision tower,
one module listed in ``modules_to_not_convert``) stays as it was, and ``config.json`` gets the release's
``quantization_config``. The reference folder holds the same weights dequantized with plain torch loops. Both
load through ``from_pretrained``; the FP8 one must give the reference's parameters bit for bit and its logits
(and transformers' logits on the reference folder within 1e-5); its export has no scales and no
``quantization_config``. Any other quantization is refused, naming ``quantization_config.<key>`` and the file,
before a tensor is read. The 2-rank loads (FSDP 2, EP 2, TP 2: shards crossing block edges) are in
``tests/torch/st/test_fp8_sharded_load.py``, which builds its folders with :func:`write_fp8_release`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyper_parallel.models import glm_image_moe_v2, qwen3_5_moe_v2, qwen3_5_v2, qwen3_vl_moe_v2
from hyper_parallel.models.qwen3_vl_moe_v2.state_dict import config_to_hf as vl_config_to_hf
from hyper_parallel.hf import quant as hf_quant
from hyper_parallel.hf.quant import UnsupportedQuantizationError
from hyper_parallel.hf.storage import HFCheckpointError, HFFolder, StoredTensor
from hyper_parallel.protocols.model import split_output

BLOCK = (128, 128)
FP8 = torch.float8_e4m3fn
FP8_CONFIG = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
}  # fmt: skip
TOL = 1e-5

# ---- an FP8 release from a full-precision folder (plain torch, block by block) ---------------------------


def _blocks(shape: torch.Size) -> list[tuple[slice, slice, int, int]]:
    bi, bj = BLOCK
    return [
        (slice(a, a + bi), slice(b, b + bj), a // bi, b // bj)
        for a in range(0, shape[-2], bi)
        for b in range(0, shape[-1], bj)
    ]


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` rounded to float8_e4m3fn per block (amax -> 448) and its float32 ``weight_scale_inv``."""
    bi, bj = BLOCK
    q = torch.empty(w.shape, dtype=FP8)
    s = torch.empty(-(-w.shape[0] // bi), -(-w.shape[1] // bj))
    for rows, cols, i, j in _blocks(w.shape):
        scale = w[rows, cols].abs().amax().clamp(min=1e-12) / 448.0
        s[i, j] = scale
        q[rows, cols] = (w[rows, cols] / scale).clamp(-448.0, 448.0).to(FP8)
    return q, s


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The dense weight an FP8 release stands for: each block's FP8 values times its scale."""
    out = torch.empty(q.shape)
    for rows, cols, i, j in _blocks(q.shape):
        out[rows, cols] = q[rows, cols].float() * s[i, j]
    return out


def _spread_blocks(w: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``w`` with each block scaled by 2^k, k in [-3, 3]: the blocks' scales differ by up to 64x."""
    w = w.clone()
    for rows, cols, _, _ in _blocks(w.shape):
        w[rows, cols] *= 2.0 ** int(torch.randint(-3, 4, (), generator=g))
    return w


def _save_two_files(sd: dict[str, torch.Tensor], folder: Path) -> None:
    """Two safetensors files + index; keys alternate, so a weight and its scale often sit in different files."""
    keys = sorted(sd)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    parts = [{k: sd[k].contiguous() for k in keys[i::2]} for i in range(2)]
    for name, part in zip(names, parts, strict=True):
        save_file(part, str(folder / name), metadata={"format": "pt"})
    weight_map = {k: names[i] for i in range(2) for k in parts[i]}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write_fp8_release(
    src: Path,
    fp8_dir: Path,
    ref_dir: Path,
    *,
    quantize: Callable[[str, torch.Tensor], bool],
    not_convert: list[str],
    extra: dict[str, torch.Tensor] | None = None,
    seed: int = 0,
) -> list[str]:
    """From the HF folder ``src`` (+ ``extra`` tensors): an FP8 release in ``fp8_dir`` (the keys ``quantize``
    picks, except the modules in ``not_convert``, as FP8 + ``weight_scale_inv``) and in ``ref_dir`` the same
    model with those weights dequantized (float32). Returns the quantized keys."""
    g = torch.Generator().manual_seed(seed)
    sd = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    sd.update(extra or {})
    fp8, ref, quantized = {}, {}, []
    for key in sorted(sd):
        t = sd[key]
        if quantize(key, t) and key.removesuffix(".weight") not in not_convert:
            q, s = quantize_blocks(_spread_blocks(t.float(), g))
            fp8[key], fp8[key + hf_quant.SCALE_SUFFIX], ref[key] = q, s, dequantize_blocks(q, s)
            quantized.append(key)
        else:
            fp8[key] = ref[key] = t
    config = json.loads((src / "config.json").read_text())
    for folder, tensors, cfg in (
        (fp8_dir, fp8, {**config, "dtype": "bfloat16",
                        "quantization_config": {**FP8_CONFIG, "modules_to_not_convert": not_convert}}),
        (ref_dir, ref, config),
    ):  # fmt: skip
        folder.mkdir(parents=True)
        _save_two_files(tensors, folder)
        (folder / "config.json").write_text(json.dumps(cfg))
    return quantized


# what the Qwen3.5 / Qwen3.6 FP8 releases quantize: every projection of attention, DeltaNet (except the per-head
# in_proj_a / in_proj_b), the experts and the shared expert, and the MTP block; never the vision tower
_QWEN_QUANTIZED = re.compile(r"(_proj|\.fc)\.weight$")
_QWEN_KEPT = re.compile(r"(^model\.visual\.|in_proj_[ab]\.weight$)")


def _qwen_quantized(key: str, t: torch.Tensor) -> bool:
    return t.ndim == 2 and bool(_QWEN_QUANTIZED.search(key)) and not _QWEN_KEPT.search(key)


# GLM-4.7-Flash: MLA projections, dense MLP, experts, shared experts, the nextn eh_proj; router gate kept
_GLM_QUANTIZED = re.compile(r"(_proj|_proj_with_mqa)\.weight$")


def _glm_quantized(key: str, t: torch.Tensor) -> bool:
    return t.ndim == 2 and bool(_GLM_QUANTIZED.search(key))


# ---- the two families' shrunk releases -------------------------------------------------------------------

QWEN_NOT_CONVERTED = "model.language_model.layers.1.self_attn.o_proj"  # listed in modules_to_not_convert
GLM_NOT_CONVERTED = "model.layers.1.mlp.shared_experts.down_proj"


def _qwen_text(**overrides: Any) -> dict[str, Any]:
    """Hidden 160, 1 DeltaNet + 1 gated-attention layer: q_proj 320 x 160, in_proj_qkv 160 x 160, experts
    136 x 160 / 160 x 136, shared expert 200: every quantized weight has ragged edge blocks."""
    kw: dict[str, Any] = dict(
        vocab_size=640, hidden_size=160, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=40, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=20, linear_value_head_dim=20, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=136, shared_expert_intermediate_size=200,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25, mrope_section=[2, 2, 1]),
    )  # fmt: skip
    kw.update(overrides)
    return kw


def qwen_release(root: Path) -> tuple[Path, Path, list[str], Any]:
    """A shrunk Qwen3.5-MoE ConditionalGeneration release (vision tower, ``mtp.*``) in FP8 form and dequantized;
    returns (fp8 folder, reference folder, quantized keys, the transformers model of the reference)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    from tests.torch.ut.hf_utils import randomize_
    from tests.torch.ut.models.qwen3_5_moe_v2.test_model import _hf_like_decay_

    cfg = Qwen3_5MoeConfig(
        text_config=_qwen_text(),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=160, num_position_embeddings=16),
        image_token_id=600, video_token_id=601, vision_start_token_id=602, vision_end_token_id=603,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    cfg.text_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    randomize_(hf, 0)
    _hf_like_decay_(hf)
    hf.save_pretrained(root / "src")
    g = torch.Generator().manual_seed(5)
    mtp = {  # the MTP block ships quantized too; with MTP off it is passthrough, exported dense
        "mtp.fc.weight": torch.randn(160, 320, generator=g) * 0.05,
        "mtp.layers.0.input_layernorm.weight": torch.randn(160, generator=g),
    }
    not_convert = ["lm_head", "model.language_model.embed_tokens", "model.visual", QWEN_NOT_CONVERTED]
    quantized = write_fp8_release(
        root / "src", root / "fp8", root / "ref", quantize=_qwen_quantized, not_convert=not_convert, extra=mtp
    )
    oracle = Qwen3_5MoeForConditionalGeneration.from_pretrained(root / "ref").eval()
    return root / "fp8", root / "ref", quantized, oracle


def glm_release(root: Path) -> tuple[Path, Path, list[str], Any]:
    """A shrunk GLM-4.7-Flash (Glm4MoeLite) release with its nextn layer, in FP8 form and dequantized."""
    from transformers import Glm4MoeLiteForCausalLM

    from tests.torch.ut.hf_utils import randomize_, tiny_lite_config

    cfg = tiny_lite_config(
        hidden_size=200, intermediate_size=264, moe_intermediate_size=136, num_hidden_layers=2, q_lora_rank=136,
        kv_lora_rank=72, num_attention_heads=2, num_key_value_heads=2, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_group=1, topk_group=1,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Glm4MoeLiteForCausalLM(cfg).eval()
    randomize_(hf, 0)
    hf.save_pretrained(root / "src")
    g = torch.Generator().manual_seed(6)
    nextn = {  # layer L = num_hidden_layers: the MTP layer HF does not build (passthrough with MTP off)
        "model.layers.2.eh_proj.weight": torch.randn(200, 400, generator=g) * 0.05,
        "model.layers.2.enorm.weight": torch.randn(200, generator=g),
    }
    not_convert = ["lm_head", "model.embed_tokens", GLM_NOT_CONVERTED]
    quantized = write_fp8_release(
        root / "src", root / "fp8", root / "ref", quantize=_glm_quantized, not_convert=not_convert, extra=nextn
    )
    return root / "fp8", root / "ref", quantized, Glm4MoeLiteForCausalLM.from_pretrained(root / "ref").eval()


FAMILIES = {"qwen3_5_moe": (qwen3_5_moe_v2, qwen_release), "glm4_moe_lite": (glm_image_moe_v2, glm_release)}


def _ids(high: int) -> torch.Tensor:
    return torch.randint(0, high, (2, 12), generator=torch.Generator().manual_seed(1))


# ---- the lazy dequantization itself ------------------------------------------------------------------------


def test_a_box_reads_its_fp8_slice_and_the_covering_scales_only(tmp_path, monkeypatch):
    """Boxes of a [300, 200] and a stacked [3, 300, 200] weight (ragged blocks; chunked reads) equal the
    block-by-block dequantization, and each read touches only the box of the weight and the scale blocks
    covering it."""
    g = torch.Generator().manual_seed(0)
    w2 = _spread_blocks(torch.randn(300, 200, generator=g), g)
    q2, s2 = quantize_blocks(w2)
    stacked = [quantize_blocks(_spread_blocks(torch.randn(300, 200, generator=g), g)) for _ in range(3)]
    q3, s3 = torch.stack([q for q, _ in stacked]), torch.stack([s for _, s in stacked])
    tensors = {"a.weight": q2, "a.weight_scale_inv": s2, "e.w": q3, "e.w_scale_inv": s3}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    quant = hf_quant.FP8BlockQuantization(block=BLOCK)
    lazy = hf_quant.dequantize_lazy(HFFolder.open(tmp_path).tensors, quant, where="t")
    assert sorted(lazy) == ["a.weight", "e.w"]  # the scales are consumed
    ref2 = dequantize_blocks(q2, s2)
    ref3 = torch.stack([dequantize_blocks(q, s) for q, s in stacked])
    reads: list[tuple[str, tuple[slice, ...]]] = []
    original = StoredTensor.read_into

    def recording(self: StoredTensor, out: torch.Tensor, box: Any) -> None:
        reads.append((self.key, tuple(box)))
        original(self, out, box)

    monkeypatch.setattr(StoredTensor, "read_into", recording)
    monkeypatch.setattr(hf_quant, "_CHUNK_ELEMENTS", 128 * 64)  # several chunks per box
    for (r0, r1), (c0, c1) in [((0, 300), (0, 200)), ((150, 300), (0, 200)), ((0, 300), (100, 200)),
                               ((127, 129), (127, 129)), ((256, 300), (128, 200)), ((5, 260), (64, 136))]:  # fmt: skip
        reads.clear()
        got = torch.empty(r1 - r0, c1 - c0)
        lazy["a.weight"].read_into(got, (slice(r0, r1), slice(c0, c1)))
        assert torch.equal(got, ref2[r0:r1, c0:c1]), (r0, r1, c0, c1)
        scale_boxes = [b for k, b in reads if k == "a.weight_scale_inv"]
        weight_rows = [b[0] for k, b in reads if k == "a.weight"]
        assert scale_boxes == [(slice(r0 // 128, -(-r1 // 128)), slice(c0 // 128, -(-c1 // 128)))]
        assert weight_rows[0].start == r0 and weight_rows[-1].stop == r1
        assert all(a.stop == b.start for a, b in zip(weight_rows, weight_rows[1:]))  # each row once
        assert all(b[1] == slice(c0, c1) for k, b in reads if k == "a.weight")
        got3 = torch.empty(2, r1 - r0, c1 - c0)
        lazy["e.w"].read_into(got3, (slice(1, 3), slice(r0, r1), slice(c0, c1)))
        assert torch.equal(got3, ref3[1:3, r0:r1, c0:c1]), (r0, r1, c0, c1)
    # without a destination dtype it reads as the release's declared dtype (bf16 by default)
    assert lazy["a.weight"].read().dtype == torch.bfloat16
    assert torch.equal(lazy["a.weight"].read(), ref2.to(torch.bfloat16))


def test_a_scale_of_the_wrong_shape_names_the_rule(tmp_path):
    q, s = quantize_blocks(torch.randn(300, 200))
    save_file({"a.weight": q, "a.weight_scale_inv": s[:2]}, str(tmp_path / "model.safetensors"))
    rule = r"a\.weight_scale_inv .*\[2, 2\].*must be a float tensor of shape \[3, 2\]"
    with pytest.raises(HFCheckpointError, match=rule):
        hf_quant.dequantize_lazy(HFFolder.open(tmp_path).tensors, hf_quant.FP8BlockQuantization(block=BLOCK), where="t")


# ---- whole releases -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> Callable[[str], tuple[Path, Path, list[str], Any]]:
    """``releases(family)``: that family's (fp8 folder, reference folder, quantized keys, transformers model),
    made once per module."""
    made: dict[str, tuple[Path, Path, list[str], Any]] = {}

    def get(family: str) -> tuple[Path, Path, list[str], Any]:
        if family not in made:
            made[family] = FAMILIES[family][1](tmp_path_factory.mktemp(family))
        return made[family]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_release_loads_to_the_dequantized_model_and_exports_dense(tmp_path, releases, family):
    package = FAMILIES[family][0]
    fp8_dir, ref_dir, quantized, hf = releases(family)
    assert len(quantized) > 10
    kept_fp8 = [k for k, v in load_file(str(next(fp8_dir.glob("*.safetensors")))).items() if v.dtype != FP8]
    assert kept_fp8, "some modules of the release stay unquantized"
    ours, ref = package.from_pretrained(fp8_dir), package.from_pretrained(ref_dir)
    vocab = hf.config.get_text_config().vocab_size
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    # GLM: the image parts a Glm4MoeLite folder lacks (VQ, head rows [V, V+C)) are initialised, not loaded
    loaded = {k: (lambda t, k=k: t[:vocab] if k == "lm_head.weight" else t) for k in b if not k.startswith("vq_")}
    differ = [k for k, part in loaded.items() if not torch.equal(part(a[k]), part(b[k]))]
    assert differ == [], differ[:5]
    # the module listed in modules_to_not_convert kept its full-precision weight (never rounded through FP8)
    src = {k: v for f in (fp8_dir.parent / "src").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    listed = QWEN_NOT_CONVERTED if family == "qwen3_5_moe" else GLM_NOT_CONVERTED
    ours_listed = listed.replace("model.language_model.", "").replace("model.", "") + ".weight"
    assert torch.equal(a[ours_listed], src[listed + ".weight"])
    ids = _ids(90 if family == "qwen3_5_moe" else vocab - 1)  # no image / placeholder tokens
    with torch.no_grad():
        got, want = split_output(ours(ids))[0][..., :vocab], split_output(ref(ids))[0][..., :vocab]
        oracle = hf(input_ids=ids, use_cache=False).logits
    diff_ref, diff_hf = (got - want).abs().max().item(), (got - oracle).abs().max().item()
    size = oracle.abs().max().item()
    print(f"{family}: max |logits FP8 folder - dequantized folder| = {diff_ref:.3g}, vs transformers on the "
          f"dequantized folder {diff_hf:.3g} (max |logit| {size:.3g})")  # fmt: skip
    # transformers: fp32 rounding of other kernels, relative to the logits' size (the blocks' spread makes them large)
    assert diff_ref <= TOL and diff_hf <= TOL * max(1.0, size), (diff_ref, diff_hf, size)

    # the export: the training dtype, dense, no scales, no quantization_config; the FP8 passthrough written dense
    package.save_pretrained(ours, tmp_path / "export")
    exported = {k: v for f in (tmp_path / "export").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    text = (tmp_path / "export" / "config.json").read_text()
    assert "quantization_config" not in text and "weight_block_size" not in text
    assert not [k for k in exported if k.endswith("_scale_inv")]
    assert not [k for k, v in exported.items() if v.dtype == FP8]
    ref_sd = {k: v for f in ref_dir.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    passthrough = "mtp.fc.weight" if family == "qwen3_5_moe" else "eh_proj.weight"
    key = next(k for k in exported if k.endswith(passthrough))
    ref_key = next(k for k in ref_sd if k.endswith(passthrough))
    assert ref_key in quantized
    assert exported[key].dtype == torch.bfloat16  # the release's declared dtype (its dense form)
    assert torch.equal(exported[key], ref_sd[ref_key].to(torch.bfloat16))
    back = package.from_pretrained(tmp_path / "export").state_dict()  # the export reads back as the same model
    # GLM's save_pretrained writes the folder's declared dtype by default (bf16; issue 41), Qwen's the training dtype
    rounded = (lambda t: t.to(torch.bfloat16).to(t.dtype)) if family == "glm4_moe_lite" else (lambda t: t)
    assert all(torch.equal(part(back[k]), rounded(part(b[k]))) for k, part in loaded.items())


# ---- what is refused, and how ---------------------------------------------------------------------------


def test_fp8_release_through_the_trainer_initial_load_path(tmp_path, releases):
    """The CLI path (``--checkpoint.initial_load_path`` an FP8 release): the run's model is the release's,
    dequantized: every parameter equals the one-process load of the dequantized folder."""
    from hyper_parallel.config import ConfigManager
    from hyper_parallel.hf.convert import full_tensor

    fp8_dir, ref_dir, _, _ = releases("qwen3_5_moe")
    cfg = ConfigManager().parse_args(
        ["--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--dump_folder", str(tmp_path / "run"),
         "--checkpoint.initial_load_path", str(fp8_dir), "--checkpoint.enable", "False"]
    )  # fmt: skip
    trainer = cfg.build()
    try:
        got = {k: full_tensor(v) for k, v in trainer.model.state_dict().items()}
        assert "quantization_config" not in repr(trainer.model.config)
    finally:
        trainer.close()
    want = qwen3_5_moe_v2.from_pretrained(ref_dir).state_dict()
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert differ == [], differ[:5]


@pytest.fixture(scope="module")
def glm_fp8(releases):
    return releases("glm4_moe_lite")[0]


def _with_config(src: Path, dst: Path, quantization_config: Any) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    if quantization_config is None:
        cfg.pop("quantization_config")
    else:
        cfg["quantization_config"] = quantization_config
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "qc, field, value",
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quant_method", "'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method", "'gptq'"),
        ({"quant_method": "compressed-tensors", "config_groups": {}}, "quant_method", "'compressed-tensors'"),
        ({**FP8_CONFIG, "weight_block_size": None}, "weight_block_size", "None"),
        ({**FP8_CONFIG, "fmt": "e5m2"}, "fmt", "'e5m2'"),
        ({**FP8_CONFIG, "activation_scheme": "static"}, "activation_scheme", "'static'"),
    ],
)  # fmt: skip
def test_other_quantization_is_refused_naming_the_key_before_any_read(tmp_path, glm_fp8, monkeypatch, qc, field, value):
    folder = _with_config(glm_fp8, tmp_path / "q", qc)
    reads: list[str] = []
    monkeypatch.setattr(StoredTensor, "read_into", lambda self, out, box: reads.append(self.key))
    pattern = rf"{re.escape(str(folder / 'config.json'))}: quantization_config\.{field}={re.escape(value)}"
    with pytest.raises(UnsupportedQuantizationError, match=pattern):
        glm_image_moe_v2.from_pretrained(folder)
    with pytest.raises(UnsupportedQuantizationError, match=rf"quantization_config\.{field}="):  # the reader too
        glm_image_moe_v2.config_from_hf(json.loads((folder / "config.json").read_text()))
    assert reads == []


def test_fp8_tensors_without_quantization_config_name_fp8(tmp_path, glm_fp8):
    """A release whose config.json lost its quantization_config: the error names FP8 and the key (it used to be
    'N problem(s): unexpected: ...weight_scale_inv')."""
    folder = _with_config(glm_fp8, tmp_path / "bare", None)
    with pytest.raises(HFCheckpointError, match=r"FP8 block-quantized tensors .* has no quantization_config") as e:
        glm_image_moe_v2.from_pretrained(folder)
    assert "unexpected" not in str(e.value)


RELEASED = Path(__file__).parents[1] / "released_configs"
READERS = [
    ("qwen3_5_35b_a3b.json", qwen3_5_moe_v2), ("qwen3_6_35b_a3b.json", qwen3_5_moe_v2),
    ("qwen3_5_35b_a3b.json", qwen3_vl_moe_v2), ("qwen3_vl_30b_a3b_instruct.json", qwen3_vl_moe_v2),
    ("qwen3_5_27b.json", qwen3_5_v2), ("glm_4_7_flash.json", glm_image_moe_v2),
]  # fmt: skip


_WRITERS = {
    qwen3_5_moe_v2: qwen3_5_moe_v2.config_to_hf, qwen3_5_v2: qwen3_5_v2.config_to_hf,
    glm_image_moe_v2: glm_image_moe_v2.config_to_hf, qwen3_vl_moe_v2: vl_config_to_hf,
}  # fmt: skip


@pytest.mark.parametrize("name, package", READERS, ids=[f"{n}-{p.__name__.rsplit('.', 1)[-1]}" for n, p in READERS])
def test_every_family_reader_consumes_quantization_config(name, package):
    """The FP8 release form of each released config (``quantization_config`` at the top level, where the FP8
    releases put it, or in ``text_config``): read as the dense model, nothing of it kept for the export."""
    hf = json.loads((RELEASED / name).read_text())
    plain = package.config_from_hf(hf)
    for where in ("top", "text_config"):
        q = json.loads(json.dumps(hf))
        (q if where == "top" or "text_config" not in q else q["text_config"])["quantization_config"] = {
            **FP8_CONFIG, "modules_to_not_convert": ["lm_head"]}  # fmt: skip
        cfg = package.config_from_hf(q)
        assert "quantization_config" not in repr(cfg.hf_extra), where
        written = json.dumps(_WRITERS[package](cfg))
        assert "quantization_config" not in written and written == json.dumps(_WRITERS[package](plain)), where
