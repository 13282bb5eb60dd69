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
  is killed. Stop requests are idempotent: a second one is the same stop. Only a forced stop
  (`verl stop --force`; the daemon turns a late repeated signal into one) kills the trainer at
  once, without a checkpoint. The daemon then exits 0.
- a hang: a trainer that has said hello and then sends no heartbeat (`beat`) for the hang timeout
  is made to write its Python stacks (STACK_DUMP_SIGNAL, faulthandler) and killed, then restarted
  like a crash, counted under the reason "hang".

The trainer runs in a session of its own, so a signal to the daemon's process group (Ctrl-C,
`timeout`) reaches the daemon alone, which forwards one stop.

With several ranks the supervised process is their launcher (trainer/distributed/launch.py), and "the trainer"
above is the whole group: the launcher passes SIGTERM and STACK_DUMP_SIGNAL on to the ranks and ends with
the first failed rank's exit code, so a rank that dies restarts the group. Every rank that said hello must
keep sending heartbeats; one silent rank makes the group hang. A kill (forced stop, a stop or hang timeout)
kills the launcher's descendants too: the ranks run in sessions of their own and may ignore SIGTERM.
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

import psutil

from daemon.failures import Failure
from trainer.config import KEYS
from trainer.config.exit_codes import EXIT_OK, EXIT_OUT_OF_MEMORY, EXIT_USAGE
from trainer.config.ipc import STACK_DUMP_SIGNAL

log = logging.getLogger("verl.daemon.supervisor")

