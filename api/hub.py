"""The daemon's bounded telemetry history and its live fan-out to WebSocket subscribers.

Everything the daemon learns (GPU samples, step metrics, phases, offload copies, settings, restarts)
is published once as an `Event` with an increasing sequence number. The hub keeps the last
`history_seconds` (at most `max_events`) for monitors that attach late and for `?since=` resumes,
and hands each new event to every live subscriber without ever waiting for one.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import json
import math
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from trainer.config.messages import CopyCount, CopySample, OffloadMessage, StepMessage, to_json

OFFLOAD_WINDOW_SECONDS = 60.0

MESSAGE_ENVELOPE = {"data": {"type", "time"}}
"""The fields of a trainer's message that its event leaves out (see Event.to_json)."""

EventData = BaseModel | dict[str, Any]
"""What an event carries: the trainer's message as the daemon received it (step, phase, offload), a
model the daemon built (settings, status), or a plain dict (GPU samples, logs, restarts)."""


@dataclass(frozen=True)
class Event:
    """One thing the daemon learned; `seq` orders the whole stream (1, 2, 3, ...)."""

    seq: int
    time: float
    kind: str
    data: EventData = field(hash=False)

    def as_dict(self) -> dict[str, Any]:
        """The event as plain data, exactly as a client decodes it from `to_json`."""
        decoded: dict[str, Any] = json.loads(self._json)
        return decoded

    def to_json(self) -> str:
        """The event as a JSON object (NaN and infinities become null: JSON has neither)."""
        return self._json

    @functools.cached_property
    def _json(self) -> str:
        # Encoded once, however many stream clients receive it (50 followers of a fast run made the
        # encoding the daemon's largest cost). An event's data is not changed after it is published.
        # A trainer's message goes out without its `type` (the event's kind says it) and its `time`
        # (the event's own time is when the daemon received it).
        exclude = MESSAGE_ENVELOPE if isinstance(self.data, BaseModel) else None
        return to_json({"seq": self.seq, "time": self.time, "kind": self.kind, "data": self.data},
                       exclude=exclude).decode()


class OffloadWindow:
    """Offload copies of the last `window_seconds`: latency percentiles and copy bandwidth.

    The trainer times a sample of its copies (CopySample, CUDA-event timed) and counts all of them
    (CopyCount): percentiles and bandwidth come from the sample, the number of copies from the counts.
    """

    def __init__(self, *, window_seconds: float = OFFLOAD_WINDOW_SECONDS, clock: Callable[[], float] = time.time):
        self.window_seconds = window_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._copies: collections.deque[tuple[float, float, int]] = collections.deque()  # (time, seconds, bytes)
        self._counted: collections.deque[tuple[float, int]] = collections.deque()  # (time, copies)

    def add(self, copies: Iterable[CopySample], counts: Iterable[CopyCount] | None = None) -> None:
        """Timed `copies`; `counts` of every copy they were sampled from (None: the copies are all of them)."""
        now = self._clock()
        with self._lock:
            before = len(self._copies)
            self._copies.extend((now, copy.seconds, copy.bytes) for copy in copies)
            counted = len(self._copies) - before if counts is None else sum(count.copies for count in counts)
            self._counted.append((now, counted))
            self._prune(now)

    def percentile(self, q: float) -> float | None:
        """The q-th percentile (0 to 100) of copy durations in seconds, linearly interpolated; None when empty."""
        if not 0 <= q <= 100:
            raise ValueError(f"percentile must be between 0 and 100, got {q}")
        durations = sorted(seconds for _, seconds, _ in self._window())
        if not durations:
            return None
        position = (len(durations) - 1) * q / 100
        below = math.floor(position)
        above = min(below + 1, len(durations) - 1)
        return durations[below] + (durations[above] - durations[below]) * (position - below)

    def bandwidth_bytes_per_second(self) -> float | None:
        """Bytes copied per second spent copying (what the link achieves), None when nothing was timed."""
        window = self._window()
        seconds = sum(seconds for _, seconds, _ in window)
        return sum(size for _, _, size in window) / seconds if seconds > 0 else None

    def summary(self) -> dict[str, float | int | None]:
        with self._lock:
            self._prune(self._clock())
            copies = sum(counted for _, counted in self._counted)
        return {"copy_latency_p50_s": self.percentile(50), "copy_latency_p99_s": self.percentile(99),
                "bandwidth_bytes_per_second": self.bandwidth_bytes_per_second(), "copies": copies}

    def _window(self) -> list[tuple[float, float, int]]:
        with self._lock:
            self._prune(self._clock())
            return list(self._copies)

    def _prune(self, now: float) -> None:
        while self._copies and self._copies[0][0] < now - self.window_seconds:
            self._copies.popleft()
        while self._counted and self._counted[0][0] < now - self.window_seconds:
            self._counted.popleft()


