"""verl's policy loss modes (trainer/algorithms/policy_losses.py) against numbers worked out by hand in the comments."""

import math
import typing

import pytest
import torch
from torch.testing import assert_close

from trainer.algorithms import (
    POLICY_LOSSES,
    PolicyLossInputs,
    compute_policy_loss,
    get_policy_loss,
    policy_loss_mode,
)
from trainer.algorithms.policy_losses import (
    compute_cispo_loss,
    compute_clip_cov_loss,
    compute_geo_mean_loss,
    compute_gpg_loss,
    compute_gspo_loss,
    compute_kl_cov_loss,
    compute_sapo_loss,
)
from trainer.config import ActorConfig
from trainer.config.losses import PolicyLossMode, RolloutCorrectionConfig


def tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def with_grad(values) -> torch.Tensor:
    return tensor(values).requires_grad_(True)


# ------------------------------------------------------------------------------------------- registry


def test_the_registry_has_every_loss_mode_verl_registers_and_the_schema_takes_the_same_names():
    verl = ["vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "bypass_mode"]
    assert sorted(POLICY_LOSSES) == sorted(verl)
    assert sorted(typing.get_args(PolicyLossMode)) == sorted(verl)


def test_an_unknown_loss_mode_is_refused_with_the_key_and_every_name():
    with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.policy_loss.loss_mode 'ppo'; allowed: vanilla, "
                                         r"gspo, sapo, gpg, clip_cov, kl_cov, geo_mean, cispo, bypass_mode"):
        get_policy_loss("ppo")


def test_bypass_mode_runs_the_bypass_loss_whatever_loss_mode_says():
    actor = ActorConfig.model_validate({"policy_loss": {"loss_mode": "gspo"}})
    assert policy_loss_mode(actor, RolloutCorrectionConfig()) == "gspo"
    assert policy_loss_mode(actor, RolloutCorrectionConfig(bypass_mode=True)) == "bypass_mode"


# -------------------------------------------------------------------------------------------- vanilla


def test_vanilla_is_ppos_clipped_loss_with_each_token_times_its_importance_weight():
    log_prob = torch.log(tensor([[1.5, 0.5, 4.0, 1.0, 0.5, 1.0]]))
    inputs = dict(old_log_prob=torch.zeros(1, 6, dtype=torch.float64), log_prob=log_prob,
                  advantages=tensor([[1.0, -2.0, -1.0, 2.0, 1.0, 1.0]]), response_mask=tensor([[1, 1, 1, 1, 1, 0]]))
    weights = tensor([[2.0, 1.0, 1.0, 1.0, 0.5, 7.0]])
    config = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    result = get_policy_loss("vanilla")(PolicyLossInputs(**inputs, rollout_is_weights=weights), config,
                                        RolloutCorrectionConfig())
    # token losses -1.28, 1.6, 3 (dual clip), -2, -0.5 (test_algorithms.py), times 2, 1, 1, 1, 0.5; padding out
    assert_close(result.loss, tensor((-1.28 * 2 + 1.6 + 3.0 - 2.0 - 0.5 * 0.5) / 5))
    assert result.aggregation == "token-mean"
    assert set(result.metrics) == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}
    unweighted = compute_policy_loss(**inputs, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert_close(result.metrics["pg_clipfrac"], unweighted.clipfrac)


# ----------------------------------------------------------------------------------------------- GSPO


def gspo_batch(log_prob):
    # row 0: 2 tokens, log ratios 0.2 and 0.0, A = +1; row 1: 3 tokens, log ratios -0.3, 0, 0, A = -1
    return dict(old_log_prob=tensor([[-1.2, -1.0, 0.0], [-0.7, -1.0, -1.0]]), log_prob=log_prob,
                advantages=tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]),
                response_mask=tensor([[1, 1, 0], [1, 1, 1]]))


