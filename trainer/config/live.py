"""Settings that may change while a run goes on, without a restart.

The daemon validates a change (all or nothing), keeps the current values, forwards them to the
trainer and re-sends them after a trainer restart; the trainer applies them at its next safe
point and acknowledges with the step. Names are what ``PATCH /v1/settings`` and ``verl set``
take; ``dynamic_offload.enabled`` keeps the config's dotted name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from trainer.config.schema import LogLevel, RunConfig


class LiveSettings(BaseModel):
    """The current value of every live setting."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True,
                              use_attribute_docstrings=True)

    gpu_memory_threshold: float = Field(0.85, gt=0.0, le=1.0)
    """Fraction of GPU memory in use above which dynamic offload moves layers to the CPU."""
    min_transformer_layers_on_gpu: int = Field(0, ge=0)
    """Never keep fewer transformer layers on the GPU."""
    dynamic_offload_enabled: bool = Field(False, alias="dynamic_offload.enabled")
    """Whether dynamic offload may move layers at all."""
    gpu_sample_interval_s: float = Field(1.0, ge=0.05, le=60.0)
    """Seconds between GPU samples."""
    pcie_sample_interval_s: float = Field(10.0, ge=1.0, le=600.0)
    """Seconds between PCIe throughput samples."""
    log_level: LogLevel = "info"
    """Least severe log lines kept."""

    def public(self) -> dict[str, Any]:
        """Values under their public names, as the API shows them."""
        return self.model_dump(by_alias=True)


# Who acts on each setting: the trainer (at a safe point) or the daemon (at once).
APPLIED_BY: dict[str, Literal["trainer", "daemon", "both"]] = {
    "gpu_memory_threshold": "trainer",
    "min_transformer_layers_on_gpu": "trainer",
    "dynamic_offload.enabled": "trainer",
    "gpu_sample_interval_s": "daemon",
    "pcie_sample_interval_s": "daemon",
    "log_level": "both",
}
SETTING_NAMES = tuple(APPLIED_BY)


@dataclass(frozen=True)
class SettingProblem:
    """A rejected value: which setting, and why (naming what is allowed)."""

    setting: str
    message: str

    def __str__(self) -> str:
        return f"{self.setting}: {self.message}"


class SettingsRejected(ValueError):
    """A change with at least one bad value; nothing was changed."""

    def __init__(self, problems: list[SettingProblem]):
        self.problems = problems
        super().__init__("; ".join(str(problem) for problem in problems))


def initial_live_settings(config: RunConfig) -> LiveSettings:
    """The run's starting values, from the actor's dynamic_offload and the telemetry/daemon sections."""
    dynamic = config.actor_rollout_ref.actor.fsdp_config.dynamic_offload
    return LiveSettings.model_validate({
        "gpu_memory_threshold": dynamic.gpu_memory_threshold,
        "min_transformer_layers_on_gpu": dynamic.min_transformer_layers_on_gpu,
        "dynamic_offload.enabled": dynamic.enabled,
        "gpu_sample_interval_s": config.telemetry.gpu_sample_interval_s,
        "pcie_sample_interval_s": config.telemetry.pcie_sample_interval_s,
        "log_level": config.daemon.log_level,
    })


def apply_change(current: LiveSettings, change: Mapping[str, Any]) -> LiveSettings:
    """The settings with `change` applied, or SettingsRejected naming every bad entry (all or nothing)."""
    if not isinstance(change, Mapping) or not change:
        raise SettingsRejected([SettingProblem("body", "expected a JSON object of setting -> value; allowed "
                                               "settings: " + ", ".join(SETTING_NAMES))])
    problems = [SettingProblem(str(name), "unknown setting; allowed: " + ", ".join(SETTING_NAMES))
                for name in change if name not in APPLIED_BY]
    if problems:
        raise SettingsRejected(problems)
    try:
        return LiveSettings.model_validate({**current.public(), **change})
    except ValidationError as error:
        raise SettingsRejected([_describe(item) for item in error.errors()]) from None


def _describe(error: Mapping[str, Any]) -> SettingProblem:
    name = str(error["loc"][0]) if error["loc"] else "body"
    field = LiveSettings.model_fields.get(name) or next(
        (field for field in LiveSettings.model_fields.values() if field.alias == name), None)
    allowed = _allowed(field) if field else ""
    return SettingProblem(name, f"got {error.get('input')!r}: {error['msg'].lower()}{allowed}")


def _allowed(field: FieldInfo) -> str:
    bounds = []
    for constraint in field.metadata:
        for attribute, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            value = getattr(constraint, attribute, None)
            if value is not None:
                bounds.append(f"{symbol} {value}")
    if not bounds:
        return ""  # pydantic's message already lists the choices or names the type
    kinds: dict[Any, str] = {float: "a number", int: "an integer"}
    kind = kinds.get(field.annotation, str(field.annotation))
    return f"; allowed: {kind} {' and '.join(bounds)}"
