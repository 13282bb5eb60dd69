"""verl's outcome advantage estimators beside GRPO: each response's score (the sum of its token rewards) against a
baseline from its prompt's group, the batch or a greedy response, registered by verl's names.

Shapes: ``B`` responses, ``T`` response tokens. Every function is pure and runs without gradients; each returns
``(advantages, returns)``, both ``[B, T]`` and 0 on the padding after a response. A group is the responses to one
prompt (``group_index``); on several ranks a prompt's responses are all on one rank, so the group statistics are
local, and what is taken over the whole batch (whitening, GPG's count of scored responses) is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.algorithms.advantages import (
    AdvantageInputs,
    SumOverBatch,
    Whiten,
    register_advantage_estimator,
    same_tensor,
)
from trainer.algorithms.functional import masked_whiten
from trainer.config import AlgorithmConfig


@dataclass(frozen=True)
class Groups:
    """Which prompt group each response belongs to, and the groups' sizes."""

    of_row: torch.Tensor
    """[B] long: each response's group, numbered 0 .. G-1."""
    sizes: torch.Tensor
    """[G] the responses in each group (float)."""

    @classmethod
    def of(cls, group_index: torch.Tensor, dtype: torch.dtype = torch.float32) -> Groups:
        """The groups of ``group_index`` ``[B]`` (responses to one prompt share an id)."""
        _, of_row = torch.unique(group_index, return_inverse=True)
        return cls(of_row, torch.bincount(of_row).to(dtype))

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        """[B] -> [G] each group's sum."""
        return torch.zeros_like(self.sizes, dtype=values.dtype).index_add_(0, self.of_row, values)

    def means(self, values: torch.Tensor) -> torch.Tensor:
        """[B] -> [G] each group's mean; 0 for a group of one (verl's baseline of a lone response)."""
        means = self.sums(values) / self.sizes.to(values.dtype)
        return torch.where(self.sizes > 1, means, torch.zeros_like(means))

    def unbiased_stds(self, values: torch.Tensor) -> torch.Tensor:
        """[B] -> [G] each group's standard deviation with Bessel's correction (``torch.std``); 1 for a group of
        one."""
        means = self.sums(values) / self.sizes.to(values.dtype)
        squares = self.sums((values - means[self.of_row]) ** 2)
        stds = (squares / (self.sizes - 1).clamp(min=1)).sqrt()
        return torch.where(self.sizes > 1, stds, torch.ones_like(stds))


def response_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B] each response's score: the sum of its token rewards."""
    return (token_level_rewards * response_mask).sum(-1)