def test_gspo_clips_the_length_normalised_sequence_ratio_and_averages_per_sequence():
    batch = gspo_batch(tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]]))
    loss, metrics = compute_gspo_loss(**batch, clip_ratio_low=0.05, clip_ratio_high=0.05)
    # s0 = exp((0.2 + 0) / 2) = 1.1052 > 1.05: -A * clip = -1.05 on both tokens (clipped)
    # s1 = exp(-0.3 / 3) = 0.9048 < 0.95: max(0.9048, 0.95) = 0.95 on all three (clipped)
    # per sequence, then over sequences: (-1.05 + 0.95) / 2
    assert_close(loss, tensor(-0.05))
    assert_close(metrics["pg_clipfrac"], tensor(1.0))
    assert_close(metrics["ppo_kl"], tensor(-(0.2 - 0.3) / 5))  # mean of old - new over the 5 tokens
    assert_close(metrics["pg_clipfrac_lower"], tensor(0.0))


def test_gspo_gives_every_token_its_sequences_ratio_as_gradient_weight():
    log_prob = with_grad([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]])
    loss, _ = compute_gspo_loss(**gspo_batch(log_prob), clip_ratio_low=0.5, clip_ratio_high=0.5)  # nothing clipped
    loss.backward()
    # d/d log pi_t of mean_i mean_t (-A_i * s_i,t) = -A_i * s_i / len_i / 2 (sequences)
    s0, s1 = math.exp(0.1), math.exp(-0.1)
    assert_close(log_prob.grad, tensor([[-s0 / 4, -s0 / 4, 0.0], [s1 / 6, s1 / 6, s1 / 6]]))


# ----------------------------------------------------------------------------------------------- SAPO


def test_sapo_gates_the_ratio_with_the_temperature_of_the_advantages_sign():
    log_prob = with_grad([[0.0, 0.5]])
    loss, metrics = compute_sapo_loss(torch.zeros(1, 2, dtype=torch.float64), log_prob, tensor([[1.0, -1.0]]),
                                      tensor([[1, 1]]), tau_pos=1.0, tau_neg=1.05)
    # token 0: r = 1, A = +1, tau 1:    f = sigmoid(0) * 4 / 1 = 2,                 loss -2
    # token 1: r = e^0.5, A = -1, tau 1.05: f = sigmoid(1.05 * (1.6487 - 1)) * 4 / 1.05 = 0.66399 * 3.80952 = 2.52949
    gate = 1.0 / (1.0 + math.exp(-1.05 * (math.exp(0.5) - 1.0))) * 4.0 / 1.05
    assert_close(loss, tensor((-2.0 + gate) / 2))
    loss.backward()
    # At r = 1 the gate's slope is 4 sigmoid(0) (1 - sigmoid(0)) = 1: PPO's gradient -A r = -1, over 2 tokens
    assert_close(log_prob.grad[0, 0], tensor(-0.5))
    assert_close(metrics["pg_clipfrac"], tensor(0.0))


# ------------------------------------------------------------------------------------------------ GPG


def test_gpg_is_the_plain_policy_gradient():
    log_prob = with_grad([[-1.0, -2.0]])
    loss = compute_gpg_loss(log_prob, tensor([[1.0, -1.0]]), tensor([[1, 1]]), "token-mean")
    # mean(-A * log pi) = (-(1)(-1) - (-1)(-2)) / 2 = (1 - 2) / 2
    assert_close(loss, tensor(-0.5))
    loss.backward()
    assert_close(log_prob.grad, tensor([[-0.5, 0.5]]))  # -A / 2: no ratio, no clip


# ---------------------------------------------------------------------------------------------- CISPO


def test_cispo_clips_the_weight_but_keeps_every_tokens_gradient():
    log_prob = with_grad([[-1.0, -2.0]])
    old_log_prob = tensor([[-1.0 - math.log(1.5), -2.0 - math.log(0.9)]])  # ratios 1.5 and 0.9
    loss, metrics = compute_cispo_loss(old_log_prob, log_prob, tensor([[1.0, -1.0]]), tensor([[1, 1]]), 0.2, 0.2,
                                       "token-mean")
    # weights clip(1.5) = 1.2, clip(0.9) = 0.9; -w * A * log pi = [-1.2 * 1 * -1, -0.9 * -1 * -2] = [1.2, -1.8]
    assert_close(loss, tensor(-0.3))
    loss.backward()
    # d/d log pi = -w * A / 2: the clipped token still moves (PPO's clip would have zeroed it)
    assert_close(log_prob.grad, tensor([[-0.6, 0.45]]))
    assert_close(metrics["pg_clipfrac"], tensor(0.5))


