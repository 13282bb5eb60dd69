"""verl's advantage estimators against numbers worked out by hand, the registry under verl's names, and what the
estimators that look at the whole batch give on several ranks."""

from __future__ import annotations

import math
import statistics
import typing

import pytest
import torch
from torch import tensor
from torch.testing import assert_close

from trainer.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_optimal_token_baseline_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_advantage_estimator,
    masked_whiten,
    sum_pi_squared_from_logits,
    token_baselines,
    variance_proxy_metrics,
)
from trainer.config import AlgorithmConfig, load_config_with_notes
from trainer.config.schema import AdvantageEstimatorName

# verl's AdvantageEstimator (verl/trainer/ppo/core_algos.py), every value.
VERL_ESTIMATORS = ("gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo", "opo",
                   "grpo_passk", "gpg", "rloo_vectorized", "grpo_vectorized", "optimal_token_baseline",
                   "tir_optimal_token_baseline")
EPS = 1e-6


def test_every_verl_estimator_is_registered_and_offered_by_the_config():
    assert sorted(ADVANTAGE_ESTIMATORS) == sorted(VERL_ESTIMATORS)
    assert typing.get_args(AdvantageEstimatorName) == VERL_ESTIMATORS
    for name in VERL_ESTIMATORS:
        assert AlgorithmConfig(adv_estimator=name).adv_estimator == name
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'; allowed: gae, grpo, .*, "
                                         r"tir_optimal_token_baseline"):
        get_advantage_estimator("ppo")


def outcome_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores: group 7 -> 1, 0, 1; group 5 (alone) -> 0.5; group 3 -> 2, 4. Each reward is on the row's last
    token; row 3's 9.0 is on padding and must not count."""
    rewards = tensor([[0, 1.0], [0, 0], [0, 1.0], [0.5, 9.0], [0, 2.0], [0, 4.0]])
    mask = tensor([[1, 1], [1, 1], [1, 1], [1, 0], [1, 1], [1, 1]])
    return rewards, mask, torch.tensor([7, 7, 7, 5, 3, 3])


def per_token(values: list[float], mask: torch.Tensor) -> torch.Tensor:
    return tensor(values).unsqueeze(-1) * mask


# ------------------------------------------------------------------------------------------- RLOO


def test_rloo_takes_each_response_against_the_mean_of_the_others():
    rewards, mask, groups = outcome_batch()
    advantages, returns = compute_rloo_outcome_advantage(rewards, mask, groups)
    # group 7: 1 - (0 + 1) / 2 = 0.5; 0 - (1 + 1) / 2 = -1.  group 3: 2 - 4 = -2; 4 - 2 = 2.
    # The lone response keeps its score (verl's rloo).
    expected = per_token([0.5, -1.0, 0.5, 0.5, -2.0, 2.0], mask)
    assert_close(advantages, expected)
    assert_close(returns, expected)


def test_rloo_vectorized_gives_a_lone_response_zero():
    rewards, mask, groups = outcome_batch()
    advantages, _ = get_advantage_estimator("rloo_vectorized")(AdvantageInputs(rewards, mask, groups),
                                                               AlgorithmConfig())
    assert_close(advantages, per_token([0.5, -1.0, 0.5, 0.0, -2.0, 2.0], mask))


# ------------------------------------------------------------------------------------------- GRPO


def test_grpo_vectorized_is_grpo_where_the_groups_vary():
    rewards, mask, groups = outcome_batch()
    for norm in (True, False):
        assert_close(compute_grpo_vectorized_outcome_advantage(rewards, mask, groups, norm_adv_by_std=norm)[0],
                     compute_grpo_outcome_advantage(rewards, mask, groups, norm_adv_by_std=norm)[0])


def test_grpo_vectorized_floors_the_group_variance_at_epsilon():
    rewards = tensor([[0.0], [1e-4]], dtype=torch.float64)
    mask, groups = torch.ones_like(rewards), torch.tensor([0, 0])
    # Unbiased variance (1e-4)^2 / 2 = 5e-9 < 1e-6: the std is sqrt(1e-6) = 1e-3, so +-5e-5 / (1e-3 + 1e-6).
    vectorized, _ = compute_grpo_vectorized_outcome_advantage(rewards, mask, groups)
    assert_close(vectorized[:, 0], tensor([-5e-5, 5e-5], dtype=torch.float64) / (1e-3 + EPS))
    # GRPO itself divides by the true std, sqrt(5e-9) = 7.07e-5: +-0.69...
    plain, _ = compute_grpo_outcome_advantage(rewards, mask, groups)
    assert_close(plain[:, 0], tensor([-5e-5, 5e-5], dtype=torch.float64) / (math.sqrt(5e-9) + EPS))


