"""The trainer's side of the daemon's control: live settings, checkpoint and stop requests, heartbeats, signals.

The daemon sends control messages down the telemetry link (trainer/telemetry.py); `Control` takes them at the
loop's safe point between steps. With several ranks that safe point is a collective: rank 0 holds the daemon's
connection and broadcasts what arrived, every rank applies it at the same step, and a stop any rank was signalled
stops all of them.

Live settings reach the rest of the trainer through one subscription (`SettingsFeed`): the memory manager, the
reporter's log level and anything else that acts on a setting subscribes, and is called with every new value.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable
from typing import Protocol

from trainer.config.live import LiveSettings
from trainer.config.messages import (
    CheckpointNowMessage,
    DownMessage,
    HeartbeatMessage,
    Phase,
    PhaseMessage,
    SettingsAckMessage,
    SettingsMessage,
    StopMessage,
    UpMessage,
)
from trainer.distributed.ranks import Ranks

HEARTBEAT_INTERVAL_S = 1.0
"""Heartbeats go to the daemon at most this often; the daemon restarts a trainer silent for daemon.hang_timeout_s."""
INITIAL_SETTINGS_TIMEOUT_S = 5.0
"""How long a starting trainer waits for the daemon's current live settings."""


class TelemetryLink(Protocol):
    """The trainer's side of the daemon connection (trainer/telemetry.py): never blocks."""

    def send(self, message: UpMessage) -> None: ...

    def poll(self) -> list[DownMessage]: ...


class SettingsFeed:
    """The run's live settings as they change: every part of the trainer that acts on one subscribes here."""

    def __init__(self, initial: LiveSettings):
        self.current = initial
        self._subscribers: list[Callable[[LiveSettings], None]] = []

    def subscribe(self, subscriber: Callable[[LiveSettings], None]) -> None:
        """Call `subscriber` with every change from here on (`current` holds the settings now)."""
        self._subscribers.append(subscriber)

    def publish(self, settings: LiveSettings) -> None:
        self.current = settings
        for subscriber in self._subscribers:
            subscriber(settings)


class Control:
    """What the daemon asks of the run, taken at safe points; the heartbeat and the phase it is in, sent up."""

    def __init__(self, telemetry: TelemetryLink | None, ranks: Ranks, settings: SettingsFeed,
                 completed_steps: Callable[[], int]):
        self.telemetry = telemetry
        self.ranks = ranks
        self.settings = settings
        self.stop_requested = threading.Event()
        self.checkpoint_requested = False
        self._stop_agreed = False  # several ranks: the stop they agreed on at the last safe point
        self._heartbeat_at = -math.inf
        self._completed_steps = completed_steps  # what a heartbeat, a phase or an acknowledgement names is the next

    def send(self, message: UpMessage) -> None:
        if self.telemetry is not None:
            self.telemetry.send(message)

    def take_messages(self) -> None:
        """The safe point between steps: apply live settings, note checkpoint and stop requests (on several ranks,
        a collective)."""
        if self.telemetry is None and not self.ranks.distributed:
            return
        self.heartbeat()
        for message in self._agreed(self.telemetry.poll() if self.telemetry is not None else []):
            self._dispatch(message)
        if self.ranks.distributed:
            stop = self.ranks.reduce_many([float(self.stop_requested.is_set())], "max")[0]
            if stop:
                self.stop_requested.set()
            self._stop_agreed = bool(stop)

    def stopping(self) -> bool:
        """Whether the loop stops now: on several ranks, what they agreed at the last safe point (a signal arriving
        since must not stop one rank a step before the others)."""
        return self._stop_agreed if self.ranks.distributed else self.stop_requested.is_set()

    def receive_initial_settings(self, timeout_s: float = INITIAL_SETTINGS_TIMEOUT_S) -> bool:
        """Wait (once, before the first step) for the daemon's current settings, so a change made before a restart
        holds from the restarted trainer's first step. False if a daemon is there but sent none (on several ranks
        rank 0 waits and every rank applies what it received)."""
        received: list[DownMessage] = []
        waiting = self.telemetry is not None and self.ranks.is_main
        deadline = time.monotonic() + timeout_s
        while waiting and self.telemetry is not None and time.monotonic() < deadline:
            messages = self.telemetry.poll()
            received += messages
            if not self.ranks.distributed:
                for message in messages:
                    self._dispatch(message)
            if any(isinstance(message, SettingsMessage) for message in messages):
                break
            time.sleep(0.01)
        if self.ranks.distributed:
            for message in self._agreed(received):
                self._dispatch(message)
        answered = not waiting or any(isinstance(message, SettingsMessage) for message in received)
        return bool(self.ranks.broadcast_from_main(answered))

    def apply_live_settings(self, version: int, values: LiveSettings) -> None:
        """Take the daemon's settings from the next step on, and acknowledge with that step (on several ranks,
        every rank calls this at the same safe point: rank 0 acknowledges once all have applied)."""
        self.settings.publish(values)
        self.ranks.barrier()
        if self.ranks.is_main:
            self.send(SettingsAckMessage(version=version, step=self._completed_steps() + 1, values=values))

    def heartbeat(self) -> None:
        """Tell the daemon this thread is making progress (at most every HEARTBEAT_INTERVAL_S): call it from the
        loop and from inside long phases, never from another thread (it would hide a hang)."""
        now = time.monotonic()
        if self.telemetry is not None and now - self._heartbeat_at >= HEARTBEAT_INTERVAL_S:
            self._heartbeat_at = now
            self.telemetry.send(HeartbeatMessage(step=self._completed_steps() + 1))

    def phase_started(self, name: str) -> None:
        """The step timer's callback: the daemon shows which phase of the next step runs."""
        if name != "step":  # the timer's whole-step span, not a phase
            self.send(PhaseMessage(step=self._completed_steps() + 1, phase=Phase(name)))

    def request_stop(self) -> None:
        """Checkpoint at the end of the current step and return from fit(). Safe from a signal handler."""
        self.stop_requested.set()

    def install_signal_handlers(self) -> Callable[[], None]:
        """SIGTERM and SIGINT ask for a stop at the next safe point; returns the function that puts the previous
        handlers back. Call it when training ends: a handler is a reference from the interpreter to this trainer,
        whose sharded models hold the process groups, and a group still alive when the interpreter finalizes can
        abort the process (its gloo threads then drop tensors without a live interpreter)."""
        previous = {signum: signal.signal(signum, lambda *_: self.request_stop())
                    for signum in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return restore

    def _agreed(self, messages: list[DownMessage]) -> list[DownMessage]:
        """Rank 0's messages on every rank (another rank's own connection only reports: what its daemon sends it is
        dropped)."""
        return self.ranks.broadcast_from_main(messages if self.ranks.is_main else [])

    def _dispatch(self, message: DownMessage) -> None:
        if isinstance(message, SettingsMessage):
            self.apply_live_settings(message.version, message.values)
        elif isinstance(message, CheckpointNowMessage):
            self.checkpoint_requested = True
        elif isinstance(message, StopMessage):
            self.request_stop()
