"""What the API promises: the control surface the daemon implements, and the bodies the routes send.

The run's status (RunStatus) and the live settings' state are models of trainer/config/messages.py:
the daemon builds them from what the trainer reports and the routes send them as they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from trainer.config.live import SHORT_NAMES, LiveSettings
from trainer.config.messages import RunStatus, SettingsState

EVENT_KINDS = ("gpu", "step", "phase", "offload", "settings", "restart", "log", "status")
"""Kinds of event the hub carries (a subscriber may also receive "gap", see api.hub.Subscription)."""
_KINDS_ITEM = r"\s*(?:(?:{kind})\s*)?".format(kind="|".join(EVENT_KINDS))
KINDS_PATTERN = rf"^{_KINDS_ITEM}(?:,{_KINDS_ITEM})*$"
"""A `kinds` query value: comma-separated kinds, blanks around them and empty items allowed (each blank
belongs to one place in the pattern, so no input makes a regex engine backtrack for long)."""
LARGEST_INTEGER = 2**53 - 1
"""The largest whole number the API takes (a seq, a setting): every reader of its JSON holds it exactly,
the live page's JavaScript and tools that read JSON numbers as doubles included."""


class RunControl(Protocol):
    """What the API asks of the run; the daemon implements it.

    The app calls these on the event loop that serves it, so they must return at once (hand work to
    the daemon, never wait on the trainer). A method may also be a coroutine function: the app awaits
    what it returns.
    """

    def status(self) -> RunStatus:
        """The GET /v1/status body."""

    def settings(self) -> SettingsBody:
        """The GET /v1/settings body."""

    def update_settings(self, change: dict) -> dict:
        """Apply a change all or nothing; the PATCH /v1/settings 200 body, or SettingsRejectedError."""

    def request_checkpoint(self) -> dict:
        """Ask the trainer to save a checkpoint at its next safe point."""

    def request_stop(self, force: bool = False) -> dict:
        """Ask the trainer to checkpoint at its next safe point and exit; the daemon then exits 0. Idempotent while
        stopping; `force` kills the trainer at once, without a checkpoint."""


class NotControlNodeError(Exception):
    """A run-wide request (a live setting, checkpoint now, stop) made to the daemon of a node other than node 0,
    which alone holds the run's control; nothing was changed. The message names node 0's daemon."""


class SettingsRejectedError(Exception):
    """A settings change with at least one bad entry; nothing was changed.

    `problems` holds (setting, message) pairs, one per bad entry. Objects with `.setting` and
    `.message` (trainer.config.live.SettingProblem) are accepted too and turned into pairs.
    """

    def __init__(self, problems: Iterable[tuple[str, str] | Any]):
        self.problems: list[tuple[str, str]] = [_pair(problem) for problem in problems]
        super().__init__("; ".join(f"{setting}: {message}" for setting, message in self.problems))


def _pair(problem: tuple[str, str] | Any) -> tuple[str, str]:
    if hasattr(problem, "setting") and hasattr(problem, "message"):
        return str(problem.setting), str(problem.message)
    setting, message = problem
    return str(setting), str(message)


class SettingsNotSavedError(Exception):
    """A valid settings change that could not be written to the run's audit log (a full disk, ...); nothing
    was changed, so asking again once the disk has room is safe."""


def settings_change_schema() -> dict[str, Any]:
    """The JSON schema of a PATCH /v1/settings body, as strict as the validation: at least one known setting,
    by its canonical or its short name but not both, each within the bounds of LiveSettings (whole numbers also
    within LARGEST_INTEGER)."""
    properties = LiveSettings.model_json_schema(by_alias=True)["properties"]
    for schema in properties.values():
        # A change has no defaults (an absent setting keeps its value), and the names are their own titles.
        schema.pop("default", None)
        schema.pop("title", None)
        if schema.get("type") == "integer":
            schema["maximum"] = min(schema.get("maximum", LARGEST_INTEGER), LARGEST_INTEGER)
    shorts = {short: {**properties[name], "description": f"The short name of {name}."}
              for short, name in SHORT_NAMES.items()}
    return {"type": "object", "title": "Change", "properties": {**properties, **shorts},
            "additionalProperties": False, "minProperties": 1,
            "allOf": [{"not": {"required": [name, short]}} for short, name in SHORT_NAMES.items()],
            "examples": [{"dynamic_offload.gpu_memory_threshold": 0.8}]}


# ------------------------------------------------------------------------------ response bodies


class Health(BaseModel):
    status: str = "ok"


class EventBody(BaseModel):
    """One event of the hub, as in history bodies and WebSocket frames."""

    seq: int = Field(description="Position in the daemon's stream, from 1, increasing by 1 per event.")
    time: float = Field(description="When the daemon received it (epoch seconds).")
    kind: str = Field(description="One of " + ", ".join(EVENT_KINDS) + " (or 'gap' on a stream).")
    data: dict[str, Any]


class HistoryBody(BaseModel):
    events: list[EventBody]
    last_seq: int = Field(description="Pass it as `since` to get only what came after this answer.")


class StepSnapshot(BaseModel):
    step: int
    time: float
    metrics: dict[str, Any] = Field(description="verl's names -> number or null, e.g. actor/pg_loss, timing_s/gen.")


class OffloadSummary(BaseModel):
    """Offload copies of the last minute."""

    copy_latency_p50_s: float | None
    copy_latency_p99_s: float | None
    bandwidth_bytes_per_second: float | None = Field(description="Bytes copied / seconds spent copying.")
    copies: int


class LatestBody(BaseModel):
    seq: int
    step: StepSnapshot | None
    gpu: dict[str, Any] | None = Field(description="The latest GPU sample (nvml, gpus, host).")
    offload: OffloadSummary


class SettingsUpdateBody(BaseModel):
    """PATCH /v1/settings answer: the change is pending until the trainer acknowledges it.

    Asking for values already in effect changes nothing: `old` and `new` are empty and `version` is
    the current one.
    """

    version: int = Field(description="The settings version now in force (not bumped when nothing changed).")
    old: dict[str, Any] = Field(description="Each setting whose value changed -> its value before.")
    new: dict[str, Any] = Field(description="Each setting whose value changed -> its value now; empty: no change.")
    values: dict[str, Any] = Field(description="Every live setting -> its value now.")
    applies_at_step: int | None = Field(description="The first step that runs with the change (null: no change).")
    status: str = Field(description="'pending' until the trainer acknowledges the version; 'unchanged' when "
                                    "nothing changed.")


class SettingInfo(BaseModel):
    """One live setting as GET /v1/settings shows it."""

    name: str = Field(description="Its canonical name, the config key it starts from (dynamic_offload.enabled "
                                  "has none); PATCH /v1/settings and `verl set` take it.")
    short_name: str | None = Field(description="The short name PATCH /v1/settings and `verl set` take too "
                                               "(null: it has none).")
    value: Any
    applied_by: Literal["trainer", "daemon", "both"] = Field(description="Who acts on a change: the trainer "
                                                                         "at its next safe point, the daemon at once.")
    description: str


class SettingsBody(SettingsState):
    """GET /v1/settings: the settings' state and, per setting, who applies it and what it does."""

    settings: list[SettingInfo]


class ValidationProblem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorBody(BaseModel):
    detail: list[ValidationProblem]


class ErrorBody(BaseModel):
    detail: str


class HintsBody(BaseModel):
    """GET /v1/hints: what the advisor (api.advisor) reads off the run now; empty when nothing looks wrong."""

    time: float = Field(description="When the hints were computed (epoch seconds).")
    hints: list[str] = Field(description="Sentences for a user, most urgent first.")
