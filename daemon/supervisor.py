"""Runs the trainer as a child process and decides what its exit means.

- exit 0: the run is done (or stopped on request); the daemon exits 0.
- exit 2: a problem with the config, data or models that a restart cannot fix; no restart, the
  daemon exits 2.
- anything else (a crash, death by a signal such as SIGKILL, or exit 12: out of device memory the
  trainer could not recover from): restart after a back-off that
  doubles from ``daemon.restart_backoff_s`` up to ``daemon.restart_backoff_max_s``, at most
  ``daemon.max_restarts`` times (the trainer resumes from its latest complete checkpoint);
  after that the daemon gives up and exits 1.
- a stop request (SIGTERM/SIGINT to the daemon, or the API): the trainer is asked over IPC and
  by SIGTERM to checkpoint at its next safe point and exit; after ``daemon.stop_timeout_s`` it
  is killed. A second request kills it at once. The daemon then exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("verl.daemon.supervisor")

EXIT_OK = 0
EXIT_GAVE_UP = 1
EXIT_USAGE = 2  # the trainer's "fix your config/data" exit code, passed on as the daemon's
# The trainer's exit code for an unrecovered out-of-memory error: the same value as
# trainer/main.py's EXIT_OUT_OF_MEMORY (the daemon must not import that module; change both).
EXIT_OUT_OF_MEMORY = 12


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int
    backoff_s: float
    backoff_max_s: float

    def delay(self, restart: int) -> float:
        """Seconds to wait before restart number `restart` (1 for the first)."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** (restart - 1))


def exit_reason(returncode: int) -> str:
    """Why a trainer that will be restarted ended: "signal" when a signal killed it, "oom" when it ran out
    of device memory and could not recover, else "crash"."""
    if returncode < 0:
        return "signal"
    return "oom" if returncode == EXIT_OUT_OF_MEMORY else "crash"


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    if returncode == EXIT_OUT_OF_MEMORY:
        return f"ran out of memory (exit code {returncode})"
    return f"exit code {returncode}"


