"""The RL math against numbers worked out by hand (in the comments next to each expectation)."""

import math
import statistics
import typing

import pytest
import torch
from torch.testing import assert_close

from trainer.algorithms import (
    KL_ESTIMATOR_ALIASES,
    KL_ESTIMATORS,
    AdaptiveKLController,
    AdvantageInputs,
    FixedKLController,
    actor_loss,
    aggregate_loss,
    apply_kl_penalty,
    build_kl_controller,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
    get_advantage_estimator,
    kl_penalty,
    log_probs_and_entropy_from_logits,
    log_probs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    scaled_logits,
)
from trainer.config import ActorConfig, AlgorithmConfig
from trainer.config.schema import KLEstimator
from trainer.data import PromptRecord
from trainer.models import load_policy, load_tokenizer
from trainer.rollout.batch import RolloutBatch
from trainer.workers.actor import Actor


def tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# ------------------------------------------------------------------------------ masked statistics


def test_masked_mean_and_var_ignore_masked_positions():
    values = tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = tensor([[1, 1, 0], [1, 0, 0]])
    # kept values 1, 2, 3: mean 2; squared deviations 1, 0, 1
    assert_close(masked_mean(values, mask), tensor(2.0))
    assert_close(masked_mean(values, mask, dim=-1), tensor([1.5, 3.0]))
    assert_close(masked_var(values, mask), tensor(1.0))  # 2 / (3 - 1)
    assert_close(masked_var(values, mask, unbiased=False), tensor(2.0 / 3.0))


def test_masked_statistics_of_empty_and_single_selection_are_finite():
    values = tensor([5.0, 7.0])
    assert_close(masked_mean(values, tensor([0, 0])), tensor(0.0))
    assert_close(masked_var(values, tensor([0, 1])), tensor(0.0))
    assert_close(masked_whiten(values, tensor([0, 1]))[1], tensor(0.0))


def test_masked_whiten_uses_unbiased_std_and_can_keep_the_mean():
    values = tensor([1.0, 2.0, 3.0, 50.0])
    mask = tensor([1, 1, 1, 0])
    # mean 2, unbiased var 1
    scale = 1.0 / math.sqrt(1.0 + 1e-8)
    assert_close(masked_whiten(values, mask)[:3], tensor([-1.0, 0.0, 1.0]) * scale)
    assert_close(masked_whiten(values, mask, shift_mean=False)[:3], tensor([-1.0, 0.0, 1.0]) * scale + 2.0)


# ------------------------------------------------------------------------------ loss aggregation


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-sum", ((1 + 2 + 3) + 4) / 2),  # 5; the all-masked row is not a sequence
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),  # 3
    ],
)
def test_aggregate_loss_modes_on_a_ragged_mask(mode, expected):
    loss_mat = tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert_close(aggregate_loss(loss_mat, mask, mode), tensor(expected))


def test_aggregate_loss_rejects_unknown_mode():
    allowed = "allowed: token-mean, seq-mean-token-sum, seq-mean-token-mean"
    with pytest.raises(ValueError, match=f"unknown loss_agg_mode 'sum'; {allowed}"):
        aggregate_loss(tensor([[1.0]]), tensor([[1.0]]), "sum")


# ------------------------------------------------------------------------------------------- GAE

GAMMA, LAM = 0.9, 0.8  # gamma * lam = 0.72


def gae_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rewards = tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]])
    values = tensor([[0.5, 0.4, 0.3], [0.2, 0.6, 9.0]])
    # Row 2 is right-padded after its second token; the padding holds garbage reward and value.
    mask = tensor([[1, 1, 1], [1, 1, 0]])
    return rewards, values, mask


