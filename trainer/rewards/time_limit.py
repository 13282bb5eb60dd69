"""A time limit on each call of a user's reward function (reward_model.reward_timeout_s).

The call runs on a worker thread of a small pool that lives for the process while the caller waits for it: a call
that does not return within the limit is abandoned where it is stuck (its thread is marked lost and left behind, a
daemon thread does not hold the process's exit up, and a fresh worker takes the next call, so one stuck call never
blocks the next ones). In the trainer a timeout ends the run with one ERROR line naming the function, the data
source and the limit, exit code 2, which the daemon does not restart (a restart would hang in the same place). Where
a timeout does not end the run (a prime worker process scores the response 0 and goes on), the lost threads are
bounded: past MAX_LOST_THREADS still stuck, the next call is refused with one ERROR line (RewardThreadsExhausted).
While it waits, the caller also watches for a stop request (`verl stop`, SIGTERM): a stop during a stuck call
abandons the step (StepInterrupted), and the trainer checkpoints the last completed step instead of being killed
with none.

Why threads rather than processes: the function keeps the process's state as it had it (modules it cached, files it
opened, its own globals between calls), and nothing is pickled. Why a pool rather than a thread per call: starting a
thread costs more than a cheap scorer's call (benchmarks/reward_time_limit.py measures both). A function that needs
the main thread (one that sets a SIGALRM timer of its own) runs there as before with
reward_model.reward_timeout_s=null.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from trainer.config import KEYS
from trainer.errors import UserError

STOP_POLL_S = 0.2
"""How often the waiting thread looks for a stop request."""
MAX_LOST_THREADS = 8
"""How many abandoned calls may still be stuck on their threads before the next call is refused."""


class RewardTimeoutError(UserError):
    """A call of the user's reward function did not return within reward_model.reward_timeout_s: the run ends
    (whatever custom_reward_function.on_error says: the call is still running, nothing was scored)."""

    rank_local = True


class RewardThreadsExhausted(UserError):
    """MAX_LOST_THREADS abandoned calls are still stuck: a further call is refused rather than leave one more thread
    behind (each holds what its call holds, for as long as it is stuck)."""

    rank_local = True


class StepInterrupted(Exception):
    """A stop was requested while the user's reward function was running: the step is abandoned and the trainer
    checkpoints the last completed one."""


class _Call:
    """One call handed to the pool: the function and its arguments, then its outcome."""

    __slots__ = ("function", "args", "kwargs", "value", "error", "running", "finished", "lost")

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.function, self.args, self.kwargs = function, args, kwargs
        self.value: Any = None
        self.error: BaseException | None = None
        # Held until the call has returned: a bare lock is the cheapest thing to wait on with a timeout (an Event
        # is a lock and a condition, and costs a call about half as much again).
        self.running = threading.Lock()
        self.running.acquire()
        self.finished = False  # the call has returned (set under the pool's lock)
        self.lost = False  # abandoned by its caller (set under the pool's lock)


class RewardThreads:
    """The worker threads that run the calls: one per call in flight at most (a trainer's main thread makes one
    call at a time, so one worker serves a whole run), started when every worker is busy, waiting on a queue in
    between. A worker whose call was abandoned is lost: when its call returns at last it leaves the pool."""

    def __init__(self, max_lost: int = MAX_LOST_THREADS):
        self.max_lost = max_lost
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # workers waiting on the queue (or about to)
        self._started = 0
        self.lost = 0  # abandoned calls whose threads are still stuck in them

    def submit(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
               what: Callable[[], str]) -> _Call:
        """Hand `function(*args, **kwargs)` to a worker; its outcome is the returned call's once `running` is
        released."""
        call = _Call(function, args, kwargs)
        with self._lock:
            if self.lost >= self.max_lost:
                raise RewardThreadsExhausted(
                    f"{self.lost} calls of the reward function that did not return within "
                    f"{KEYS.reward_model.reward_timeout_s} are still running on abandoned threads, the most this "
                    f"process leaves behind; not calling {what()} again: make the function return sooner, or raise "
                    f"{KEYS.reward_model.reward_timeout_s}")
            if self._idle > 0:
                self._idle -= 1
            else:
                self._started += 1
                threading.Thread(target=self._work, name=f"verl-reward-worker-{self._started}", daemon=True).start()
        self._calls.put(call)
        return call

    def abandon(self, call: _Call) -> None:
        """The caller no longer waits for `call`: its worker is lost until the call returns."""
        with self._lock:
            if not call.finished and not call.lost:
                call.lost = True
                self.lost += 1

    def _work(self) -> None:
        while True:
            call = self._calls.get()
            try:
                call.value = call.function(*call.args, **call.kwargs)
            except BaseException as error:  # the user's: raised again on the waiting thread
                call.error = error
            with self._lock:
                call.finished = True
                call.running.release()
                if call.lost:  # its caller has gone: this thread leaves the pool rather than rejoin it
                    self.lost -= 1
                    return
                self._idle += 1


_THREADS = RewardThreads()
"""The process's pool: it lives as long as the process (a run)."""


def call_with_time_limit(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
                         limit_s: float | None, what: Callable[[], str],
                         stopping: Callable[[], bool] | None = None, threads: RewardThreads | None = None) -> Any:
    """`function(*args, **kwargs)` on a worker thread of `threads` (the process's pool unless given), waited for at
    most `limit_s` seconds (None: no limit, and the call runs on this thread as before); what it raises is raised
    here. `what()` names the call for the timeout's message ("custom_reward_function 'f' scoring a response of
    data_source 'gsm8k'"); `stopping()` True while waiting raises StepInterrupted."""
    if limit_s is None:
        return function(*args, **kwargs)
    pool = threads or _THREADS
    call = pool.submit(function, args, kwargs, what=what)
    deadline = time.monotonic() + limit_s
    while not call.running.acquire(timeout=max(0.0, min(STOP_POLL_S, deadline - time.monotonic()))):
        if stopping is not None and stopping():
            pool.abandon(call)
            raise StepInterrupted(f"a stop was requested while {what()} was running")
        if time.monotonic() >= deadline:
            pool.abandon(call)
            raise RewardTimeoutError(f"{what()} did not return within {KEYS.reward_model.reward_timeout_s}="
                                     f"{limit_s:g} s; the run stops (a restart would wait on it again): make the "
                                     f"function return sooner, or raise {KEYS.reward_model.reward_timeout_s} "
                                     "(null: no limit)")
    if call.error is not None:
        raise call.error
    return call.value


def bind_stop(reward: Any, stopping: Callable[[], bool]) -> None:
    """Let the user's function that `reward` calls (a manager's CustomScore, or the batch manager itself) give way
    to a stop request while a call is stuck."""
    target = getattr(reward, "compute_score", reward)
    if hasattr(target, "stopping"):
        target.stopping = stopping
