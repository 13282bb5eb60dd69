"""Advantage estimators, registered by verl's names (``algorithm.adv_estimator``).

Each estimator is a pure tensor function citing its paper, and a registered adapter that reads what it needs from
`AdvantageInputs` and the algorithm config, so the trainer calls every estimator the same way:

    estimator = get_advantage_estimator(config.algorithm.adv_estimator)
    advantages, returns = estimator(AdvantageInputs(...), config.algorithm)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.algorithms.functional import masked_whiten
from trainer.config import AlgorithmConfig

Whiten = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(values [B, T], mask [B, T]) -> values whitened over the batch's masked positions."""
SumOverBatch = Callable[[torch.Tensor], torch.Tensor]
"""A tensor summed over every rank's share of the batch (on one rank: the tensor itself)."""


def same_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """One rank's `SumOverBatch`: its share is the whole batch."""
    return tensor


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read of a step's batch. Shapes: ``B`` responses, ``T`` response tokens."""

    token_level_rewards: torch.Tensor
    """[B, T] the scores less the in-reward KL penalty, each response's on its last token."""
    response_mask: torch.Tensor
    """[B, T] 1.0 on response tokens (EOS included), 0.0 on the padding after it."""
    group_index: torch.Tensor
    """[B] responses to the same prompt share an id."""
    values: torch.Tensor | None = None
    """[B, T] the critic's values (None: the run has no critic)."""
    whiten: Whiten = masked_whiten
    """Whitens over the whole batch: on several ranks, over every rank's tokens (distributed/run_wide.py)."""
    old_log_probs: torch.Tensor | None = None
    """[B, T] log-probs of the sampled tokens under the policy being trained (None: not scored this step)."""
    sum_pi_squared: torch.Tensor | None = None
    """[B, T] that policy's sum over the vocabulary of squared probabilities (None: not computed)."""
    reward_baselines: torch.Tensor | None = None
    """[B] the score of the greedy response to each response's prompt (ReMax; None: not generated)."""
    rollout_is_weights: torch.Tensor | None = None
    """[B, T] rollout importance weights (None: uniform, no rollout correction)."""
    sum_over_batch: SumOverBatch = same_tensor
    """Sums over the whole batch: on several ranks, over every rank's share (Ranks.sum_tensor_over_data)."""


Estimator = Callable[[AdvantageInputs, AlgorithmConfig], tuple[torch.Tensor, torch.Tensor]]
"""(inputs, algorithm config) -> (advantages [B, T], returns [B, T])."""

ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}


def register_advantage_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Register an estimator under verl's name for it (``algorithm.adv_estimator``)."""

    def register(estimator: Estimator) -> Estimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ADVANTAGE_ESTIMATORS[name] = estimator
        return estimator
    return register


def get_advantage_estimator(name: str) -> Estimator:
    """The estimator registered as ``name``."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator '{name}'; allowed: {', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


# What a response alone in its group gets from each estimator that compares the responses to a prompt (rollout.n=1).
# GRPO's case is a rule of the config's.
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: Whiten = masked_whiten,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation", eq. 16), computed backwards over the response.

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1}.

    A masked step neither supplies V_{t+1} nor advances A_{t+1}: the running next value and running
    advantage pass through it unchanged. Right padding therefore behaves as a terminal state (next
    value 0), whatever values or rewards the padding holds.

    Args:
        token_level_rewards: ``[B, T]``.
        values: ``[B, T]`` critic values of the rollout.
        response_mask: ``[B, T]``.
        gamma: discount factor.
        lam: GAE lambda (bias/variance trade-off).
        whiten: whitens the advantages over the batch's response tokens (on several ranks: every rank's).

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` and 0 at masked positions. ``returns`` is
        advantages + values before whitening (the critic's target); ``advantages`` are then
        whitened over the batch's response tokens.
    """
    next_value = torch.zeros_like(values[:, 0])
    running_advantage = torch.zeros_like(values[:, 0])
    advantages_reversed = []
    for t in reversed(range(values.shape[1])):
        keep = response_mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        step_advantage = delta + gamma * lam * running_advantage
        next_value = torch.where(keep.bool(), values[:, t], next_value)
        running_advantage = torch.where(keep.bool(), step_advantage, running_advantage)
        advantages_reversed.append(running_advantage)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = (advantages + values) * response_mask
    advantages = whiten(advantages, response_mask) * response_mask
    return advantages, returns


@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative outcome advantage (GRPO: Shao et al. 2024, "DeepSeekMath", sec. 4.1.2).

    Each response's score is the sum of its token rewards; its advantage is
    (score - group mean) / (group std + epsilon), std unbiased as ``torch.std``. A group of one
    has mean 0 and std 1, as in verl, so its advantage is its raw score. With
    ``norm_adv_by_std=False`` the division is dropped (Dr.GRPO: Liu et al. 2025, "Understanding
    R1-Zero-Like Training", sec. 3.1).

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``.
        group_index: ``[B]`` integer group ids; responses to the same prompt share one.
        epsilon: keeps a group of identical scores (std 0) finite.
        norm_adv_by_std: divide by the group std.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``: the sequence advantage on every response
        token, 0 at masked positions. ``returns`` equals ``advantages``.
    """
    scores = (token_level_rewards * response_mask).sum(-1)
    _, group_of_row = torch.unique(group_index, return_inverse=True)
    group_sizes = torch.bincount(group_of_row).to(scores.dtype)
    group_sums = torch.zeros_like(group_sizes).index_add_(0, group_of_row, scores)
    group_means = group_sums / group_sizes
    squared_deviations = (scores - group_means[group_of_row]) ** 2
    group_vars = torch.zeros_like(group_sizes).index_add_(0, group_of_row, squared_deviations)
    group_stds = (group_vars / (group_sizes - 1).clamp(min=1)).sqrt()
    is_group = group_sizes > 1
    group_means = torch.where(is_group, group_means, torch.zeros_like(group_means))
    group_stds = torch.where(is_group, group_stds, torch.ones_like(group_stds))
    advantages = scores - group_means[group_of_row]
    if norm_adv_by_std:
        advantages = advantages / (group_stds[group_of_row] + epsilon)
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_advantage_estimator("gae")
def gae(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's: GAE over the critic's values."""
    if inputs.values is None:
        raise ValueError("algorithm.adv_estimator=gae needs the critic's values")
    return compute_gae_advantage_return(inputs.token_level_rewards, inputs.values, inputs.response_mask,
                                        gamma=config.gamma, lam=config.lam, whiten=inputs.whiten)


@register_advantage_estimator("grpo")
def grpo(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's: each response against its group's."""
    return compute_grpo_outcome_advantage(inputs.token_level_rewards, inputs.response_mask, inputs.group_index,
                                          norm_adv_by_std=config.norm_adv_by_std_in_grpo)
