"""The schema's sections of the policy loss and of what reweights or filters the samples it reads: verl's
``actor.policy_loss`` (the loss mode and its knobs), ``algorithm.rollout_correction`` (importance weights and
rejection between the policy that sampled and the one trained) and ``algorithm.pf_ppo`` (policy filtration).
A part of schema.py, kept apart by job; the math is in trainer/algorithms (policy_losses.py,
rollout_correction.py, pf_ppo.py).

Torch-free: the daemon validates a config with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from trainer.config.fields import Section, show

PolicyLossMode = Literal["vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "bypass_mode"]
"""verl's registered loss modes (core_algos.register_policy_loss); trainer.algorithms.POLICY_LOSSES registers the
same names, and a test keeps the two equal."""

REJECTION_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                     "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
"""verl's rollout_rs options: where the divergence is taken (a token, or a sequence's sum, mean or largest token)
and which estimator of it (k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r, r = pi_train / pi_rollout)."""


class PolicyLossConfig(Section):
    loss_mode: PolicyLossMode = "vanilla"
    """The actor's policy loss by verl's name; bypass_mode is rollout_correction.bypass_mode's (policy_losses.py)."""
    clip_cov_ratio: float = Field(0.0002, gt=0.0)
    """clip_cov: fraction of the response tokens whose gradient is cut, among those of high covariance."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance of a token that may be cut."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of the covariance of a token that may be cut."""
    kl_cov_ratio: float = Field(0.0002, gt=0.0)
    """kl_cov: fraction of the response tokens of highest covariance that get the |log ratio| penalty."""
    ppo_kl_coef: float = Field(0.1, ge=0.0)
    """kl_cov: weight of that penalty."""


class RolloutCorrectionConfig(Section):
    rollout_is: Literal["token", "sequence"] | None = None
    """Truncated importance weights pi_old / pi_rollout, per token or per sequence (their product); null: none."""
    rollout_is_threshold: float = Field(2.0, gt=0.0)
    """Upper bound an importance weight is truncated at (TIS)."""
    rollout_is_batch_normalize: bool = False
    """Divide the truncated weights by their mean over the batch (tokens, or sequences), every rank's."""
    rollout_rs: str | None = None
    """Rejection: comma-separated options (token_k1, seq_mean_k3, ...); what is out of bounds leaves the loss."""
    rollout_rs_threshold: str | float | None = None
    """rollout_rs's bounds, one or one per option: k1 'lower_upper' (or upper, lower 1/upper), k2 or k3 an upper."""
    bypass_mode: bool = False
    """The rollout's log-probs serve as the old ones (no scoring pass); the loss corrects pi_theta / pi_rollout."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """bypass_mode's loss: ppo_clip (the ratio to the rollout, clipped) or reinforce (log-probs times IS weights)."""

    @property
    def active(self) -> bool:
        """Whether the run corrects for the rollout: weights, rejection or bypass mode (they need its log-probs)."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode

    @field_validator("rollout_rs", mode="before")
    @classmethod
    def _known_options(cls, value: Any) -> Any:
        if isinstance(value, str):
            options = rejection_options(value)
            unknown = [option for option in options if option not in REJECTION_OPTIONS]
            if unknown or not options:
                raise ValueError(f"got {show(value)}; allowed: null, or a comma-separated list of "
                                 f"{', '.join(REJECTION_OPTIONS)}")
        return value

    @field_validator("rollout_rs_threshold")
    @classmethod
    def _thresholds_fit_the_options(cls, value: str | float | None, info: ValidationInfo) -> str | float | None:
        options = info.data.get("rollout_rs")
        if options is None:
            return value  # unset (nothing to bound), or refused itself
        if value is None:
            raise ValueError(f"got null, but rollout_rs is {show(options)}; allowed: its bounds, e.g. '0.5_2.0' for "
                             "a k1 option (ratio bounds) or 0.01 for a k2 or k3 option")
        rejection_criteria(options, value)  # its ValueError names what is wrong
        return value


@dataclass(frozen=True)
class RejectionCriterion:
    """One rollout_rs option and its bounds: a k1 statistic (-log r, summed or averaged) is kept within
    [log lower, log upper]; a k2 or k3 statistic at most `upper`."""

    option: str
    lower: float | None
    """k1 only: the lower ratio bound (its log bounds the statistic)."""
    upper: float


def rejection_options(rollout_rs: str) -> list[str]:
    """The options of a rollout_rs string, in order, each once."""
    return list(dict.fromkeys(part.strip() for part in rollout_rs.split(",") if part.strip()))


def rejection_criteria(rollout_rs: str, rollout_rs_threshold: str | float) -> tuple[RejectionCriterion, ...]:
    """rollout_rs and rollout_rs_threshold read as verl reads them: one threshold for every option, or one per
    option (comma-separated); a k1 option's threshold is 'lower_upper' or an upper whose reciprocal is the lower.
    Raises ValueError (a message for rollout_rs_threshold) on a threshold that does not fit."""
    options = rejection_options(rollout_rs)
    specs = ([str(rollout_rs_threshold)] if not isinstance(rollout_rs_threshold, str)
             else [part.strip() for part in rollout_rs_threshold.split(",") if part.strip()])
    if len(specs) not in (1, len(options)):
        raise ValueError(f"got {show(rollout_rs_threshold)}: {len(specs)} thresholds for {len(options)} rollout_rs "
                         f"options; allowed: one for all, or one per option")
    specs = specs * len(options) if len(specs) == 1 else specs
    return tuple(_criterion(option, spec) for option, spec in zip(options, specs, strict=True))


def _criterion(option: str, spec: str) -> RejectionCriterion:
    bounds = spec.split("_", 1)
    if len(bounds) == 2 and not option.endswith("k1"):
        raise ValueError(f"got {show(spec)} for {option}, but only a k1 option takes 'lower_upper'; allowed: one "
                         "upper bound > 0")
    try:
        numbers = [float(bound) for bound in bounds]
    except ValueError:
        raise ValueError(f"got {show(spec)} for {option}, not a number; allowed: a number > 0"
                         + (" or 'lower_upper'" if option.endswith("k1") else "")) from None
    if not all(number > 0 and math.isfinite(number) for number in numbers):
        raise ValueError(f"got {show(spec)} for {option}; allowed: bounds > 0")
    if not option.endswith("k1"):
        return RejectionCriterion(option, None, numbers[0])
    lower, upper = numbers if len(numbers) == 2 else (1.0 / numbers[0], numbers[0])
    return RejectionCriterion(option, lower, upper)


class PfPpoConfig(Section):
    reweight_method: Literal["pow", "max_min", "max_random"] = "pow"
    """A response's chance to be resampled: |score|^weight_pow, the best and worst only, or the best 4x the rest."""
    weight_pow: float = 2.0
    """The power of the pow method."""
