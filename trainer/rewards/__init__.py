"""Rule-based rewards: built-in scorers by data_source and user-supplied scoring functions."""

from trainer.rewards.custom import (
    CustomRewardError,
    RewardFunctionError,
    as_float_score,
    load_custom_score,
    resolve_compute_score,
)
from trainer.rewards.scorers import (
    SCORERS,
    UnknownDataSource,
    default_compute_score,
    score_counting,
    score_gsm8k,
)

__all__ = [
    "SCORERS",
    "CustomRewardError",
    "RewardFunctionError",
    "UnknownDataSource",
    "as_float_score",
    "default_compute_score",
    "load_custom_score",
    "resolve_compute_score",
    "score_counting",
    "score_gsm8k",
]