def test_grpo_passk_gives_only_the_best_response_its_margin_over_the_runner_up():
    rewards = tensor([[3.0], [1.0], [2.0], [2.0], [4.0], [1.0], [0.0], [1.0]])
    mask, groups = torch.ones_like(rewards), torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    # group 0: best 3 (row 0), runner-up 2: margin 1; scores 3, 1, 2 have std 1.
    # group 1: best 4 (row 4), runner-up 2: margin 2; std sqrt(2).  group 2: two best tie at 1: margin 0.
    advantages, _ = compute_grpo_passk_outcome_advantage(rewards, mask, groups)
    assert_close(advantages[:, 0], tensor([1 / (1 + EPS), 0, 0, 0, 2 / (math.sqrt(2) + EPS), 0, 0, 0]))
    unnormalised, _ = compute_grpo_passk_outcome_advantage(rewards, mask, groups, norm_adv_by_std=False)
    assert_close(unnormalised[:, 0], tensor([1.0, 0, 0, 0, 2.0, 0, 0, 0]))


def test_grpo_passk_refuses_a_group_of_one_as_verl_does():
    rewards, mask, groups = outcome_batch()
    with pytest.raises(ValueError, match="grpo_passk needs at least 2 responses per prompt"):
        compute_grpo_passk_outcome_advantage(rewards, mask, groups)


# -------------------------------------------------------------------------------------- OPO and GPG


def test_opo_baseline_is_the_groups_length_weighted_mean_score():
    rewards = tensor([[2.0, 0, 0], [0, 0, 0], [0, 1.0, 0]])
    mask = tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0]])
    groups = torch.tensor([0, 0, 1])
    # group 0: lengths 1 and 3, scores 2 and 0: baseline (1 * 2 + 3 * 0) / 4 = 0.5. Row 2 alone: baseline 0.
    advantages, returns = compute_opo_outcome_advantage(rewards, mask, groups)
    expected = tensor([[1.5, 0, 0], [-0.5, -0.5, -0.5], [1.0, 1.0, 0]])
    assert_close(advantages, expected)
    assert_close(returns, expected)


def gpg_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rewards = tensor([[1.0], [0.0], [0.0], [0.0], [2.0]])
    return rewards, torch.ones_like(rewards), torch.tensor([0, 0, 1, 1, 2])


def test_gpg_scales_group_centred_scores_by_responses_over_scored_responses():
    rewards, mask, groups = gpg_batch()
    # 5 responses, 2 with a non-zero score: alpha = 2.5. group 0 mean 0.5; group 1 all 0; row 4 alone: mean 0.
    advantages, _ = compute_gpg_outcome_advantage(rewards, mask, groups)
    assert_close(advantages[:, 0], tensor([1.25, -1.25, 0.0, 0.0, 5.0]))


def test_gpg_on_two_ranks_scales_as_one_rank_over_the_whole_batch():
    rewards, mask, groups = gpg_batch()
    whole, _ = compute_gpg_outcome_advantage(rewards, mask, groups)
    shares = [slice(0, 2), slice(2, 5)]  # each rank holds whole groups

    def counts(share: slice) -> torch.Tensor:  # what a rank adds to the batch-wide sum: (responses, scored)
        scores = rewards[share, 0]
        return tensor([float(len(scores)), float((scores != 0).sum())], dtype=torch.float64)

    for mine, other in (shares, shares[::-1]):
        advantages, _ = compute_gpg_outcome_advantage(rewards[mine], mask[mine], groups[mine],
                                                      sum_over_batch=lambda local, other=other: local + counts(other))
        assert_close(advantages, whole[mine])
    # Without the other rank's counts, rank 0 alone would scale by 2 / 1.
    alone, _ = compute_gpg_outcome_advantage(rewards[:2], mask[:2], groups[:2])
    assert_close(alone[:, 0], tensor([1.0, -1.0]))


# ------------------------------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_baseline_whitens_group_centred_scores_over_the_batch_tokens():
    rewards = tensor([[0, 1.0], [0.0, 0], [0, 3.0], [0, 1.0]])
    mask = tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    groups = torch.tensor([0, 0, 1, 1])
    # centred: group 0 (1, 0) -> 0.5, -0.5; group 1 (3, 1) -> 1, -1; on each response token (row 1 has one).
    tokens = [0.5, 0.5, -0.5, 1.0, 1.0, -1.0, -1.0]
    mean, std = statistics.mean(tokens), math.sqrt(statistics.variance(tokens) + 1e-8)
    expected = tensor([[0.5, 0.5], [-0.5, 0.0], [1.0, 1.0], [-1.0, -1.0]])
    expected = (expected - mean) / std * mask
    advantages, returns = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, groups)
    assert_close(advantages, expected)
    assert_close(returns, expected)


