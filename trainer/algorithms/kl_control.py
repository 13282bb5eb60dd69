"""Controllers for the coefficient of the in-reward KL penalty (``algorithm.kl_ctrl``).

The trainer calls ``update(current_kl, n_steps)`` once per step with the measured KL and the
number of samples in the batch, and reads ``value`` as the next step's ``kl_coef``. Both
controllers save and restore ``value`` so a resumed run continues with the coefficient it had.
"""

from __future__ import annotations

from typing import Any, Protocol

KL_CONTROLLER_TYPES = ("fixed", "adaptive")
# Ziegler et al. clip the proportional error so one noisy KL estimate changes the coefficient by
# at most a factor 1 +/- 0.2 * n_steps / horizon.
_MAX_PROPORTIONAL_ERROR = 0.2


class KLController(Protocol):
    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; present so the trainer treats both controllers alike."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Steers the KL coefficient towards ``target_kl`` (Ziegler et al. 2019, "Fine-Tuning Language
    Models from Human Preferences", sec. 2.2).

    e = clip(current_kl / target_kl - 1, -0.2, 0.2);  value *= 1 + e * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0 for the adaptive KL controller, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0 for the adaptive KL controller, got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = current_kl / self.target_kl - 1.0
        error = min(max(error, -_MAX_PROPORTIONAL_ERROR), _MAX_PROPORTIONAL_ERROR)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


def build_kl_controller(type: str, kl_coef: float, target_kl: float, horizon: int) -> KLController:
    """The controller named by ``algorithm.kl_ctrl.type``; ``kl_coef`` is its (initial) value."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller type '{type}'; allowed: {', '.join(KL_CONTROLLER_TYPES)}")
