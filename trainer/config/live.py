"""Settings that may change while a run goes on, without a restart.

The daemon validates a change (all or nothing), keeps the current values, forwards them to the
trainer and re-sends them after a trainer restart; the trainer applies them at its next safe
point and acknowledges with the step. Names are what ``PATCH /v1/settings`` and ``verl set``
take. The threshold and the layer minimum start from the config's run-wide ``dynamic_offload``
section; ``dynamic_offload.enabled`` is the one switch over every model whose
``fsdp_config.dynamic_offload.enabled`` is true.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from trainer.config.fields import (
    GpuSampleInterval,
    LayerMinimum,
    LogLevel,
    MemoryThreshold,
    PcieSampleInterval,
    Section,
    describe_allowed,
)
from trainer.config.schema import DaemonConfig, DynamicOffloadConfig, RunConfig, TelemetryConfig


def _as_configured(section: type[Section], name: str) -> Any:
    """The config field's default and docstring: a live setting that a config sets states neither again."""
    field = section.model_fields[name]
    return Field(field.default, description=field.description)


class LiveSettings(BaseModel):
    """The current value of every live setting.

    The types (and so the bounds) are the config's own; the defaults and descriptions too, but for the one
    setting that only exists live (dynamic_offload.enabled).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True,
                              use_attribute_docstrings=True)

    gpu_memory_threshold: MemoryThreshold = _as_configured(DynamicOffloadConfig, "gpu_memory_threshold")
    min_transformer_layers_on_gpu: LayerMinimum = _as_configured(DynamicOffloadConfig, "min_transformer_layers_on_gpu")
    dynamic_offload_enabled: bool = Field(False, alias="dynamic_offload.enabled")
    """Pauses (false) or resumes every dynamically offloaded model; starts true when any model enables it."""
    gpu_sample_interval_s: GpuSampleInterval = _as_configured(TelemetryConfig, "gpu_sample_interval_s")
    pcie_sample_interval_s: PcieSampleInterval = _as_configured(TelemetryConfig, "pcie_sample_interval_s")
    log_level: LogLevel = _as_configured(DaemonConfig, "log_level")

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
    """The run's starting values, from the dynamic_offload, telemetry and daemon sections; dynamic offload
    starts switched on when any model the run builds enables it."""
    return LiveSettings.model_validate({
        "gpu_memory_threshold": config.dynamic_offload.gpu_memory_threshold,
        "min_transformer_layers_on_gpu": config.dynamic_offload.min_transformer_layers_on_gpu,
        "dynamic_offload.enabled": any(fsdp.dynamic_offload.enabled for fsdp in config.fsdp_configs().values()),
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
    if not field.metadata:
        return ""  # no bounds: pydantic's message already lists the choices or names the type
    return f"; allowed: {describe_allowed(field.annotation, field)}"
