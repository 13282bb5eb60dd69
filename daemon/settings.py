"""The daemon's copy of the live settings: current values, version numbers and the audit log.

A change is validated as a whole (trainer.config.live.apply_change: all or nothing) and gets
the next version number; the trainer applies it at its next safe point and acknowledges the
version with the step it applied at. Every accepted, rejected and applied change is one JSON
line of ``runs/<name>/settings_audit.jsonl``: time, version, old, new, source, result (and
problems or step). The current values go to every trainer that connects (`down_message`), so
a change outlives a trainer restart.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.schemas import SettingInfo, SettingsBody
from trainer.config.live import (
    APPLIED_BY,
    SETTING_NAMES,
    LiveSettings,
    SettingsRejected,
    apply_change,
)
from trainer.config.messages import SettingsMessage, SettingsState


@dataclass(frozen=True)
class SettingsUpdate:
    """An accepted change: its version, the changed settings before and after, and every value now.

    `new` is empty when the change asked only for values already in effect: then `version` is the
    current one (no new version was made).
    """

    version: int
    old: dict[str, Any]
    new: dict[str, Any]
    values: dict[str, Any]

    @property
    def changed(self) -> bool:
        """Whether any value changed (else: no new version, nothing to send to the trainer)."""
        return bool(self.new)


class SettingsStore:
    """Thread-safe: the API may call `update` from a worker thread while IPC acknowledges on the loop."""

    def __init__(self, initial: LiveSettings, *, audit_path: Path, clock: Callable[[], float] = time.time):
        self._values = initial
        self.version = 0
        self.acknowledged_version = 0
        self.applied_at_step: int | None = None
        self.audit_path = Path(audit_path)
        self._clock = clock
        self._changes: dict[int, SettingsUpdate] = {}
        self._lock = threading.Lock()

    @property
    def values(self) -> LiveSettings:
        return self._values

    def update(self, change: Mapping[str, Any], *, source: str = "api") -> SettingsUpdate:
        """Apply `change` (public name -> value) as a new version, or raise SettingsRejected changing nothing.

        `old` and `new` of the answer hold only the settings whose value changes; when none does (every
        value asked for is already in effect), both are empty and the version stays as it is.
        """
        with self._lock:
            current = self._values.public()
            try:
                updated = apply_change(self._values, change)
            except SettingsRejected as rejected:
                known = {name: current[name] for name in change if name in current} if isinstance(change, Mapping) \
                    else {}
                self._audit({"version": None, "old": known, "new": dict(change) if isinstance(change, Mapping)
                             else change, "source": source, "result": "rejected",
                             "problems": [{"setting": problem.setting, "message": problem.message}
                                          for problem in rejected.problems]})
                raise
            values = updated.public()
            changed = [name for name in change if values[name] != current[name]]
            old, new = {name: current[name] for name in changed}, {name: values[name] for name in changed}
            if not changed:
                # Asking for the values already in effect: no version, nothing for the trainer, no audit line.
                return SettingsUpdate(self.version, old, new, values)
            self._values = updated
            self.version += 1
            result = SettingsUpdate(self.version, old, new, values)
            self._changes[self.version] = result
            self._audit({"version": result.version, "old": result.old, "new": result.new, "source": source,
                         "result": "accepted"})
            return result

    def acknowledge(self, version: int, step: int) -> SettingsUpdate | None:
        """The trainer runs `version` from `step` on; returns that version's change when it was news."""
        with self._lock:
            if version > self.version:
                return None
            news = version > self.acknowledged_version
            self.acknowledged_version = max(self.acknowledged_version, version)
            self.applied_at_step = step
            change = self._changes.get(version)
            if change is not None:
                # Logged on every acknowledgement, so a re-application after a trainer restart shows too.
                self._audit({"version": version, "old": change.old, "new": change.new, "source": "trainer",
                             "result": "applied", "step": step})
            return change if news else None

    def down_message(self) -> SettingsMessage:
        """The IPC message that brings a trainer up to date."""
        with self._lock:
            return SettingsMessage(version=self.version, values=self._values)

    def state(self) -> SettingsState:
        """The "settings" event data and the settings part of /v1/status."""
        with self._lock:
            return SettingsState(version=self.version, values=self._values,
                                 acknowledged_version=self.acknowledged_version, applied_at_step=self.applied_at_step)

    def describe(self) -> SettingsBody:
        """GET /v1/settings: the state plus, per setting, who applies it and what it means."""
        state = self.state()
        values = state.values.public()
        fields = {field.alias or name: field for name, field in LiveSettings.model_fields.items()}
        return SettingsBody(**dict(state), settings=[
            SettingInfo(name=name, value=values[name], applied_by=APPLIED_BY[name],
                        description=fields[name].description or "") for name in SETTING_NAMES])

    def _audit(self, entry: dict[str, Any]) -> None:
        self.audit_path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"time": self._clock(), **entry}, default=repr)
        with self.audit_path.open("a", encoding="utf-8") as file:
            file.write(line + "\n")