# Row 1:
#   t=2: delta = 1 + 0.9*0 - 0.3 = 0.7;          A = 0.7
#   t=1: delta = 0 + 0.9*0.3 - 0.4 = -0.13;      A = -0.13 + 0.72*0.7 = 0.374
#   t=0: delta = 0 + 0.9*0.4 - 0.5 = -0.14;      A = -0.14 + 0.72*0.374 = 0.12928
# Row 2 (t=2 is padding: terminal, next value 0, running advantage 0):
#   t=1: delta = 1 + 0.9*0 - 0.6 = 0.4;          A = 0.4
#   t=0: delta = 0 + 0.9*0.6 - 0.2 = 0.34;       A = 0.34 + 0.72*0.4 = 0.628
RAW_GAE = [[0.12928, 0.374, 0.7], [0.628, 0.4, 0.0]]


def test_gae_returns_are_raw_advantages_plus_values_and_padding_does_not_leak():
    rewards, values, mask = gae_batch()
    _, returns = compute_gae_advantage_return(rewards, values, mask, gamma=GAMMA, lam=LAM)
    # returns = A + V; 0 on the padding
    assert_close(returns, tensor([[0.12928 + 0.5, 0.374 + 0.4, 0.7 + 0.3], [0.628 + 0.2, 0.4 + 0.6, 0.0]]))


def test_gae_advantages_are_whitened_over_the_response_tokens():
    rewards, values, mask = gae_batch()
    advantages, _ = compute_gae_advantage_return(rewards, values, mask, gamma=GAMMA, lam=LAM)
    kept = [0.12928, 0.374, 0.7, 0.628, 0.4]
    mean, std = statistics.mean(kept), math.sqrt(statistics.variance(kept) + 1e-8)
    whitened = [[(a - mean) / std for a in row] for row in RAW_GAE]
    whitened[1][2] = 0.0  # padding
    assert_close(advantages, tensor(whitened))


def test_gae_padded_row_matches_the_same_row_unpadded():
    rewards, values, mask = gae_batch()
    _, padded_returns = compute_gae_advantage_return(rewards, values, mask, gamma=GAMMA, lam=LAM)
    _, short_returns = compute_gae_advantage_return(rewards[1:, :2], values[1:, :2], mask[1:, :2], GAMMA, LAM)
    assert_close(padded_returns[1, :2], short_returns[0])


# ------------------------------------------------------------------------------------------ GRPO


def grpo_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Scores: group 7 -> 1, 0, 1; group 3 -> 2, 4; group 5 (singleton) -> 0.5.
    # Each reward sits on the row's last response token; the masked 9.0 must not count.
    rewards = tensor([[0, 1.0], [0, 0], [0, 1.0], [0.5, 9.0], [0, 2.0], [0, 4.0]])
    mask = tensor([[1, 1], [1, 1], [1, 1], [1, 0], [1, 1], [1, 1]])
    group_index = torch.tensor([7, 7, 7, 5, 3, 3])
    return rewards, mask, group_index


def test_grpo_normalises_by_group_mean_and_unbiased_std():
    rewards, mask, group_index = grpo_batch()
    eps = 1e-6
    advantages, returns = compute_grpo_outcome_advantage(rewards, mask, group_index, epsilon=eps)
    # group 7: mean 2/3, var ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2 = 1/3
    std7 = math.sqrt(1 / 3)
    # group 3: mean 3, var (1 + 1) / 1 = 2
    std3 = math.sqrt(2)
    # singleton: mean 0, std 1 -> 0.5 / (1 + eps)
    per_row = [(1 / 3) / (std7 + eps), (-2 / 3) / (std7 + eps), (1 / 3) / (std7 + eps),
               0.5 / (1 + eps), -1 / (std3 + eps), 1 / (std3 + eps)]
    expected = tensor(per_row).unsqueeze(-1) * mask
    assert_close(advantages, expected)
    assert_close(returns, expected)
    assert advantages[3, 1] == 0.0


def test_grpo_without_std_division_only_centres():
    rewards, mask, group_index = grpo_batch()
    advantages, _ = compute_grpo_outcome_advantage(rewards, mask, group_index, norm_adv_by_std=False)
    expected = tensor([1 / 3, -2 / 3, 1 / 3, 0.5, -1.0, 1.0]).unsqueeze(-1) * mask
    assert_close(advantages, expected)