class TelemetryHub:
    """Bounded history plus live fan-out; safe to publish from any thread.

    History keeps the events of the last `history_seconds`, at most `max_events` of them. `latest`
    remembers the newest event of each kind even after it has aged out of the history (a run between
    steps still shows its last step). The hub also feeds "offload" events' copies to `offload`, the
    rolling window behind the latency percentiles.
    """

    def __init__(self, *, history_seconds: float, max_events: int = 100_000, clock: Callable[[], float] = time.time,
                 subscriber_queue_size: int = 1024):
        if history_seconds <= 0 or max_events < 1 or subscriber_queue_size < 1:
            raise ValueError("history_seconds, max_events and subscriber_queue_size must be positive")
        self.history_seconds = history_seconds
        self.max_events = max_events
        self.subscriber_queue_size = subscriber_queue_size
        self.clock = clock
        self.offload = OffloadWindow(clock=clock)
        self._lock = threading.Lock()
        self._history: collections.deque[Event] = collections.deque()
        self._latest: dict[str, Event] = {}
        self._last_seq = 0
        self._subscriptions: weakref.WeakSet[Subscription] = weakref.WeakSet()

    @property
    def last_seq(self) -> int:
        return self._last_seq

    @property
    def first_seq(self) -> int:
        """The oldest seq still in the history (last_seq + 1 when it is empty)."""
        with self._lock:
            self._prune(self.clock())
            return self._history[0].seq if self._history else self._last_seq + 1

    def publish(self, kind: str, data: EventData) -> Event:
        with self._lock:
            self._last_seq += 1
            event = Event(self._last_seq, self.clock(), kind, data)
            self._history.append(event)
            self._latest[kind] = event
            self._prune(event.time)
            subscriptions = list(self._subscriptions)
        if isinstance(data, OffloadMessage):
            self.offload.add(data.copies, data.counts)
        for subscription in subscriptions:
            subscription._offer(event)
        return event

    def since(self, seq: int = 0, *, kinds: Collection[str] | None = None,
              keys: Collection[str] | None = None) -> list[Event]:
        """Events with seq > `seq`, oldest first; `kinds` keeps those kinds, `keys` those step metrics."""
        with self._lock:
            self._prune(self.clock())
            # Seqs in the history are consecutive, so the first wanted one sits at a known offset.
            start = max(0, seq + 1 - self._history[0].seq) if self._history else 0
            events = list(itertools.islice(self._history, start, None))
        if kinds is not None:
            events = [event for event in events if event.kind in kinds]
        if keys is not None:
            events = [_only_keys(event, event.data, keys) if isinstance(event.data, StepMessage) else event
                      for event in events]
        return events

    def latest(self, kind: str) -> Event | None:
        with self._lock:
            return self._latest.get(kind)

    def subscribe(self, since: int | None = None) -> Subscription:
        """Live events from now on, after replaying those with seq > `since` (None: no replay; 0: the
        whole history, however far back it reaches now).

        Use as `async with hub.subscribe(since) as events: async for event in events: ...` (from a
        coroutine: the subscription belongs to the running event loop). A subscriber that falls more
        than `subscriber_queue_size` events behind receives a "gap" event and then resumes from the
        history, so it misses only what has already aged out of it; publish never waits for it.
        """
        return Subscription(self, since)

    def _register(self, subscription: Subscription, since: int | None) -> tuple[int, list[Event], int]:
        """Register a subscriber: (seq it starts after, events to replay, asked-for events no longer kept).

        A `since` beyond the last seq (a stream from another daemon) counts as "from now". `since=0` (a
        client that has seen nothing yet, as the live page on its first load) has lost nothing, however
        much has aged out of the history before it came.
        """
        with self._lock:
            self._subscriptions.add(subscription)
            start = self._last_seq if since is None else min(since, self._last_seq)
        if since is None:
            return start, [], 0
        # Events published meanwhile reach both the replay and the queue; the subscriber skips repeats.
        replay, lost = self._replay_after(start)
        return start, replay, lost if since > 0 else 0

    def _replay_after(self, seq: int) -> tuple[list[Event], int]:
        events = self.since(seq)
        first = events[0].seq if events else self._last_seq + 1
        return events, max(0, first - seq - 1)

    def _unregister(self, subscription: Subscription) -> None:
        with self._lock:
            self._subscriptions.discard(subscription)

    def _prune(self, now: float) -> None:
        history = self._history
        while len(history) > self.max_events:
            history.popleft()
        oldest_kept = now - self.history_seconds
        while history and history[0].time < oldest_kept:
            history.popleft()


