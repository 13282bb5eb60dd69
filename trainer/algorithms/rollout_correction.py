"""Rollout correction (verl's ``algorithm.rollout_correction``): importance weights and rejection between the policy
that sampled a batch (pi_rollout: the log-probs the rollout recorded) and the policy the loss reads (pi_old, scored
after the rollout; in bypass mode pi_theta itself, in the loss).

Here the rollout decodes with the actor's own weights, yet the two differ: under ``fsdp_config.delayed_update`` the
rollout reads the weights from before the update still running, and the decode's numerics (bf16, CUDA graphs, fused
kernels) are not the scoring forward's. Liu, Li et al. 2025 ("When Speed Kills Stability: Demystifying RL Collapse
from the Training-Inference Mismatch", https://richardli.xyz/rl-collapse) show how such a gap breaks training and
how truncated importance sampling (TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
RL Training", https://fengyao.notion.site/off-policy-rl) and rejection mend it.

Shapes: ``B`` responses, ``T`` response tokens; every ``[B, T]`` tensor comes with its ``response_mask``. Metrics are
0-dim tensors under verl's names (``rollout_corr/...``), so that a caller reads them all in one host sync.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from trainer.algorithms.functional import masked_mean
from trainer.config.losses import RejectionCriterion, RolloutCorrectionConfig, rejection_criteria

SAFETY_BOUND = 20.0
"""Log-ratios (a token's, or a sequence's sum) are clamped to [-20, 20] before exp: a weight stays within
[2e-9, 5e8] and finite."""

MaskedMean = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(values, mask) -> their mean over the kept positions of the whole batch (on several ranks: every rank's)."""

Metrics = dict[str, torch.Tensor]


class RolloutCorrection(NamedTuple):
    """What :func:`compute_rollout_correction` gives a batch."""

    weights: torch.Tensor | None
    """[B, T] truncated importance weights (detached, 0 at padding); None without rollout_is."""
    response_mask: torch.Tensor | None
    """[B, T] the response mask less the rejected tokens; None without rollout_rs."""
    metrics: Metrics
    """Under verl's names: rollout_corr/rollout_is_*, rollout_corr/rollout_rs_*, and the off-policy figures."""


def compute_rollout_correction(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                               config: RolloutCorrectionConfig, *, mean: MaskedMean = masked_mean
                               ) -> RolloutCorrection:
    """Importance weights (rollout_is), rejection (rollout_rs) and the off-policy metrics of `log_prob` (pi_old, or
    pi_theta detached in bypass mode) against `rollout_log_prob` (pi_rollout), all ``[B, T]``, as the config asks.
    `mean` normalises the weights (rollout_is_batch_normalize) over the whole batch. Nothing keeps a graph."""
    with torch.no_grad():
        log_ratio = log_prob.detach() - rollout_log_prob
        metrics: Metrics = {}
        weights = kept = None
        if config.rollout_is is not None:
            weights, weight_metrics = importance_weights(log_ratio, response_mask, config.rollout_is,
                                                         config.rollout_is_threshold,
                                                         batch_normalize=config.rollout_is_batch_normalize, mean=mean)
            metrics.update(weight_metrics)
        if config.rollout_rs is not None:
            assert config.rollout_rs_threshold is not None  # the schema refuses rejection without bounds
            kept, rejection_metrics = rejection_mask(log_ratio, response_mask,
                                                     rejection_criteria(config.rollout_rs, config.rollout_rs_threshold))
            metrics.update(rejection_metrics)
        metrics.update(off_policy_metrics(log_prob.detach(), rollout_log_prob, response_mask))
    return RolloutCorrection(weights, kept, {f"rollout_corr/{key}": value for key, value in metrics.items()})