def _on_tokens(per_response: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [B] advantage on every token of its response, as (advantages, returns)."""
    advantages = per_response.unsqueeze(-1) * response_mask
    return advantages, advantages


@torch.no_grad()
def compute_rloo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                   group_index: torch.Tensor, *, lone_response_keeps_score: bool = True
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; for LLMs
    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback
    in LLMs", arXiv:2402.14740): each response's score less the mean score of the other responses to its prompt,

        A_i = s_i - (sum_j s_j - s_i) / (n - 1) = n / (n - 1) * (s_i - mean_j s_j).

    A group of one has no others: verl's ``rloo`` keeps its raw score (``lone_response_keeps_score``), verl's
    ``rloo_vectorized`` gives it 0.

    Args:
        token_level_rewards, response_mask: ``[B, T]``.
        group_index: ``[B]``; responses to the same prompt share an id.
        lone_response_keeps_score: the advantage of a group of one: its score (True) or 0.

    Returns:
        ``(advantages, returns)``, equal, ``[B, T]``: the response's advantage on each of its tokens.
    """
    scores = response_scores(token_level_rewards, response_mask)
    groups = Groups.of(group_index, scores.dtype)
    size = groups.sizes[groups.of_row]
    others_mean = (groups.sums(scores)[groups.of_row] - scores) / (size - 1).clamp(min=1)
    lone = scores if lone_response_keeps_score else torch.zeros_like(scores)
    return _on_tokens(torch.where(size > 1, scores - others_mean, lone), response_mask)


@torch.no_grad()
def compute_grpo_vectorized_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                              group_index: torch.Tensor, *, epsilon: float = 1e-6,
                                              norm_adv_by_std: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's group-relative advantage (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2) as verl's vectorized variant
    computes it: (s_i - group mean) / (group std + epsilon), the std unbiased and its variance floored at
    ``epsilon`` (so std >= sqrt(epsilon)); a group of one has mean 0 and std 1. Without ``norm_adv_by_std`` only
    the mean is subtracted (Dr.GRPO).

    Returns:
        ``(advantages, returns)``, equal, ``[B, T]``.
    """
    scores = response_scores(token_level_rewards, response_mask)
    groups = Groups.of(group_index, scores.dtype)
    sizes = groups.sizes
    sums = groups.sums(scores)
    variances = (groups.sums(scores ** 2) - sums ** 2 / sizes) / (sizes - 1).clamp(min=1)
    means = torch.where(sizes > 1, sums / sizes, torch.zeros_like(sums))
    stds = torch.where(sizes > 1, variances.clamp(min=epsilon).sqrt(), torch.ones_like(sums))
    advantages = scores - means[groups.of_row]
    if norm_adv_by_std:
        advantages = advantages / (stds[groups.of_row] + epsilon)
    return _on_tokens(advantages, response_mask)


@torch.no_grad()
def compute_grpo_passk_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                         group_index: torch.Tensor, *, epsilon: float = 1e-6,
                                         norm_adv_by_std: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantage (verl's ``grpo_passk``, after arXiv:2503.19595): only the best response of each group
    learns, by its margin over the runner-up, A = s_max - s_second (divided by the group's unbiased std +
    ``epsilon`` with ``norm_adv_by_std``); every other response gets 0. Of tied best responses the first in the
    batch gets it (the margin is then 0 anyway).

    Raises:
        ValueError: a group of fewer than 2 responses (there is no runner-up), as in verl.

    Returns:
        ``(advantages, returns)``, equal, ``[B, T]``.
    """
    scores = response_scores(token_level_rewards, response_mask)
    groups = Groups.of(group_index, scores.dtype)
    if bool((groups.sizes < 2).any()):
        raise ValueError("algorithm.adv_estimator=grpo_passk needs at least 2 responses per prompt "
                         f"(got groups of {int(groups.sizes.min())}); set actor_rollout_ref.rollout.n >= 2")
    rows = torch.arange(len(scores), device=scores.device)
    count = len(groups.sizes)
    best_score = torch.full((count,), -torch.inf, dtype=scores.dtype, device=scores.device).scatter_reduce(
        0, groups.of_row, scores, "amax")
    is_best = scores == best_score[groups.of_row]
    best_row = torch.full((count,), len(scores), device=scores.device).scatter_reduce(
        0, groups.of_row, torch.where(is_best, rows, len(scores)), "amin")
    others = torch.where(rows == best_row[groups.of_row], -torch.inf, scores)
    second_score = torch.full_like(best_score, -torch.inf).scatter_reduce(0, groups.of_row, others, "amax")
    margin = best_score - second_score
    if norm_adv_by_std:
        margin = margin / (groups.unbiased_stds(scores) + epsilon)
    advantages = torch.zeros_like(scores)
    advantages[best_row] = margin
    return _on_tokens(advantages, response_mask)


@torch.no_grad()
def compute_opo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                  group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline",
    arXiv:2505.23585): the baseline of a group is its length-weighted mean score, b = sum_i |y_i| s_i / sum_i |y_i| (the
    variance-minimising baseline when a response's gradient norm grows with its length), with no division by a
    std. A group of one has baseline 0.

    Returns:
        ``(advantages, returns)``, equal, ``[B, T]``.
    """
    scores = response_scores(token_level_rewards, response_mask)
    lengths = response_mask.sum(-1).to(scores.dtype)
    groups = Groups.of(group_index, scores.dtype)
    baselines = groups.sums(lengths * scores) / groups.sums(lengths).clamp(min=1)
    baselines = torch.where(groups.sizes > 1, baselines, torch.zeros_like(baselines))
    return _on_tokens(scores - baselines[groups.of_row], response_mask)


@torch.no_grad()
def compute_gpg_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                  group_index: torch.Tensor, *, f_norm: float = 1.0,
                                  sum_over_batch: SumOverBatch = same_tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Policy Gradient (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv:2504.02546): A_i = alpha * (s_i - group mean) / f_norm, where alpha = B / M rescales the batch's
    gradient by its B responses over the M of them with a non-zero score (M at least 1), so that groups whose
    responses all score 0 do not dilute it. A group of one has mean 0.

    Args:
        token_level_rewards, response_mask: ``[B, T]``.
        group_index: ``[B]``.
        f_norm: the paper's normaliser (verl passes 1).
        sum_over_batch: sums B and M over every rank's share of the batch, so several ranks scale as one rank
            would over the whole batch.

    Returns:
        ``(advantages, returns)``, equal, ``[B, T]``.
    """
    scores = response_scores(token_level_rewards, response_mask)
    groups = Groups.of(group_index, scores.dtype)
    counts = sum_over_batch(torch.stack([torch.tensor(float(len(scores)), device=scores.device),
                                         (scores != 0).sum().to(torch.float32)]).double())
    alpha = float(counts[0] / counts[1].clamp(min=1))
    return _on_tokens(alpha * (scores - groups.means(scores)[groups.of_row]) / f_norm, response_mask)


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_index: torch.Tensor, *,
        whiten: Whiten = masked_whiten) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models", arXiv:2501.03262, its variant for group sampling): each
    response's score less its group's mean score (0 for a group of one), placed on every response token, then
    whitened over the batch's response tokens (the global normalisation).

    Args:
        whiten: whitens over the batch's response tokens (on several ranks: every rank's).

    Returns:
        ``(advantages, returns)``, equal, ``[B, T]``.
    """
    scores = response_scores(token_level_rewards, response_mask)
    groups = Groups.of(group_index, scores.dtype)
    centred = (scores - groups.means(scores)[groups.of_row]).unsqueeze(-1) * response_mask
    advantages = whiten(centred, response_mask) * response_mask
    return advantages, advantages


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                                  *, gamma: float, whiten: Whiten = masked_whiten
                                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
    arXiv:2501.03262): the discounted return of each token,
    G_t = r_t + gamma * G_{t+1}, restarted after the response's end, whitened over the batch's response tokens
    (no critic, no group).

    Args:
        token_level_rewards, response_mask: ``[B, T]``.
        gamma: discount factor.
        whiten: whitens over the batch's response tokens (on several ranks: every rank's).

    Returns:
        ``(advantages, returns)``, ``[B, T]``: the whitened returns, and the returns.
    """
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running = (token_level_rewards[:, t] + gamma * running) * response_mask[:, t]
        returns[:, t] = running
    return whiten(returns, response_mask) * response_mask, returns


