"""Policy-filtration PPO's reweighting (trainer/algorithms/pf_ppo.py)."""

import typing

import pytest
import torch
from torch.testing import assert_close

from trainer.algorithms import PF_PPO_METHODS, pf_ppo_resample, pf_ppo_weights
from trainer.config.losses import PfPpoConfig

FLOOR = 1e-8


def test_each_method_weighs_the_scores_as_verl_does():
    scores = torch.tensor([-2.0, 1.0, 0.0, 3.0])
    assert_close(pf_ppo_weights(scores, "pow", 2.0), torch.tensor([4.0, 1.0, 0.0, 9.0]) + FLOOR)  # |score|^2
    assert_close(pf_ppo_weights(scores, "max_min", 2.0), torch.tensor([1.0, 0.0, 0.0, 1.0]) + FLOOR)  # worst, best
    assert_close(pf_ppo_weights(scores, "max_random", 2.0), torch.tensor([0.1, 0.1, 0.1, 0.4]) + FLOOR)


def test_the_config_takes_the_methods_the_function_knows():
    assert typing.get_args(PfPpoConfig.model_fields["reweight_method"].annotation) == PF_PPO_METHODS


def test_an_unknown_method_names_the_key_and_the_methods():
    with pytest.raises(ValueError, match="algorithm.pf_ppo.reweight_method 'top'; allowed: pow, max_min, max_random"):
        pf_ppo_weights(torch.zeros(2), "top", 2.0)


def test_resampling_keeps_the_batch_size_and_is_repeatable_with_a_seeded_generator():
    scores = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    first = pf_ppo_resample(scores, "pow", 1.0, torch.Generator().manual_seed(7))
    again = pf_ppo_resample(scores, "pow", 1.0, torch.Generator().manual_seed(7))
    assert first.shape == (6,) and first.dtype == torch.long
    assert torch.equal(first, again)
    expected = torch.multinomial(scores + FLOOR, 6, replacement=True, generator=torch.Generator().manual_seed(7))
    assert torch.equal(first, expected)
    assert 0 not in first.tolist()  # a score of 0 has weight 1e-8 under pow


def test_max_min_draws_only_the_best_and_worst_responses():
    scores = torch.tensor([0.3, 0.9, 0.1, 0.5, 0.9, 0.4, 0.2, 0.6])
    drawn = pf_ppo_resample(scores, "max_min", 2.0, torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) <= {1, 2, 4}  # the two best (0.9, tied) and the worst (0.1)


def test_pow_draws_in_proportion_to_the_weights():
    scores = torch.tensor([1.0, 3.0]).repeat(2000)  # weights 1 and 3: a quarter and three quarters
    drawn = pf_ppo_resample(scores, "pow", 1.0, torch.Generator().manual_seed(0))
    share_of_threes = (drawn % 2 == 1).float().mean().item()
    assert abs(share_of_threes - 0.75) < 0.02
