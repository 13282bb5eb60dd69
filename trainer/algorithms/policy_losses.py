"""Policy losses, registered by verl's names (``actor.policy_loss.loss_mode``).

Each loss is a pure tensor function citing its paper, and a registered adapter that reads what it needs from
`PolicyLossInputs` and the config, so the actor calls every loss the same way:

    loss = get_policy_loss(policy_loss_mode(actor_config, rollout_correction))
    result = loss(PolicyLossInputs(...), actor_config, rollout_correction)

A result carries the loss, the ``loss_agg_mode`` it is a mean by (GSPO and SAPO average per sequence whatever the
config says, GMPO over sequences: the update weighs each micro-batch's share by it) and its metrics under verl's
names, without the ``actor/`` prefix the actor adds (rollout correction's keep their own ``rollout_corr/``).

Shapes: ``B`` responses, ``T`` response tokens; every ``[B, T]`` tensor comes with the ``response_mask``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from trainer.algorithms.functional import aggregate_loss, compute_policy_loss, masked_mean
from trainer.algorithms.rollout_correction import compute_rollout_correction
from trainer.config import KEYS, ActorConfig
from trainer.config.losses import RolloutCorrectionConfig

# exp() of a log-ratio above ~88 overflows float32 (functional.py clamps the same way).
_LOG_RATIO_LIMIT = 20.0
# GSPO's sequence ratio is clamped above at exp(10), as verl does.
_SEQUENCE_LOG_RATIO_LIMIT = 10.0

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PolicyLossInputs:
    """What a policy loss may read of a micro-batch. Shapes: ``B`` responses, ``T`` response tokens."""

    old_log_prob: torch.Tensor
    """[B, T] log-probs under the policy the ratio is taken to (pi_old; the rollout's in bypass mode)."""
    log_prob: torch.Tensor
    """[B, T] log-probs under the policy being trained (with grad)."""
    advantages: torch.Tensor
    """[B, T]."""
    response_mask: torch.Tensor
    """[B, T] the tokens the loss reads (rollout correction's rejection applied)."""
    loss_agg_mode: str = "token-mean"
    """actor.loss_agg_mode: how a loss that follows it averages its tokens (functional.aggregate_loss)."""
    rollout_is_weights: torch.Tensor | None = None
    """[B, T] rollout correction's truncated importance weights (detached), multiplying each token's loss."""
    generator: torch.Generator | None = None
    """clip_cov's random pick of tokens (None: torch's default generator)."""


class PolicyLossResult(NamedTuple):
    """A policy loss's scalar loss (with its graph), how it is aggregated, and its metrics (0-dim, detached)."""

    loss: torch.Tensor
    aggregation: str
    """The loss_agg_mode the loss is a mean by (functional.aggregation_weight)."""
    metrics: Metrics


PolicyLossFn = Callable[[PolicyLossInputs, ActorConfig, RolloutCorrectionConfig], PolicyLossResult]
"""(inputs, the actor's config, the rollout correction's) -> the result."""

POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss under verl's name for it (``actor.policy_loss.loss_mode``)."""

    def register(loss: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = loss
        return loss
    return register


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown {KEYS.actor_rollout_ref.actor.policy_loss.loss_mode} '{name}'; allowed: "
                         f"{', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def policy_loss_mode(actor: ActorConfig, rollout_correction: RolloutCorrectionConfig) -> str:
    """The loss the actor runs: bypass_mode under rollout_correction.bypass_mode (verl's trainer sets it so),
    else actor.policy_loss.loss_mode."""
    return "bypass_mode" if rollout_correction.bypass_mode else actor.policy_loss.loss_mode


def _weighted(token_losses: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return token_losses if weights is None else token_losses * weights


def _ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, clipfrac: torch.Tensor,
                   clipfrac_lower: torch.Tensor | None = None) -> Metrics:
    """verl's actor/pg_clipfrac, actor/ppo_kl (mean of old - new log-prob) and actor/pg_clipfrac_lower."""
    lower = torch.zeros_like(clipfrac) if clipfrac_lower is None else clipfrac_lower
    return {"pg_clipfrac": clipfrac.detach(), "ppo_kl": masked_mean(-log_ratio, mask).detach(),
            "pg_clipfrac_lower": lower.detach()}


# ----------------------------------------------------------------------------------------------- vanilla


@register_policy_loss("vanilla")
def vanilla(inputs: PolicyLossInputs, config: ActorConfig, correction: RolloutCorrectionConfig) -> PolicyLossResult:
    """PPO's clipped surrogate with dual clip (functional.compute_policy_loss)."""
    low, high = config.clip_range
    policy = compute_policy_loss(inputs.old_log_prob, inputs.log_prob, inputs.advantages, inputs.response_mask,
                                 clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=config.clip_ratio_c,
                                 loss_agg_mode=inputs.loss_agg_mode, weights=inputs.rollout_is_weights)
    return PolicyLossResult(policy.loss, inputs.loss_agg_mode, {
        "pg_clipfrac": policy.clipfrac, "ppo_kl": policy.ppo_kl, "pg_clipfrac_lower": policy.clipfrac_lower})


# -------------------------------------------------------------------------------------------------- GSPO


def compute_gspo_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                      response_mask: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float,
                      weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, "Group Sequence Policy Optimization",
    arXiv 2507.18071, eq. 5 and its token-level GSPO-token, eq. 13).

    The ratio is the sequence's length-normalised likelihood ratio s_i = exp(mean_t (log pi - log pi_old)), clipped
    as PPO's: L = max(-A * s, -A * clip(s, 1 - low, 1 + high)), averaged per sequence then over sequences
    (seq-mean-token-mean). Per token the ratio is s_i,t = sg[s_i] * pi_t / sg[pi_t]: the value s_i, the gradient
    of each token's own log-prob (scaled by s_i); log s is clamped above at 10.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[B, T]``.
        clip_ratio_low, clip_ratio_high: the clip range of s (GSPO uses a far narrower one than PPO's: 3e-4, 4e-4).
        weights: ``[B, T]`` rollout correction's importance weights, or None.

    Returns:
        ``(loss, metrics)``: pg_clipfrac (tokens whose sequence's ratio is clipped), ppo_kl, pg_clipfrac_lower (0).
    """
    log_ratio = log_prob - old_log_prob
    lengths = response_mask.sum(-1).clamp(min=1)
    sequence_log_ratio = (log_ratio * response_mask).sum(-1) / lengths
    token_log_ratio = log_prob - log_prob.detach() + sequence_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=_SEQUENCE_LOG_RATIO_LIMIT))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    token_losses = _weighted(torch.maximum(unclipped, clipped), weights)
    loss = aggregate_loss(token_losses, response_mask, "seq-mean-token-mean")
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(ratio.dtype), response_mask)
        metrics = _ratio_metrics(log_ratio, response_mask, clipfrac)
    return loss, metrics


@register_policy_loss("gspo")
def gspo(inputs: PolicyLossInputs, config: ActorConfig, correction: RolloutCorrectionConfig) -> PolicyLossResult:
    """GSPO's sequence-level clipped ratio; aggregated seq-mean-token-mean whatever loss_agg_mode is (as verl)."""
    low, high = config.clip_range
    loss, metrics = compute_gspo_loss(inputs.old_log_prob, inputs.log_prob, inputs.advantages, inputs.response_mask,
                                      low, high, inputs.rollout_is_weights)
    return PolicyLossResult(loss, "seq-mean-token-mean", metrics)


# -------------------------------------------------------------------------------------------------- SAPO


def compute_sapo_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                      response_mask: torch.Tensor, tau_pos: float, tau_neg: float,
                      weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """Soft Adaptive Policy Optimization (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347).

    A smooth gate replaces the hard clip: L = -f(r, tau) * A per token, f(r, tau) = sigmoid(tau (r - 1)) * 4 / tau,
    whose gradient in r is 1 at r = 1 (PPO's) and fades as r leaves 1; tau is tau_pos where A > 0, tau_neg
    elsewhere (a larger tau_neg damps negative updates sooner). Averaged seq-mean-token-mean.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[B, T]``.
        tau_pos, tau_neg: the gate's temperatures (actor.tau_pos, actor.tau_neg).
        weights: ``[B, T]`` rollout correction's importance weights, or None.

    Returns:
        ``(loss, metrics)``: ppo_kl, and pg_clipfrac and pg_clipfrac_lower at 0 (nothing is clipped).
    """
    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    taus = torch.where(advantages > 0, torch.full_like(advantages, tau_pos), torch.full_like(advantages, tau_neg))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    loss = aggregate_loss(_weighted(-gates * advantages, weights), response_mask, "seq-mean-token-mean")
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, response_mask, loss.new_zeros(()))
    return loss, metrics


@register_policy_loss("sapo")
def sapo(inputs: PolicyLossInputs, config: ActorConfig, correction: RolloutCorrectionConfig) -> PolicyLossResult:
    """SAPO's gated ratio at actor.tau_pos and actor.tau_neg; aggregated seq-mean-token-mean (as verl)."""
    loss, metrics = compute_sapo_loss(inputs.old_log_prob, inputs.log_prob, inputs.advantages, inputs.response_mask,
                                      config.tau_pos, config.tau_neg, inputs.rollout_is_weights)
    return PolicyLossResult(loss, "seq-mean-token-mean", metrics)


# --------------------------------------------------------------------------------------------------- GPG


def compute_gpg_loss(log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                     loss_agg_mode: str, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Group Policy Gradient (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv 2504.02546, eq. 6): the plain policy gradient L = -A * log pi per token, no ratio and no clip,
    aggregated by `loss_agg_mode`. ``[B, T]`` inputs; `weights` multiply each token's loss."""
    return aggregate_loss(_weighted(-advantages * log_prob, weights), response_mask, loss_agg_mode)


@register_policy_loss("gpg")
def gpg(inputs: PolicyLossInputs, config: ActorConfig, correction: RolloutCorrectionConfig) -> PolicyLossResult:
    """GPG's policy gradient; no metrics beside the loss (as verl)."""
    loss = compute_gpg_loss(inputs.log_prob, inputs.advantages, inputs.response_mask, inputs.loss_agg_mode,
                            inputs.rollout_is_weights)
    return PolicyLossResult(loss, inputs.loss_agg_mode, {})


# ---------------------------------------------------------------------------------------- Clip-Cov, KL-Cov


def _covariance(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] each token's term of the covariance between advantage and log-prob over the masked tokens (detached)."""
    return ((advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob, mask))).detach()


def compute_clip_cov_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                          response_mask: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float, *,
                          clip_cov_ratio: float, clip_cov_lb: float, clip_cov_ub: float, loss_agg_mode: str,
                          weights: torch.Tensor | None = None,
                          generator: torch.Generator | None = None) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
    arXiv 2505.22617, sec. 4.2): the policy's entropy collapses through tokens whose advantage and log-prob covary
    strongly, so a few of them lose their gradient.

    Each token's covariance term is (A - mean A)(log pi - mean log pi) over the masked tokens. Among the tokens PPO's
    clip leaves alone whose term lies in (clip_cov_lb, clip_cov_ub), max(1, int(clip_cov_ratio * tokens)) are
    picked at random (from `generator`) and their loss, PPO's clipped surrogate otherwise, is set to 0 (no dual
    clip). Aggregated by `loss_agg_mode`.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[B, T]``.
        clip_ratio_low, clip_ratio_high: PPO's clip range.
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: policy_loss's keys of the same names.
        weights: ``[B, T]`` rollout correction's importance weights, or None.

    Returns:
        ``(loss, metrics)``: pg_clipfrac (the fraction of tokens cut), ppo_kl.
    """
    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    with torch.no_grad():
        covariance = _covariance(advantages, log_prob, response_mask)
        candidates = ((covariance > clip_cov_lb) & (covariance < clip_cov_ub) & (response_mask > 0)
                      & ~(clipped > unclipped))
        positions = torch.nonzero(candidates)
        count = min(max(int(clip_cov_ratio * float(response_mask.sum())), 1), len(positions))
        order = torch.randperm(len(positions), generator=generator)[:count].to(positions.device)
        keep = torch.ones_like(advantages)
        keep[positions[order, 0], positions[order, 1]] = 0.0
    token_losses = _weighted(torch.maximum(unclipped, clipped) * keep, weights)
    loss = aggregate_loss(token_losses, response_mask, loss_agg_mode)
    with torch.no_grad():
        cut = masked_mean(1.0 - keep, response_mask)
        metrics = {"pg_clipfrac": cut, "ppo_kl": masked_mean(-log_ratio, response_mask)}
    return loss, metrics


@register_policy_loss("clip_cov")
def clip_cov(inputs: PolicyLossInputs, config: ActorConfig, correction: RolloutCorrectionConfig) -> PolicyLossResult:
    """Clip-Cov with policy_loss.clip_cov_ratio, clip_cov_lb and clip_cov_ub."""
    low, high = config.clip_range
    settings = config.policy_loss
    loss, metrics = compute_clip_cov_loss(
        inputs.old_log_prob, inputs.log_prob, inputs.advantages, inputs.response_mask, low, high,
        clip_cov_ratio=settings.clip_cov_ratio, clip_cov_lb=settings.clip_cov_lb, clip_cov_ub=settings.clip_cov_ub,
        loss_agg_mode=inputs.loss_agg_mode, weights=inputs.rollout_is_weights, generator=inputs.generator)
    return PolicyLossResult(loss, inputs.loss_agg_mode, metrics)


def compute_kl_cov_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, *, kl_cov_ratio: float, ppo_kl_coef: float, loss_agg_mode: str,
                        weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617, sec. 4.2): the policy gradient -A * r on every token, plus a
    penalty ppo_kl_coef * |log r| on the max(1, int(kl_cov_ratio * tokens)) tokens of largest covariance term
    (A - mean A)(log pi - mean log pi), which holds those back instead of cutting them. Aggregated by
    `loss_agg_mode`.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[B, T]``.
        kl_cov_ratio, ppo_kl_coef: policy_loss's keys of the same names.
        weights: ``[B, T]`` rollout correction's importance weights, or None.

    Returns:
        ``(loss, metrics)``: ppo_kl, here the mean |log r| (as verl reports it for kl_cov).
    """
    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    token_losses = -advantages * ratio
    with torch.no_grad():
        covariance = _covariance(advantages, log_prob, response_mask).masked_fill(response_mask == 0, -torch.inf)
        tokens = int(response_mask.sum())
        penalised = torch.zeros_like(advantages)
        if tokens > 0:
            largest = torch.topk(covariance.flatten(), max(1, int(tokens * kl_cov_ratio))).indices
            penalised.view(-1)[largest] = 1.0
    token_losses = token_losses + penalised * ppo_kl_coef * log_ratio.abs()
    loss = aggregate_loss(_weighted(token_losses, weights), response_mask, loss_agg_mode)
    return loss, {"ppo_kl": masked_mean(log_ratio.abs(), response_mask).detach()}