def test_advantage_registry_names_the_allowed_estimators():
    with pytest.raises(ValueError) as error:
        get_advantage_estimator("x")
    assert str(error.value) == ("unknown advantage estimator 'x'; allowed: gae, grpo, rloo, rloo_vectorized, "
                                "grpo_vectorized, grpo_passk, opo, gpg, reinforce_plus_plus_baseline, "
                                "reinforce_plus_plus, remax, optimal_token_baseline, tir_optimal_token_baseline")


def test_each_registered_estimator_reads_its_inputs_and_the_algorithm_config():
    rewards, mask, group_index = grpo_batch()
    values = torch.linspace(0.0, 1.0, rewards.numel()).view_as(rewards)
    config = AlgorithmConfig(gamma=0.9, lam=0.8, norm_adv_by_std_in_grpo=False)
    inputs = AdvantageInputs(rewards, mask, group_index, values=values)
    for estimator, expected in ((get_advantage_estimator("gae"),
                                 compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)),
                                (get_advantage_estimator("grpo"),
                                 compute_grpo_outcome_advantage(rewards, mask, group_index, norm_adv_by_std=False))):
        for got, want in zip(estimator(inputs, config), expected, strict=True):
            assert_close(got, want)
    with pytest.raises(ValueError, match="needs the critic's values"):
        get_advantage_estimator("gae")(AdvantageInputs(rewards, mask, group_index), config)


def test_gae_whitens_with_the_function_it_is_given():
    """On several ranks the advantages are whitened over every rank's tokens: the estimator takes the whitening."""
    rewards, mask, group_index = grpo_batch()
    values = torch.zeros_like(rewards)
    seen = []

    def whiten(advantages, whitened_mask):
        seen.append(whitened_mask)
        return advantages * 2.0

    advantages, returns = get_advantage_estimator("gae")(
        AdvantageInputs(rewards, mask, group_index, values=values, whiten=whiten), AlgorithmConfig())
    assert len(seen) == 1 and torch.equal(seen[0], mask)
    assert_close(advantages, returns * 2.0)  # values 0: the returns are the unwhitened advantages


# ----------------------------------------------------------------------------------- policy loss


def policy_batch() -> dict[str, torch.Tensor]:
    # log ratio of each token; clip range [1 - 0.2, 1 + 0.28], dual clip c = 3
    ratios = [1.5, 0.5, 4.0, 1.0, 0.5, 1.0]
    log_prob = torch.log(tensor(ratios)).unsqueeze(0).requires_grad_(True)
    return {
        "old_log_prob": torch.zeros(1, 6, dtype=torch.float64),
        "log_prob": log_prob,
        "advantages": tensor([[1.0, -2.0, -1.0, 2.0, 1.0, 1.0]]),
        "response_mask": tensor([[1, 1, 1, 1, 1, 0]]),
    }