def _only_keys(event: Event, step: StepMessage, keys: Collection[str]) -> Event:
    metrics = {key: value for key, value in step.metrics.items() if key in keys}
    return Event(event.seq, event.time, event.kind, step.model_copy(update={"metrics": metrics}))


class Subscription:
    """An async iterator over a hub's events for one subscriber (see TelemetryHub.subscribe)."""

    def __init__(self, hub: TelemetryHub, since: int | None):
        self._hub = hub
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue(maxsize=hub.subscriber_queue_size)
        self._overflowed = False
        self._closed = False
        self._last, replay, lost = hub._register(self, since)
        self._pending: collections.deque[Event] = collections.deque(replay)
        if lost:
            self._pending.appendleft(self._gap(lost, "asked for events no longer kept in the history"))

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Event:
        while not self._closed:
            if self._pending:  # replayed from the history: in order, any hole announced by a gap event
                event = self._pending.popleft()
            elif self._overflowed:
                self._resync(always_mark_gap=True, reason="subscriber fell behind")
                continue
            else:
                event = await self._queue.get()
                if event.seq > self._last + 1:
                    # An earlier event is still on its way (published from another thread, its delivery
                    # waits in the loop's queue): take both, in order, from the history instead.
                    self._resync(always_mark_gap=False, reason="events no longer kept in the history")
                    continue
            if event.kind == "gap":
                return event
            if event.seq <= self._last:  # already delivered by a replay
                continue
            self._last = event.seq
            return event
        raise StopAsyncIteration

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        self._hub._unregister(self)

    def _offer(self, event: Event) -> None:
        """Called by publish from any thread; never blocks."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._enqueue(event)
            return
        try:
            self._loop.call_soon_threadsafe(self._enqueue, event)
        except RuntimeError:  # the subscriber's loop is closed: nobody will read this again
            self._hub._unregister(self)

    def _enqueue(self, event: Event) -> None:
        if self._overflowed:
            return  # the subscriber will read these from the history
        if self._queue.full():
            self._overflowed = True
            return
        self._queue.put_nowait(event)

    def _resync(self, *, always_mark_gap: bool, reason: str) -> None:
        """Continue from the history after the last event delivered; the queue's events are all in it."""
        while not self._queue.empty():
            self._queue.get_nowait()
        self._overflowed = False
        replay, lost = self._hub._replay_after(self._last)
        if lost or always_mark_gap:
            self._pending.append(self._gap(lost, reason))
        self._pending.extend(replay)

    def _gap(self, lost: int, reason: str) -> Event:
        """Marks a discontinuity; its seq is the last one delivered before it, so resuming from it is safe."""
        return Event(self._last, self._hub.clock(), "gap", {"after_seq": self._last, "lost": lost, "reason": reason})


