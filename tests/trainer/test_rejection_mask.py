"""Rollout correction's rejection drops a token from training as verl drops it from its batch's response_mask
(verl/trainer/ppo/rollout_corr_helper.py: compute_rollout_correction_and_add_to_batch): the advantages pass over
it, the step's advantage and return metrics leave it out, and the actor's and critic's losses read the same mask.
Numbers worked out by hand in the comments."""

import math

import torch
from torch.testing import assert_close

from trainer.advantage_phase import AdvantagePhase
from trainer.algorithms import build_kl_controller
from trainer.config import RunConfig
from trainer.distributed.ranks import Ranks
from trainer.distributed.run_wide import RunWide
from trainer.metrics import data_metrics
from trainer.rollout.batch import RolloutBatch


def phase(adv_estimator: str, **algorithm) -> AdvantagePhase:
    config = RunConfig.model_validate({"algorithm": {
        "adv_estimator": adv_estimator, **algorithm,
        "rollout_correction": {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"}}})
    ranks = Ranks.single(torch.device("cpu"))
    return AdvantagePhase(config, RunWide(ranks, config, send=lambda message: None), ranks,
                          build_kl_controller("fixed", 0.0, 0.1, 10000))


def batch(scores: list[float], values: torch.Tensor | None = None) -> RolloutBatch:
    """Responses of three tokens each to one prompt; the first response's middle token was sampled with a third of
    the probability the trained policy gives it (ratio 3, outside token_k1's [0.5, 2]), every other at ratio 1."""
    rows = len(scores)
    old = torch.full((rows, 3), -1.0)
    rollout = old.clone()
    rollout[0, 1] -= math.log(3.0)
    rewards = torch.zeros(rows, 3)
    rewards[:, -1] = torch.tensor(scores)
    return RolloutBatch(prompt_ids=torch.ones(rows, 1, dtype=torch.long), prompt_mask=torch.ones(rows, 1),
                        response_ids=torch.ones(rows, 3, dtype=torch.long), response_mask=torch.ones(rows, 3),
                        group_index=torch.zeros(rows, dtype=torch.long), records=[None] * rows,
                        old_log_probs=old, rollout_log_probs=rollout, token_level_scores=rewards, values=values)


def test_a_rejected_token_takes_no_grpo_advantage_and_leaves_the_metrics():
    rollouts = batch([1.0, 0.0])
    result, metrics = phase("grpo")(rollouts)
    assert math.isclose(metrics["rollout_corr/rollout_rs_masked_fraction"], 1 / 6, rel_tol=1e-6)
    assert_close(result.training_mask, torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]))
    # scores 1 and 0: mean 0.5, std (unbiased) 1/sqrt(2): advantages +-1/sqrt(2); none on the rejected token
    half = 1 / math.sqrt(2)
    assert_close(result.advantages, torch.tensor([[half, 0.0, half], [-half, -half, -half]]), rtol=1e-5, atol=1e-5)
    assert result.response_mask.sum() == 6  # the forwards still attend to the rejected token
    figures = data_metrics(result, response_length=3, prompt_length=1)
    # five kept tokens: 2 x (1/sqrt 2) and 3 x (-1/sqrt 2)
    assert math.isclose(figures["critic/advantages/mean"], -half / 5, rel_tol=1e-5)
    assert figures["response_length/mean"] == 3.0  # lengths count every sampled token, as verl's attention_mask


def test_gae_passes_over_a_rejected_token_as_over_padding():
    # gamma 1, lambda 0.5; values 0.5, 0.2, 0.1; the score 1 on the last token; the middle token rejected:
    # t=2: delta = 1 - 0.1 = 0.9, A = 0.9; t=1 is passed over (next value stays 0.1, A stays 0.9);
    # t=0: delta = 0.1 - 0.5 = -0.4, A = -0.4 + 0.5 * 0.9 = 0.05; returns A + V: 0.55, 0 (rejected), 1.0.
    # Were it kept: t=1: A = (0.1 - 0.2) + 0.45 = 0.35; t=0: (0.2 - 0.5) + 0.175 = -0.125, return 0.375.
    values = torch.tensor([[0.5, 0.2, 0.1], [0.5, 0.2, 0.1]])
    result, _ = phase("gae", gamma=1.0, lam=0.5)(batch([1.0, 1.0], values))
    assert_close(result.returns[0], torch.tensor([0.55, 0.0, 1.0]))
    assert result.advantages[0, 1] == 0.0
    assert_close(result.returns[1], torch.tensor([0.375, 0.55, 1.0]))  # t=1: A 0.35 + V 0.2
