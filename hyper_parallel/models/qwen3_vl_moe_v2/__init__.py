"""Qwen3-VL-MoE / Qwen3.5-MoE VL (spec registration: pending, issue 14)."""
