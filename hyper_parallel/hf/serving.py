"""The files a server reads beside an HF export's weights and ``config.json``.

A fine-tuned folder is served like the release it came from only if it also carries the tokenizer and chat
template the run used and the release's generation / processor configs: without them transformers'
``AutoTokenizer`` returns an empty tokenizer, ``generate`` has no EOS and ``AutoProcessor`` fails. Which files,
from where:

- the tokenizer files and chat template (:data:`TOKENIZER_FILES`): all from ONE source, the run's tokenizer
  (``--data.tokenizer``: an HF folder, or a ``tokenizer.json`` file) or else the loaded folder's own, so that
  two tokenizers are never mixed; a processor's chat template (``chat_template.json``) comes from the folder
  when the run's tokenizer has no template;
- the loaded folder's ``generation_config.json`` and processor configs (:data:`FOLDER_FILES`).

Only these names are copied (nothing a server must not see: no optimizer state, no run files), byte for
byte. Model agnostic: nothing here knows a family.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

__all__ = ["FOLDER_FILES", "TEMPLATE_FILES", "TOKENIZER_FILES", "write_serving_files"]

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
"""Chat templates saved beside a tokenizer (transformers 5) or a processor."""
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", *TEMPLATE_FILES,
)  # fmt: skip
"""A tokenizer folder's files (fast and slow forms); copied from the run's tokenizer source only."""
_TOKENIZER_DIRS = ("additional_chat_templates",)  # transformers 5: named chat templates, one .jinja each
FOLDER_FILES = (
    "generation_config.json", "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
)  # fmt: skip
"""What the loaded folder gives the export: generation defaults (EOS ids, sampling) and processor configs."""


def _tokenizer_source(tokenizer: str | os.PathLike) -> tuple[Path, dict[str, Path]]:
    """The folder of the run's tokenizer, and its files by export name (a lone ``*.json`` file is the
    ``tokenizer.json`` of an otherwise empty tokenizer folder)."""
    path = Path(os.path.expanduser(str(tokenizer)))
    if path.is_dir():
        return path, {n: path / n for n in TOKENIZER_FILES if (path / n).is_file()}
    if not path.is_file():
        raise FileNotFoundError(f"data.tokenizer={str(tokenizer)!r} does not exist: the export copies its files")
    if path.name == "tokenizer.json":  # a tokenizer folder named by its main file
        return _tokenizer_source(path.parent)
    return path.parent, {"tokenizer.json": path}


def _has_template(files: dict[str, Path]) -> bool:
    if any(n in files for n in TEMPLATE_FILES):
        return True
    config = files.get("tokenizer_config.json")
    return config is not None and bool(json.loads(config.read_text()).get("chat_template"))


def write_serving_files(
    export: str | os.PathLike,
    *,
    folder: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | None = None,
) -> list[str]:
    """Copy the files a server needs into the ``export`` folder; return their names (sorted).

    ``folder``: the HF folder the run started from (its generation / processor configs, and its tokenizer when
    ``tokenizer`` is not given). ``tokenizer``: the run's tokenizer (``--data.tokenizer``). Files of these
    names left in ``export`` by an earlier export, but not written now, are removed (the folder then holds one
    consistent tokenizer). One process calls this (rank 0); it reads and writes only small files.
    """
    export = Path(export)
    export.mkdir(parents=True, exist_ok=True)
    model = Path(os.path.expanduser(str(folder))) if folder else None
    if model is not None and not model.is_dir():
        model = None  # not an HF folder (e.g. a DCP checkpoint): nothing of it to copy
    files: dict[str, Path] = {}
    dirs: dict[str, Path] = {}
    if tokenizer:
        source, files = _tokenizer_source(tokenizer)
    elif model is not None:
        source, files = model, {n: model / n for n in TOKENIZER_FILES if (model / n).is_file()}
    else:
        source = None
    if source is not None:
        dirs = {n: source / n for n in _TOKENIZER_DIRS if (source / n).is_dir()}
    if model is not None:
        if not _has_template(files):  # a processor's template (the run's tokenizer had none)
            files.update({n: model / n for n in TEMPLATE_FILES if (model / n).is_file()})
        files.update({n: model / n for n in FOLDER_FILES if (model / n).is_file()})
    for name in (*TOKENIZER_FILES, *FOLDER_FILES):
        stale = export / name
        if name not in files and stale.is_file():
            stale.unlink()
    for name in _TOKENIZER_DIRS:
        if name not in dirs and (export / name).is_dir():
            shutil.rmtree(export / name)
    for name, src in files.items():
        dst = export / name
        if not (dst.exists() and dst.samefile(src)):  # exporting into the loaded folder itself
            shutil.copyfile(src, dst)
    for name, src in dirs.items():
        dst = export / name
        if not (dst.exists() and dst.samefile(src)):
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst)
    return sorted([*files, *dirs])
