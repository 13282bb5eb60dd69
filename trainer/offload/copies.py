"""Host<->device copies: the copy streams, pinned host memory, and the log of every copy.

Every copy is counted (bytes and copies, per direction and group). A sample of them is timed with
a pair of CUDA events recorded around it on its own stream: about TIMED_COPIES_PER_DRAIN between
two drains (one in every `stride` copies of each direction and group, the stride set at each drain
from the number of copies since the last). The events are read only once they have completed (at
drain time), so timing never makes the hot path wait. The sample keeps telemetry's cost flat: a
7B step makes thousands of copies, and reading and reporting every one cost 30 ms a step on an
H200 host (benchmarks/telemetry_bench.py). On a CPU-only machine the "device" is the CPU: a copy
is a plain copy timed by the host clock, and the byte counts are the same as on a GPU.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy
import torch

H2D, D2H = "h2d", "d2h"
# A drained batch of copies goes to the daemon in one IPC message (1 MiB at most); past this many
# records, further copies are folded into one record per (direction, group).
MAX_RECORDS_PER_DRAIN = 4096
# Copies whose events nobody drains (no telemetry attached) are forgotten past this many.
MAX_PENDING_RECORDS = 65536
# About this many copies are timed between two drains (a drain comes once a training step).
TIMED_COPIES_PER_DRAIN = 64


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
    return torch.frombuffer(memory.data[start:start + nbytes], dtype=torch.uint8)


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
    """Every copy counted: direction, group, bytes; a sample of them timed (read lazily).

    `timed_per_drain` None times every copy (benchmarks that add up copy times set it so).
    """

    def __init__(self, cuda: bool, *, max_records: int = MAX_RECORDS_PER_DRAIN,
                 timed_per_drain: int | None = TIMED_COPIES_PER_DRAIN, clock: Callable[[], float] = time.perf_counter):
        self.cuda = cuda
        self.max_records = max_records
        self.timed_per_drain = timed_per_drain
        self.stride = 1
        """One copy in `stride` of each direction and group is timed (1 until the first drain)."""
        self.clock = clock
        self._pending: deque[_Pending] = deque(maxlen=MAX_PENDING_RECORDS)
        self._lock = threading.Lock()
        self.totals: dict[tuple[str, str], int] = {}
        self.counts: dict[tuple[str, str], int] = {}
        self._counts_drained: dict[tuple[str, str], int] = {}  # `counts` and `totals` at the last drain_counts
        self._totals_drained: dict[tuple[str, str], int] = {}

    def count(self, direction: str, group: str, nbytes: int) -> None:
        """A copy made where no event here can time it (FSDP2's of a gradient shard to the host): counted only."""
        key = (direction, group)
        with self._lock:
            self.totals[key] = self.totals.get(key, 0) + nbytes
            self.counts[key] = self.counts.get(key, 0) + 1

    def timed(self, direction: str, group: str, nbytes: int, stream: torch.cuda.Stream | None,
              copy: Callable[[], object]) -> torch.cuda.Event | None:
        """Run `copy` on `stream`, count it (time it if sampled), and return the event that marks
        its end (None on CPU)."""
        key = (direction, group)
        with self._lock:
            self.totals[key] = self.totals.get(key, 0) + nbytes
            count = self.counts[key] = self.counts.get(key, 0) + 1
            sampled = self.timed_per_drain is None or count % self.stride == 0
        if not self.cuda:
            if not sampled:
                copy()
                return None
            started = self.clock()
            copy()
            self._pending.append(_Pending(direction, group, nbytes, None, None, self.clock() - started))
            return None
        # Fresh events (creating one costs about a microsecond): the end event also orders the
        # compute after the copy, so it must not be recorded again for another copy.
        if not sampled:
            end = torch.cuda.Event()
            with torch.cuda.stream(stream):
                copy()
                end.record(stream)
            return end
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            copy()
            end.record(stream)
        self._pending.append(_Pending(direction, group, nbytes, start, end))
        return end

    def drain_counts(self) -> list[dict[str, Any]]:
        """Every copy since the last call, [{direction, group, copies, bytes}]; sets the next stride."""
        with self._lock:
            counts, totals = dict(self.counts), dict(self.totals)
        rows: list[dict[str, Any]] = [
            {"direction": key[0], "group": key[1], "copies": count - self._counts_drained.get(key, 0),
             "bytes": totals[key] - self._totals_drained.get(key, 0)}
            for key, count in counts.items() if count != self._counts_drained.get(key, 0)]
        self._counts_drained, self._totals_drained = counts, totals
        copies = sum(int(row["copies"]) for row in rows)
        if self.timed_per_drain is not None and copies:  # (no copies: nothing to go by, the stride stays)
            self.stride = max(1, -(-copies // self.timed_per_drain))
        return rows

    def drain(self, max_records: int | None = None) -> list[dict[str, Any]]:
        """The timed copies completed since the last drain, oldest first; copies still in flight stay.

        Past `max_records` (default: the log's), copies are folded into one record per
        (direction, group) holding their summed bytes and seconds.
        """
        limit = self.max_records if max_records is None else max_records
        records: list[dict[str, Any]] = []
        folded: dict[tuple[str, str], dict[str, Any]] = {}
        while self._pending:
            pending = self._pending[0]
            if pending.seconds is None:
                assert pending.start is not None and pending.end is not None
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
        stream = self.compute()
        if event is not None and stream is not None:
            stream.wait_event(event)

    @staticmethod
    def stream_waits(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    def synchronize(self) -> None:
        for stream in (self.h2d, self.d2h):
            if stream is not None:
                stream.synchronize()


@dataclass
class _Piece:
    """A reserved range of the staging region, and the task that lands what it holds."""

    start: int
    end: int
    task: Future[Any] | None = None


class StagingRing:
    """One pinned host region that gradients wait in until the engine's worker has landed them,
    handed out first in, first out, as a ring.

    Pieces of every size share the region: a head's 64 MiB gradient chunks can all be on their way
    while the worker still lands the first, where a few whole-block buffers would hold one chunk
    each (and the backward would wait for the worker between chunks: 25-30 ms of a 7B pass's
    backward on an H200, 2026-11-30). The worker lands in order, so the oldest piece is always the
    first to be freed: `take` waits for it only when the region is full.

    `take(nbytes)` gives a uint8 view, `hold_until(task)` ties the piece taken last to the task
    that lands it (waited for with `task.exception()`: a failure is raised where the engine awaits
    its tasks). The region is allocated at the first take.
    """

    def __init__(self, capacity: int, allocate: Callable[[int], torch.Tensor], alignment: int = 256):
        self.capacity = capacity
        self.alignment = alignment
        """Every piece starts at a multiple of this many bytes (the region's start is page-aligned)."""
        self._allocate = allocate
        self._region: torch.Tensor | None = None
        self._pieces: deque[_Piece] = deque()  # oldest first
        self._next = 0
        self.waits = 0
        """How many takes waited for the worker (a full region)."""

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.capacity - self.capacity % self.alignment:
            raise ValueError(f"a staged gradient piece of {nbytes} bytes is larger than the staging "
                             f"region ({self.capacity} bytes)")
        if self._pieces and self._pieces[-1].task is None:
            raise RuntimeError("StagingRing.take: the piece taken before has no task holding it")
        if self._region is None:
            self._region = self._allocate(self.capacity)
        # Rounded up to the alignment; an empty piece still holds its place in the order.
        reserved = max(-(-nbytes // self.alignment) * self.alignment, self.alignment)
        while (start := self._free_start(reserved)) is None:
            self.waits += 1
            oldest = self._pieces.popleft().task
            assert oldest is not None
            oldest.exception()
        self._pieces.append(_Piece(start, start + reserved))
        self._next = start + reserved
        return self._region[start:start + nbytes]

    def hold_until(self, task: Future[Any]) -> None:
        """The piece taken last stays reserved until `task` is done."""
        self._pieces[-1].task = task

    def _free_start(self, nbytes: int) -> int | None:
        """Where a piece of `nbytes` fits now, or None while the region is full."""
        while self._pieces and (task := self._pieces[0].task) is not None and task.done():
            self._pieces.popleft()
        if not self._pieces:
            return 0
        oldest = self._pieces[0].start
        if self._next > oldest:
            # Free: from the newest piece's end to the region's end, then from its start to the oldest.
            if self.capacity - self._next >= nbytes:
                return self._next
            return 0 if oldest >= nbytes else None
        # Wrapped (full when the newest piece ends where the oldest starts): free up to the oldest.
        return self._next if oldest - self._next >= nbytes else None

    def reset(self) -> None:
        """Forget every piece: nothing may still copy into them or land from them."""
        self._pieces.clear()
        self._next = 0

    def clear(self) -> None:
        """`reset`, and give the region back."""
        self.reset()
        self._region = None
