"""The daemon's copy of the live settings: current values, version numbers and the audit log.

A change is validated as a whole (trainer.config.live.apply_change: all or nothing) and gets
the next version number; the trainer applies it at its next safe point and acknowledges the
version with the step it applied at. Every accepted, rejected and applied change is one JSON
line of ``runs/<name>/settings_audit.jsonl``: time, version, old, new, source, result (and
problems or step). An accepted change takes effect only once its line is written, so the log
never misses one (a full disk refuses the change instead); a rejected value is kept as a short
excerpt. The current values go to every trainer that connects (`down_message`), so a change
outlives a trainer restart.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.schemas import LARGEST_INTEGER, SettingInfo, SettingsBody, SettingsNotSavedError
from trainer.config.live import (
    LIVE_SETTINGS,
    LiveSettings,
    SettingProblem,
    SettingsRejected,
    apply_change,
    canonical_change,
    canonical_name,
    named_twice,
)
from trainer.config.messages import SettingsMessage, SettingsState

log = logging.getLogger("verl.daemon.settings")
EXCERPT_CHARS = 80
"""How much of a rejected value or name the logs, the audit and the 422 answer keep."""
_WHOLE_NUMBER_SETTINGS = frozenset(setting.name for setting in LIVE_SETTINGS
                                   if LiveSettings.model_fields[setting.attribute].annotation is int)


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
        """Apply `change` (canonical or short name -> value) as a new version, or raise changing nothing:
        SettingsRejected naming every bad entry, or SettingsNotSavedError when the audit log cannot be written.

        `old` and `new` of the answer hold only the settings whose value changes, under their canonical names;
        when none does (every value asked for is already in effect), both are empty and the version stays as it is.
        """
        with self._lock:
            current = self._values.public()
            try:
                updated = checked_change(self._values, change)
            except SettingsRejected as rejected:
                self._audit_rejected(change, current, rejected, source)
                raise
            values = updated.public()
            changed = [name for name in canonical_change(change) if values[name] != current[name]]
            old, new = {name: current[name] for name in changed}, {name: values[name] for name in changed}
            if not changed:
                # Asking for the values already in effect: no version, nothing for the trainer, no audit line.
                return SettingsUpdate(self.version, old, new, values)
            result = SettingsUpdate(self.version + 1, old, new, values)
            try:
                self._audit({"version": result.version, "old": result.old, "new": result.new, "source": source,
                             "result": "accepted"})
            except OSError as error:
                log.warning("settings change not made: the audit log %s cannot be written (%s)", self.audit_path,
                            error)
                raise SettingsNotSavedError(
                    f"the change was not made: the settings audit log {self.audit_path} cannot be written ({error}); "
                    "free some disk space and send it again") from None
            self._values, self.version = updated, result.version
            self._changes[result.version] = result
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
                self._audit_or_warn({"version": version, "old": change.old, "new": change.new, "source": "trainer",
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
        fields = LiveSettings.model_fields
        return SettingsBody(**dict(state), settings=[
            SettingInfo(name=setting.name, short_name=setting.short, value=getattr(state.values, setting.attribute),
                        applied_by=setting.applied_by, description=fields[setting.attribute].description or "")
            for setting in LIVE_SETTINGS])

    def _audit_rejected(self, change: Any, current: dict[str, Any], rejected: SettingsRejected, source: str) -> None:
        asked = _as_asked(change) if isinstance(change, Mapping) else {}
        self._audit_or_warn({
            "version": None, "old": {name: current[name] for name in asked if name in current},
            "new": {excerpt(str(name)): _short(value) for name, value in asked.items()} if asked else _short(change),
            "source": source, "result": "rejected",
            "problems": [{"setting": problem.setting, "message": problem.message} for problem in rejected.problems]})

    def _audit_or_warn(self, entry: dict[str, Any]) -> None:
        """For what happened anyway (a rejection, a trainer's acknowledgement): a line lost is only warned about."""
        try:
            self._audit(entry)
        except OSError as error:
            log.warning("settings audit log %s: a %s line is lost (%s)", self.audit_path, entry["result"], error)

    def _audit(self, entry: dict[str, Any]) -> None:
        """Append one whole line, or nothing: a write cut short by a full disk is taken back, so the next line
        does not continue a broken one."""
        self.audit_path.parent.mkdir(parents=True, exist_ok=True)
        data = (json.dumps({"time": self._clock(), **entry}, default=repr) + "\n").encode()
        descriptor = os.open(self.audit_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.lseek(descriptor, 0, os.SEEK_END)
            try:
                written = 0
                while written < len(data):
                    written += os.write(descriptor, data[written:])
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(descriptor, end)
                raise
        finally:
            os.close(descriptor)


def checked_change(current: LiveSettings, change: Mapping[str, Any]) -> LiveSettings:
    """`current` with `change` applied, or SettingsRejected naming every bad entry at once: unknown names, a
    setting named twice and bad values alike (apply_change stops at unknown names), whole numbers beyond
    LARGEST_INTEGER (which no reader of the API's JSON holds), each rejected value and name cut to an excerpt.
    A known setting's problem names it by its canonical name, whichever name the change used."""
    if not isinstance(change, Mapping) or not change:
        return apply_change(current, change)  # raises: the body as a whole is wrong
    problems = named_twice(change)
    twice = {problem.setting for problem in problems}
    unknown = {name: value for name, value in change.items() if canonical_name(str(name)) is None}
    known = {canonical: _as_json_number(canonical, value) for name, value in change.items()
             if (canonical := canonical_name(str(name))) is not None and canonical not in twice}
    updated = current
    for part in (unknown, known):
        try:
            updated = apply_change(current, part) if part else updated
        except SettingsRejected as rejected:
            problems += rejected.problems
    named = {problem.setting for problem in problems}
    problems += [SettingProblem(name, f"got {excerpt(repr(value))}: too large; allowed: a whole number <= "
                                      f"{LARGEST_INTEGER}")
                 for name, value in known.items()
                 if name not in named and isinstance(value, int) and abs(value) > LARGEST_INTEGER]
    if problems:
        values = [value for name, value in change.items() if canonical_name(str(name)) in named or name in named]
        raise SettingsRejected([_shortened(problem, values) for problem in problems])
    return updated


def _as_json_number(name: str, value: Any) -> Any:
    """JSON has one kind of number: 4.0 is the whole number 4 (JSON Schema's "integer" takes it too)."""
    if name in _WHOLE_NUMBER_SETTINGS and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _shortened(problem: SettingProblem, values: list[Any]) -> SettingProblem:
    """The problem with its setting's name and the values it quotes cut to excerpts (apply_change and
    named_twice quote them whole)."""
    message = problem.message
    for value in values:
        quoted = repr(value)
        message = message.replace(quoted, excerpt(quoted), 1)
    return SettingProblem(excerpt(problem.setting), message)


def _as_asked(change: Mapping[str, Any]) -> dict[str, Any]:
    """A change as the audit log records it: known settings under their canonical names, but for a setting
    named twice, whose names stay as they were given (so both values are kept)."""
    twice = {problem.setting for problem in named_twice(change)}
    return {name if (canonical := canonical_name(str(name))) is None or canonical in twice else canonical: value
            for name, value in change.items()}


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """`text` cut to `limit` characters, saying how long it was, and safe to write as UTF-8 (a JSON body
    may hold lone surrogates, which would make the answer, the log and the audit log fail)."""
    safe = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(safe) <= limit:
        return safe
    return f"{safe[:limit]}... ({len(text)} characters)"


def _short(value: Any) -> Any:
    """A rejected value for the audit log: as it came when short, else an excerpt of its JSON."""
    text = json.dumps(value, default=repr)
    return value if len(text) <= EXCERPT_CHARS else excerpt(text)
