"""A GlmImageMoe run that mixes DirectToken images with chat conversations, started from a GLM-4.7-Flash release
(issue 41), through the real entry point and a run file (``[[data.sources]]``), fp32 deterministic:

- the release is a Glm4MoeLite folder; the DirectToken source grows the image path at start, and the log says so;
- per-source losses are logged (``loss/images``, ``loss/chat``); a chat micro-batch carries no image codes and no
  placeholder id, an image one carries both;
- 1 process (in this process, so the trained model is at hand) and FSDP2 (2 ranks, ``torchrun``) give the same
  losses, per source too;
- the export is the GlmImageMoe form, which ``hyper_parallel.from_pretrained`` reads back to the trained model's
  logits (1e-5), and the 2-rank export to the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import hyper_parallel  # noqa: E402
from hyper_parallel.config import ConfigManager  # noqa: E402
from hyper_parallel.data import ToyCorpusSpec, write_toy_corpus  # noqa: E402
from hyper_parallel.protocols.model import split_output  # noqa: E402
from tests.torch.st import launch  # noqa: E402
from tests.torch.ut.models.glm_image_moe_v2.test_glm_flash_finetune import chat_file, write_release  # noqa: E402

STEPS = 3
PLACEHOLDER = 511  # the glm_image_moe_debug recipe's image fields: codebook 256, placeholder 511


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("glm_mixed")
    release = root / "GLM-4.7-Flash-tiny"
    write_release(release)
    spec = ToyCorpusSpec(lang_vocab_size=512, codebook_size=256, placeholder_token_id=PLACEHOLDER, num_samples=64,
                         samples_per_shard=32, seed=1)  # fmt: skip
    write_toy_corpus(str(root / "images"), spec)
    run_file = root / "run.toml"
    run_file.write_text(
        f"""
[data]
max_tokens_per_microbatch = 128
global_batch_tokens = 512
cache_dir = "{root / 'cache'}"

[[data.sources]]
name = "images"
source = "direct_token"
path = "{root / 'images'}"
weight = 0.5

[[data.sources]]
name = "chat"
source = "text"
path = "{chat_file(root / 'chats.jsonl')}"
text = {{ chat_column = "messages" }}
tokenizer = "{release}"
weight = 0.5
"""
    )
    return {"root": root, "release": release, "run_file": run_file}


def _args(setup: dict[str, Path], dump: Path) -> list[str]:
    return ["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--config-file", str(setup["run_file"]),
            "--checkpoint.initial_load_path", str(setup["release"]), "--debug.deterministic", "--metrics.log_freq", "1",
            "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "1", "--checkpoint.enable", "False",
            "--checkpoint.export_hf", "True", "--checkpoint.export_dtype", "float32", "--dump_folder", str(dump)]  # fmt: skip


def _records(dump: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}


def _probe() -> dict[str, torch.Tensor]:
    """Text, an image of 2 x 2 codes (placeholders in the ids), text."""
    ids = torch.tensor([[40, 41, 42, 3, 7, 7, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, 4, 50, 51, 52]])
    return {"input_ids": ids, "vq_codes": torch.tensor([5, 17, 200, 3])}


def _logits(model: Any) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return split_output(model(**_probe()))[0]


@pytest.fixture(scope="module")
def one_process(setup) -> dict[str, Any]:
    dump = setup["root"] / "one"
    trainer = ConfigManager().parse_args(_args(setup, dump)).build()
    seen: list[dict] = []
    try:
        names = trainer.data.source_names
        take = trainer.data.next_step

        def spy():
            step = take()
            seen.extend(step)
            return step

        trainer.data.next_step = spy
        trainer.train()
        logits = _logits(trainer.model)
        has_path = trainer.config.model.has_image_path
    finally:
        trainer.close()
    return {"dump": dump, "records": _records(dump), "seen": seen, "names": names, "logits": logits,
            "has_path": has_path}  # fmt: skip


def test_text_documents_carry_no_image_codes(one_process):
    assert one_process["has_path"]  # grown for the DirectToken source
    kinds = set()
    for mb in one_process["seen"]:
        name = one_process["names"][int(mb["source_ids"].reshape(-1)[0])]
        codes = mb.get("vq_codes")
        n_codes = 0 if codes is None else codes.numel()
        n_placeholders = int((mb["input_ids"] == PLACEHOLDER).sum())
        if name == "chat":
            positions = mb.get("visual_indices")
            assert n_codes == 0 and n_placeholders == 0 and (positions is None or positions.numel() == 0)
        else:
            assert n_codes == n_placeholders
        kinds.add((name, n_codes > 0))
    assert ("chat", False) in kinds and ("images", True) in kinds


def test_per_source_losses_same_on_fsdp2_and_export_reads_back(setup, one_process, tmp_path):
    ref = one_process["records"]
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert any("loss/chat" in r for r in ref.values()) and any("loss/images" in r for r in ref.values())
    out = launch.run(launch.train_command(_args(setup, tmp_path / "fsdp2"), 2))
    assert "image path grown for the direct_token data" in out
    fsdp = _records(tmp_path / "fsdp2")
    for step in range(1, STEPS + 1):
        tol = 1e-5 if step == 1 else 1e-4
        assert abs(ref[step]["loss"] - fsdp[step]["loss"]) <= tol, (step, ref[step]["loss"], fsdp[step]["loss"])
        for key in ("loss/chat", "loss/images"):
            assert (key in ref[step]) == (key in fsdp[step]), (step, key)
            if key in ref[step]:
                assert abs(ref[step][key] - fsdp[step][key]) <= tol, (step, key, ref[step][key], fsdp[step][key])
    print("mixed run losses (1 process | FSDP2):",
          [(round(ref[s]["loss"], 6), round(fsdp[s]["loss"], 6)) for s in range(1, STEPS + 1)])  # fmt: skip
    for dump, tol in ((one_process["dump"], 1e-5), (tmp_path / "fsdp2", 1e-4)):
        config = json.loads((dump / "hf" / "config.json").read_text())
        assert config["model_type"] == "glm_image_moe" and config["architectures"] == ["GlmImageMoeForConditionalGeneration"]
        back = hyper_parallel.from_pretrained(dump / "hf")
        assert back.config.has_image_path and back.lm_head.weight.shape[0] == 512 + 256
        diff = (_logits(back) - one_process["logits"]).abs().max().item()
        print(f"from_pretrained({dump.name}/hf) vs the trained model: max |logits diff| {diff:.2e}")
        assert diff <= tol
