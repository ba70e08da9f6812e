"""The dry run's advice names LoRA when a full fine-tune does not fit.
"""

from __future__ import annotations


def test_dry_run_advice_names_lora_when_a_full_fine_tune_does_not_fit():
    from hyper_parallel.dry_run import main

    report = main(["--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--world_size", "1", "--no_step",
                   "--device_memory_gib", "0.001"])  # fmt: skip
    assert any("--lora.rank" in line for line in report.advice), report.advice
