"""A time limit on each call of a user's reward function (reward_model.reward_timeout_s).

The call runs on a daemon thread of its own while the trainer's main thread waits for it: a call that does not
return within the limit is abandoned where it is stuck (a daemon thread does not hold the process's exit up) and
ends the run with one ERROR line naming the function, the data source and the limit, exit code 2, which the daemon
does not restart (a restart would hang in the same place). While it waits, the main thread also watches for a stop
request (`verl stop`, SIGTERM): a stop during a stuck call abandons the step (StepInterrupted), and the trainer
checkpoints the last completed step instead of being killed with none.

Why a thread rather than a process: the function keeps the process's state as it had it (modules it cached,
files it opened, its own globals between calls), and nothing is pickled. A function that needs the main thread
(one that sets a SIGALRM timer of its own) runs there as before with reward_model.reward_timeout_s=null.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from trainer.config import KEYS
from trainer.errors import UserError

STOP_POLL_S = 0.2
"""How often the waiting main thread looks for a stop request."""


class RewardTimeoutError(UserError):
    """A call of the user's reward function did not return within reward_model.reward_timeout_s: the run ends
    (whatever custom_reward_function.on_error says: the call is still running, nothing was scored)."""


class StepInterrupted(Exception):
    """A stop was requested while the user's reward function was running: the step is abandoned and the trainer
    checkpoints the last completed one."""


def call_with_time_limit(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
                         limit_s: float | None, what: Callable[[], str],
                         stopping: Callable[[], bool] | None = None) -> Any:
    """`function(*args, **kwargs)` on a daemon thread, waited for at most `limit_s` seconds (None: no limit, and
    the call runs on this thread as before); what it raises is raised here. `what()` names the call for the
    timeout's message ("custom_reward_function 'f' scoring a response of data_source 'gsm8k'"); `stopping()` True
    while waiting raises StepInterrupted."""
    if limit_s is None:
        return function(*args, **kwargs)
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = function(*args, **kwargs)
        except BaseException as error:  # the user's: raised again on the waiting thread
            outcome["error"] = error
        finally:
            done.set()

    threading.Thread(target=run, name="verl-reward-call", daemon=True).start()
    deadline = time.monotonic() + limit_s
    while not done.wait(max(0.0, min(STOP_POLL_S, deadline - time.monotonic()))):
        if stopping is not None and stopping():
            raise StepInterrupted(f"a stop was requested while {what()} was running")
        if time.monotonic() >= deadline:
            raise RewardTimeoutError(f"{what()} did not return within {KEYS.reward_model.reward_timeout_s}="
                                     f"{limit_s:g} s; the run stops (a restart would wait on it again): make the "
                                     f"function return sooner, or raise {KEYS.reward_model.reward_timeout_s} "
                                     "(null: no limit)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def bind_stop(reward: Any, stopping: Callable[[], bool]) -> None:
    """Let the user's function that `reward` calls (a manager's CustomScore, or the batch manager itself) give way
    to a stop request while a call is stuck."""
    target = getattr(reward, "compute_score", reward)
    if hasattr(target, "stopping"):
        target.stopping = stopping