def test_policy_loss_clips_both_ends_and_dual_clips():
    batch = policy_batch()
    result = compute_policy_loss(**batch, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    # token: A, r      -> -A*r, -A*clip(r)  -> max      -> dual clip (A<0: min with -A*3)
    # a: +1, 1.5       -> -1.5, -1.28       -> -1.28 (clipped, upper end)
    # b: -2, 0.5       ->  1.0,  1.6        ->  1.6 (clipped, lower end)  -> min(1.6, 6) = 1.6
    # c: -1, 4.0       ->  4.0,  1.28       ->  4.0                       -> min(4, 3) = 3 (dual)
    # d: +2, 1.0       -> -2.0, -2.0        -> -2.0
    # e: +1, 0.5       -> -0.5, -0.8        -> -0.5 (pessimistic: unclipped)
    # f: padding
    assert_close(result.loss, tensor((-1.28 + 1.6 + 3.0 - 2.0 - 0.5) / 5))
    assert_close(result.clipfrac, tensor(2 / 5))
    assert_close(result.clipfrac_lower, tensor(1 / 5))
    # ppo_kl = mean(old - new) = -log(1.5 * 0.5 * 4 * 1 * 0.5) / 5 = -log(1.5) / 5
    assert_close(result.ppo_kl, tensor(-math.log(1.5) / 5))
    for metric in (result.clipfrac, result.ppo_kl, result.clipfrac_lower):
        assert not metric.requires_grad


def test_policy_loss_gradient_flows_only_through_unclipped_tokens():
    batch = policy_batch()
    compute_policy_loss(**batch, clip_ratio_low=0.2, clip_ratio_high=0.28).loss.backward()
    # d(-A * r)/d log_prob = -A * r, divided by the 5 response tokens; clipped tokens have none
    assert_close(batch["log_prob"].grad, tensor([[0.0, 0.0, 0.0, -2.0 / 5, -0.5 / 5, 0.0]]))


def test_policy_loss_stays_finite_for_extreme_log_ratios():
    # exp(200) is inf in float32 and inf * 0 is nan; the clamp to [-20, 20] must prevent that.
    result = compute_policy_loss(
        old_log_prob=torch.zeros(1, 2),
        log_prob=torch.tensor([[0.0, 200.0]]),
        advantages=torch.zeros(1, 2),
        response_mask=torch.tensor([[1.0, 0.0]]),
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
    )
    assert torch.isfinite(result.loss)
    assert_close(result.loss, torch.tensor(0.0))


def test_policy_loss_rejects_a_dual_clip_bound_of_one_or_less():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        compute_policy_loss(**policy_batch(), clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=1.0)


# ------------------------------------------------------------------------------- the actor's loss


def test_actor_loss_subtracts_the_entropy_bonus_and_adds_the_kl_loss():
    # 0.5 - 0.01 * 2.0 + 0.1 * 0.3 = 0.5 - 0.02 + 0.03 = 0.51
    loss = actor_loss(tensor(0.5), tensor(2.0), tensor(0.3), entropy_coeff=0.01, kl_loss_coef=0.1)
    assert_close(loss, tensor(0.51))
    # Without a KL loss: 0.5 - 0.02
    assert_close(actor_loss(tensor(0.5), tensor(2.0), None, entropy_coeff=0.01, kl_loss_coef=0.1), tensor(0.48))
    # Zero weights leave the policy loss alone.
    assert_close(actor_loss(tensor(0.5), tensor(2.0), tensor(0.3), entropy_coeff=0.0, kl_loss_coef=0.0),
                 tensor(0.5))


def test_actor_loss_gradients_raise_entropy_and_lower_kl():
    pg_loss, entropy, kl_loss = (tensor(value).requires_grad_(True) for value in (0.5, 2.0, 0.3))
    actor_loss(pg_loss, entropy, kl_loss, entropy_coeff=0.01, kl_loss_coef=0.1).backward()
    # Gradient descent moves each input against its gradient: the entropy up (a bonus), the KL down.
    assert_close(pg_loss.grad, tensor(1.0))
    assert_close(entropy.grad, tensor(-0.01))
    assert_close(kl_loss.grad, tensor(0.1))


def test_the_actor_update_minimises_actor_loss_of_its_own_terms():
    """Actor._loss combines its policy loss, entropy and KL loss through actor_loss, signs included."""
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    model = load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.float32, seed=1,
                        override_config={"num_hidden_layers": 1})
    config = ActorConfig(entropy_coeff=0.25, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k2")
    actor = Actor(model, config, temperature=1.0, rollout_n=1, log_prob_micro_batch_size=2, total_steps=1, seed=1)
    generator = torch.Generator().manual_seed(0)
    batch = RolloutBatch(prompt_ids=torch.tensor([[0, 4, 5], [6, 7, 8]]),
                         prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
                         response_ids=torch.tensor([[9, 10, 1], [11, 1, 0]]),
                         response_mask=torch.tensor([[1.0, 1, 1], [1, 1, 0]]), group_index=torch.arange(2),
                         records=[PromptRecord(prompt="p", data_source="test")] * 2)
    batch.old_log_probs = actor.compute_log_probs(batch)
    batch.ref_log_probs = batch.old_log_probs - torch.rand(2, 3, generator=generator)
    batch.advantages = torch.randn(2, 3, generator=generator) * batch.response_mask
    loss, metrics = actor._loss(batch)
    assert metrics["kl_loss"] > 0 and metrics["entropy"] > 0
    expected = metrics["pg_loss"] - 0.25 * metrics["entropy"] + 0.5 * metrics["kl_loss"]
    assert loss.item() == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------------------------ value loss


def test_value_loss_takes_the_larger_of_clipped_and_unclipped():
    values = tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    vpreds = tensor([[1.5, 0.9, 0.5, 0.5, 7.0]]).requires_grad_(True)
    returns = tensor([[2.0, 0.0, 2.0, 0.0, 0.0]])
    mask = tensor([[1, 1, 1, 1, 0]])
    loss, clipfrac = compute_value_loss(vpreds, values, returns, mask, cliprange_value=0.2)
    # token: vpred -> clipped; (vpred-R)^2, (clipped-R)^2 -> max
    # 1: 1.5 -> 1.2;  0.25, 0.64 -> 0.64 (clipped larger)
    # 2: 0.9 -> 0.9;  0.81, 0.81 -> 0.81
    # 3: 0.5 -> 0.8;  2.25, 1.44 -> 2.25
    # 4: 0.5 -> 0.8;  0.25, 0.64 -> 0.64 (clipped larger)
    assert_close(loss, tensor(0.5 * (0.64 + 0.81 + 2.25 + 0.64) / 4))
    assert_close(clipfrac, tensor(2 / 4))
    loss.backward()
    # only unclipped-max tokens have a gradient: 0.5 * 2 * (vpred - R) / 4
    assert_close(vpreds.grad, tensor([[0.0, 0.9 / 4, -1.5 / 4, 0.0, 0.0]]))


# ------------------------------------------------------------------------------------ KL and logits


LOG_PROB = tensor([[-1.0, -2.0]])
REF_LOG_PROB = tensor([[-1.5, -1.0]])  # log p - log q = [0.5, -1.0]


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("kl", [0.5, -1.0]),
        ("abs", [0.5, 1.0]),
        ("mse", [0.125, 0.5]),
        # d = log q - log p = [-0.5, 1.0]; exp(d) - d - 1
        ("low_var_kl", [math.exp(-0.5) + 0.5 - 1, math.e - 1.0 - 1]),  # [0.10653, 0.71828]
    ],
)
def test_kl_estimators_on_known_numbers(estimator, expected):
    assert_close(kl_penalty(LOG_PROB, REF_LOG_PROB, estimator), tensor([expected]))


