"""Shard writers stopped by bad input leave nothing behind and name the line (issue 45).
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image
from tests.torch.ut.hf.test_release_folders import _png


def test_vl_writer_stopped_by_a_missing_image_leaves_nothing_and_names_the_line(tmp_path, capsys):
    from hyper_parallel.data.vision_language.cli import main

    (tmp_path / "img.png").write_bytes(_png())
    lines = [json.dumps({"images": ["img.png" if i != 7 else "missing.png"], "text": f"<image> picture {i}"})
             for i in range(30)]  # fmt: skip
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "shards"
    assert main(["write", "--input", str(tmp_path / "in.jsonl"), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'in.jsonl'} line 8: " in err and "missing.png" in err and err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == []  # no .tar, no .partial, no vl_dataset.json
    assert main(["write", "--input", str(tmp_path / "in.jsonl"), "--output-dir", str(out), "--samples-per-shard",
                 "10"]) == 2  # fmt: skip
    (tmp_path / "missing.png").write_bytes(_png())
    assert main(["write", "--input", str(tmp_path / "in.jsonl"), "--output-dir", str(out), "--samples-per-shard",
                 "10"]) == 0  # fmt: skip
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".idx.npz")) == [
        "train-000000.tar", "train-000001.tar", "train-000002.tar", "vl_dataset.json"]  # fmt: skip


def test_direct_token_and_text_writers_leave_nothing_on_error(tmp_path, capsys):
    from hyper_parallel.data.direct_token.cli import main
    from hyper_parallel.data.text.loader import TextShardWriter

    good = {"tokens": [1, 5, 5, 2], "vq_codes": [3, 4], "image_grids": [[1, 2]]}
    rows = [json.dumps(good)] * 2 + [json.dumps({"tokens": [1, 5, 2], "vq_codes": [3, 4], "image_grids": [[1, 2]]})]
    (tmp_path / "docs.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / "dt"
    assert main(["write", "--input", str(tmp_path / "docs.jsonl"), "--output-dir", str(out), "--placeholder-token-id",
                 "5", "--samples-per-shard", "1"]) == 2  # fmt: skip
    assert "docs.jsonl line 3: refusing to write sample" in capsys.readouterr().err
    assert list(out.iterdir()) == []
    with pytest.raises(RuntimeError, match="stop"):
        with TextShardWriter(str(tmp_path / "text"), docs_per_shard=1) as w:
            w.write("a", torch.arange(4).numpy())
            w.write("b", torch.arange(4).numpy())
            raise RuntimeError("stop")
    assert list((tmp_path / "text").iterdir()) == []
