"""Rollout correction (trainer/algorithms/rollout_correction.py): importance weights, rejection and the off-policy
metrics, against numbers worked out by hand in the comments."""

import math

import pytest
import torch
from torch.testing import assert_close

from trainer.algorithms import compute_rollout_correction, off_policy_metrics
from trainer.algorithms.rollout_correction import importance_weights, rejection_mask
from trainer.config.losses import RolloutCorrectionConfig, rejection_criteria


def tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


LOG = math.log
# One row of three tokens, the last one padding: ratios pi_train / pi_rollout of 3 and 0.4.
TOKEN_RATIOS = tensor([[LOG(3.0), LOG(0.4), LOG(1.5)]])
TOKEN_MASK = tensor([[1, 1, 0]])
# Two rows: log ratios 0.1, 0.2 (sum 0.3) and 0.5, 0.5, 0.5 (sum 1.5).
SEQUENCE_RATIOS = tensor([[0.1, 0.2, 0.0], [0.5, 0.5, 0.5]])
SEQUENCE_MASK = tensor([[1, 1, 0], [1, 1, 1]])


# ---------------------------------------------------------------------------------- importance weights


def test_token_weights_are_each_tokens_ratio_truncated_at_the_threshold_and_zero_at_padding():
    weights, metrics = importance_weights(TOKEN_RATIOS, TOKEN_MASK, "token", 2.0)
    assert_close(weights, tensor([[2.0, 0.4, 0.0]]))
    # before truncation: mean (3 + 0.4) / 2, max 3, min 0.4; 3 > 2 (high), 0.4 < 1 / 2 (low)
    assert_close(metrics["rollout_is_mean"], tensor(1.7))
    assert_close(metrics["rollout_is_max"], tensor(3.0))
    assert_close(metrics["rollout_is_min"], tensor(0.4))
    assert_close(metrics["rollout_is_ratio_fraction_high"], tensor(0.5))
    assert_close(metrics["rollout_is_ratio_fraction_low"], tensor(0.5))
    # held within [0.5, 2]: [2, 0.5], mean 1.25, E[w^2] = 2.125: std sqrt(2.125 - 1.5625) = 0.75;
    # effective sample size 1 / mean((w / 1.25)^2) = 1 / ((1.6^2 + 0.4^2) / 2) = 1 / 1.36
    assert_close(metrics["rollout_is_std"], tensor(0.75))
    assert_close(metrics["rollout_is_eff_sample_size"], tensor(1 / 1.36), rtol=1e-6, atol=0)


def test_sequence_weights_are_the_product_of_the_token_ratios_on_every_token():
    weights, metrics = importance_weights(SEQUENCE_RATIOS, SEQUENCE_MASK, "sequence", 2.0)
    # exp(0.3) = 1.35; exp(1.5) = 4.48 -> 2
    assert_close(weights, tensor([[math.exp(0.3), math.exp(0.3), 0.0], [2.0, 2.0, 2.0]]))
    assert_close(metrics["rollout_is_ratio_fraction_high"], tensor(0.5))  # one sequence of two
    assert_close(metrics["rollout_is_max"], tensor(math.exp(1.5)))


def test_batch_normalised_weights_average_one_over_tokens_or_sequences():
    token, metrics = importance_weights(TOKEN_RATIOS, TOKEN_MASK, "token", 2.0, batch_normalize=True)
    assert_close(token, tensor([[2.0 / 1.2, 0.4 / 1.2, 0.0]]))  # truncated [2, 0.4], mean 1.2
    assert_close(metrics["rollout_is_batch_norm_factor"], tensor(1.2))
    sequence, _ = importance_weights(SEQUENCE_RATIOS, SEQUENCE_MASK, "sequence", 2.0, batch_normalize=True)
    mean = (math.exp(0.3) + 2.0) / 2  # over the two sequences, not their five tokens
    assert_close(sequence[:, 0], tensor([math.exp(0.3) / mean, 2.0 / mean]))


def test_batch_normalisation_divides_by_the_whole_batchs_mean_it_is_given():
    """On several ranks `mean` is every rank's (RunWide.masked_mean): the weights divide by it, not by this rank's."""
    weights, metrics = importance_weights(TOKEN_RATIOS, TOKEN_MASK, "token", 2.0, batch_normalize=True,
                                          mean=lambda values, mask: tensor(4.0))
    assert_close(weights, tensor([[0.5, 0.1, 0.0]]))
    assert_close(metrics["rollout_is_batch_norm_factor"], tensor(4.0))


