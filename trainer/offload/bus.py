"""Turns on the bus for the optimizer updates that stream their states through it, across a run's models.

An offloaded model's AdamW on the GPU (device_update.py) moves 14 bytes a parameter each way over PCIe: 43 GB
each way for a 3B model, about 0.8 s at 55 GB/s. PPO updates the critic, then the actor, and the next rollout
waits for the actor's update. Measured on an H200 (benchmarks/README.md, e2e_bench ppo3b, 2026-12-02): the
critic's update ran while the actor trained and updated, sharing the bus with the actor's streamed layers and
its update, so both took longer, while the rollout after them, whose layers stay on the GPU, left the bus idle.

So a model's updates on the device wait while a model used more often (dynamic.USE_ORDER: the actor first)
claims the bus: from the start of its training phase until its own updates have run. The critic's update
then runs during the rollout, which does not read the critic, and is done before the critic's next forward
(its values), which waits for it as before. Nothing is reordered within a model, and no update changes: only
when each crosses the bus.

A wait for a held model's update (its next forward reaching a unit, a checkpoint: units.UpdateDone) lets that
model's updates go at once (`hurry`): a held update never waits on the thread that waits for it.

A model whose update is delayed (fsdp_config.delayed_update: the actor's) is needed last, not first: nothing
reads the update before that model's next training phase (or its old log-probs, where a step scores them), while
the critic's next values come right after the rollout. So its training phase claims the bus as before, but the
claim ends with the phase, and its updates, which run during the next rollout, wait behind every other model's
claim (`defer`). Measured on an H200 (3B PPO, 12 GiB, 2026-12-04): the critic's update, held behind the actor's
delayed one through the whole rollout, crossed during the next values phase, which waited 0.6 s for it.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from trainer.offload.dynamic import USE_ORDER

T = TypeVar("T")


class BusTurns:
    """Which models' device updates may cross the bus now: a model's wait while a model ahead of it in `order`
    (most used first; a role not in it counts as first) holds a claim, unless its updates are hurried."""

    def __init__(self, order: Sequence[str] = USE_ORDER):
        self._order = tuple(order)
        self._condition = threading.Condition()
        self._claims: Counter[str] = Counter()
        self._hurried: set[str] = set()
        self._deferred: set[str] = set()
        self.held_seconds: defaultdict[str, float] = defaultdict(float)
        """Per role: seconds its updates waited for their turn (a profile reads them)."""

    def _rank(self, role: str) -> int:
        return self._order.index(role) if role in self._order else -1

    def claim(self, role: str) -> None:
        """`role` needs the bus (its training phase starts): the updates of the models after it wait. Its own
        updates are no longer hurried (each phase starts afresh)."""
        with self._condition:
            self._claims[role] += 1
            self._hurried.discard(role)

    def release(self, role: str) -> None:
        """One claim of `role` ends (its updates since the claim have run)."""
        with self._condition:
            self._claims[role] -= 1
            if self._claims[role] <= 0:
                del self._claims[role]
            self._condition.notify_all()

    def hurry(self, role: str) -> None:
        """Something waits for `role`'s updates: they go now, whatever claims are held, until its next claim."""
        with self._condition:
            self._hurried.add(role)
            self._condition.notify_all()

    def defer(self, role: str) -> None:
        """`role`'s updates are delayed (read at its next training phase at the earliest): they wait behind every
        other model's claim, whatever the order."""
        with self._condition:
            self._deferred.add(role)
            self._condition.notify_all()

    def may_go(self, role: str) -> bool:
        rank = self._rank(role)
        if role in self._hurried:
            return True
        if role in self._deferred:
            return not any(other != role for other in self._claims)
        return not any(self._rank(other) < rank for other in self._claims)

    def wait_turn(self, role: str) -> None:
        """Block until `role`'s next update may cross the bus."""
        with self._condition:
            if self.may_go(role):
                return
            started = time.perf_counter()
            self._condition.wait_for(lambda: self.may_go(role))
            self.held_seconds[role] += time.perf_counter() - started

    def in_turn(self, role: str, work: Callable[..., T]) -> Callable[..., T]:
        """`work`, run once `role` may cross the bus."""

        @functools.wraps(work)  # (a profile names the worker's tasks by the update's name)
        def turn(*args: Any) -> T:
            self.wait_turn(role)
            return work(*args)

        return turn
