"""Settings that may change while a run goes on, without a restart.

The daemon validates a change (all or nothing), keeps the current values, forwards them to the
trainer and re-sends them after a trainer restart; the trainer applies them at its next safe
point and acknowledges with the step. Each setting is named by the config key it starts from
(``dynamic_offload.gpu_memory_threshold``): that is how the API, ``verl set``, the audit log and
/metrics' labels show it, and ``PATCH /v1/settings`` and ``verl set`` also take its short name
(``gpu_memory_threshold``). ``dynamic_offload.enabled`` has no config key of its own: it is the
one switch over every model whose ``fsdp_config.dynamic_offload.enabled`` is true.

``LIVE_SETTINGS`` is the one table of them: names, who applies each, its Prometheus gauge.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from trainer.config.fields import (
    GpuSampleInterval,
    LayerMinimum,
    LogLevel,
    MemoryThreshold,
    PcieSampleInterval,
    describe_allowed,
)
from trainer.config.schema import RunConfig


@dataclass(frozen=True)
class LiveSetting:
    """One live setting: its names, who acts on it, and its Prometheus gauge."""

    name: str
    """The canonical name: the config key the run starts it from (dynamic_offload.enabled has none)."""
    attribute: str
    """The LiveSettings field that holds it: what trainer code reads (trainer.offload.dynamic.DynamicSettings)."""
    applied_by: Literal["trainer", "daemon", "both"]
    """The trainer (at its next safe point), the daemon (at once), or both."""
    gauge: str
    """The Prometheus metric that shows its value (the log level's: one series per level, 1 for the current)."""
    gauge_help: str
    short: str | None = None
    """The name it had before it was named by its config key; `verl set` and PATCH /v1/settings still take it."""


LIVE_SETTINGS: tuple[LiveSetting, ...] = (
    LiveSetting("dynamic_offload.gpu_memory_threshold", "gpu_memory_threshold", "trainer",
                "verl_setting_gpu_memory_threshold_ratio",
                "Fraction of GPU memory in use above which dynamic offload moves layers to the CPU.",
                short="gpu_memory_threshold"),
    LiveSetting("dynamic_offload.min_transformer_layers_on_gpu", "min_transformer_layers_on_gpu", "trainer",
                "verl_setting_min_transformer_layers_on_gpu", "Fewest transformer layers dynamic offload keeps on "
                "the GPU.", short="min_transformer_layers_on_gpu"),
    LiveSetting("dynamic_offload.enabled", "dynamic_offload_enabled", "trainer",
                "verl_setting_dynamic_offload_enabled", "1 when dynamic offload may move layers, else 0."),
    LiveSetting("telemetry.gpu_sample_interval_s", "gpu_sample_interval_s", "daemon",
                "verl_setting_gpu_sample_interval_seconds", "Seconds between GPU samples.",
                short="gpu_sample_interval_s"),
    LiveSetting("telemetry.pcie_sample_interval_s", "pcie_sample_interval_s", "daemon",
                "verl_setting_pcie_sample_interval_seconds", "Seconds between PCIe throughput samples.",
                short="pcie_sample_interval_s"),
    LiveSetting("daemon.log_level", "log_level", "both",
                "verl_setting_log_level", "1 for the current log level, 0 for the others.", short="log_level"),
)
SETTINGS: dict[str, LiveSetting] = {setting.name: setting for setting in LIVE_SETTINGS}
"""Canonical name -> its row."""
SETTING_NAMES = tuple(SETTINGS)
"""The canonical names, in the order the API lists them."""
SHORT_NAMES: dict[str, str] = {setting.short: setting.name for setting in LIVE_SETTINGS if setting.short}
"""Short name -> canonical name."""
NAME_OF: dict[str, str] = {setting.attribute: setting.name for setting in LIVE_SETTINGS}
"""LiveSettings attribute -> canonical name: for code that acts on a change (whose keys are canonical names)."""
LOG_LEVEL_SETTING = NAME_OF["log_level"]
ALLOWED_NAMES = ", ".join(SETTING_NAMES) + " (or their short names: " + ", ".join(SHORT_NAMES) + ")"
"""What a message that refuses a name lists."""


def canonical_name(name: str) -> str | None:
    """The canonical name of a setting named by either of its names; None for a name no setting has."""
    return name if name in SETTINGS else SHORT_NAMES.get(name)


def _live(attribute: str, *, default: Any = None) -> Any:
    """The field of the setting at `attribute`, under its canonical name. A setting that a config key starts
    states neither default nor description again: they are the config field's own; the switch, which no
    config key starts, takes `default` and its docstring."""
    setting = SETTINGS[NAME_OF[attribute]]
    section: type[BaseModel] = RunConfig
    *parents, key = setting.name.split(".")
    for parent in parents:
        annotation = section.model_fields[parent].annotation
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel), setting.name
        section = annotation
    if key not in section.model_fields:
        assert default is not None, f"{setting.name} is no config key: give its default"
        return Field(default, alias=setting.name)
    field = section.model_fields[key]
    return Field(field.default, alias=setting.name, description=field.description)


