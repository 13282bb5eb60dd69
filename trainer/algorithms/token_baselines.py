"""The optimal token baseline (verl's ``optimal_token_baseline`` and ``tir_optimal_token_baseline``), the policy's
sum of squared probabilities it reads (verl's ``calculate_sum_pi_squared``), and verl's gradient-variance proxies
built from the same figures.

The optimal token baseline (Li et al. 2025, "Optimal Token Baseline", https://richardli.xyz/optimal-token-baseline;
verl's docs/algo/otb.md) gives every token position its own baseline: the group's rewards-to-go weighted by how
much gradient each trajectory has accumulated so far,

    B*_t = sum_i G_t^i W_t^i / (sum_i W_t^i + epsilon),   W_t = sum_{j <= t} (1 - 2 pi_j + sum_v pi_j(v)^2),

where pi_j is the probability of the sampled token j and sum_v pi_j(v)^2 the policy's sum of squared
probabilities at that position: 1 - 2 pi_j + sum_v pi_j(v)^2 is the squared norm of the gradient of log pi_j with
respect to the logits (the logit-gradient proxy), known from the forward pass alone.

Shapes: ``B`` responses, ``T`` response tokens, ``V`` the vocabulary.
"""

from __future__ import annotations

import torch

from trainer.algorithms.advantages import AdvantageInputs, SumOverBatch, register_advantage_estimator, same_tensor
from trainer.algorithms.functional import LOSS_CHUNK_ELEMENTS, masked_mean
from trainer.algorithms.functional import _loss_chunks as loss_chunks  # the chunks the log-prob pass uses
from trainer.algorithms.functional import _scaled_chunk as scaled_chunk
from trainer.algorithms.outcome_advantages import Groups
from trainer.config import AlgorithmConfig

OTB_EPSILON = 1e-8


