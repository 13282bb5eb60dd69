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

import numpy
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
    memory = numpy.empty(nbytes + 2 * page, dtype=numpy.uint8)
    start = -memory.ctypes.data % page
    pointer, length = memory.ctypes.data + start, -(-nbytes // page) * page
    error = int(torch.cuda.cudart().cudaHostRegister(pointer, length, 1))  # 1: cudaHostRegisterPortable
    if error != 0:
        raise RuntimeError(f"could not page-lock {nbytes} bytes of host memory for the offload engine "
                           f"(cudaError {error}); check the memory lock limit (ulimit -l) and free host memory")
    # The tensor's storage holds `memory` through the memoryview, and so does every view of it:
    # the memory is unregistered only once nothing can reach it any more, just before it is freed.
    weakref.finalize(memory, _unregister, pointer)
    return torch.frombuffer(memoryview(memory)[start:start + nbytes], dtype=torch.uint8)


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

    def __init__(self, cuda: bool, *, max_records: int = MAX_RECORDS_PER_DRAIN,
                 clock: Callable[[], float] = time.perf_counter):
        self.cuda = cuda
        self.max_records = max_records
        self.clock = clock
        self._pending: deque[_Pending] = deque(maxlen=MAX_PENDING_RECORDS)
        self._lock = threading.Lock()
        self.totals: dict[tuple[str, str], int] = {}
        self.counts: dict[tuple[str, str], int] = {}

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
        # Fresh events (creating one costs about a microsecond): the end event also orders the
        # compute after the copy, so it must not be recorded again for another copy.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            copy()
            end.record(stream)
        self._pending.append(_Pending(direction, group, nbytes, start, end))
        return end

    def drain(self, max_records: int | None = None) -> list[dict]:
        """The copies completed since the last drain, oldest first; copies still in flight stay.

        Past `max_records` (default: the log's), copies are folded into one record per
        (direction, group) holding their summed bytes and seconds.
        """
        limit = self.max_records if max_records is None else max_records
        records: list[dict] = []
        folded: dict[tuple[str, str], dict] = {}
        while self._pending:
            pending = self._pending[0]
            if pending.seconds is None:
                if not pending.end.query():
                    break
                pending.seconds = pending.start.elapsed_time(pending.end) / 1e3
            self._pending.popleft()
            if len(records) < limit:
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