# ------------------------------------------------------------------------------------------------ GMPO


def test_geo_mean_takes_the_geometric_mean_of_the_pessimistically_clipped_ratios():
    # log ratios: row 0 (A = +1) 0.6, -0.2; row 1 (A = -1) -0.6, 0.2; clip range of the log ratio [-0.4, 0.4]
    log_prob = tensor([[0.6, -0.2], [-0.6, 0.2]])
    loss, metrics = compute_geo_mean_loss(torch.zeros(2, 2, dtype=torch.float64), log_prob,
                                          tensor([[1.0, 1.0], [-1.0, -1.0]]), tensor([[1, 1], [1, 1]]), 0.4, 0.4)
    # row 0, s = +1: min(0.6, 0.4) = 0.4, min(-0.2, -0.2) = -0.2 -> mean 0.1 -> -1 * e^0.1
    # row 1, s = -1: -min(0.6, 0.4) = -0.4, -min(-0.2, -0.2) = 0.2 -> mean -0.1 -> +1 * e^-0.1
    assert_close(loss, tensor((-math.exp(0.1) + math.exp(-0.1)) / 2))
    assert_close(metrics["pg_clipfrac"], tensor(0.25))  # row 0's first token (A > 0) was clipped
    assert_close(metrics["pg_clipfrac_lower"], tensor(0.25))  # row 1's first token (A < 0)


def test_geo_mean_takes_importance_weights_as_each_sequences_geometric_mean():
    loss, _ = compute_geo_mean_loss(torch.zeros(1, 2, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64),
                                    tensor([[1.0, 1.0]]), tensor([[1, 1]]), 0.4, 0.4, weights=tensor([[4.0, 1.0]]))
    assert_close(loss, tensor(-2.0), atol=1e-8, rtol=0)  # ratio 1, weight sqrt(4 * 1) = 2


# ---------------------------------------------------------------------------------------- Clip-Cov, KL-Cov


def covariance_batch(old_log_prob):
    # A = [2, 0, 0, -2] (mean 0), log pi = [-1, -2, -2, -2.5] (mean -1.875):
    # covariance terms (A - 0)(log pi + 1.875) = [1.75, 0, 0, 1.25]
    return dict(old_log_prob=old_log_prob, log_prob=tensor([[-1.0, -2.0, -2.0, -2.5]]),
                advantages=tensor([[2.0, 0.0, 0.0, -2.0]]), response_mask=tensor([[1, 1, 1, 1]]))


def test_clip_cov_cuts_the_gradient_of_tokens_whose_covariance_lies_within_its_bounds():
    batch = covariance_batch(old_log_prob=tensor([[-1.0, -2.0, -2.0, -2.5]]))  # every ratio 1
    loss, metrics = compute_clip_cov_loss(**batch, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_cov_ratio=0.0002,
                                          clip_cov_lb=1.0, clip_cov_ub=1.5, loss_agg_mode="token-mean")
    # only token 3 (1.25) lies in (1, 1.5); max(1, int(0.0002 * 4)) = 1 token is cut: losses [-2, 0, 0, 0]
    assert_close(loss, tensor(-2.0 / 4))
    assert_close(metrics["pg_clipfrac"], tensor(0.25))


def test_clip_cov_never_cuts_a_token_ppos_clip_already_holds():
    # token 0's ratio is 1.5 (A = +2): PPO's clip holds it at 1.2, so of the tokens in (1, 5) only token 3 is cut,
    # although clip_cov_ratio asks for int(0.5 * 4) = 2
    batch = covariance_batch(old_log_prob=tensor([[-1.0 - math.log(1.5), -2.0, -2.0, -2.5]]))
    loss, metrics = compute_clip_cov_loss(**batch, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_cov_ratio=0.5,
                                          clip_cov_lb=1.0, clip_cov_ub=5.0, loss_agg_mode="token-mean",
                                          generator=torch.Generator().manual_seed(0))
    assert_close(loss, tensor(-2.0 * 1.2 / 4))  # [-2.4, 0, 0, cut]
    assert_close(metrics["pg_clipfrac"], tensor(0.25))


