"""FP8 block-quantized releases load sharded (issue 31 item 5): the shrunk Qwen3.5-MoE (ConditionalGeneration
form, vision tower and ``mtp.*`` kept) and GLM-4.7-Flash releases of ``tests/torch/ut/hf/test_fp8_load.py``
(128 x 128 blocks, ragged edges) loaded into FSDP 2, EP 2 and TP 2 on gloo: a rank's slices start and end
inside blocks, and each rank dequantizes only its own. Every loaded parameter equals the one-process load of
the dequantized folder bit for bit, the logits of the parallel model equal its logits within 1e-5 (relative to
the logits' size: TP 2 reduces in another order), and a rank reads well under the folder's FP8 bytes."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from tests.torch.st.fp8_jobs import fp8_sharded_load_job
from tests.torch.st.glm_jobs import Layout
from tests.torch.ut.hf.test_fp8_load import glm_release, qwen_release

pytestmark = pytest.mark.slow

TOL = 1e-5
LAYOUTS = {
    "qwen3_5_moe": [Layout(world=2), Layout(world=2, ep=2), Layout(world=2, tp=2, loss_parallel=False)],
    "glm4_moe_lite": [Layout(world=2), Layout(world=2, ep=2)],
}


def _fp8_elements(folder) -> int:
    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                if sl.get_dtype() == "F8_E4M3":
                    n = 1
                    for d in sl.get_shape():
                        n *= d
                    total += n
    return total


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_fp8_release_loads_sharded_to_the_dequantized_model(pool, tmp_path, family):
    fp8_dir, ref_dir, _, hf = (qwen_release if family == "qwen3_5_moe" else glm_release)(tmp_path)
    vocab = hf.config.get_text_config().vocab_size
    total = _fp8_elements(fp8_dir)
    results = pool.run(fp8_sharded_load_job, 2, family, str(fp8_dir), str(ref_dir), vocab, LAYOUTS[family])
    for rank, per_layout in enumerate(results):
        for name, r in per_layout.items():
            print(f"{family} {name} rank {rank}: max logit diff {r['logit_diff']:.3g} (max |logit| "
                  f"{r['logit_size']:.3g}), read "
                  f"{r['fp8_read'] / total:.2f} of the FP8 bytes, {r['scales_read']} scales, "
                  f"load {r['load_s']:.2f} s")  # fmt: skip
            assert r["differ"] == [], (rank, name, r["differ"][:5])
            # FSDP / EP compute as one process; TP 2 reduces in another order (fp32 rounding, relative to the logits)
            assert r["logit_diff"] <= TOL * max(1.0, r["logit_size"]), (rank, name, r["logit_diff"], r["logit_size"])
            assert 0 < r["fp8_read"] <= 0.7 * total, (rank, name, r["fp8_read"], total)
    assert any("experts.gate_up_proj" in k for k in results[0]["w2-ep2"]["sharded"])
    if family == "qwen3_5_moe":
        assert any("in_proj_qkv" in k for k in results[0]["w2-tp2-noLP"]["sharded"])
