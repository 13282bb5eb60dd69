"""Divergence ends the run (issue 41, item 5): steps in a row whose loss, gradient norm or reward are not finite stop
the trainer with one ERROR and the user-error exit code; the skip warning tells the truth about the weights; the
skipped updates are counted."""

from __future__ import annotations

import math

import pytest

from trainer.checkpoint import list_checkpoints
from trainer.config import load_config
from trainer.divergence import DivergenceError, DivergenceWatch, first_nonfinite_metric
from trainer.loop import Trainer
from trainer.metrics import reduce_metrics

TINY = [
    "actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
    "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "data.max_prompt_length=8",
    "data.max_response_length=4", "trainer.device=cpu", "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=1", "algorithm.norm_adv_by_std_in_grpo=false",
]


def test_a_diverged_run_stops_with_one_error_naming_what_and_when_and_keeps_its_checkpoint(tmp_path, monkeypatch):
    """Probe 3 (optim.lr=1e30, or a reward of 1e308): every step after the first skipped its update and the run
    "finished" with exit 0. Now the third step in a row that is not finite ends it, and the step-1 checkpoint stays."""
    config = load_config(None, [*TINY, f"trainer.runs_dir={tmp_path}", "trainer.total_training_steps=6",
                                "trainer.save_freq=1"])
    warnings: list[str] = []
    trainer = Trainer(config, log=lambda *_: None, warn=warnings.append)
    real = trainer.score.__class__.__call__

    def diverging(self, batch):
        metrics = real(self, batch)
        if trainer.step >= 1:  # from step 2 on the scores are infinite (what a diverged policy earns from 1e308)
            batch.token_level_scores.fill_(math.inf)
        return metrics

    monkeypatch.setattr(trainer.score.__class__, "__call__", diverging)
    with pytest.raises(DivergenceError) as caught:
        trainer.fit()
    message = str(caught.value)
    assert "3 steps in a row were not finite (trainer.max_nonfinite_steps=3)" in message
    assert "the first, step 2, had critic/score/mean inf" in message
    assert trainer.step == 4
    assert [step for step, _ in list_checkpoints(trainer.checkpointer.directory)] == [1]
    rows = trainer.metrics_log.read()
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert [line.split(":")[0] for line in warnings if "no checkpoint saved" in line] == ["STEP 2", "STEP 3"]


def test_max_nonfinite_steps_null_never_stops():
    watch = DivergenceWatch(None, warn=lambda _: None)
    for step in range(1, 10):
        watch.observe(step, {"actor/pg_loss": math.nan})
    assert watch.streak == 9


def test_a_finite_step_restarts_the_count():
    watch = DivergenceWatch(2, warn=lambda _: None)
    watch.observe(1, {"actor/grad_norm": math.inf})
    watch.observe(2, {"actor/grad_norm": 1.0})
    watch.observe(3, {"actor/pg_loss": math.nan})
    with pytest.raises(DivergenceError, match=r"the first, step 3, had actor/pg_loss nan"):
        watch.observe(4, {"actor/grad_norm": math.inf})


def test_the_reward_is_named_before_the_loss_it_spoils():
    assert first_nonfinite_metric({"actor/pg_loss": math.nan, "critic/score/mean": math.inf}) == "critic/score/mean"
    assert first_nonfinite_metric({"actor/pg_loss": 0.1, "actor/skipped_steps": 2.0}) == "actor/skipped_steps"
    assert first_nonfinite_metric({"actor/pg_loss": 0.1}) is None


def test_skipped_steps_counts_updates_and_the_warning_does_not_claim_the_weights_stood_still():
    """Probe 3: actor/skipped_steps read 1.0 on steps with 4 skipped updates, and the warning said "its weights did
    not change" though the step's first update had changed them."""
    assert reduce_metrics({"skipped_steps": [1.0, 1.0, 1.0, 1.0], "grad_norm": [1.0, 3.0]}) == {
        "skipped_steps": 4.0, "grad_norm": 2.0}
    warnings: list[str] = []
    DivergenceWatch(3, warn=warnings.append).observe(1, {"actor/skipped_steps": 4.0})
    assert len(warnings) == 1
    assert "actor skipped 4 optimizer update(s)" in warnings[0]
    assert "did not change" not in warnings[0] and "the step's other updates changed them" in warnings[0]
