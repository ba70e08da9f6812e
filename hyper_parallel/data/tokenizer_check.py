"""The run's tokenizer is the model folder's: ``check_run_tokenizer``.

A model folder that ships a tokenizer (``tokenizer.json``) fixes the vocabulary, special tokens and chat template
its weights were trained with. Data tokenised with another tokenizer trains in silence and the export would ship
the other tokenizer beside the folder's weights, so every tokenizer the run's data uses is compared with the
folder's: ``data.tokenizer``, each mixture source's ``tokenizer``, and, where those are left out, the tokenizer
vision-language shards were written with (``vl_dataset.json``). ``--data.allow_foreign_tokenizer`` allows a
deliberate change. Pre-tokenised text and DirectToken shards record no tokenizer; the embedded toy corpora are
offline smoke data and are not checked.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hyper_parallel.config.errors import ConfigError
from hyper_parallel.data.tokenizer import has_tokenizer, tokenizer_differences, tokenizer_fingerprint

if TYPE_CHECKING:
    from hyper_parallel.data.base import DataConfig

__all__ = ["check_run_tokenizer", "run_tokenizers"]


def _recorded(path: str) -> tuple[str, dict[str, str]] | None:
    """``(vl_dataset.json, its record)`` of vision-language shards at ``path`` (None: none, or no shards)."""
    from hyper_parallel.data.shards import resolve_shards
    from hyper_parallel.data.vision_language.writer import read_dataset_tokenizer

    try:
        return read_dataset_tokenizer(resolve_shards(path))
    except (FileNotFoundError, ValueError):
        return None  # no shards here: the loader names the path


def run_tokenizers(data: DataConfig) -> list[tuple[str, str, str | None]]:
    """``(what, tokenizer folder, recorded fingerprint or None)`` for every tokenizer the run's data uses."""
    sources = list(data.sources) or [data]
    out: list[tuple[str, str, str | None]] = []
    for i, source in enumerate(sources):
        name = "data" if source is data else f"data.sources[{i}] ({source.name or source.source})"
        tokenizer = source.tokenizer or data.tokenizer
        kind, path = source.source, source.path
        if tokenizer:
            out.append((f"{name}.tokenizer", tokenizer, None))
        elif kind == "vision_language" and path:
            recorded = _recorded(path)
            if recorded is not None:
                where, meta = recorded
                out.append((f"the tokenizer the shards of {name}.path={path!r} were written with ({where})",
                            meta["tokenizer"], meta["tokenizer_fingerprint"]))  # fmt: skip
    return out


def check_run_tokenizer(model_folder: str | None, data: DataConfig, *, allow: bool | None = None) -> None:
    """Refuse a run whose data uses a tokenizer other than ``model_folder``'s (see the module doc). ``allow``
    (default: ``data.allow_foreign_tokenizer``) lets it pass."""
    allow = data.allow_foreign_tokenizer if allow is None else allow
    if not has_tokenizer(model_folder) or allow:
        return
    from hyper_parallel.data.vision_language.writer import TOY_TOKENIZER, toy_tokenizer_folder

    problems = []
    for what, folder, fingerprint in run_tokenizers(data):
        resolved = toy_tokenizer_folder(data.cache_dir) if folder == TOY_TOKENIZER else os.path.expanduser(folder)
        if os.path.realpath(resolved) == os.path.realpath(os.path.expanduser(model_folder)):
            continue
        if not has_tokenizer(resolved):
            if fingerprint is not None and fingerprint == tokenizer_fingerprint(os.path.expanduser(model_folder)):
                continue  # shards written with the model folder's tokenizer, read from another copy of it
            if fingerprint is None:
                continue  # not a tokenizer folder: the data loader says so
            problems.append(f"{what} is {folder!r}, which is gone, and its fingerprint {fingerprint} is not the model's")
            continue
        differs = tokenizer_differences(model_folder, resolved)
        if differs:
            problems.append(f"{what} is {folder!r}, which differs in {'; '.join(differs)}")
    if problems:
        raise ConfigError(
            f"the model folder {model_folder!r} ships its own tokenizer, and the run's data uses another: "
            + "; ".join(problems)
            + ". Use the folder's tokenizer (--data.tokenizer "
            + f"{model_folder}, or rewrite the shards with it), or pass --data.allow_foreign_tokenizer to train with "
            "the other one on purpose (the export then ships that tokenizer)"
        )