def test_reinforce_plus_plus_whitens_the_discounted_returns():
    rewards = tensor([[0.0, 1.0, 2.0], [1.0, 3.0, 5.0]])
    mask = tensor([[1, 1, 1], [1, 1, 0]])
    # gamma 0.5. Row 0: G2 = 2, G1 = 1 + 0.5 * 2 = 2, G0 = 0 + 0.5 * 2 = 1.
    # Row 1 ends at t=1 (the 5.0 is padding): G1 = 3, G0 = 1 + 0.5 * 3 = 2.5.
    advantages, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    assert_close(returns, tensor([[1.0, 2.0, 2.0], [2.5, 3.0, 0.0]]))
    # Over the 5 response tokens: mean 2.1, unbiased variance (1.21 + .01 + .01 + .16 + .81) / 4 = 0.55.
    std = math.sqrt(0.55 + 1e-8)
    assert_close(advantages, (tensor([[1.0, 2.0, 2.0], [2.5, 3.0, 2.1]]) - 2.1) / std * mask)


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_estimators_that_whiten_over_the_batch_use_the_whitening_they_are_given(name):
    """On several ranks the trainer passes the whitening over every rank's tokens (RunWide.whiten)."""
    rewards, mask, groups = outcome_batch()
    seen = []

    def whiten(values, whitened_mask):
        seen.append(whitened_mask)
        return values * 2.0

    estimator = get_advantage_estimator(name)
    doubled, _ = estimator(AdvantageInputs(rewards, mask, groups, whiten=whiten), AlgorithmConfig(gamma=0.9))
    assert len(seen) == 1 and torch.equal(seen[0], mask)
    plain, _ = estimator(AdvantageInputs(rewards, mask, groups, whiten=lambda values, _: values), AlgorithmConfig(
        gamma=0.9))
    assert_close(doubled, plain * 2.0)
    whitened, _ = estimator(AdvantageInputs(rewards, mask, groups), AlgorithmConfig(gamma=0.9))
    assert_close(whitened, masked_whiten(plain, mask) * mask)


# -------------------------------------------------------------------------------------------- ReMax


def test_remax_subtracts_the_greedy_responses_score_from_the_reward_to_go():
    rewards = tensor([[0.0, 0.0, 1.0], [0.5, 1.0, 7.0]])
    mask = tensor([[1, 1, 1], [1, 1, 0]])
    # Row 0: reward-to-go 1, 1, 1 less the greedy score 0.25. Row 1: 1.5, 1 (the 7.0 is padding) less 1.
    advantages, returns = compute_remax_outcome_advantage(rewards, mask, tensor([0.25, 1.0]))
    assert_close(returns, tensor([[1.0, 1.0, 1.0], [1.5, 1.0, 0.0]]))
    assert_close(advantages, tensor([[0.75, 0.75, 0.75], [0.5, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="remax needs the scores of the greedy responses"):
        get_advantage_estimator("remax")(AdvantageInputs(rewards, mask, torch.arange(2)), AlgorithmConfig())


# ------------------------------------------------------------------------------ optimal token baseline


def otb_batch() -> dict[str, torch.Tensor]:
    """Rows a and b answer one prompt, c another. pi is the sampled token's probability, s the sum of squared
    probabilities: w = 1 - 2 pi + s is 1 - 1 + 0.5 = 0.5 on a's tokens, 1 - 0.5 + 0.25 = 0.75 on b's."""
    return {"token_level_rewards": tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 2.0]]),
            "response_mask": tensor([[1, 1], [1, 0], [1, 1]]),
            "group_index": torch.tensor([0, 0, 1]),
            "old_log_probs": torch.log(tensor([[0.5, 0.5], [0.25, 0.5], [0.5, 0.5]])),
            "sum_pi_squared": tensor([[0.5, 0.5], [0.25, 0.5], [0.5, 0.5]])}


def test_otb_baseline_weighs_each_return_by_its_accumulated_score_norm():
    batch = otb_batch()
    advantages, returns = compute_optimal_token_baseline_advantage(**batch)
    assert_close(returns, tensor([[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]]))
    # W: a 0.5, 1.0; b 0.75. t=0: (1 * 0.5 + 0 * 0.75) / (0.5 + 0.75) = 0.4. t=1: a alone, 1 * 1 / 1 = 1.
    # c is alone in its group: baseline 0.
    assert_close(advantages, tensor([[0.6, 0.0], [-0.4, 0.0], [2.0, 2.0]]), atol=1e-6, rtol=0)