def importance_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str, threshold: float, *,
                       batch_normalize: bool = False, mean: MaskedMean = masked_mean) -> tuple[torch.Tensor, Metrics]:
    """Truncated importance weights from ``[B, T]`` log-ratios log pi_train - log pi_rollout (TIS).

    ``token``: w_t = min(exp(log r_t), threshold) on each token (biased, low variance);
    ``sequence``: w = min(exp(sum_t log r_t), threshold) on every token of the sequence (the product of its token
    ratios: unbiased before truncation, high variance). The log-ratios are clamped to [-20, 20] first (SAFETY_BOUND).
    Padding gets 0. With `batch_normalize` the truncated weights are divided by their mean over the batch (over its
    tokens for ``token``, over its sequences for ``sequence``; `mean` is the batch-wide masked mean), so that they
    average 1 (verl's rollout_is_batch_norm_factor is that mean).

    Returns ``(weights [B, T], metrics)``; the metrics (rollout_is_mean, _max, _min, _ratio_fraction_high, _low:
    beyond threshold or below 1 / threshold, _std and _eff_sample_size over the weights held within those bounds)
    describe the weights before truncation, as verl's do.
    """
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        sequence_log_ratio = (log_ratio * response_mask).sum(-1, keepdim=True)
        raw = torch.exp(sequence_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    else:
        raise ValueError(f"unknown rollout_is level {level!r}; allowed: 'token', 'sequence'")
    raw = raw * response_mask
    metrics = _weight_metrics(raw, response_mask, level, threshold)
    weights = raw.clamp(max=threshold)
    if batch_normalize:
        if level == "token":
            norm = mean(weights, response_mask)
        else:
            rows = (response_mask.sum(-1) > 0).to(weights.dtype)
            norm = mean(masked_mean(weights, response_mask, dim=-1), rows)
        norm = torch.where(norm > 1e-8, norm, torch.ones_like(norm))  # all weights ~0: left as they are
        weights = weights / norm
        metrics["rollout_is_batch_norm_factor"] = norm
    return weights, metrics


def _weight_metrics(raw: torch.Tensor, mask: torch.Tensor, level: str, threshold: float) -> Metrics:
    lower = 1.0 / threshold
    if level == "token":
        fraction_high = masked_mean((raw > threshold).to(raw.dtype), mask)
        fraction_low = masked_mean((raw < lower).to(raw.dtype), mask)
    else:  # one weight per sequence: the fractions are of sequences
        rows = (mask.sum(-1) > 0).to(raw.dtype)
        per_row = masked_mean(raw, mask, dim=-1)
        fraction_high = masked_mean((per_row > threshold).to(raw.dtype), rows)
        fraction_low = masked_mean((per_row < lower).to(raw.dtype), rows)
    bounded = raw.clamp(lower, threshold)
    bounded_mean = masked_mean(bounded, mask)
    variance = (masked_mean(bounded.square(), mask) - bounded_mean.square()).clamp(min=0.0)
    normalised = bounded / (bounded_mean + 1e-8)
    return {
        "rollout_is_mean": masked_mean(raw, mask),
        "rollout_is_max": _masked_extreme(raw, mask, largest=True),
        "rollout_is_min": _masked_extreme(raw, mask, largest=False),
        "rollout_is_ratio_fraction_high": fraction_high,
        "rollout_is_ratio_fraction_low": fraction_low,
        "rollout_is_std": variance.sqrt(),
        "rollout_is_eff_sample_size": 1.0 / masked_mean(normalised.square(), mask).clamp(min=1e-8),
    }


def rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor,
                   criteria: tuple[RejectionCriterion, ...]) -> tuple[torch.Tensor, Metrics]:
    """Rejection sampling by divergence (verl's rollout_rs): the tokens or sequences whose divergence between the
    trained and the rollout policy is out of bounds leave the loss, a hard trust region (Liu, Li et al. 2025, part
    3: "why rejection over clipping"). With log r the ``[B, T]`` log-ratios, clamped to [-20, 20]:

        k1 = -log r,   k2 = (log r)^2 / 2,   k3 = r - 1 - log r   (Schulman 2020's estimators of KL(rollout || train))

    An option ``token_kN`` judges each token by its own kN; ``seq_sum_kN``, ``seq_mean_kN`` and ``seq_max_kN`` judge
    a whole sequence by the sum, mean or largest of its tokens' kN. A k1 statistic is kept within
    [log lower, log upper] (ratio bounds); a k2 or k3 one at most ``upper``. Every option must keep a token.

    Returns ``(response_mask less the rejected tokens [B, T], metrics)``: per option rollout_rs_<option>_mean (over
    the tokens), _max and _min (over tokens, or sequences), _masked_fraction (of tokens) and _seq_masked_fraction (of
    sequences with a rejected token), and rollout_rs_masked_fraction and rollout_rs_seq_masked_fraction overall.
    """
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    estimators = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}
    rows = (response_mask.sum(-1) > 0).to(response_mask.dtype)
    keep = torch.ones_like(response_mask)
    metrics: Metrics = {}
    for criterion in criteria:
        where, estimator = criterion.option.rsplit("_", 1)
        statistic = _statistic(estimators[estimator], response_mask, where)  # [B, T] or [B, 1]
        if criterion.lower is not None:
            kept = (statistic >= math.log(criterion.lower)) & (statistic <= math.log(criterion.upper))
        else:
            kept = statistic <= criterion.upper
        kept_tokens = kept.expand_as(response_mask).to(response_mask.dtype)
        name = f"rollout_rs_{criterion.option}"
        judged = response_mask if where == "token" else rows.unsqueeze(-1)  # one statistic per token, or per row
        metrics[f"{name}_mean"] = masked_mean(statistic.expand_as(response_mask), response_mask)
        metrics[f"{name}_max"] = _masked_extreme(statistic, judged, largest=True)
        metrics[f"{name}_min"] = _masked_extreme(statistic, judged, largest=False)
        metrics[f"{name}_masked_fraction"] = masked_mean(1.0 - kept_tokens, response_mask)
        metrics[f"{name}_seq_masked_fraction"] = masked_mean(_any_rejected(kept_tokens, response_mask), rows)
        keep = keep * kept_tokens
    metrics["rollout_rs_masked_fraction"] = masked_mean(1.0 - keep, response_mask)
    metrics["rollout_rs_seq_masked_fraction"] = _any_rejected(keep, response_mask).mean()
    return keep * response_mask, metrics