class LiveSettings(BaseModel):
    """The current value of every live setting.

    The types (and so the bounds) are the config's own; the defaults and descriptions too, but for the one
    setting that only exists live (dynamic_offload.enabled). Python code reads them by attribute; they are
    validated and written under their canonical names (short names are taken too).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True,
                              use_attribute_docstrings=True)

    gpu_memory_threshold: MemoryThreshold = _live("gpu_memory_threshold")
    min_transformer_layers_on_gpu: LayerMinimum = _live("min_transformer_layers_on_gpu")
    dynamic_offload_enabled: bool = _live("dynamic_offload_enabled", default=False)
    """Pauses (false) or resumes every dynamically offloaded model; starts true when any model enables it."""
    gpu_sample_interval_s: GpuSampleInterval = _live("gpu_sample_interval_s")
    pcie_sample_interval_s: PcieSampleInterval = _live("pcie_sample_interval_s")
    log_level: LogLevel = _live("log_level")

    @model_validator(mode="before")
    @classmethod
    def _canonical_names(cls, data: Any) -> Any:
        """Values under any of a setting's names (a live_settings.json of an older version holds the short
        ones; Python code may use the attributes) renamed to the canonical name; a setting given under two
        names is an error rather than one of them silently winning."""
        if not isinstance(data, Mapping):
            return data
        twice = named_twice(data, lambda name: canonical_name(name) or NAME_OF.get(name))
        if twice:
            raise ValueError("; ".join(map(str, twice)))
        return {canonical_name(str(name)) or NAME_OF.get(str(name), name): value for name, value in data.items()}

    def public(self) -> dict[str, Any]:
        """Values under their canonical names, as the API shows them."""
        return self.model_dump(by_alias=True)


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
        "dynamic_offload_enabled": any(fsdp.dynamic_offload.enabled for fsdp in config.fsdp_configs().values()),
        "gpu_sample_interval_s": config.telemetry.gpu_sample_interval_s,
        "pcie_sample_interval_s": config.telemetry.pcie_sample_interval_s,
        "log_level": config.daemon.log_level,
    })


def apply_change(current: LiveSettings, change: Mapping[str, Any]) -> LiveSettings:
    """The settings with `change` (canonical or short name -> value) applied, or SettingsRejected naming every
    bad entry (all or nothing). A setting named twice (by its canonical and its short name) is refused."""
    if not isinstance(change, Mapping) or not change:
        raise SettingsRejected([SettingProblem("body", "expected a JSON object of setting -> value; allowed "
                                               "settings: " + ALLOWED_NAMES)])
    problems = [SettingProblem(str(name), "unknown setting; allowed: " + ALLOWED_NAMES)
                for name in change if canonical_name(str(name)) is None]
    if problems:
        raise SettingsRejected(problems)
    try:
        return LiveSettings.model_validate({**current.public(), **canonical_change(change)})
    except ValidationError as error:
        raise SettingsRejected([_describe(item) for item in error.errors()]) from None


def canonical_change(change: Mapping[str, Any]) -> dict[str, Any]:
    """`change` with each setting under its canonical name (names no setting has kept as they are), or
    SettingsRejected when it names a setting twice."""
    twice = named_twice(change)
    if twice:
        raise SettingsRejected(twice)
    return {canonical_name(str(name)) or name: value for name, value in change.items()}


def named_twice(change: Mapping[str, Any], rename: Callable[[str], str | None] = canonical_name
                ) -> list[SettingProblem]:
    """One problem per setting that `change` names more than once (its canonical and its short name), naming
    each name. Refused even where the values agree: one name per setting is a rule the API's JSON schema can
    state (it cannot state "equal where both are given"), and so PATCH /v1/settings' schema does."""
    names: dict[str, list[str]] = {}
    for name in change:
        canonical = rename(str(name))
        if canonical is not None:
            names.setdefault(canonical, []).append(str(name))
    return [SettingProblem(canonical, "given twice, as " + " and ".join(f"{name}={change[name]!r}" for name in given)
                           + "; give it once")
            for canonical, given in names.items() if len(given) > 1]


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