@register_policy_loss("kl_cov")
def kl_cov(inputs: PolicyLossInputs, config: ActorConfig, correction: RolloutCorrectionConfig) -> PolicyLossResult:
    """KL-Cov with policy_loss.kl_cov_ratio and ppo_kl_coef."""
    settings = config.policy_loss
    loss, metrics = compute_kl_cov_loss(
        inputs.old_log_prob, inputs.log_prob, inputs.advantages, inputs.response_mask,
        kl_cov_ratio=settings.kl_cov_ratio, ppo_kl_coef=settings.ppo_kl_coef, loss_agg_mode=inputs.loss_agg_mode,
        weights=inputs.rollout_is_weights)
    return PolicyLossResult(loss, inputs.loss_agg_mode, metrics)


# -------------------------------------------------------------------------------------------------- GMPO


def compute_geo_mean_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                          response_mask: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float,
                          weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """Geometric-Mean Policy Optimization (Zhao et al. 2025, "Geometric-Mean Policy Optimization",
    arXiv 2507.20673, eq. 6).

    The objective of a sequence is its advantage times the geometric mean of its token ratios, each clipped in log
    space the pessimistic way: with s = sign(A), log r~_t = s * min(s * log r_t, s * clip(log r_t, -low, high)),
    L_i = -mean_t(A) * exp(mean_t log r~_t), then the mean over sequences. (Sequence-level advantages, as GRPO's:
    mean_t A is the sequence's.) Importance weights enter per sequence as their geometric mean.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[B, T]``.
        clip_ratio_low, clip_ratio_high: the clip range of the log-ratio (GMPO's (-0.4, 0.4) is wider than PPO's).
        weights: ``[B, T]`` rollout correction's importance weights, or None.

    Returns:
        ``(loss, metrics)``: pg_clipfrac (clipped tokens of A > 0), pg_clipfrac_lower (of A < 0), ppo_kl.
    """
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    bounded = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)
    lengths = response_mask.sum(-1).clamp(min=1)
    ratio = torch.exp((pessimistic * response_mask).sum(-1) / lengths)
    advantage = (advantages * response_mask).sum(-1) / lengths
    sequence_losses = -advantage * ratio
    if weights is not None:
        sequence_losses = sequence_losses * torch.exp((torch.log(weights + 1e-10) * response_mask).sum(-1) / lengths)
    rows = (response_mask.sum(-1) > 0).to(sequence_losses.dtype)
    loss = masked_mean(sequence_losses, rows)
    with torch.no_grad():
        was_clipped = log_ratio != bounded
        metrics = _ratio_metrics(log_ratio, response_mask,
                                 masked_mean((was_clipped & (advantages > 0)).to(ratio.dtype), response_mask),
                                 masked_mean((was_clipped & (advantages < 0)).to(ratio.dtype), response_mask))
    return loss, metrics