@torch.no_grad()
def sum_pi_squared_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[..., V]`` logits -> float32 ``[...]``: sum over the vocabulary of softmax(logits / temperature)^2 at each
    position (verl's ``calculate_sum_pi_squared``), as exp(logsumexp(2 z) - 2 logsumexp(z)), which never squares
    a tiny probability. In float32 a chunk at a time (the log-prob pass's chunks, 64 MB of float32 logits each),
    never one float32 copy of the whole [B, T, V] logits."""
    vocabulary = logits.shape[-1]
    rows = logits.reshape(1, -1, vocabulary) if logits.dim() != 3 else logits
    result = torch.empty(rows.shape[:-1], dtype=torch.float32, device=logits.device)
    for part in loss_chunks(rows.shape, LOSS_CHUNK_ELEMENTS):
        scaled = scaled_chunk(rows[part], temperature)
        result[part] = torch.exp(torch.logsumexp(2.0 * scaled, dim=-1) - 2.0 * torch.logsumexp(scaled, dim=-1))
    return result.reshape(logits.shape[:-1])


def score_norm_proxy(old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
                     rollout_is_weights: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T]`` w_t = 1 - 2 pi_t + sum_v pi_t(v)^2, the squared norm of d log pi_t / d logits; with rollout
    importance weights rho_t, rho_t^2 w_t (the weight minimising the baseline's error under truncated IS)."""
    weights = 1.0 - 2.0 * torch.exp(old_log_probs) + sum_pi_squared
    return weights if rollout_is_weights is None else weights * rollout_is_weights ** 2


@torch.no_grad()
def compute_optimal_token_baseline_advantage(
        token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_index: torch.Tensor,
        old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, rollout_is_weights: torch.Tensor | None = None,
        *, handle_zero_tail: bool = False, by_response_position: bool = False, epsilon: float = OTB_EPSILON,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline advantages A_t = G_t - B*_t (module docstring), G_t the undiscounted reward-to-go.

    Args:
        token_level_rewards, response_mask: ``[B, T]``.
        group_index: ``[B]``; the baseline of position t is taken over the responses to one prompt.
        old_log_probs: ``[B, T]`` log-probs of the sampled tokens under the policy that is trained.
        sum_pi_squared: ``[B, T]`` that policy's sum of squared probabilities (`sum_pi_squared_from_logits`).
        rollout_is_weights: ``[B, T]`` rollout importance weights rho_t (W then sums rho_t^2 w_t); None: uniform.
        handle_zero_tail: a group's one longest response has baseline 0 from the second longest one's length on
            (no other response reaches those positions: a baseline of its own return would cancel it).
        by_response_position: t counts a response's own tokens (those the mask keeps, holes of a multi-turn
            response skipped; responses with no tokens are left out of their group), not the columns of [B, T]:
            verl's ``tir_optimal_token_baseline``.
        epsilon: keeps a position no response weighs finite.

    Returns:
        ``(advantages, returns)``, ``[B, T]``: G_t - B*_t on the response's tokens (0 elsewhere), and G_t. A group
        of one has baseline 0: its advantages are its returns.
    """
    returns = (token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1)
    path_weights = (score_norm_proxy(old_log_probs, sum_pi_squared, rollout_is_weights) * response_mask).cumsum(-1)
    kept = response_mask > 0
    lengths = kept.sum(-1)
    length = response_mask.shape[1]
    if by_response_position:
        positions = (kept.cumsum(-1) - 1).clamp(min=0)
        counted = lengths > 0
    else:
        positions = torch.arange(length, device=response_mask.device).expand_as(response_mask)
        counted = torch.ones_like(lengths, dtype=torch.bool)
    groups = Groups.of(torch.where(counted, group_index, group_index.min() - 1), returns.dtype)
    sizes = torch.zeros_like(groups.sizes).index_add_(0, groups.of_row, counted.to(returns.dtype))
    slots = groups.of_row.unsqueeze(-1) * length + positions  # one per (group, position)
    used = kept & counted.unsqueeze(-1)
    numerator = torch.zeros(len(sizes) * length, dtype=returns.dtype, device=returns.device).index_add_(
        0, slots[used], (returns * path_weights)[used])
    denominator = torch.zeros_like(numerator).index_add_(0, slots[used], path_weights[used])
    baselines = numerator[slots] / (denominator[slots] + epsilon)
    baselines = torch.where(used & (sizes[groups.of_row] > 1).unsqueeze(-1), baselines, torch.zeros_like(baselines))
    if handle_zero_tail:
        baselines = baselines.masked_fill(_lone_tail(groups, sizes, lengths, counted, positions), 0.0)
    return (returns - baselines) * response_mask, returns


def _lone_tail(groups: Groups, sizes: torch.Tensor, lengths: torch.Tensor, counted: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """[B, T] True at the positions of each group's single longest response from the second longest one's length
    on (groups of two or more counted responses whose longest is longer than all the others)."""
    lengths = torch.where(counted, lengths, -1)
    longest = torch.full_like(sizes, -1, dtype=lengths.dtype).scatter_reduce(0, groups.of_row, lengths, "amax")
    is_longest = counted & (lengths == longest[groups.of_row])
    ties = torch.zeros_like(sizes).index_add_(0, groups.of_row, is_longest.to(sizes.dtype))
    others = torch.where(is_longest, -1, lengths)
    second = torch.full_like(longest, -1).scatter_reduce(0, groups.of_row, others, "amax")
    alone = is_longest & (ties[groups.of_row] == 1) & (sizes[groups.of_row] > 1)
    return alone.unsqueeze(-1) & (positions >= second[groups.of_row].unsqueeze(-1))


def _otb_inputs(inputs: AdvantageInputs, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if inputs.old_log_probs is None or inputs.sum_pi_squared is None:
        raise ValueError(f"algorithm.adv_estimator={name} needs the old log-probs and the policy's sum of squared "
                         "probabilities (actor_rollout_ref.actor.calculate_sum_pi_squared)")
    return inputs.old_log_probs, inputs.sum_pi_squared


@register_advantage_estimator("optimal_token_baseline")
def optimal_token_baseline(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB: a baseline per token position, each response's return weighted by its accumulated score norm."""
    old_log_probs, sum_pi_squared = _otb_inputs(inputs, "optimal_token_baseline")
    return compute_optimal_token_baseline_advantage(inputs.token_level_rewards, inputs.response_mask,
                                                    inputs.group_index, old_log_probs, sum_pi_squared,
                                                    inputs.rollout_is_weights)


@register_advantage_estimator("tir_optimal_token_baseline")
def tir_optimal_token_baseline(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB for multi-turn (tool-integrated) responses: positions count a response's own tokens, and a group's lone
    longest response has no baseline past the others' ends."""
    old_log_probs, sum_pi_squared = _otb_inputs(inputs, "tir_optimal_token_baseline")
    return compute_optimal_token_baseline_advantage(inputs.token_level_rewards, inputs.response_mask,
                                                    inputs.group_index, old_log_probs, sum_pi_squared,
                                                    inputs.rollout_is_weights, handle_zero_tail=True,
                                                    by_response_position=True)


# ------------------------------------------------------------------------------ gradient-variance proxies


@torch.no_grad()
def variance_proxy_metrics(advantages: torch.Tensor, response_mask: torch.Tensor, old_log_probs: torch.Tensor,
                           sum_pi_squared: torch.Tensor, *, grad_norm: float | None = None,
                           rollout_is_weights: torch.Tensor | None = None,
                           sum_over_batch: SumOverBatch = same_tensor) -> dict[str, float]:
    """verl's gradient-variance proxies (docs/algo/otb.md, "Gradient Variance Proxy Metrics"), from the forward
    pass alone, for any estimator, where the policy's sum of squared probabilities is computed.

    With A_i a response's mean advantage over its tokens and W_i = sum_t w_t its summed score-norm proxy
    (`score_norm_proxy`, clamped at 0), the squared norm of its policy gradient is about W_i A_i^2, so over the
    batch's N responses:

    - ``variance_proxy/proxy1_signal_strength``: ||mean gradient||^2, the actor's gradient norm squared
      (0 without one);
    - ``variance_proxy/proxy2_total_power``: mean_i W_i A_i^2 (with rollout IS weights, each response's mean
      weight squared times A_i^2 times its unweighted W_i);
    - ``variance_proxy/proxy3_pure_noise``: max(0, (proxy2 - proxy1) / (N - 1)), the variance of the batch's mean
      gradient (0 without a gradient norm or with one response);
    - ``variance_proxy/expected_a_squared`` and ``variance_proxy/expected_w``: mean_i A_i^2 and mean_i W_i.

    Args:
        advantages, response_mask, old_log_probs, sum_pi_squared: ``[B, T]``.
        grad_norm: the actor's gradient norm of the step (``actor/grad_norm``).
        rollout_is_weights: ``[B, T]`` or None.
        sum_over_batch: sums over every rank's share of the batch, so that several ranks report what one rank
            would over the whole batch.
    """
    mean_advantages = masked_mean(advantages, response_mask, dim=-1)
    per_token = score_norm_proxy(old_log_probs, sum_pi_squared, rollout_is_weights)
    weighted = (per_token * response_mask).sum(-1)
    if rollout_is_weights is None:
        power = mean_advantages ** 2 * weighted.clamp(min=0.0)
    else:  # each response's W without the weights (a token weighted 0 counts 0), times its mean weight squared
        unweighted = (per_token / (rollout_is_weights ** 2).clamp(min=1e-10) * response_mask).sum(-1)
        mean_weights = masked_mean(rollout_is_weights, response_mask, dim=-1)
        power = mean_weights ** 2 * mean_advantages ** 2 * unweighted.clamp(min=0.0)
    totals = sum_over_batch(torch.stack([power.sum(), (mean_advantages ** 2).sum(), weighted.sum(),
                                         torch.tensor(float(len(advantages)), device=advantages.device)]).double())
    power_mean, squared_mean, weight_mean = (totals[:3] / totals[3].clamp(min=1)).tolist()
    sequences = float(totals[3])
    signal = grad_norm ** 2 if grad_norm is not None else None
    noise = max(0.0, (power_mean - signal) / (sequences - 1)) if signal is not None and sequences > 1 else 0.0
    return {"variance_proxy/proxy1_signal_strength": signal if signal is not None else 0.0,
            "variance_proxy/proxy2_total_power": power_mean,
            "variance_proxy/proxy3_pure_noise": noise,
            "variance_proxy/expected_a_squared": squared_mean,
            "variance_proxy/expected_w": weight_mean}
