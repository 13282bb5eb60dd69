"""verl's policy loss modes, rollout correction and policy-filtration PPO each train through the real trainer: one
tiny GRPO step of the built-in model each (two mini-batches, so the second one's ratios move off 1), with finite
losses and the metrics under verl's names."""

import math

import pytest
import torch

from tests.trainer.test_training import TINY
from trainer.algorithms import POLICY_LOSSES
from trainer.config import load_config
from trainer.loop import Trainer
from trainer.rewards.manager import place_on_last_token

ONE_STEP = [*TINY, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2"]
# What verl's loss functions report beside actor/pg_loss (core_algos.py): gpg nothing, kl_cov its ppo_kl only.
RATIO_METRICS = {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
LOSS_METRICS = {"vanilla": RATIO_METRICS, "gspo": RATIO_METRICS, "sapo": RATIO_METRICS, "geo_mean": RATIO_METRICS,
                "cispo": RATIO_METRICS, "clip_cov": {"actor/pg_clipfrac", "actor/ppo_kl"}, "kl_cov": {"actor/ppo_kl"},
                "gpg": set()}


def make_trainer(tmp_path, *overrides: str) -> Trainer:
    """The trainer, its responses scored 0, 1, 2, ... in batch order: every group's advantages are non-zero (the
    random policy scores 0 on the built-in task nearly always)."""
    config = load_config(None, [*ONE_STEP, f"trainer.runs_dir={tmp_path}", *overrides])
    trainer = Trainer(config, log=lambda *_: None)
    scoring = trainer.score

    def distinct_scores(batch):
        metrics = scoring(batch)
        batch.token_level_scores = place_on_last_token(torch.arange(len(batch), dtype=torch.float32),
                                                       batch.response_mask)
        return metrics

    trainer.score = distinct_scores
    return trainer


def one_step(trainer: Trainer) -> dict[str, float]:
    return trainer.train_step([trainer.records[index] for index in trainer.sampler.next_batch()])


@pytest.mark.parametrize("loss_mode", sorted(LOSS_METRICS))
def test_each_loss_mode_trains_with_finite_losses_and_verls_metrics(tmp_path, loss_mode):
    # clip_cov and kl_cov act on a fraction of the tokens: one in four here, so that some are picked
    trainer = make_trainer(tmp_path, f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
                           "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.25",
                           "actor_rollout_ref.actor.policy_loss.clip_cov_lb=-100",
                           "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.25",
                           "actor_rollout_ref.actor.entropy_coeff=0.01")
    assert trainer.actor.policy_loss is POLICY_LOSSES[loss_mode]
    before = [parameter.detach().clone() for parameter in trainer.actor.model.parameters()]
    metrics = one_step(trainer)
    actor = {key for key in metrics if key.startswith("actor/")}
    assert LOSS_METRICS[loss_mode] <= actor
    assert not (RATIO_METRICS - LOSS_METRICS[loss_mode]) & actor  # nothing verl's function does not report
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", *LOSS_METRICS[loss_mode]):
        assert math.isfinite(metrics[key]), (key, metrics[key])
    assert metrics["actor/grad_norm"] > 0
    after = list(trainer.actor.model.parameters())
    assert any(not torch.equal(old, new) for old, new in zip(before, after, strict=True))


def test_decoupled_rollout_correction_weighs_and_rejects_and_reports_under_verls_names(tmp_path):
    # One mini-batch: an update of one optimizer step takes its own log-probs as the old ones unless something reads
    # them first, as rollout correction does (before the advantages): the old log-probs are then scored on their own.
    trainer = make_trainer(tmp_path, "algorithm.rollout_correction.rollout_is=token",
                           "algorithm.rollout_correction.rollout_rs=token_k1",
                           "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0'",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    metrics = one_step(trainer)
    for key in ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size",
                "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_rs_token_k1_mean",
                "rollout_corr/kl", "rollout_corr/training_ppl", "rollout_corr/rollout_ppl", "actor/pg_loss"):
        assert math.isfinite(metrics[key]), key
    assert not any(key.startswith("actor/rollout_corr") for key in metrics)
    # The rollout sampled with the weights that scored the old log-probs, in float32 on the CPU: the two agree.
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0


def test_bypass_mode_takes_the_rollouts_log_probs_as_the_old_ones_without_a_scoring_pass(tmp_path):
    trainer = make_trainer(tmp_path, "algorithm.rollout_correction.bypass_mode=true",
                           "algorithm.rollout_correction.loss_type=reinforce",
                           "algorithm.rollout_correction.rollout_is=sequence")
    assert trainer.actor.policy_loss is POLICY_LOSSES["bypass_mode"]
    scored = []
    score = trainer.actor.compute_log_probs
    trainer.actor.compute_log_probs = lambda batch: scored.append(len(batch)) or score(batch)
    metrics = one_step(trainer)
    assert scored == []
    for key in ("actor/pg_loss", "actor/ppo_kl", "rollout_corr/rollout_is_mean", "rollout_corr/kl"):
        assert math.isfinite(metrics[key]), key


def test_pf_ppo_trains_on_the_batch_resampled_by_score(tmp_path):
    trainer = make_trainer(tmp_path, "algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_min")
    trained = []
    update = trainer.actor.update
    trainer.actor.update = lambda batch: trained.append(batch.token_level_scores.sum(-1)) or update(batch)
    metrics = one_step(trainer)
    # responses 0..7 score 0..7: max_min draws the worst and the best alone
    assert len(trained[0]) == 8 and set(trained[0].tolist()) <= {0.0, 7.0}
    assert math.isfinite(metrics["actor/pg_loss"])
