"""What the daemon knows of each trainer rank of its node: one entry per rank that said hello.

A run of one process has one rank, 0. With several, every rank's trainer reports to its node's daemon
(its hello names its global and local rank); rank 0's step metrics are the run's, the others' are their
local figures, kept here for /v1/status, the monitor's rows and the advisor's imbalance hint.

The ranks a node runs are fixed by the config (trainer.node_rank * trainer.n_gpus_per_node on), so the
table, and the `rank` label of the metrics built from it, has at most trainer.n_gpus_per_node entries;
a hello from any other rank is refused a place (`admits`).

On a run of several nodes, node 0's daemon also shows the other nodes' ranks: rank 0 gathers every rank's figures
at each step's end and sends them (RanksMessage, `observe_remote`): their step, peak memory and mean copy time. Those
rows have no process here, and at most the run's world size of them are kept; one that rank 0 has not reported for
longer than the daemon's hang timeout (`stale_after_s`) is shown not connected, as that node's ranks may be gone.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from api.prometheus import GIB, MEMORY_KEY
from trainer.config.messages import OffloadMessage, RanksMessage, RankStatus, StepMessage

COPY_SAMPLES_KEPT = 512
"""Each rank's latest timed offload copies that its mean copy latency is taken over."""


@dataclass
class RankState:
    rank: int
    local_rank: int
    pid: int | None = None
    connected: bool = False
    step: int | None = None
    heard_at: float | None = None
    gpu_memory_bytes: float | None = None
    copy_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=COPY_SAMPLES_KEPT))

    def status(self, now: float, node_rank: int) -> RankStatus:
        copies = list(self.copy_seconds)
        return RankStatus(rank=self.rank, local_rank=self.local_rank, node_rank=node_rank,
                          pid=self.pid if self.connected else None,
                          connected=self.connected, step=self.step,
                          heard_s_ago=None if self.heard_at is None else max(0.0, now - self.heard_at),
                          gpu_memory_bytes=self.gpu_memory_bytes,
                          copy_latency_mean_s=sum(copies) / len(copies) if copies else None)


class RankTable:
    """The ranks of one node: global ranks `first_rank` .. `first_rank + ranks_per_node - 1`."""

    def __init__(self, *, node_rank: int, ranks_per_node: int, clock: Callable[[], float] = time.time,
                 world_size: int | None = None, stale_after_s: Callable[[], float] | None = None):
        self.node_rank = node_rank
        self.first_rank = node_rank * ranks_per_node
        self.ranks_per_node = ranks_per_node
        self.world_size = ranks_per_node if world_size is None else world_size
        self._clock = clock
        # How long another node's rank counts as connected after rank 0's last report of it (None: for ever).
        self._stale_after_s = stale_after_s
        self._ranks: dict[int, RankState] = {}
        self._remote: dict[int, tuple[float, RankStatus]] = {}  # other nodes' ranks: when reported, what

    def admits(self, rank: int) -> bool:
        return self.first_rank <= rank < self.first_rank + self.ranks_per_node

    def connected(self, rank: int, *, local_rank: int, pid: int, step: int) -> RankState:
        state = self._ranks.get(rank) or RankState(rank=rank, local_rank=local_rank)
        state.local_rank, state.pid, state.connected, state.step = local_rank, pid, True, step
        state.heard_at = self._clock()
        self._ranks[rank] = state
        return state

    def disconnected(self, rank: int) -> None:
        if rank in self._ranks:
            self._ranks[rank].connected = False

    def heard(self, rank: int) -> None:
        if rank in self._ranks:
            self._ranks[rank].heard_at = self._clock()

    def observe_step(self, rank: int, message: StepMessage) -> None:
        state = self._ranks.get(rank)
        if state is None:
            return
        state.step = message.step
        memory = message.metrics.get(MEMORY_KEY)
        if memory is not None:
            state.gpu_memory_bytes = memory * GIB

    def observe_offload(self, rank: int, message: OffloadMessage) -> None:
        state = self._ranks.get(rank)
        if state is not None:
            state.copy_seconds.extend(copy.seconds for copy in message.copies)

    def observe_remote(self, message: RanksMessage) -> None:
        """Rank 0's report of every rank's figures at a step's end: the other nodes' ranks are kept (this node's
        report themselves)."""
        now = self._clock()
        for report in message.ranks:
            if self.admits(report.rank) or not 0 <= report.rank < self.world_size:
                continue
            self._remote[report.rank] = (now, RankStatus(
                rank=report.rank, local_rank=report.local_rank, node_rank=report.node_rank, pid=None, connected=True,
                step=report.step, heard_s_ago=0.0, gpu_memory_bytes=report.gpu_memory_bytes,
                copy_latency_mean_s=report.copy_latency_mean_s, gpu_utilization_percent=report.gpu_utilization_percent))

    def pids(self) -> list[int]:
        """The connected ranks' processes (the GPU sampler's thread asks too: one C-level copy of the entries)."""
        return [state.pid for state in tuple(self._ranks.values()) if state.connected and state.pid is not None]

    def statuses(self) -> list[RankStatus]:
        """This node's ranks, and (node 0) the other nodes' as last reported, by rank."""
        now = self._clock()
        rows = {rank: state.status(now, self.node_rank) for rank, state in self._ranks.items()}
        stale_after_s = None if self._stale_after_s is None else self._stale_after_s()
        for rank, (reported, status) in self._remote.items():
            silent_s = max(0.0, now - reported)
            rows[rank] = status.model_copy(update={
                "heard_s_ago": silent_s, "connected": stale_after_s is None or silent_s <= stale_after_s})
        return [rows[rank] for rank in sorted(rows)]

    def local_ranks(self) -> Iterable[tuple[int, int]]:
        """(global rank, local rank) of each rank seen."""
        return [(state.rank, state.local_rank) for state in self._ranks.values()]