def test_low_var_kl_is_clamped_to_ten():
    # exp(15) - 15 - 1 is about 3.3e6
    assert_close(kl_penalty(tensor([[0.0]]), tensor([[15.0]]), "low_var_kl"), tensor([[10.0]]))


@pytest.mark.parametrize(("alias", "name"), [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")])
def test_verl_aliases_compute_the_estimator_they_name(alias, name):
    log_prob, ref_log_prob = tensor([[-1.0, -2.0, 0.0, -30.0]]), tensor([[-1.5, -1.0, -25.0, 0.0]])
    assert KL_ESTIMATOR_ALIASES[alias] == name
    assert_close(kl_penalty(log_prob, ref_log_prob, alias), kl_penalty(log_prob, ref_log_prob, name), rtol=0, atol=0)


def test_the_config_offers_exactly_the_estimators_the_function_knows():
    # The schema cannot import torch, so it spells the names out again: they must not drift apart.
    assert set(typing.get_args(KLEstimator)) == {*KL_ESTIMATORS, *KL_ESTIMATOR_ALIASES}


def test_kl_penalty_rejects_unknown_estimator():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k9'; allowed: kl, abs, mse, low_var_kl, "
                                         r"k1 \(= kl\), k2 \(= mse\), k3 \(= low_var_kl\)"):
        kl_penalty(LOG_PROB, REF_LOG_PROB, "k9")


def test_apply_kl_penalty_subtracts_masked_kl_and_reports_mean_of_sequence_means():
    scores = tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    ref_log_prob = torch.zeros(2, 3, dtype=torch.float64)
    log_prob = tensor([[0.1, 0.2, 0.3], [0.4, -0.2, 5.0]])  # k1 = log_prob here
    mask = tensor([[1, 1, 1], [1, 1, 0]])
    rewards, mean_kl = apply_kl_penalty(scores, log_prob, ref_log_prob, mask, kl_coef=0.5, estimator="kl")
    # rewards = scores - 0.5 * kl * mask
    assert_close(rewards, tensor([[-0.05, -0.1, 0.85], [-0.2, 2.1, 0.0]]))
    # sequence means 0.2 and 0.1 -> 0.15 (a token mean would give 0.8 / 5 = 0.16)
    assert_close(mean_kl, tensor(0.15))


def test_entropy_from_logits_is_stable_for_large_logits():
    logits = tensor([[0.0, 0.0, 0.0, 0.0], [1000.0, 1000.0 + math.log(3), -1e4, -1e4]])
    # uniform over 4 -> log 4; probs (1/4, 3/4) -> -(1/4 log 1/4 + 3/4 log 3/4) = 0.5623
    expected = tensor([math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])
    assert_close(entropy_from_logits(logits), expected)


def test_log_probs_from_logits_on_known_numbers_and_large_logits():
    logits = tensor([[[1000.0, 1000.0 + math.log(3)], [0.0, 0.0]]])
    labels = torch.tensor([[1, 0]])
    assert_close(log_probs_from_logits(logits, labels), tensor([[math.log(0.75), math.log(0.5)]]))


def test_log_probs_from_bf16_logits_are_computed_in_float32():
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 3, 50, generator=generator) * 5).to(torch.bfloat16)
    labels = torch.randint(0, 50, (2, 3), generator=generator)
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    result = log_probs_from_logits(logits, labels)
    assert result.dtype == torch.float32
    assert_close(result, expected)