def test_a_huge_log_ratio_gives_a_finite_weight():
    weights, metrics = importance_weights(tensor([[100.0, -100.0]]), tensor([[1, 1]]), "token", 1e12)
    assert_close(weights, tensor([[math.exp(20.0), math.exp(-20.0)]]))  # clamped to [-20, 20] before exp
    assert all(torch.isfinite(value) for value in metrics.values())


# ------------------------------------------------------------------------------------------- rejection


def rejected(ratios, mask, rollout_rs, threshold):
    return rejection_mask(ratios, mask, rejection_criteria(rollout_rs, threshold))


def test_token_k1_keeps_the_tokens_whose_ratio_lies_within_the_bounds():
    # k1 = -log r = [-1.10, 0.92] against [log 0.5, log 2] = [-0.69, 0.69]: both out
    kept, metrics = rejected(TOKEN_RATIOS, TOKEN_MASK, "token_k1", "0.5_2")
    assert_close(kept, tensor([[0.0, 0.0, 0.0]]))
    # one bound is the upper, its reciprocal the lower: [1/4, 4] keeps both
    kept, _ = rejected(TOKEN_RATIOS, TOKEN_MASK, "token_k1", 4.0)
    assert_close(kept, tensor([[1.0, 1.0, 0.0]]))
    assert_close(metrics["rollout_rs_token_k1_mean"], tensor((-LOG(3.0) - LOG(0.4)) / 2))
    assert_close(metrics["rollout_rs_token_k1_max"], tensor(-LOG(0.4)))
    assert_close(metrics["rollout_rs_masked_fraction"], tensor(1.0))
    assert_close(metrics["rollout_rs_seq_masked_fraction"], tensor(1.0))


def test_token_k2_and_k3_bound_each_tokens_divergence_from_above():
    ratios = tensor([[LOG(1.1), LOG(0.5)]])
    mask = tensor([[1, 1]])
    # k2 = (log r)^2 / 2 = [0.0045, 0.2402]; k3 = r - 1 - log r = [0.0047, 0.1931]
    assert_close(rejected(ratios, mask, "token_k2", 0.1)[0], tensor([[1.0, 0.0]]))
    assert_close(rejected(ratios, mask, "token_k3", 0.2)[0], tensor([[1.0, 1.0]]))
    assert_close(rejected(ratios, mask, "token_k3", 0.19)[0], tensor([[1.0, 0.0]]))


