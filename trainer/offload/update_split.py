"""Which offloaded units an optimizer step updates on the device and which on the host's cores
(fsdp_config.optimizer_update: both).

The two updates use different resources: the device path (device_update.py) is bound by the bus, 14 bytes a
parameter each way; the host path by the host's cores and memory. On the H200 machine the 3B actor's update took
1.0 s on the device path and about 1.45 s on the host path (benchmarks/README.md, 2026-12-02 08:25-08:40 UTC), so
the two at once on disjoint units should take about 0.6 s. Each step the split gives each unit, in forward order,
to the path that would finish it first, from each path's seconds per element: an exponential moving average of
what the previous steps measured, starting from guesses (the bus's bandwidth for the device, a conservative
figure for the host). With the estimates right, the step's longer path never takes longer than either path
alone would: a unit goes to the host only when that ends before the device would end with it, and back.

Ending early is worth nothing when the reads that need the update come later: a delayed update's next reader is
the next step's update, after the whole rollout; a critic's, the next step's values. The engine learns that
window (from its plan to the first read needing the update) and the split then gives the host what it ends
within most of it, and the device only the rest: the device path's bytes (its states up and down) are the
bus time the step's other copies wait behind (the 3B PPO step at a 12 GiB cap was within 1% of its PCIe floor,
2026-12-04, with the critic's and the actor's updates split to end early).

The split is plain arithmetic over the measurements it is given (no clock, no threads): the engine times each
unit's update and hands the timings over at the next step, but the first step's: that one makes and page-locks
the states (a 7B actor's first update took 36 s on the H200 machine, 2026-12-04, against 1-2 s after), and
learned from it the host's estimate was still 1.35 ns an element two steps later where the host measured 0.87,
so the split gave the host 18% of the elements where about 28% would have ended both paths together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

UpdatePath = Literal["device", "host"]
UpdateMode = Literal["cpu", "gpu", "both"]
"""Where an offloaded optimizer's update runs (fsdp_config.optimizer_update once "auto" is resolved): the host's
cores, the compute device over states streamed through it, or both at once on disjoint units (UpdateSplit)."""
PATHS: tuple[UpdatePath, UpdatePath] = ("device", "host")

DEVICE_GUESS_BANDWIDTH = 50e9
"""Bytes a second the first device estimate assumes each way (pinned copies on an H200 reach ~52 GB/s each way,
and the update's two directions run at once)."""
HOST_GUESS_SECONDS_PER_ELEMENT = 1e-9
"""The first host estimate: about twice what the H200 machine's 16 cores measured (1.45 s for 3B parameters,
0.48 ns an element), so that the first step leans on the device path, whose speed the bus bounds."""
WINDOW_SHARE = 0.75
"""The share of the learned window (the seconds from a step's plan to the first read that needs its updates) the
host path may fill: what is left is the margin for a window shorter than the last ones, or a host slower."""
SMOOTHING = 0.5
"""The weight of the newest step's measurement in each path's moving average: a change of load (the critic's
update beside the actor's) shows within a couple of steps, one noisy step moves the split halfway."""


@dataclass(frozen=True)
class UpdateTiming:
    """One unit's update as it ran: its path, the elements it updated, the seconds it took."""

    path: UpdatePath
    elements: int
    seconds: float


@dataclass
class UpdateSplit:
    """Assigns each unit of an optimizer step to the device path or the host path so that both end together."""

    seconds_per_element: dict[UpdatePath, float]
    """Each path's estimate, learned from the steps so far."""
    smoothing: float = SMOOTHING
    last_assignment: list[UpdatePath] = field(default_factory=list)
    last_host_share: float | None = None
    """The share of the last assignment's elements that went to the host (None: none yet, or no elements)."""
    window: float | None = None
    """Seconds from a step's plan to the first read that needed its updates, learned (None: not yet)."""
    window_share: float = field(default_factory=lambda: WINDOW_SHARE)
    """(Read when the split is made: e2e_bench's `_balanced` variants set WINDOW_SHARE to 0, no window.)"""
    measured: set[UpdatePath] = field(default_factory=set)
    """The paths measured at least once: a path's first measurement replaces its guess instead of moving it
    halfway (a guess off by 3x would take a few steps to wear off, each with a lopsided split)."""

    def __post_init__(self) -> None:
        if set(self.seconds_per_element) != set(PATHS) or min(self.seconds_per_element.values()) <= 0:
            raise ValueError(f"UpdateSplit needs a positive seconds per element for each of {PATHS}, "
                             f"got {self.seconds_per_element}")
        if not 0 <= self.smoothing <= 1:
            raise ValueError(f"UpdateSplit's smoothing is the weight of a new measurement, from 0 to 1, "
                             f"got {self.smoothing}")

    @classmethod
    def guessed(cls, device_bytes_each_way: int, *, bandwidth: float = DEVICE_GUESS_BANDWIDTH,
                host_seconds_per_element: float = HOST_GUESS_SECONDS_PER_ELEMENT,
                smoothing: float = SMOOTHING) -> UpdateSplit:
        """A split before any measurement: the device path at `bandwidth` for the bytes an element moves each
        way (both ways at once), the host path at a conservative figure."""
        return cls({"device": device_bytes_each_way / bandwidth, "host": host_seconds_per_element}, smoothing)

    def assign(self, elements: Sequence[int]) -> list[UpdatePath]:
        """The path of each unit (`elements`: each unit's elements to update, in the order they are updated).
        Units keep their order within each path, which runs them one after the other.

        Balanced: each unit goes to the path whose queue, with it added, ends first (the device on a tie), so the
        update ends as early as the two paths allow. But when the reads that need the update come later than
        that (the learned `window`: a delayed update runs through the next rollout, a critic's through the
        actor's update and the rollout), an early end buys nothing, and each element the device path updates
        crosses the bus twice (its states up and down, bytes the step's other copies wait behind). Then the
        host takes units in order while its queue ends within `window_share` of the window, and the device the
        rest: never a later end than the balanced split's, never more on the device."""
        balanced = self._balanced(elements)
        makespan = max(self.predicted_seconds(elements, balanced).values(), default=0.0)
        budget = self.window * self.window_share if self.window is not None else 0.0
        assignment = balanced
        if budget > makespan:
            host_first = self._host_first(elements, budget)
            if _on_device(elements, host_first) < _on_device(elements, balanced):
                assignment = host_first
        self.last_assignment = assignment
        total = sum(elements)
        if total:
            self.last_host_share = 1 - _on_device(elements, assignment) / total
        return assignment

    def _balanced(self, elements: Sequence[int]) -> list[UpdatePath]:
        ends: dict[UpdatePath, float] = {"device": 0.0, "host": 0.0}
        assignment: list[UpdatePath] = []
        for count in elements:
            device_end = ends["device"] + count * self.seconds_per_element["device"]
            host_end = ends["host"] + count * self.seconds_per_element["host"]
            path: UpdatePath = "device" if device_end <= host_end else "host"
            ends[path] = device_end if path == "device" else host_end
            assignment.append(path)
        return assignment

    def _host_first(self, elements: Sequence[int], budget: float) -> list[UpdatePath]:
        """The host takes each unit whose update ends within `budget` on its queue; the device the others."""
        host_end = 0.0
        assignment: list[UpdatePath] = []
        for count in elements:
            seconds = count * self.seconds_per_element["host"]
            if host_end + seconds <= budget:
                host_end += seconds
                assignment.append("host")
            else:
                assignment.append("device")
        return assignment

    def predicted_seconds(self, elements: Sequence[int], assignment: Sequence[UpdatePath]) -> dict[UpdatePath, float]:
        """How long each path's queue takes by the current estimates."""
        totals: dict[UpdatePath, float] = {"device": 0.0, "host": 0.0}
        for count, path in zip(elements, assignment, strict=True):
            totals[path] += count * self.seconds_per_element[path]
        return totals

    def learn(self, timings: Iterable[UpdateTiming]) -> None:
        """Fold one step's timings into each path's estimate (a path that updated nothing keeps its own; a path's
        first measurement replaces its guess)."""
        elements: dict[UpdatePath, int] = {"device": 0, "host": 0}
        seconds: dict[UpdatePath, float] = {"device": 0.0, "host": 0.0}
        for timing in timings:
            elements[timing.path] += timing.elements
            seconds[timing.path] += timing.seconds
        for path in PATHS:
            if elements[path] and seconds[path] > 0:
                measured = seconds[path] / elements[path]
                weight = self.smoothing if path in self.measured else 1.0
                self.seconds_per_element[path] += weight * (measured - self.seconds_per_element[path])
                self.measured.add(path)

    def learn_window(self, seconds: float) -> None:
        """Fold one step's window (its plan to the first read that needed its updates) into the estimate (the first
        replaces nothing: it is the estimate)."""
        if seconds < 0:
            raise ValueError(f"UpdateSplit's window is seconds from a plan to a read, at least 0, got {seconds}")
        self.window = seconds if self.window is None else self.window + self.smoothing * (seconds - self.window)

    def describe(self) -> str:
        """The estimates in words, e.g. "device 0.33 ns/element, host 0.48 ns/element, window 1.2 s"."""
        paths = ", ".join(f"{path} {self.seconds_per_element[path] * 1e9:.3g} ns/element" for path in PATHS)
        return paths if self.window is None else f"{paths}, window {self.window:.3g} s"


def _on_device(elements: Sequence[int], assignment: Sequence[UpdatePath]) -> int:
    return sum(count for count, path in zip(elements, assignment, strict=True) if path == "device")