@register_policy_loss("geo_mean")
def geo_mean(inputs: PolicyLossInputs, config: ActorConfig, correction: RolloutCorrectionConfig) -> PolicyLossResult:
    """GMPO's geometric mean of the clipped ratios; a mean over sequences whatever loss_agg_mode is (as verl)."""
    low, high = config.clip_range
    loss, metrics = compute_geo_mean_loss(inputs.old_log_prob, inputs.log_prob, inputs.advantages,
                                          inputs.response_mask, low, high, inputs.rollout_is_weights)
    return PolicyLossResult(loss, "seq-mean-token-mean", metrics)


# ------------------------------------------------------------------------------------------------- CISPO


def compute_cispo_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                       response_mask: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float, loss_agg_mode: str,
                       weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """Clipped IS-weight Policy Optimization (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with
    Lightning Attention", arXiv 2506.13585, eq. 4): L = -sg[clip(r, 1 - low, 1 + high)] * A * log pi per token.
    The importance weight is clipped and detached rather than the update dropped, so every token keeps a gradient
    (PPO's clip zeroes those beyond the range). Aggregated by `loss_agg_mode`.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[B, T]``.
        clip_ratio_low, clip_ratio_high: the clip range of the weight.
        weights: ``[B, T]`` rollout correction's importance weights, or None.

    Returns:
        ``(loss, metrics)``: pg_clipfrac (tokens whose weight was clipped), ppo_kl, pg_clipfrac_lower (0).
    """
    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
    loss = aggregate_loss(_weighted(-clipped * advantages * log_prob, weights), response_mask, loss_agg_mode)
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, response_mask,
                                 masked_mean((ratio != clipped).to(ratio.dtype), response_mask))
    return loss, metrics


