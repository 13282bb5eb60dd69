"""Host<->device copies: the copy streams, pinned host memory, and the log of every copy.

Each copy is timed with a pair of CUDA events recorded around it on its own stream. The events
are read only once they have completed (at drain time), so timing never makes the hot path wait.
On a CPU-only machine the "device" is the CPU: a copy is a plain copy timed by the host clock,
and the byte counts are the same as on a GPU.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

H2D, D2H = "h2d", "d2h"
# A drained batch of copies goes to the daemon in one IPC message (1 MiB at most); past this many
# records, further copies are folded into one record per (direction, group).
MAX_RECORDS_PER_DRAIN = 4096
# Copies whose events nobody drains (no telemetry attached) are forgotten past this many.
MAX_PENDING_RECORDS = 65536


def pinned_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 host buffer of exactly `nbytes`, page-locked when the compute device is a GPU.

    torch's pinned allocator rounds every request up to a power of two (a 13 GB arena would take
    16 GB), so large arenas are allocated as ordinary memory and registered with the driver.
    """
    if device.type != "cuda" or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    # Register whole pages that lie inside this allocation only, so that no other registration
    # can overlap it (the driver refuses overlapping ranges).
    page = 4096
    allocation = torch.empty(nbytes + 2 * page, dtype=torch.uint8)
    start = -allocation.data_ptr() % page
    buffer = allocation[start:start + nbytes]
    pointer, length = buffer.data_ptr(), -(-nbytes // page) * page
    error = int(torch.cuda.cudart().cudaHostRegister(pointer, length, 1))  # 1: cudaHostRegisterPortable
    if error != 0:
        raise RuntimeError(f"could not page-lock {nbytes} bytes of host memory for the offload engine "
                           f"(cudaError {error}); check the memory lock limit (ulimit -l) and free host memory")
    # Unregister before the memory can go back to the C allocator: the finalizer runs when the
    # buffer object dies, before the allocation it holds is released.
    weakref.finalize(buffer, _unregister, pointer)
    return buffer


def _unregister(pointer: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(pointer)
    except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may already be gone
        pass


@dataclass
class _Pending:
    direction: str
    group: str
    nbytes: int
    start: torch.cuda.Event | None
    end: torch.cuda.Event | None
    seconds: float | None = None


class CopyLog:
    """Every copy: direction, group, bytes, and (read lazily) its duration."""

    def __init__(self, cuda: bool, *, clock: Callable[[], float] = time.perf_counter):
        self.cuda = cuda
        self.clock = clock
        self._pending: deque[_Pending] = deque(maxlen=MAX_PENDING_RECORDS)
        self._events: list[torch.cuda.Event] = []
        self._lock = threading.Lock()
        self.totals: dict[tuple[str, str], int] = {}
        self.counts: dict[tuple[str, str], int] = {}

    def _event(self) -> torch.cuda.Event:
        with self._lock:
            if self._events:
                return self._events.pop()
        return torch.cuda.Event(enable_timing=True)

    def timed(self, direction: str, group: str, nbytes: int, stream: torch.cuda.Stream | None,
              copy: Callable[[], None]) -> torch.cuda.Event | None:
        """Run `copy` on `stream`, log it, and return the event that marks its end (None on CPU)."""
        key = (direction, group)
        with self._lock:
            self.totals[key] = self.totals.get(key, 0) + nbytes
            self.counts[key] = self.counts.get(key, 0) + 1
        if not self.cuda:
            started = self.clock()
            copy()
            self._pending.append(_Pending(direction, group, nbytes, None, None, self.clock() - started))
            return None
        start, end = self._event(), self._event()
        with torch.cuda.stream(stream):
            start.record(stream)
            copy()
            end.record(stream)
        self._pending.append(_Pending(direction, group, nbytes, start, end))
        return end

    def drain(self) -> list[dict]:
        """The copies completed since the last drain, oldest first; copies still in flight stay."""
        records: list[dict] = []
        folded: dict[tuple[str, str], dict] = {}
        while self._pending:
            pending = self._pending[0]
            if pending.seconds is None:
                if not pending.end.query():
                    break
                pending.seconds = pending.start.elapsed_time(pending.end) / 1e3
                with self._lock:
                    self._events += [pending.start, pending.end]
            self._pending.popleft()
            if len(records) < MAX_RECORDS_PER_DRAIN:
                records.append({"direction": pending.direction, "group": pending.group,
                                "bytes": pending.nbytes, "seconds": pending.seconds})
                continue
            entry = folded.setdefault((pending.direction, pending.group),
                                      {"direction": pending.direction, "group": pending.group,
                                       "bytes": 0, "seconds": 0.0})
            entry["bytes"] += pending.nbytes
            entry["seconds"] += pending.seconds
        return records + list(folded.values())


class CopyStreams:
    """The compute stream and two copy streams (one per direction, so the two can overlap).

    On the CPU all three are "no stream": copies run at once, and waits are no-ops.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None

    def compute(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def record_compute(self, event: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
        """An event at the compute stream's current position."""
        if not self.cuda:
            return None
        event = event or torch.cuda.Event()
        event.record(self.compute())
        return event

    def compute_waits(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            self.compute().wait_event(event)

    @staticmethod
    def stream_waits(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    def synchronize(self) -> None:
        if self.cuda:
            self.h2d.synchronize()
            self.d2h.synchronize()