EXIT_GAVE_UP = 1
STACK_DUMP_WAIT_S = 2.0
"""How long a hung trainer gets to write its stacks before it is killed (faulthandler writes at once)."""


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
    on_state(state), request_trainer_stop() (sends "stop" over IPC), on_hang(pid, silent_s) just before a hung
    trainer is made to dump its stacks. `hang_timeout_s()` is the current hang timeout (None: no watchdog);
    `pass_fds` are descriptors the trainer inherits (the run directory's lock).
    """

    def __init__(self, command: Sequence[str], *, policy: RestartPolicy, stop_timeout_s: float,
                 env: Mapping[str, str] | None = None, output: Path | None = None,
                 on_started: Callable[[int], None] = lambda pid: None,
                 on_exited: Callable[[int, int], None] = lambda pid, returncode: None,
                 on_restart: Callable[[dict[str, Any]], None] = lambda event: None,
                 on_state: Callable[[str], None] = lambda state: None,
                 request_trainer_stop: Callable[[], None] = lambda: None,
                 hang_timeout_s: Callable[[], float] | None = None,
                 on_hang: Callable[[int, float], None] = lambda pid, silent_s: None,
                 on_stacks_due: Callable[[int], None] = lambda pid: None,
                 explain_failure: Callable[[], Failure | None] = lambda: None,
                 pass_fds: Sequence[int] = ()):
        self.command = list(command)
        self.policy = policy
        self.stop_timeout_s = stop_timeout_s
        self.env = dict(os.environ if env is None else env)
        self.output = output
        self.pass_fds = tuple(pass_fds)
        self._on_started, self._on_exited, self._on_restart = on_started, on_exited, on_restart
        self._on_state, self._request_trainer_stop = on_state, request_trainer_stop
        self._hang_timeout_s, self._on_hang = hang_timeout_s, on_hang
        self._on_stacks_due, self._explain_failure = on_stacks_due, explain_failure
        self.last_failure: Failure | None = None  # the previous failed trainer's, to recognise a crash loop
        self.crash_loop = False  # the run ended because a restart failed as the one before it
        self.output_start = 0  # where the current trainer's output begins in `output`
        self._heard_at: dict[int, float] = {}  # rank -> monotonic time of its last sign of life (watched ranks only)
        self._hung = False  # the current trainer was killed as hung
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
            if self._cannot_help():
                return EXIT_GAVE_UP
            self.restarts += 1
            reason = "hang" if self._hung else exit_reason(returncode)
            self.restarts_by_reason[reason] += 1
            delay = self.policy.delay(self.restarts)
            log.warning("trainer %s; restart %d of %d in %.1f s (it resumes from its latest checkpoint)",
                        "hung and was killed" if self._hung else describe_exit(returncode), self.restarts,
                        self.policy.max_restarts, delay)
            self._set_state("restarting")
            self._on_restart({"reason": reason, "exit_code": returncode, "restarts": self.restarts,
                              "backoff_s": delay})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_requested.wait(), delay)
        log.info("stopped on request before the trainer was restarted")
        self._set_state("finished")
        return EXIT_OK

    def trainer_connected(self, rank: int = 0) -> None:
        """A trainer rank said hello: it is past its start-up, and from now on it must keep sending heartbeats."""
        self._heard_at[rank] = time.monotonic()
        if self.state in ("starting", "restarting"):
            self._set_state("running")

    def trainer_disconnected(self, rank: int = 0) -> None:
        """No link, so no heartbeats to expect from that rank until its next hello."""
        self._heard_at.pop(rank, None)

    def beat(self, rank: int = 0) -> None:
        """A rank's main thread made progress (a heartbeat, phase, step ... message)."""
        if rank in self._heard_at:
            self._heard_at[rank] = time.monotonic()

    def request_stop(self, *, force: bool = False) -> bool:
        """Ask the trainer to checkpoint and exit (killed after stop_timeout_s). Idempotent: a request while
        stopping is the same stop. `force` kills the trainer now, without a checkpoint. Whether this request
        started the stop (False: one was under way)."""
        if self._stop_requested is None:
            self._stop_requested = asyncio.Event()
        process = self._process
        alive = process is not None and process.returncode is None
        pid = process.pid if process is not None else None
        first = not self._stop_requested.is_set()
        self._stop_requested.set()
        if first and self.state not in ("finished", "failed"):
            self._set_state("stopping")
        if force:
            if alive:
                log.warning("forced stop: killing the trainer (pid %s) without a checkpoint", pid)
                _kill(process)
        elif not first:
            if alive:
                log.info("already stopping: the trainer (pid %s) checkpoints at its next safe point, then exits "
                         "(`verl stop --force` kills it without a checkpoint)", pid)
        elif alive:
            log.info("stopping: the trainer (pid %s) checkpoints at its next safe point, then exits "
                     "(killed after %.0f s; `verl stop --force` kills it now, without a checkpoint)", pid,
                     self.stop_timeout_s)
            self._request_trainer_stop()
            _signal(process, signal.SIGTERM)
        return first

    # ------------------------------------------------------------------------------------ helpers

    async def _run_once(self) -> int:
        self._set_state("starting")
        self._heard_at, self._hung = {}, False
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
            self.output_start = output.tell()
            output.write(f"=== trainer starting {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(self.command)}\n"
                         .encode())
            output.flush()
        try:
            # A session of its own: a signal to the daemon's process group (Ctrl-C, `timeout`) does not reach it.
            return await asyncio.create_subprocess_exec(
                *self.command, env=self.env, stdin=asyncio.subprocess.DEVNULL, stdout=output,
                stderr=asyncio.subprocess.STDOUT if output is not None else None, start_new_session=True,
                pass_fds=self.pass_fds)
        finally:
            if output is not None:
                output.close()  # the child has its own copy of the descriptor

    async def _wait(self, process: asyncio.subprocess.Process) -> int:
        exited = asyncio.ensure_future(process.wait())
        stop = asyncio.ensure_future(self._stop_requested.wait())
        watchdog = asyncio.ensure_future(self._watch_for_hang(process))
        try:
            await asyncio.wait({exited, stop, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            if not exited.done() and stop.done():
                try:
                    await asyncio.wait_for(asyncio.shield(exited), self.stop_timeout_s)
                except TimeoutError:
                    log.warning(f"the trainer did not exit within {KEYS.daemon.stop_timeout_s}=%.0f s; killing it",
                                self.stop_timeout_s)
                    _kill(process)
            return await exited
        finally:
            stop.cancel()
            watchdog.cancel()

    async def _watch_for_hang(self, process: asyncio.subprocess.Process) -> None:
        """Returns once it has killed `process` for sending no heartbeat within the hang timeout."""
        hang_timeout_s = self._hang_timeout_s
        if hang_timeout_s is None:
            await asyncio.Event().wait()  # no watchdog: wait for ever (cancelled with the trainer)
            return
        while True:
            timeout = hang_timeout_s()
            await asyncio.sleep(min(1.0, timeout / 4))
            if not self._heard_at or self.stopping:
                continue
            rank, heard_at = min(self._heard_at.items(), key=lambda item: item[1])
            silent = time.monotonic() - heard_at
            if silent < timeout:
                continue
            who = f"the trainer (pid {process.pid})" if set(self._heard_at) == {0} else \
                f"trainer rank {rank} (of the group of launcher pid {process.pid})"
            log.error(f"%s sent no heartbeat for %.0f s ({KEYS.daemon.hang_timeout_s}=%.0f): it hangs; its Python "
                      "stacks go to logs/trainer.log, then it is killed and restarted from its latest checkpoint", who,
                      silent, timeout)
            self._on_hang(process.pid, silent)
            self._hung = True
            _signal(process, STACK_DUMP_SIGNAL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(process.wait()), STACK_DUMP_WAIT_S)
            self._on_stacks_due(process.pid)
            _kill(process)
            return

    @property
    def hung(self) -> bool:
        """The current (or last) trainer was killed as hung."""
        return self._hung

    def _cannot_help(self) -> bool:
        """Whether this failure repeats the previous one (the same step, the same error or hang place): then a
        restart would only fail again, and the run ends with its cause instead of spending the restarts left."""
        failure = self._explain_failure()
        previous, self.last_failure = self.last_failure, failure
        if failure is None or not failure.repeats(previous):
            return False
        log.error("the restarted trainer failed at step %s as the previous one did (%s): restarting cannot help; "
                  "stopping with %d of %d restarts unused", failure.step, failure.cause,
                  self.policy.max_restarts - self.restarts, self.policy.max_restarts)
        self.crash_loop = True
        self._set_state("failed")
        return True

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
            log.error(f"trainer %s; giving up after %d restart(s) ({KEYS.daemon.max_restarts}=%d)",
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


def _kill(process: asyncio.subprocess.Process) -> None:
    """SIGKILL to the process and every descendant (a launcher's ranks live in sessions of their own)."""
    if process.returncode is None:
        with contextlib.suppress(psutil.Error):
            for descendant in psutil.Process(process.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    descendant.kill()
    _signal(process, signal.SIGKILL)
