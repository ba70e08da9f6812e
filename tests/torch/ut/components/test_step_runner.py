"""One step objective (``components/step.py``): the dry run steps with the trainer's, not a copy of it."""

from __future__ import annotations

from hyper_parallel.components.step import StepObjective
from hyper_parallel.config import ConfigManager
from hyper_parallel.dry_run import dry_run


def test_dry_run_steps_with_the_trainers_objective_and_aux_weighting(monkeypatch):
    """CP 2 x FSDP 2, 2 micro-batches per step: every simulated micro-batch's loss is ``StepObjective``'s, whose aux
    loss weight is the trainer's ``1 / (micro-batches x dp x cp)`` = 1/8 (a copy in the dry run had drifted to
    ``1 / micro-batches``)."""
    made, calls = [], []
    init, call = StepObjective.__init__, StepObjective.__call__

    def recording_init(self, runner, counts, per_source=None):
        init(self, runner, counts, per_source)
        made.append((self.aux_scale, counts.micro_batches, runner.token_ranks()))

    def recording_call(self, out, mb):
        calls.append(out.aux_loss is not None)
        return call(self, out, mb)

    monkeypatch.setattr(StepObjective, "__init__", recording_init)
    monkeypatch.setattr(StepObjective, "__call__", recording_call)
    cfg = ConfigManager().parse_args([
        "--module", "qwen3_5_moe", "--config", "qwen3_5_moe_debug", "--parallelism.context_parallel_degree", "2",
        "--data.global_batch_tokens", "2048",
    ])  # fmt: skip
    report = dry_run(cfg, world_size=4)
    assert report.micro_batches_per_step == 2
    assert calls and all(calls), calls  # the MoE aux loss reached the objective
    assert made and all(m == (1 / 8, 2, 4) for m in made), made