# ------------------------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_moves_up_and_down_with_clipped_error():
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    controller.update(current_kl=9.0, n_steps=1000)  # error clip(0.5) = 0.2 -> x (1 + 0.2 * 0.1) = 1.02
    assert controller.value == pytest.approx(0.102)
    controller.update(current_kl=3.0, n_steps=1000)  # error clip(-0.5) = -0.2 -> x 0.98
    assert controller.value == pytest.approx(0.09996)
    controller.update(current_kl=6.6, n_steps=1000)  # error 0.1 (inside the clip) -> x 1.01
    assert controller.value == pytest.approx(0.1009596)


def test_adaptive_kl_controller_state_round_trip():
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    controller.update(current_kl=9.0, n_steps=1000)
    restored = AdaptiveKLController(init_kl_coef=0.5, target_kl=6.0, horizon=10000)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == pytest.approx(0.102)
    restored.update(current_kl=3.0, n_steps=1000)
    assert restored.value == pytest.approx(0.09996)


def test_fixed_kl_controller_never_moves():
    controller = FixedKLController(kl_coef=0.05)
    controller.update(current_kl=100.0, n_steps=1000)
    assert controller.value == 0.05
    assert controller.state_dict() == {"value": 0.05}


def test_build_kl_controller_by_type():
    fixed = build_kl_controller("fixed", kl_coef=0.1, target_kl=6.0, horizon=100)
    assert isinstance(fixed, FixedKLController)
    adaptive = build_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=100)
    assert isinstance(adaptive, AdaptiveKLController)
    assert adaptive.value == 0.1
    with pytest.raises(ValueError, match="unknown KL controller type 'pid'; allowed: fixed, adaptive"):
        build_kl_controller("pid", kl_coef=0.1, target_kl=6.0, horizon=100)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_logits_are_the_float32_quotient_with_one_copy_at_most_and_the_same_gradients(dtype, temperature):
    from trainer.algorithms import scaled_logits

    weights = torch.randn(6, 4, dtype=dtype, requires_grad=True)
    hidden = torch.randn(3, 6, dtype=dtype)
    logits = hidden @ weights  # the model's own output: its backward reads only `hidden`
    before = logits.detach().clone()
    scaled = scaled_logits(logits, temperature)
    assert scaled.dtype == torch.float32
    torch.testing.assert_close(scaled, before.float() / temperature, rtol=0, atol=0)
    assert torch.equal(logits.detach(), before)  # the model's tensor is left as it was
    (gradient,) = torch.autograd.grad((scaled * torch.arange(4.0)).sum(), weights)
    reference = torch.autograd.grad(((hidden @ weights).float() / temperature * torch.arange(4.0)).sum(), weights)[0]
    torch.testing.assert_close(gradient, reference, rtol=0, atol=0)


