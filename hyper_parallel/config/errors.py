"""``ConfigError``: the one error type of the config system, importable from every side of it."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config, recipe or run-file problem; the message says what to change."""
