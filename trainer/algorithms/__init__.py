"""RL algorithms: advantage estimators, policy losses, KL estimators, KL coefficient controllers, rollout correction
and policy filtration."""

from trainer.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    get_advantage_estimator,
    register_advantage_estimator,
)
from trainer.algorithms.functional import (
    KL_ESTIMATOR_ALIASES,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    PolicyLoss,
    actor_loss,
    aggregate_loss,
    aggregation_weight,
    apply_kl_penalty,
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
    kl_penalty,
    log_probs_and_entropy_from_logits,
    log_probs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    scaled_logits,
)
from trainer.algorithms.kl_control import (
    KL_CONTROLLER_TYPES,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    build_kl_controller,
)
from trainer.algorithms.pf_ppo import PF_PPO_METHODS, pf_ppo_resample, pf_ppo_weights
from trainer.algorithms.policy_losses import (
    POLICY_LOSSES,
    PolicyLossFn,
    PolicyLossInputs,
    PolicyLossResult,
    get_policy_loss,
    policy_loss_mode,
    register_policy_loss,
)
from trainer.algorithms.rollout_correction import RolloutCorrection, compute_rollout_correction, off_policy_metrics

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_CONTROLLER_TYPES",
    "KL_ESTIMATORS",
    "KL_ESTIMATOR_ALIASES",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "AdvantageInputs",
    "FixedKLController",
    "KLController",
    "PolicyLoss",
    "actor_loss",
    "aggregate_loss",
    "aggregation_weight",
    "apply_kl_penalty",
    "build_kl_controller",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_value_loss",
    "entropy_from_logits",
    "get_advantage_estimator",
    "kl_penalty",
    "log_probs_and_entropy_from_logits",
    "log_probs_from_logits",
    "scaled_logits",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "register_advantage_estimator",
    # policy_losses.py, rollout_correction.py, pf_ppo.py
    "PF_PPO_METHODS", "POLICY_LOSSES", "PolicyLossFn", "PolicyLossInputs", "PolicyLossResult", "RolloutCorrection",
    "compute_rollout_correction", "get_policy_loss", "off_policy_metrics", "pf_ppo_resample", "pf_ppo_weights",
    "policy_loss_mode", "register_policy_loss",
]