class Supervisor:
    """Owns the trainer process. Call `run()` once (returns the daemon's exit code); `request_stop()` any time
    from the event loop.

    Hooks: on_started(pid), on_exited(pid, returncode), on_restart(event) with the "restart" event data,
    on_state(state), request_trainer_stop() (sends "stop" over IPC).
    """

    def __init__(self, command: Sequence[str], *, policy: RestartPolicy, stop_timeout_s: float,
                 env: Mapping[str, str] | None = None, output: Path | None = None,
                 on_started: Callable[[int], None] = lambda pid: None,
                 on_exited: Callable[[int, int], None] = lambda pid, returncode: None,
                 on_restart: Callable[[dict[str, Any]], None] = lambda event: None,
                 on_state: Callable[[str], None] = lambda state: None,
                 request_trainer_stop: Callable[[], None] = lambda: None):
        self.command = list(command)
        self.policy = policy
        self.stop_timeout_s = stop_timeout_s
        self.env = dict(os.environ if env is None else env)
        self.output = output
        self._on_started, self._on_exited, self._on_restart = on_started, on_exited, on_restart
        self._on_state, self._request_trainer_stop = on_state, request_trainer_stop
        self.state = "starting"
        self.restarts = 0
        self.restarts_by_reason: Counter[str] = Counter()
        self.last_exit_code: int | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._stop_requested: asyncio.Event | None = None

    @property
    def pids(self) -> list[int]:
        process = self._process
        return [process.pid] if process is not None and process.returncode is None else []

    @property
    def stopping(self) -> bool:
        return self._stop_requested is not None and self._stop_requested.is_set()

    async def run(self) -> int:
        self._stop_requested = self._stop_requested or asyncio.Event()
        while not self._stop_requested.is_set():
            returncode = await self._run_once()
            outcome = self._judge(returncode)
            if outcome is not None:
                return outcome
            self.restarts += 1
            reason = exit_reason(returncode)
            self.restarts_by_reason[reason] += 1
            delay = self.policy.delay(self.restarts)
            log.warning("trainer %s; restart %d of %d in %.1f s (it resumes from its latest checkpoint)",
                        describe_exit(returncode), self.restarts, self.policy.max_restarts, delay)
            self._set_state("restarting")
            self._on_restart({"reason": reason, "exit_code": returncode, "restarts": self.restarts,
                              "backoff_s": delay})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_requested.wait(), delay)
        log.info("stopped on request before the trainer was restarted")
        self._set_state("finished")
        return EXIT_OK

    def trainer_connected(self) -> None:
        """The trainer said hello: it is past its start-up."""
        if self.state in ("starting", "restarting"):
            self._set_state("running")

    def request_stop(self) -> None:
        """Ask the trainer to checkpoint and exit (killed after stop_timeout_s); a second request kills it now."""
        if self._stop_requested is None:
            self._stop_requested = asyncio.Event()
        process = self._process
        alive = process is not None and process.returncode is None
        if self._stop_requested.is_set():
            if alive:
                log.warning("second stop request: killing the trainer (pid %d) without a checkpoint", process.pid)
                _signal(process, signal.SIGKILL)
            return
        self._stop_requested.set()
        if self.state not in ("finished", "failed"):
            self._set_state("stopping")
        if alive:
            log.info("stopping: the trainer (pid %d) checkpoints at its next safe point, then exits "
                     "(killed after %.0f s; stop again to kill it now)", process.pid, self.stop_timeout_s)
            self._request_trainer_stop()
            _signal(process, signal.SIGTERM)

    # ------------------------------------------------------------------------------------ helpers

    async def _run_once(self) -> int:
        self._set_state("starting")
        process = await self._spawn()
        self._process = process
        self._on_started(process.pid)
        if self._stop_requested.is_set():  # a stop that came while the process was being spawned
            self._request_trainer_stop()
            _signal(process, signal.SIGTERM)
        returncode = await self._wait(process)
        self.last_exit_code = returncode
        self._on_exited(process.pid, returncode)
        return returncode

    async def _spawn(self) -> asyncio.subprocess.Process:
        output = None
        if self.output is not None:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            output = self.output.open("ab")
            output.write(f"=== trainer starting {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(self.command)}\n"
                         .encode())
            output.flush()
        try:
            return await asyncio.create_subprocess_exec(
                *self.command, env=self.env, stdin=asyncio.subprocess.DEVNULL, stdout=output,
                stderr=asyncio.subprocess.STDOUT if output is not None else None)
        finally:
            if output is not None:
                output.close()  # the child has its own copy of the descriptor

    async def _wait(self, process: asyncio.subprocess.Process) -> int:
        exited = asyncio.ensure_future(process.wait())
        stop = asyncio.ensure_future(self._stop_requested.wait())
        try:
            await asyncio.wait({exited, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not exited.done():
                try:
                    await asyncio.wait_for(asyncio.shield(exited), self.stop_timeout_s)
                except TimeoutError:
                    log.warning("the trainer did not exit within daemon.stop_timeout_s=%.0f s; killing it",
                                self.stop_timeout_s)
                    _signal(process, signal.SIGKILL)
            return await exited
        finally:
            stop.cancel()

    def _judge(self, returncode: int) -> int | None:
        """The daemon's exit code for this trainer exit, or None to restart it."""
        if self._stop_requested.is_set():
            log.info("trainer stopped on request (%s)", describe_exit(returncode))
            self._set_state("finished")
            return EXIT_OK
        if returncode == 0:
            log.info("trainer finished")
            self._set_state("finished")
            return EXIT_OK
        if returncode == EXIT_USAGE:
            log.error("the trainer stopped on a problem with the config, data or models (exit code 2; see its "
                      "ERROR lines); not restarting")
            self._set_state("failed")
            return EXIT_USAGE
        if self.restarts >= self.policy.max_restarts:
            log.error("trainer %s; giving up after %d restart(s) (daemon.max_restarts=%d)",
                      describe_exit(returncode), self.restarts, self.policy.max_restarts)
            self._set_state("failed")
            return EXIT_GAVE_UP
        return None

    def _set_state(self, state: str) -> None:
        self.state = state
        self._on_state(state)


def _signal(process: asyncio.subprocess.Process, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signum)
