"""A released folder as a new user meets it (issue 45): another model's tokenizer is refused naming both, the
release's aux-loss coefficient trains, the export keeps fused experts, a resume without the folder's path
rebuilds the folder's model, user errors are one line.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from hyper_parallel.config import ConfigError, ConfigManager
from hyper_parallel.models import qwen3_vl_moe_v2
from hyper_parallel.train import _cli as train_cli
from hyper_parallel.train import main as train_main
from tests.torch.helpers import edit_config


TINY = ["--data.global_batch_tokens", "256", "--data.max_tokens_per_microbatch", "256"]


def toy_tokenizer(cache: Path) -> Path:
    from hyper_parallel.data.text import cached_toy_text

    return Path(cached_toy_text(str(cache)).tokenizer_dir)


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts_on_disk(folder: Path) -> None:
    """Rewrite an HF folder's per-expert keys in the releases' fused form (``experts.gate_up_proj [E, 2I, H]``,
    ``experts.down_proj [E, H, I]``), one ``model.safetensors``."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
        f.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for k, t in tensors.items():
        m = _EXPERT.match(k)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
        else:
            out[k] = t
    for base, parts in experts.items():
        n = len(parts["down_proj"])
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([parts["gate_proj"][e], parts["up_proj"][e]]) for e in range(n)])
        out[f"{base}.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(n)])
    save_file({k: v.contiguous() for k, v in out.items()}, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """A Qwen3.5-MoE ConditionalGeneration folder in the released form: MTP block, experts stored fused,
    ``router_aux_loss_coef`` 0.001 with ``output_router_logits`` false, and a tokenizer (the toy one)."""
    from hyper_parallel.models.qwen3_vl_moe_v2.config_registry import qwen3_5_moe_vl_mtp_debug

    root = tmp_path_factory.mktemp("release")
    folder = root / "Qwen3.5-tiny"
    torch.manual_seed(0)
    model = qwen3_5_moe_vl_mtp_debug().model.build()
    model.init_weights()
    qwen3_vl_moe_v2.save_pretrained(model, folder, dtype=torch.float32)
    edit_config(folder, router_aux_loss_coef=0.001, output_router_logits=False)
    fuse_experts_on_disk(folder)
    for f in toy_tokenizer(root / "cache").iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    return folder


def other_tokenizer(tmp_path: Path, release: Path, *, template: str | None = None, special: str | None = None) -> Path:
    """A copy of the release's tokenizer with another chat template or one more special token."""
    other = tmp_path / "other_tokenizer"
    other.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (release / name).is_file():
            shutil.copy(release / name, other / name)
    if template is not None:
        (other / "chat_template.jinja").write_text(template)
    if special is not None:
        tcfg = json.loads((other / "tokenizer_config.json").read_text())
        tcfg["eos_token"] = special
        (other / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return other


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _one_line_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        train_cli(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    lines = err.strip().splitlines()  # the run's log lines, then the one error line
    assert lines[-1].startswith("error: ") and "Traceback" not in err and sum("error" in x for x in lines) == 1, err
    return lines[-1]


def test_a_tokenizer_other_than_the_folders_is_refused_naming_both(tmp_path, release):
    from hyper_parallel.data import DataConfig
    from hyper_parallel.data.tokenizer_check import check_run_tokenizer

    template = other_tokenizer(tmp_path / "a", release, template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    special = other_tokenizer(tmp_path / "b", release, special="<|special_eos|>")
    check_run_tokenizer(str(release), DataConfig(source="text", tokenizer=str(release)))  # the folder's own: fine
    for other, part in ((template, "chat template"), (special, "special tokens")):
        data = DataConfig(source="text", tokenizer=str(other), path="chats.jsonl")
        with pytest.raises(ConfigError, match=rf"{re.escape(str(release))}.*{re.escape(str(other))}.*differs in.*{part}"):
            check_run_tokenizer(str(release), data)
        check_run_tokenizer(str(release), DataConfig(source="text", tokenizer=str(other), allow_foreign_tokenizer=True))
    # the trainer refuses before it reads any data or builds the model
    args = ["--config", "qwen3_5_moe_debug", "--checkpoint.initial_load_path", str(release), "--data.tokenizer",
            str(template), "--data.path", str(tmp_path / "absent.jsonl"), "--dump_folder", str(tmp_path / "run"), *TINY]  # fmt: skip
    with pytest.raises(ConfigError, match="ships its own tokenizer.*--data.allow_foreign_tokenizer"):
        train_main(args)


def test_vl_shards_written_with_another_tokenizer_are_refused_when_data_tokenizer_is_left_out(tmp_path, release):
    from hyper_parallel.data import DataConfig
    from hyper_parallel.data.tokenizer_check import check_run_tokenizer
    from hyper_parallel.data.vision_language.writer import VisionLanguageWriter

    other = other_tokenizer(tmp_path, release, template="{{ messages[0]['content'] }}")
    for tokenizer, out in ((other, "foreign"), (release, "own")):
        with VisionLanguageWriter(str(tmp_path / out), tokenizer=str(tokenizer)) as w:
            w.write([_png()], text="<image> a red square")
    with pytest.raises(ConfigError, match=rf"shards of data.path=.*foreign.*written with.*{re.escape(str(other))}.*chat template"):
        check_run_tokenizer(str(release), DataConfig(source="vision_language", path=str(tmp_path / "foreign")))
    check_run_tokenizer(str(release), DataConfig(source="vision_language", path=str(tmp_path / "own")))
    check_run_tokenizer(
        str(release), DataConfig(source="vision_language", path=str(tmp_path / "foreign"), allow_foreign_tokenizer=True)
    )


def test_release_trains_its_aux_loss_exports_fused_and_resumes_without_the_path(tmp_path, release, capsys):
    """Through the a3b recipe (shrunk by the folder): aux_loss at step 1 with the release's 0.001, the differing
    fields all listed, the export in the folder's fused form; the same command without the folder resumes it."""
    dump = tmp_path / "run"
    base = ["--config", "qwen3_5_moe_a3b", "--dump_folder", str(dump), "--parallelism.context_parallel_degree", "1",
            "--parallelism.expert_parallel_degree", "1",
            "--training.mixed_precision_param", "float32", "--data.num_workers", "0", "--checkpoint.async_mode",
            "disabled", "--checkpoint.interval", "1", "--metrics.log_freq", "1", *TINY]  # fmt: skip
    train_main([*base, "--checkpoint.initial_load_path", str(release), "--training.steps", "1", "--checkpoint.export_hf"])
    logged = capsys.readouterr().err
    line = next(x for x in logged.splitlines() if "differs from the recipe in" in x)
    for field in ("vocab_size", "dim", "layers", "router_aux_loss_coef", "mlp.num_experts", "self_attn.n_heads"):
        assert field in line, (field, line)
    first = json.loads((dump / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["aux_loss"] > 0
    keys = [k for f in (dump / "hf").glob("*.safetensors") for k in load_file(f)]
    assert any(k.endswith("layers.0.mlp.experts.gate_up_proj") for k in keys)
    assert not any(_EXPERT.match(k) for k in keys)
    # rerun without the folder's path: the folder's model resumes and continues its steps
    cfg = ConfigManager().parse_args([*base, "--training.steps", "2", "--checkpoint.no_export_hf"])
    from hyper_parallel.hf.folder import resumed_folder_config

    # (checked first: building the recipe's own model instead would be the 35B one)
    assert resumed_folder_config(cfg).checkpoint.initial_load_path == str(release)
    trainer = cfg.build()
    try:
        assert trainer.step == 1 and trainer.run_model.folder == str(release)
        assert trainer.config.model.mtp is not None and trainer.config.model.dim == 64
        assert trainer.train()["steps"] == 2
    finally:
        trainer.close()


def test_user_errors_are_one_line(tmp_path, release, capsys):
    from hyper_parallel.data.text import cached_toy_text

    run = ["--dump_folder", str(tmp_path / "run"), "--checkpoint.no_enable", *TINY]
    err = _one_line_error(["--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", *run, "--training.steps", "0"], capsys)
    assert "--training.steps 0" in err
    err = _one_line_error(["--config", "qwen3_5_moe_debug", "--checkpoint.initial_load_path", str(tmp_path / "Qwen3.5-typo"),
                           *run], capsys)  # fmt: skip
    assert "does not exist" in err and "Qwen3.5-typo" in err and "both --module" not in err
    broken = tmp_path / "broken"
    shutil.copytree(release, broken)
    index = {"metadata": {}, "weight_map": {k: "model-00002-of-00002.safetensors"
                                            for k in load_file(broken / "model.safetensors")}}  # fmt: skip
    (broken / "model.safetensors").rename(broken / "model-00001-of-00002.safetensors")
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    err = _one_line_error(["--config", "qwen3_5_moe_debug", "--checkpoint.initial_load_path", str(broken), *run], capsys)
    assert "model-00002-of-00002.safetensors" in err
    toy = cached_toy_text(str(tmp_path / "cache"))
    (tmp_path / "d.jsonl").write_text('{"text": "one."}\n{"text": "two."}\n{"text": "three\n')
    err = _one_line_error(["--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", *run, "--data.path",
                           str(tmp_path / "d.jsonl"), "--data.tokenizer", toy.tokenizer_dir, "--data.cache_dir",
                           str(tmp_path / "cache")], capsys)  # fmt: skip
    assert "d.jsonl', line 3" in err