def test_sequence_options_judge_a_whole_sequence_by_the_sum_mean_or_largest_of_its_tokens():
    # sums of k1: -0.3 and -1.5 against [-0.69, 0.69]: the second sequence out
    kept, metrics = rejected(SEQUENCE_RATIOS, SEQUENCE_MASK, "seq_sum_k1", "0.5_2")
    assert_close(kept, tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert_close(metrics["rollout_rs_seq_sum_k1_max"], tensor(-0.3))  # over sequences
    assert_close(metrics["rollout_rs_seq_sum_k1_min"], tensor(-1.5))
    assert_close(metrics["rollout_rs_seq_sum_k1_masked_fraction"], tensor(3 / 5))  # of the tokens
    assert_close(metrics["rollout_rs_seq_sum_k1_seq_masked_fraction"], tensor(0.5))
    # means of k1: -0.15 and -0.5: both within
    assert_close(rejected(SEQUENCE_RATIOS, SEQUENCE_MASK, "seq_mean_k1", "0.5_2")[0], SEQUENCE_MASK)
    # largest k2: max(0.005, 0.02) = 0.02 and 0.125: the second out at 0.1
    assert_close(rejected(SEQUENCE_RATIOS, SEQUENCE_MASK, "seq_max_k2", 0.1)[0],
                 tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    # mean k3: (0.00517 + 0.02140) / 2 = 0.0133 and 0.1487: the second out at 0.05
    kept, metrics = rejected(SEQUENCE_RATIOS, SEQUENCE_MASK, "seq_mean_k3", 0.05)
    assert_close(kept, tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    k3 = [math.exp(x) - 1 - x for x in (0.1, 0.2, 0.5)]
    # the statistic's mean over the tokens: each token carries its sequence's
    assert_close(metrics["rollout_rs_seq_mean_k3_mean"], tensor((2 * (k3[0] + k3[1]) / 2 + 3 * k3[2]) / 5))


def test_every_option_must_keep_a_token():
    # token_k1 at [1/4, 4] keeps row 0's two tokens; seq_max_k2 at 0.1 drops row 1: only row 0 stays
    kept, metrics = rejected(SEQUENCE_RATIOS, SEQUENCE_MASK, "token_k1,seq_max_k2", "4,0.1")
    assert_close(kept, tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert_close(metrics["rollout_rs_token_k1_masked_fraction"], tensor(0.0))
    assert_close(metrics["rollout_rs_masked_fraction"], tensor(3 / 5))


# ------------------------------------------------------------------------------------------- together


def test_the_correction_takes_what_the_config_asks_for_and_prefixes_its_metrics():
    log_prob, rollout = tensor([[-1.0, -2.0]]), tensor([[-1.5, -1.0]])  # log ratios 0.5 and -1
    mask = tensor([[1, 1]])
    nothing = compute_rollout_correction(log_prob, rollout, mask, RolloutCorrectionConfig())
    assert nothing.weights is None and nothing.response_mask is None
    assert set(nothing.metrics) >= {"rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_seq"}
    both = compute_rollout_correction(log_prob, rollout, mask, RolloutCorrectionConfig(
        rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.5_1.5"))
    assert_close(both.weights, tensor([[math.exp(0.5), math.exp(-1.0)]]))
    assert_close(both.response_mask, tensor([[1.0, 0.0]]))  # k1 = 1 > log 1.5
    assert "rollout_corr/rollout_is_mean" in both.metrics and "rollout_corr/rollout_rs_masked_fraction" in both.metrics


def test_off_policy_metrics_measure_how_far_the_rollouts_policy_is():
    metrics = off_policy_metrics(tensor([[-1.0, -2.0]]), tensor([[-1.5, -1.0]]), tensor([[1, 1]]))
    # log ratios (train - rollout) [0.5, -1]
    assert_close(metrics["kl"], tensor(0.25))  # mean(rollout - train) = (-0.5 + 1) / 2
    assert_close(metrics["k3_kl"], tensor(((math.exp(0.5) - 1.5) + math.exp(-1.0)) / 2))
    assert_close(metrics["training_log_ppl"], tensor(1.5))
    assert_close(metrics["training_ppl"], tensor(math.exp(1.5)))
    assert_close(metrics["rollout_log_ppl"], tensor(1.25))
    assert_close(metrics["log_ppl_diff"], tensor(0.25))  # rollout's mean log-prob -1.25 less train's -1.5
    assert_close(metrics["ppl_ratio"], tensor(math.exp(0.25)))
    assert_close(metrics["chi2_token"], tensor((math.e + math.exp(-2.0)) / 2 - 1))
    assert_close(metrics["chi2_seq"], tensor(math.exp(-1.0) - 1))  # (e^{0.5 - 1})^2 - 1


# ---------------------------------------------------------------------------------- thresholds, read


def test_thresholds_are_read_as_verl_reads_them():
    both = rejection_criteria("token_k1,seq_max_k2", "0.6_1.6,2.5")
    assert [(c.option, c.lower, c.upper) for c in both] == [("token_k1", 0.6, 1.6), ("seq_max_k2", None, 2.5)]
    shared = rejection_criteria("seq_mean_k1, seq_mean_k3", 2.0)
    assert [(c.option, c.lower, c.upper) for c in shared] == [("seq_mean_k1", 0.5, 2.0), ("seq_mean_k3", None, 2.0)]


@pytest.mark.parametrize(("rollout_rs", "threshold", "message"), [
    ("token_k2", "0.5_2", "only a k1 option takes 'lower_upper'"),
    ("token_k1,token_k2", "1,2,3", "3 thresholds for 2 rollout_rs options"),
    ("token_k1", "-1", "allowed: bounds > 0"),
    ("token_k3", "much", "not a number"),
])
def test_a_threshold_that_does_not_fit_its_options_says_why(rollout_rs, threshold, message):
    with pytest.raises(ValueError, match=message):
        rejection_criteria(rollout_rs, threshold)