@register_policy_loss("cispo")
def cispo(inputs: PolicyLossInputs, config: ActorConfig, correction: RolloutCorrectionConfig) -> PolicyLossResult:
    """CISPO's clipped, detached importance weight on the log-prob."""
    low, high = config.clip_range
    loss, metrics = compute_cispo_loss(inputs.old_log_prob, inputs.log_prob, inputs.advantages, inputs.response_mask,
                                       low, high, inputs.loss_agg_mode, inputs.rollout_is_weights)
    return PolicyLossResult(loss, inputs.loss_agg_mode, metrics)


# ------------------------------------------------------------------------------------------- bypass mode


def compute_reinforce_loss(rollout_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                           response_mask: torch.Tensor, loss_agg_mode: str,
                           weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """REINFORCE with importance weights (Williams 1992; the off-policy form of Liu, Li et al. 2025,
    https://richardli.xyz/rl-collapse): L = -w * A * log pi per token, w the detached, truncated weight
    pi_theta / pi_rollout (None: 1), no ratio clip. Aggregated by `loss_agg_mode`. ``[B, T]`` inputs.

    Returns ``(loss, metrics)``: ppo_kl, the mean of log pi_rollout - log pi_theta."""
    loss = aggregate_loss(_weighted(-advantages * log_prob, weights), response_mask, loss_agg_mode)
    return loss, {"ppo_kl": masked_mean(rollout_log_prob - log_prob.detach(), response_mask)}


@register_policy_loss("bypass_mode")
def bypass_mode(inputs: PolicyLossInputs, config: ActorConfig,
                correction: RolloutCorrectionConfig) -> PolicyLossResult:
    """verl's bypass mode: the old log-probs are the rollout's (no scoring pass), and the loss corrects between the
    policy being trained and the rollout's itself, micro-batch by micro-batch. rollout_correction.loss_type picks the
    loss: ``ppo_clip``, PPO's clipped surrogate of r = pi_theta / pi_rollout (its clip is the correction: no
    importance weights on top), or ``reinforce``, :func:`compute_reinforce_loss` with rollout_is's weights.

    Rejection (rollout_rs) zeroes a rejected token's loss, the aggregate still divided by the micro-batch's share of
    the response tokens (as verl's global token count), and rollout_is_batch_normalize normalises over the
    micro-batch. The rollout_corr/ metrics join the loss's."""
    rollout_log_prob = inputs.old_log_prob
    corrected = compute_rollout_correction(inputs.log_prob, rollout_log_prob, inputs.response_mask, correction)
    kept = (torch.ones_like(inputs.response_mask) if corrected.response_mask is None
            else corrected.response_mask)
    if correction.loss_type == "reinforce":
        weights = kept if corrected.weights is None else kept * corrected.weights
        loss, metrics = compute_reinforce_loss(rollout_log_prob, inputs.log_prob, inputs.advantages,
                                               inputs.response_mask, inputs.loss_agg_mode, weights)
    else:
        low, high = config.clip_range
        policy = compute_policy_loss(rollout_log_prob, inputs.log_prob, inputs.advantages, inputs.response_mask,
                                     clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=config.clip_ratio_c,
                                     loss_agg_mode=inputs.loss_agg_mode, weights=kept)
        loss, metrics = policy.loss, {"pg_clipfrac": policy.clipfrac, "ppo_kl": policy.ppo_kl,
                                      "pg_clipfrac_lower": policy.clipfrac_lower}
    return PolicyLossResult(loss, inputs.loss_agg_mode, {**metrics, **corrected.metrics})
