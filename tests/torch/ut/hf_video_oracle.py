"""HF's Qwen3-VL video processor and processor as a test oracle, run in a child process beside torchvision.

HF has no video processor without torchvision (``Qwen3VLVideoProcessor`` resizes with
``torchvision.transforms.v2.functional.resize``), and torchvision from PyPI is a CUDA build whose C
extension cannot load beside the CPU torch of this project (``libc10_cuda.so`` is missing), so
importing it fails while registering fake kernels of its detection ops (``torchvision::nms``).
The oracle therefore runs in a child process that puts the pure-Python torchvision of the matching
release (0.28.0 for torch 2.13) on ``sys.path`` and skips only that registration: the resize, the
normalisation and every line of transformers' processor are the real ones; only ``nms`` & co. (never
called) are missing. The package is installed, without dependencies, outside the venv's import path:

    .venv/bin/pip install --no-deps --target .venv/hf_oracle torchvision==0.28.0

(``HP_HF_ORACLE_PATH`` names another folder.) The tests that need it skip, saying so, without it.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
ORACLE_PATH = os.environ.get("HP_HF_ORACLE_PATH", str(REPO / ".venv" / "hf_oracle"))
INSTALL = f"{sys.executable} -m pip install --no-deps --target {ORACLE_PATH} torchvision==0.28.0"


def oracle_missing() -> str | None:
    """Why the oracle cannot run (None when it can)."""
    if not (Path(ORACLE_PATH) / "torchvision").is_dir():
        return f"HF video oracle needs torchvision's Python code in {ORACLE_PATH}: {INSTALL}"
    return None


def run_oracle(cases: list[dict[str, Any]], workdir: Path) -> list[dict[str, Any]]:
    """Run every case through HF in one child process; see :func:`_run_case` for a case's keys."""
    src, dst = workdir / "oracle_in.pkl", workdir / "oracle_out.pkl"
    with open(src, "wb") as f:
        pickle.dump(cases, f)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ORACLE_PATH, str(REPO)]), "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, "-W", "ignore", __file__, str(src), str(dst)], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"HF oracle failed:\n{proc.stdout}\n{proc.stderr}")
    with open(dst, "rb") as f:
        return pickle.load(f)


def _run_case(case: dict[str, Any]) -> dict[str, Any]:
    """A case: ``videos`` (list of uint8 [t, H, W, 3]), ``metadata`` (list of dicts or None), ``video``
    (Qwen3VLVideoProcessor init kwargs), ``call`` (call kwargs), optionally ``text`` + ``tokenizer``
    (a folder) + ``images`` (uint8 [H, W, 3] arrays) + ``image`` (Qwen2VLImageProcessorPil kwargs)."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    video_processor = Qwen3VLVideoProcessor(**case.get("video", {}))
    videos = [np.asarray(v) for v in case["videos"]]
    call = dict(case.get("call", {}))
    if case.get("text") is None:
        out = video_processor(videos, video_metadata=case.get("metadata"), return_tensors="pt", **call)
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
    folder = case["tokenizer"]
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"),
                                        bos_token=tcfg.get("bos_token"), eos_token=tcfg.get("eos_token"),
                                        pad_token=tcfg.get("pad_token"))  # fmt: skip
    image_processor = Qwen2VLImageProcessorPil(**case.get("image", {}))
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor)
    images = [Image.fromarray(np.asarray(im)) for im in case.get("images") or []] or None
    out = processor(text=[case["text"]], images=images, videos=videos, video_metadata=case.get("metadata"),
                    return_tensors="pt", add_special_tokens=False, **call)  # fmt: skip
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def _main(src: str, dst: str) -> None:
    import types

    # torchvision's fake-kernel registration of its C ops (nms, roi_align, ...) fails without the CUDA
    # extension; nothing the oracle calls uses them.
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
    with open(src, "rb") as f:
        cases = pickle.load(f)
    results = []
    for case in cases:
        try:
            results.append(_run_case(case))
        except Exception as e:  # noqa: BLE001 - reported to the test, which may expect HF to refuse
            results.append({"error": f"{type(e).__name__}: {e}"})
    with open(dst, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
