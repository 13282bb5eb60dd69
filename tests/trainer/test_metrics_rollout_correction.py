"""Rollout correction's metrics over several ranks (trainer/metrics.py): verl names its extremes ..._max and ..._min,
and those combine as the largest and smallest of the ranks', the rest as means."""

from trainer.metrics import combine_rank_metrics, rank_reduction


def test_rollout_corrections_extremes_combine_as_extremes_and_the_rest_as_means():
    assert rank_reduction("rollout_corr/rollout_is_max") == "max"
    assert rank_reduction("rollout_corr/log_ppl_diff_min") == "min"
    assert rank_reduction("rollout_corr/rollout_is_mean") == "mean"
    combined = combine_rank_metrics([({"rollout_corr/rollout_is_max": 3.0, "rollout_corr/kl": 0.1}, 4, 10),
                                     ({"rollout_corr/rollout_is_max": 1.5, "rollout_corr/kl": 0.3}, 4, 10)])
    assert combined["rollout_corr/rollout_is_max"] == 3.0
    assert abs(combined["rollout_corr/kl"] - 0.2) < 1e-12