@torch.no_grad()
def compute_remax_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                    reward_baselines: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2024, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning
    Large Language Models", arXiv:2310.10505): REINFORCE whose baseline is the score of the greedy response to the same
    prompt, A_t = G_t - b with G_t the undiscounted reward-to-go of token t.

    Args:
        token_level_rewards, response_mask: ``[B, T]``.
        reward_baselines: ``[B]`` the score of the greedy response to each response's prompt.

    Returns:
        ``(advantages, returns)``, ``[B, T]``: G_t - b, and G_t.
    """
    returns = (token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1)
    return returns - reward_baselines.unsqueeze(-1) * response_mask, returns


# ------------------------------------------------------------------------------ registered by verl's names


@register_advantage_estimator("rloo")
def rloo(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: each response against the mean of the others to its prompt (a lone response keeps its score)."""
    return compute_rloo_outcome_advantage(inputs.token_level_rewards, inputs.response_mask, inputs.group_index)


@register_advantage_estimator("rloo_vectorized")
def rloo_vectorized(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO as verl's vectorized variant: a lone response gets 0."""
    return compute_rloo_outcome_advantage(inputs.token_level_rewards, inputs.response_mask, inputs.group_index,
                                          lone_response_keeps_score=False)


@register_advantage_estimator("grpo_vectorized")
def grpo_vectorized(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO as verl's vectorized variant (the group variance floored at epsilon)."""
    return compute_grpo_vectorized_outcome_advantage(inputs.token_level_rewards, inputs.response_mask,
                                                     inputs.group_index, norm_adv_by_std=config.norm_adv_by_std_in_grpo)


@register_advantage_estimator("grpo_passk")
def grpo_passk(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k: the best response of each group, by its margin over the runner-up."""
    return compute_grpo_passk_outcome_advantage(inputs.token_level_rewards, inputs.response_mask, inputs.group_index,
                                                norm_adv_by_std=config.norm_adv_by_std_in_grpo)


@register_advantage_estimator("opo")
def opo(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: each response against its group's length-weighted mean score."""
    return compute_opo_outcome_advantage(inputs.token_level_rewards, inputs.response_mask, inputs.group_index)


@register_advantage_estimator("gpg")
def gpg(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: group-centred scores, scaled by the batch's responses over its scored ones."""
    return compute_gpg_outcome_advantage(inputs.token_level_rewards, inputs.response_mask, inputs.group_index,
                                         sum_over_batch=inputs.sum_over_batch)


@register_advantage_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(inputs: AdvantageInputs, config: AlgorithmConfig
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: group-centred scores whitened over the batch."""
    return compute_reinforce_plus_plus_baseline_outcome_advantage(
        inputs.token_level_rewards, inputs.response_mask, inputs.group_index, whiten=inputs.whiten)


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns (algorithm.gamma) whitened over the batch."""
    return compute_reinforce_plus_plus_outcome_advantage(inputs.token_level_rewards, inputs.response_mask,
                                                         gamma=config.gamma, whiten=inputs.whiten)


@register_advantage_estimator("remax")
def remax(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: the reward-to-go less the greedy response's score."""
    if inputs.reward_baselines is None:
        raise ValueError("algorithm.adv_estimator=remax needs the scores of the greedy responses (reward_baselines)")
    return compute_remax_outcome_advantage(inputs.token_level_rewards, inputs.response_mask, inputs.reward_baselines)
