"""Each of verl's advantage estimators trains through the real trainer (one tiny step), with verl's metric names;
ReMax's greedy baseline and the optimal token baseline's sums of squared probabilities reach the advantages."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import load_config
from trainer.loop import Trainer
from trainer.rewards.manager import place_on_last_token

# The built-in tiny model cut to one small layer; 2 prompts x 2 responses, one mini-batch.
TINY = [
    "actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "data.max_prompt_length=8",
    "data.max_response_length=4",
    "trainer.device=cpu",
    "trainer.total_training_steps=1",
    "trainer.save_freq=-1",
]
NEW_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo", "opo", "grpo_passk", "gpg",
                  "rloo_vectorized", "grpo_vectorized", "optimal_token_baseline", "tir_optimal_token_baseline")
STEP_METRICS = ("actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm",
                "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/advantages/max",
                "critic/returns/mean", "timing_s/gen", "timing_s/adv", "timing_s/update_actor", "timing_s/step")
VARIANCE_PROXIES = ("variance_proxy/proxy1_signal_strength", "variance_proxy/proxy2_total_power",
                    "variance_proxy/proxy3_pure_noise", "variance_proxy/expected_a_squared",
                    "variance_proxy/expected_w")


def make_trainer(tmp_path, *overrides: str, log=lambda *_: None, warn=print) -> Trainer:
    config = load_config(None, [*TINY, f"trainer.runs_dir={tmp_path}", "trainer.experiment_name=run", *overrides])
    return Trainer(config, log=log, warn=warn)


@pytest.mark.parametrize("name", NEW_ESTIMATORS)
def test_each_estimator_trains_a_step_with_finite_losses_under_verls_names(tmp_path, name):
    lines: list[str] = []
    trainer = make_trainer(tmp_path, f"algorithm.adv_estimator={name}", log=lines.append)
    assert trainer.critic is None
    trainer.fit()
    [row] = trainer.metrics_log.read()
    for key in STEP_METRICS:
        assert key in row and math.isfinite(row[key]), key
    assert "critic/vf_loss" not in row
    reads_sums = name in ("optimal_token_baseline", "tir_optimal_token_baseline")
    for key in VARIANCE_PROXIES:
        assert (key in row) == reads_sums, key
        assert not reads_sums or math.isfinite(row[key])
    assert ("timing_s/gen_max" in row) == (name == "remax")
    # The update is one optimizer step: the old log-probs are scored in a pass of their own only where the
    # estimator reads them.
    assert any(line.startswith("old_log_prob: not scored in a pass of its own") for line in lines) != reads_sums


def scored_step(trainer: Trainer, scores: list[float]):
    """One step's batch up to its advantages, with the responses' scores set to `scores`."""
    records = trainer.records[:2]
    batch = trainer.generation.generate(records)
    if trainer.greedy_baseline is not None:
        batch.reward_baselines = trainer.greedy_baseline(records)
    if trainer.config.scores_sum_pi_squared:
        batch.old_log_probs, batch.sum_pi_squared = trainer.actor.score_responses(batch, sum_pi_squared=True)
    batch.token_level_scores = place_on_last_token(torch.tensor(scores), batch.response_mask)
    trainer.advantages.compute_advantages(batch)
    return records, batch


def test_remax_baseline_is_the_score_of_each_prompts_greedy_response(tmp_path):
    trainer = make_trainer(tmp_path, "algorithm.adv_estimator=remax")
    records, batch = scored_step(trainer, [0.0, 1.0, 0.5, 0.25])
    # The greedy response to each prompt, decoded and scored apart: the baseline of both of its responses.
    greedy = trainer.generation.generate(records, rollout=trainer.greedy_baseline.rollout, n=1)
    assert not trainer.greedy_baseline.rollout.generation_config.do_sample
    expected = trainer.models.reward(greedy).float().repeat_interleave(2)
    torch.testing.assert_close(batch.reward_baselines, expected)
    # Every token's advantage is the response's reward-to-go (its score) less its prompt's greedy score.
    torch.testing.assert_close(batch.advantages[:, 0], torch.tensor([0.0, 1.0, 0.5, 0.25]) - expected)


def test_optimal_token_baseline_reads_the_policys_sums_of_squared_probabilities(tmp_path):
    trainer = make_trainer(tmp_path, "algorithm.adv_estimator=optimal_token_baseline")
    _, batch = scored_step(trainer, [0.0, 1.0, 1.0, 1.0])
    assert batch.sum_pi_squared is not None and batch.sum_pi_squared.shape == batch.response_mask.shape
    # Prompt 1's responses both score 1: every token's reward-to-go is 1, so is the baseline, and the advantage 0.
    torch.testing.assert_close(batch.advantages[2:], torch.zeros_like(batch.advantages[2:]), atol=1e-6, rtol=0)
    # Prompt 0's: 0 and 1, so one advantage is below and the other above 0 on their first tokens.
    assert batch.advantages[0, 0] < 0 < batch.advantages[1, 0]


def test_calculate_sum_pi_squared_reports_verls_variance_proxies_with_any_estimator(tmp_path):
    trainer = make_trainer(tmp_path, "algorithm.adv_estimator=grpo",
                           "actor_rollout_ref.actor.calculate_sum_pi_squared=true")
    trainer.fit()
    [row] = trainer.metrics_log.read()
    for key in VARIANCE_PROXIES:
        assert math.isfinite(row[key]), key
    assert row["variance_proxy/proxy1_signal_strength"] == pytest.approx(row["actor/grad_norm"] ** 2)
