"""The step's `adv` phase, between the scores and the updates: verl's rollout correction, the reward's KL penalty,
the advantages by algorithm.adv_estimator and policy filtration; and verl's variance proxies, read after the actor's
update. The math is trainer/algorithms/'s pure functions; what crosses ranks comes in from RunWide and Ranks."""

from __future__ import annotations

import torch

from trainer.algorithms import (
    AdvantageInputs,
    KLController,
    apply_kl_penalty,
    compute_rollout_correction,
    get_advantage_estimator,
    pf_ppo_resample,
    variance_proxy_metrics,
)
from trainer.config import RunConfig
from trainer.distributed.ranks import Ranks
from trainer.distributed.run_wide import RunWide
from trainer.distributed.whole_groups import advantages_over_whole_groups
from trainer.rollout.batch import RolloutBatch


class AdvantagePhase:
    """From a scored batch to the one the updates train on: its advantages and returns, its rollout-correction
    weights and mask, resampled by pf_ppo where asked."""

    def __init__(self, config: RunConfig, run_wide: RunWide, ranks: Ranks, kl_controller: KLController):
        self.algorithm = config.algorithm
        self.run_wide, self.ranks, self.kl_controller = run_wide, ranks, kl_controller
        self.estimator = get_advantage_estimator(config.algorithm.adv_estimator)

    def __call__(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        metrics = self.correct_for_rollout(batch)
        metrics.update(self.compute_advantages(batch))
        return self.filter_policy(batch), metrics

    def correct_for_rollout(self, batch: RolloutBatch) -> dict[str, float]:
        """verl's decoupled rollout correction (algorithm.rollout_correction, bypass mode off): importance weights
        pi_old / pi_rollout and the rejection mask (what the advantages, the critic and the actor train on), and the
        rollout_corr/ metrics, from the rollout's log-probs (trainer/algorithms/rollout_correction.py). Nothing
        without them."""
        correction = self.algorithm.rollout_correction
        if batch.rollout_log_probs is None or batch.old_log_probs is None or correction.bypass_mode:
            return {}
        result = compute_rollout_correction(batch.old_log_probs, batch.rollout_log_probs, batch.response_mask,
                                            correction, mean=self.run_wide.masked_mean)
        batch.rollout_is_weights, batch.rollout_rs_mask = result.weights, result.response_mask
        return dict(zip(result.metrics, torch.stack(list(result.metrics.values())).tolist(), strict=True))

    def compute_advantages(self, batch: RolloutBatch) -> dict[str, float]:
        """Token rewards (less the KL penalty when it is in the reward), then advantages and returns by
        algorithm.adv_estimator (trainer/algorithms/advantages.py)."""
        algorithm = self.algorithm
        metrics = {}
        if algorithm.use_kl_in_reward:
            batch.token_level_rewards, mean_kl = apply_kl_penalty(
                batch.token_level_scores, batch.old_log_probs, batch.ref_log_probs, batch.response_mask,
                kl_coef=self.kl_controller.value, estimator=algorithm.kl_penalty)
            metrics = {"actor/reward_kl_penalty": float(mean_kl),
                       "actor/reward_kl_penalty_coeff": self.kl_controller.value}
            self.kl_controller.update(float(mean_kl), n_steps=len(batch))
        else:
            batch.token_level_rewards = batch.token_level_scores
        # The tokens rollout correction rejected take no advantage (verl's rejection replaces its response_mask).
        inputs = AdvantageInputs(batch.token_level_rewards, batch.training_mask, batch.group_index,
                                 values=batch.values, whiten=self.run_wide.whiten,
                                 old_log_probs=batch.old_log_probs, sum_pi_squared=batch.sum_pi_squared,
                                 rollout_is_weights=batch.rollout_is_weights,
                                 reward_baselines=batch.reward_baselines,
                                 sum_over_batch=self.ranks.sum_tensor_over_data)
        # A prompt's responses spread over ranks (verl's split of the sequences): the estimator sees the whole batch.
        batch.advantages, batch.returns = (
            advantages_over_whole_groups(self.estimator, inputs, algorithm, self.ranks)
            if self.run_wide.splits_groups else self.estimator(inputs, algorithm))
        return metrics

    def filter_policy(self, batch: RolloutBatch) -> RolloutBatch:
        """Policy-filtration PPO (algorithm.use_pf_ppo): the batch resampled by its responses' scores
        (trainer/algorithms/pf_ppo.py); each rank resamples its own share (verl resamples the whole batch in one
        place), the ranks of a sequence-parallel group alike. verl reweights under gae only; here every estimator."""
        if not self.algorithm.use_pf_ppo:
            return batch
        assert batch.token_level_scores is not None
        indices = pf_ppo_resample(batch.token_level_scores.sum(-1), self.algorithm.pf_ppo.reweight_method,
                                  self.algorithm.pf_ppo.weight_pow)
        return batch.select(self.ranks.broadcast_in_sequence_group([indices])[0])

    def variance_proxies(self, batch: RolloutBatch, grad_norm: float | None) -> dict[str, float]:
        """verl's variance_proxy/* metrics of the step, from the sums of squared probabilities and the actor's
        gradient norm (trainer/algorithms/token_baselines.py)."""
        assert batch.advantages is not None and batch.old_log_probs is not None and batch.sum_pi_squared is not None
        return variance_proxy_metrics(batch.advantages, batch.training_mask, batch.old_log_probs,
                                      batch.sum_pi_squared, grad_norm=grad_norm,
                                      rollout_is_weights=batch.rollout_is_weights,
                                      sum_over_batch=self.ranks.sum_tensor_over_data)