def test_otb_squares_the_rollout_importance_weights_into_the_score_norms():
    batch = otb_batch()
    weights = tensor([[2.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    advantages, _ = compute_optimal_token_baseline_advantage(**batch, rollout_is_weights=weights)
    # a's w becomes 0.5 * 4 = 2, then 0.5: W 2, 2.5. t=0: (1 * 2 + 0 * 0.75) / 2.75 = 0.72727.
    assert_close(advantages[:2], tensor([[1 - 2 / 2.75, 0.0], [-2 / 2.75, 0.0]]), atol=1e-6, rtol=0)


def test_tir_otb_gives_a_lone_longest_response_no_baseline_past_the_others_ends():
    batch = otb_batch()
    inputs = AdvantageInputs(batch["token_level_rewards"], batch["response_mask"], batch["group_index"],
                             old_log_probs=batch["old_log_probs"], sum_pi_squared=batch["sum_pi_squared"])
    advantages, _ = get_advantage_estimator("tir_optimal_token_baseline")(inputs, AlgorithmConfig())
    # a (2 tokens) outlives b (1 token): from position 1 on a's baseline is 0, so its advantage is its return.
    assert_close(advantages, tensor([[0.6, 1.0], [-0.4, 0.0], [2.0, 2.0]]), atol=1e-6, rtol=0)
    plain, _ = get_advantage_estimator("optimal_token_baseline")(inputs, AlgorithmConfig())
    assert_close(plain[0], tensor([0.6, 0.0]), atol=1e-6, rtol=0)


def test_tir_otb_lines_up_the_responses_own_tokens_across_a_tool_output():
    # a's token 1 is a tool's output (masked out): its own second token is at column 2, b's at column 1.
    # w = 0.5 on every kept token. a: G = 1, 1, 1, W = 0.5, 0.5, 1. b: G = 3, 3, W = 0.5, 1.
    rewards = tensor([[0.0, 0.0, 1.0], [0.0, 3.0, 0.0]])
    mask = tensor([[1, 0, 1], [1, 1, 0]])
    half = torch.full((2, 3), 0.5)
    common = {"group_index": torch.tensor([0, 0]), "old_log_probs": half.log(), "sum_pi_squared": half}
    tir, _ = compute_optimal_token_baseline_advantage(rewards, mask, **common, handle_zero_tail=True,
                                                      by_response_position=True)
    # Own position 0: (1 * 0.5 + 3 * 0.5) / 1 = 2. Own position 1 (a's column 2, b's column 1): (1 + 3) / 2 = 2.
    assert_close(tir, tensor([[-1.0, 0.0, -1.0], [1.0, 1.0, 0.0]]), atol=1e-6, rtol=0)
    # By column, a's column 2 and b's column 1 each stand alone: their baselines are their own returns.
    by_column, _ = compute_optimal_token_baseline_advantage(rewards, mask, **common)
    assert_close(by_column, tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), atol=1e-6, rtol=0)


def test_tir_otb_leaves_a_response_without_tokens_out_of_its_group():
    rewards, mask = tensor([[0.0, 1.0], [0.0, 0.0]]), tensor([[1, 1], [0, 0]])
    half = torch.full((2, 2), 0.5)
    common = {"group_index": torch.tensor([0, 0]), "old_log_probs": half.log(), "sum_pi_squared": half}
    tir, _ = compute_optimal_token_baseline_advantage(rewards, mask, **common, by_response_position=True)
    assert_close(tir, tensor([[1.0, 1.0], [0.0, 0.0]]))  # alone: baseline 0
    otb, _ = compute_optimal_token_baseline_advantage(rewards, mask, **common)
    assert_close(otb, torch.zeros(2, 2), atol=1e-6, rtol=0)  # verl's OTB counts the empty row: its own return


def test_otb_needs_the_old_log_probs_and_sums_of_squared_probabilities():
    batch = otb_batch()
    with pytest.raises(ValueError, match=r"optimal_token_baseline needs the old log-probs .*"
                                         r"\(actor_rollout_ref.actor.calculate_sum_pi_squared\)"):
        get_advantage_estimator("optimal_token_baseline")(
            AdvantageInputs(batch["token_level_rewards"], batch["response_mask"], batch["group_index"]),
            AlgorithmConfig())


# ---------------------------------------------------------------- sums of squared probabilities, proxies


def test_sum_pi_squared_of_known_distributions():
    logits = tensor([[0.0, math.log(3.0)]])
    # probabilities 1/4, 3/4: 1/16 + 9/16 = 0.625.
    assert_close(sum_pi_squared_from_logits(logits), tensor([0.625]))
    # At temperature 2: exp(z / 2) = 1, sqrt(3): (1 + 3) / (1 + sqrt(3))^2.
    assert_close(sum_pi_squared_from_logits(logits, temperature=2.0), tensor([4 / (1 + math.sqrt(3)) ** 2]))


def test_sum_pi_squared_in_chunks_matches_the_whole_softmax(monkeypatch):
    logits = (torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    expected = (torch.softmax(logits.float() / 0.7, dim=-1) ** 2).sum(-1)
    monkeypatch.setattr(token_baselines, "LOSS_CHUNK_ELEMENTS", 22)  # two positions of 11 per chunk
    got = sum_pi_squared_from_logits(logits, temperature=0.7)
    assert got.dtype == torch.float32 and got.shape == (3, 5)
    assert_close(got, expected)


def test_variance_proxies_on_known_numbers():
    # Row 0: two tokens, advantages 1 and 3 (mean 2), w = 1 - 2 * 0.5 + 0.5 = 0.5 each: W = 1.
    # Row 1: one token (the second is padding), advantage -1, w = 1 - 2 * 0.25 + 0.25 = 0.75: W = 0.75.
    advantages = tensor([[1.0, 3.0], [-1.0, 5.0]])
    mask = tensor([[1, 1], [1, 0]])
    old_log_probs = torch.log(tensor([[0.5, 0.5], [0.25, 0.5]]))
    squares = tensor([[0.5, 0.5], [0.25, 0.5]])
    metrics = variance_proxy_metrics(advantages, mask, old_log_probs, squares, grad_norm=0.5)
    # total power: (4 * 1 + 1 * 0.75) / 2 = 2.375; signal 0.25; noise (2.375 - 0.25) / (2 - 1) = 2.125.
    assert metrics == pytest.approx({"variance_proxy/proxy1_signal_strength": 0.25,
                                     "variance_proxy/proxy2_total_power": 2.375,
                                     "variance_proxy/proxy3_pure_noise": 2.125,
                                     "variance_proxy/expected_a_squared": 2.5,
                                     "variance_proxy/expected_w": 0.875})
    without_norm = variance_proxy_metrics(advantages, mask, old_log_probs, squares)
    assert without_norm["variance_proxy/proxy1_signal_strength"] == 0.0
    assert without_norm["variance_proxy/proxy3_pure_noise"] == 0.0


def test_variance_proxies_on_two_ranks_are_the_whole_batchs():
    advantages = tensor([[1.0, 3.0], [-1.0, 5.0]])
    mask = tensor([[1, 1], [1, 0]])
    old_log_probs = torch.log(tensor([[0.5, 0.5], [0.25, 0.5]]))
    squares = tensor([[0.5, 0.5], [0.25, 0.5]])
    whole = variance_proxy_metrics(advantages, mask, old_log_probs, squares, grad_norm=0.5)
    # Rank 0 holds row 0; the sum over the batch adds row 1's power, A^2, W and count.
    other = tensor([0.75, 1.0, 0.75, 1.0], dtype=torch.float64)
    share = variance_proxy_metrics(advantages[:1], mask[:1], old_log_probs[:1], squares[:1], grad_norm=0.5,
                                   sum_over_batch=lambda local: local + other)
    assert share == pytest.approx(whole)


# --------------------------------------------------------------------------------- one response per prompt


def test_group_estimators_with_one_response_per_prompt_warn_what_the_advantage_becomes():
    """The config's WARNING line (trainer/config/rules.py): verl runs these with one response per prompt."""
    def warnings(name: str, n: int) -> list[str]:
        loaded = load_config_with_notes(None, [f"algorithm.adv_estimator={name}", f"actor_rollout_ref.rollout.n={n}",
                                               "critic.enable=false"])
        return [warning.message for warning in loaded.warnings if warning.path == "actor_rollout_ref.rollout.n"]

    assert warnings("rloo_vectorized", 1) == [
        "got 1, but algorithm.adv_estimator=rloo_vectorized compares the responses to each prompt: each response's "
        "advantage is 0, so the policy gets no gradient from the advantages, as in verl; set n >= 2 for a baseline "
        "from its group (verl's GRPO examples use 5)"]
    assert "its own score" in warnings("rloo", 1)[0]
    assert warnings("rloo", 2) == []
    for name in ("reinforce_plus_plus", "remax"):  # no group
        assert warnings(name, 1) == []
