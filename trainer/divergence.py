"""A run that has diverged ends: after trainer.max_nonfinite_steps steps in a row whose loss, gradient norm or reward
is NaN or infinite, the trainer stops with one ERROR line naming what was not finite first and at which step, and
exits with the user-error code, which the daemon does not restart (a restart resumes into the same divergence).
The last checkpoint is left as it was: the run ends before its final save, and a save of non-finite weights is
refused anyway (trainer/checkpoint.py).

Each step's skipped optimizer updates (a non-finite gradient norm skips one) are one WARNING saying how many were
skipped: the weights keep what the step's other updates made.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from trainer.config import KEYS
from trainer.errors import UserError

# What a step's divergence shows in, in the order named when several go at once: the reward first (a bad reward
# makes the loss and the gradient non-finite too), then the losses, then the gradient norms.
WATCHED = ("critic/score/mean", "critic/rewards/mean", "actor/pg_loss", "critic/vf_loss", "actor/grad_norm",
           "critic/grad_norm")


class DivergenceError(UserError):
    """The run has diverged: trainer.max_nonfinite_steps steps in a row were not finite."""


def first_nonfinite_metric(metrics: Mapping[str, float]) -> str | None:
    """The first of WATCHED (then any `*/skipped_steps` above 0) that says the step was not finite; None if none."""
    for key in WATCHED:
        if key in metrics and not math.isfinite(metrics[key]):
            return key
    return next((key for key, value in metrics.items() if key.endswith("skipped_steps") and value > 0), None)


class DivergenceWatch:
    """Counts the steps in a row that were not finite; `observe` warns of skipped updates and raises
    DivergenceError at the limit (`limit` None: never)."""

    def __init__(self, limit: int | None, *, warn: Callable[[str], None]):
        self.limit = limit
        self.warn = warn
        self.streak = 0
        self.first: tuple[int, str, float] | None = None  # (step, key, value) that began the streak

    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if key.endswith("skipped_steps") and value > 0:
                self.warn(f"STEP {step}: {key.split('/')[0]} skipped {value:g} optimizer update(s) on a non-finite "
                          f"gradient norm ({key} {value:g}); a skipped update leaves the weights as they were, the "
                          "step's other updates changed them. Lower the learning rate or check the data and the "
                          "reward if it goes on")
        key = first_nonfinite_metric(metrics)
        if key is None:
            self.streak, self.first = 0, None
            return
        self.streak += 1
        if self.first is None:
            self.first = (step, key, metrics[key])
        if self.limit is not None and self.streak >= self.limit:
            first_step, first_key, value = self.first
            raise DivergenceError(
                f"the run has diverged: {self.streak} steps in a row were not finite "
                f"({KEYS.trainer.max_nonfinite_steps}={self.limit}); the first, step {first_step}, had {first_key} "
                f"{value:g}. Stopped without a checkpoint of the diverged weights: the latest checkpoint is left as "
                f"it was. Lower the learning rate ({KEYS.actor_rollout_ref.actor.optim.lr}) or check the reward")

    def allows_save(self, step: int) -> bool:
        """Whether `step` may be checkpointed: not while steps are not finite (the latest checkpoint stays the last
        one before the streak began, the one a user resumes from with a lower learning rate); a WARNING says so."""
        if self.streak == 0:
            return True
        self.warn(f"STEP {step}: no checkpoint saved: {self.streak} step(s) in a row were not finite (since step "
                  f"{self.first[0] if self.first else step}); the latest checkpoint is the last one before them")
        return False