def _statistic(per_token: torch.Tensor, mask: torch.Tensor, where: str) -> torch.Tensor:
    """A rollout_rs option's statistic: per token ``[B, T]``, or per sequence ``[B, 1]`` (sum, mean or max)."""
    if where == "token":
        return per_token
    if where == "seq_sum":
        return (per_token * mask).sum(-1, keepdim=True)
    if where == "seq_mean":
        return masked_mean(per_token, mask, dim=-1).unsqueeze(-1)
    largest = per_token.masked_fill(mask == 0, -math.inf).amax(-1, keepdim=True)
    return torch.where(torch.isfinite(largest), largest, torch.zeros_like(largest))  # an empty row: 0


def _any_rejected(kept: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] 1.0 where a row has a response token that `kept` leaves out."""
    return ((kept < 0.5) & (mask > 0)).any(-1).to(mask.dtype)


def _masked_extreme(values: torch.Tensor, mask: torch.Tensor, *, largest: bool) -> torch.Tensor:
    """The largest (or smallest) of `values` where `mask` (broadcast to them) is 1; 0 where none is."""
    kept = mask.expand_as(values) > 0
    fill = -math.inf if largest else math.inf
    filled = values.masked_fill(~kept, fill)
    extreme = filled.max() if largest else filled.min()
    return torch.where(kept.any(), extreme, torch.zeros_like(extreme))


def off_policy_metrics(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor) -> Metrics:
    """How far the trained policy (`log_prob`) is from the one that sampled (`rollout_log_prob`), ``[B, T]`` each, under
    verl's names: kl (the k1 estimate of KL(rollout || train)), k3_kl, each policy's perplexity (training_ppl,
    rollout_ppl: the mean over sequences of exp(-mean log-prob)) and its log (…_log_ppl), log_ppl_diff (rollout's
    mean log-prob less the trained one's, per sequence: its mean, |mean|, max and min), ppl_ratio (mean of
    exp(log_ppl_diff)), and the chi-squared divergences E[r^2] - 1 over tokens (chi2_token) and over sequences with
    r their product (chi2_seq), the variance that importance weights would carry."""
    rows = (response_mask.sum(-1) > 0).to(log_prob.dtype)
    log_ratio = log_prob - rollout_log_prob
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    train_mean = masked_mean(log_prob, response_mask, dim=-1)
    rollout_mean = masked_mean(rollout_log_prob, response_mask, dim=-1)
    difference = rollout_mean - train_mean
    sequence_log_ratio = (log_ratio * response_mask).sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": masked_mean(torch.exp(-train_mean), rows),
        "training_log_ppl": masked_mean(-train_mean, rows),
        "kl": masked_mean(-log_ratio, response_mask),
        "k3_kl": masked_mean(torch.exp(safe) - safe - 1.0, response_mask),
        "rollout_ppl": masked_mean(torch.exp(-rollout_mean), rows),
        "rollout_log_ppl": masked_mean(-rollout_mean, rows),
        "log_ppl_diff": masked_mean(difference, rows),
        "log_ppl_abs_diff": masked_mean(difference.abs(), rows),
        "log_ppl_diff_max": _masked_extreme(difference, rows, largest=True),
        "log_ppl_diff_min": _masked_extreme(difference, rows, largest=False),
        "ppl_ratio": masked_mean(torch.exp(difference), rows),
        "chi2_token": masked_mean(torch.exp(2.0 * safe), response_mask) - 1.0,
        "chi2_seq": masked_mean(torch.exp(2.0 * sequence_log_ratio), rows) - 1.0,
    }
