"""The worker processes of the prime and remote reward managers: a multiprocessing pool whose shutdown always ends
its workers at once, whatever the signals the trainer's process ignores.

`multiprocessing.pool.Pool.terminate()` ends the workers with SIGTERM, then waits for each. A spawned worker inherits
the parent's ignored signals (an ignored signal stays ignored across exec), so where the process that scores ignores
SIGTERM (the daemon's in-process shutdown ignored SIGTERM and SIGINT; a user's launcher may), terminate() waited
forever. Resetting SIGTERM in a worker initializer was not enough: a worker still starting when terminate() signals
it (the pool had started it, but the first batch had not needed it yet; or it replaces one that died) runs no
initializer yet, ignores the signal, then blocks for good on the task queue's read lock, which terminate() took and
keeps. Measured on this project's 2-core host: the pool's shutdown then lasted until something else ended the worker
(a test's time limit signalling the process group: the 31 s to 120+ s seen before), or forever.

Here a worker's terminate() is SIGKILL, which no process can ignore, and which a worker ends by as it would by a
SIGTERM it does not handle: the pool's shutdown takes milliseconds, with the workers idle, busy on a late score or
still starting. Nothing a worker holds is lost by it: terminate() takes the task queue's lock itself before it ends
the workers, and nothing is read from the result queue after.

This module imports no torch (and neither does what it imports): a spawned worker imports it to unpickle its
process object, and must start fast.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.pool
from typing import Any


class KilledWorker(multiprocessing.context.SpawnProcess):
    """A spawned worker process whose terminate() is kill() (SIGKILL): it ends even where SIGTERM is ignored."""

    def terminate(self) -> None:
        self.kill()


class WorkerPool(multiprocessing.pool.Pool):
    """A pool of spawned worker processes (no copy of the trainer's CUDA context or threads) whose terminate() ends
    every worker at once with SIGKILL (KilledWorker), rather than waiting on workers that ignore SIGTERM."""

    def __init__(self, processes: int) -> None:
        super().__init__(processes, context=multiprocessing.get_context("spawn"))

    @staticmethod
    def Process(ctx: Any, *args: Any, **kwds: Any) -> KilledWorker:  # noqa: N802 (multiprocessing's name)
        return KilledWorker(*args, **kwds)