def test_kl_cov_penalises_the_tokens_of_largest_covariance_with_their_absolute_log_ratio():
    batch = covariance_batch(old_log_prob=tensor([[-1.2, -2.0, -2.0, -2.5]]))  # token 0's log ratio 0.2
    loss, metrics = compute_kl_cov_loss(**batch, kl_cov_ratio=0.25, ppo_kl_coef=0.1, loss_agg_mode="token-mean")
    # int(4 * 0.25) = 1 token, the largest covariance: token 0 (1.75); losses -A r (+ 0.1 |log r| on token 0):
    # [-2 e^0.2 + 0.1 * 0.2, 0, 0, 2]
    assert_close(loss, tensor((-2.0 * math.exp(0.2) + 0.02 + 2.0) / 4))
    assert_close(metrics["ppo_kl"], tensor(0.2 / 4))  # verl reports the mean |log r| for kl_cov


# ------------------------------------------------------------------------------------------ bypass mode


def bypass(correction: RolloutCorrectionConfig, log_prob: torch.Tensor):
    # rollout log-probs [-1.5, -1.0] (the old ones in bypass mode); log pi [-1, -2]: log ratios 0.5 and -1
    inputs = PolicyLossInputs(old_log_prob=tensor([[-1.5, -1.0]]), log_prob=log_prob, advantages=tensor([[1.0, 1.0]]),
                              response_mask=tensor([[1, 1]]))
    return get_policy_loss("bypass_mode")(inputs, ActorConfig(), correction)


def test_bypass_reinforce_weighs_the_log_probs_by_the_truncated_ratio_to_the_rollout():
    log_prob = with_grad([[-1.0, -2.0]])
    result = bypass(RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_is="token",
                                            rollout_is_threshold=1.5), log_prob)
    # w = min(exp([0.5, -1]), 1.5) = [1.5, 0.3679]; loss = mean(-A * log pi * w) = (1 * 1.5 + 2 * 0.3679) / 2
    assert_close(result.loss, tensor((1.5 + 2.0 * math.exp(-1.0)) / 2))
    result.loss.backward()
    assert_close(log_prob.grad, tensor([[-0.75, -math.exp(-1.0) / 2]]))  # -A w / 2: the weights are detached
    assert_close(result.metrics["ppo_kl"], tensor((-0.5 + 1.0) / 2))  # mean(rollout - log pi)
    assert_close(result.metrics["rollout_corr/rollout_is_ratio_fraction_high"], tensor(0.5))  # e^0.5 > 1.5


def test_bypass_ppo_clip_is_ppos_loss_against_the_rollout_without_weights_on_top():
    log_prob = tensor([[-1.0, -2.0]])
    result = bypass(RolloutCorrectionConfig(bypass_mode=True, rollout_is="token"), log_prob)
    expected = compute_policy_loss(tensor([[-1.5, -1.0]]), log_prob, tensor([[1.0, 1.0]]), tensor([[1, 1]]), 0.2, 0.2)
    # r = [1.65, 0.37]: (max(-1.65, -1.2) + max(-0.37, -0.8)) / 2 = (-1.2 - 0.37) / 2; weights would change it
    assert_close(result.loss, tensor((-1.2 - math.exp(-1.0)) / 2))
    assert_close(result.loss, expected.loss)
    assert "rollout_corr/rollout_is_mean" in result.metrics and "rollout_corr/kl" in result.metrics


def test_bypass_rejection_zeroes_a_rejected_tokens_loss_in_the_same_mean():
    result = bypass(RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_rs="token_k1",
                                            rollout_rs_threshold="0.5_1.5"), tensor([[-1.0, -2.0]]))
    # k1 = -log r = [-0.5, 1.0] against [log 0.5, log 1.5] = [-0.69, 0.41]: token 1 is rejected
    # loss = (-1 * -1 + 0) / 2 tokens (the denominator stays the micro-batch's tokens)
    assert_close(result.loss, tensor(0.5))
    assert_close(result.metrics["rollout_corr/rollout_rs_masked_fraction"], tensor(0.5))
