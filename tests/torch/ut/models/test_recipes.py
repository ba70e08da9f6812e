"""Every recipe fixes its global batch (issue 45).
"""

from __future__ import annotations


def test_every_recipe_fixes_its_global_batch():
    from hyper_parallel.config.manager import _import_registry, available_modules, available_recipes

    unfixed = []
    for module in (m for m in available_modules() if not m.endswith("_v2")):
        registry = _import_registry(module)
        for name in available_recipes(registry):
            cfg = getattr(registry, name)()
            if getattr(cfg, "data", None) is not None and cfg.data.global_batch_tokens <= 0:
                unfixed.append(f"{module}.{name}")
    assert not unfixed, f"recipes whose optimizer step depends on the rank count: {unfixed}"