# ------------------------------------------------------------------- log-probs and entropy, chunk by chunk


def _composed(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    scaled = scaled_logits(logits, temperature)
    return log_probs_from_logits(scaled, labels), entropy_from_logits(scaled)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, {"rtol": 1e-4, "atol": 1e-5}),
                                              (torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2})], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [2 * 50, 5 * 50, 2 * 5 * 50, 64 * 5 * 50],
                         ids=["two_positions", "a_row", "two_rows", "all_at_once"])
def test_chunked_log_probs_and_entropy_match_the_composed_ops_and_their_gradients(dtype, tolerance, temperature,
                                                                                  chunk, monkeypatch):
    # Logits a chunk: 50 a position, 5 positions a sequence, 3 sequences.
    monkeypatch.setattr("trainer.algorithms.functional.LOSS_CHUNK_ELEMENTS", chunk)
    generator = torch.Generator().manual_seed(0)
    # A slice of a model's [B, T, V] output, as response_logits gives it (not contiguous).
    output = (3 * torch.randn(3, 9, 50, generator=generator)).to(dtype)
    labels = torch.randint(0, 50, (3, 5), generator=generator)
    weights = torch.randn(2, 3, 5, generator=generator)
    chunked, composed = output.clone().requires_grad_(), output.clone().requires_grad_()
    log_probs, entropies = log_probs_and_entropy_from_logits(chunked[:, 2:7], labels, temperature)
    expected_log_probs, expected_entropies = _composed(composed[:, 2:7], labels, temperature)
    torch.testing.assert_close(log_probs, expected_log_probs, **tolerance)
    torch.testing.assert_close(entropies, expected_entropies, **tolerance)
    assert log_probs.dtype == entropies.dtype == torch.float32
    ((log_probs * weights[0]).sum() + (entropies * weights[1]).sum()).backward()
    ((expected_log_probs * weights[0]).sum() + (expected_entropies * weights[1]).sum()).backward()
    torch.testing.assert_close(chunked.grad, composed.grad, **tolerance)
    assert chunked.grad.dtype == dtype and float(chunked.grad[:, :2].abs().sum()) == 0.0
    assert output.equal(chunked.detach())  # the input is left as it was (float32 logits are not scaled in place)


def test_an_entropy_without_its_graph_adds_nothing_to_the_gradient():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 30, generator=generator)
    labels = torch.randint(0, 30, (2, 4), generator=generator)
    with_graph, without = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    log_probs, entropies = log_probs_and_entropy_from_logits(with_graph, labels)
    log_probs.sum().backward()
    metric_log_probs, metric_entropies = log_probs_and_entropy_from_logits(without, labels, entropy_graph=False)
    assert not metric_entropies.requires_grad
    (metric_log_probs.sum() + 0 * metric_entropies.sum()).backward()
    torch.testing.assert_close(without.grad, with_graph.grad)
    torch.testing.assert_close(metric_entropies, entropies.detach())
