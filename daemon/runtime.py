"""Runtime files: how `verl monitor/set/status/stop --pid` find a running daemon.

Each daemon writes <state dir>/run/<daemon pid>.json (mode 0600: it holds the API token) with
its URL, token, trainer child pids, run directory and config path, and removes it on exit.
A file whose process is gone (or whose pid now names another process) is stale and removed
whenever runs are looked up; so is the IPC socket <daemon pid>.sock a killed daemon leaves beside it.

A run directory belongs to one daemon at a time: `RunLock` holds an flock on <run dir>/daemon.lock
(which names the daemon's and its trainers' pids) for the daemon's life, and the daemon passes the
locked descriptor on to its trainer, so the lock also lasts while an orphaned trainer finishes its
last step. The kernel drops the lock with the last process that holds it: a lock file left by a
dead process is simply taken over.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from trainer.config import KEYS

STATE_DIR_ENV = "VERL_STATE_DIR"
# Two processes with the same pid started this far apart are different processes.
_START_TIME_TOLERANCE_S = 1.0


class RunNotFound(LookupError):
    """No live verl run matches; the message says what was looked for and what exists, `hint` (when not
    None) what to do about it."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


@dataclass
class RuntimeInfo:
    """What a client needs to reach a running daemon."""

    pid: int
    url: str
    token: str
    run_dir: str
    config_path: str
    name: str
    started_at: float
    """The daemon process's start time (epoch seconds), to tell it from a later process with its pid."""
    trainer_pids: list[int] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> RuntimeInfo:
        return cls(**json.loads(text))


def state_dir(configured: str | None = None) -> Path:
    """daemon.state_dir, else $VERL_STATE_DIR, else $XDG_STATE_HOME/verl, else ~/.local/state/verl."""
    if configured:
        return Path(configured).expanduser()
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "verl"


def runtime_dir(state: Path) -> Path:
    directory = state / "run"
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    return directory


def runtime_file(state: Path, pid: int) -> Path:
    return runtime_dir(state) / f"{pid}.json"


def write_runtime_file(state: Path, info: RuntimeInfo) -> Path:
    """Write (or rewrite) the daemon's file atomically, readable by its owner only."""
    path = runtime_file(state, info.pid)
    temporary = path.with_name(f".{path.name}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(info.to_json())
    os.chmod(temporary, 0o600)  # O_CREAT's mode does not apply to a file that already existed
    os.replace(temporary, path)
    return path


def remove_runtime_file(state: Path, pid: int) -> None:
    runtime_file(state, pid).unlink(missing_ok=True)


def process_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def is_alive(info: RuntimeInfo) -> bool:
    started = process_start_time(info.pid)
    return started is not None and abs(started - info.started_at) <= _START_TIME_TOLERANCE_S


def live_runs(state: Path) -> list[RuntimeInfo]:
    """Every running daemon's info; stale and unreadable files (and stale sockets) are removed on the way."""
    remove_stale_sockets(state)
    runs = []
    for path in sorted(runtime_dir(state).glob("*.json")):
        try:
            info = RuntimeInfo.from_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError):
            path.unlink(missing_ok=True)
            continue
        if is_alive(info):
            runs.append(info)
        else:
            path.unlink(missing_ok=True)
    return runs


def remove_stale_sockets(state: Path) -> None:
    """Remove the <pid>.sock files of daemons that are gone: no such process, or one started after the socket
    was made (the pid was reused)."""
    for path in runtime_dir(state).glob("*.sock"):
        if not path.stem.isdigit():
            continue
        started = process_start_time(int(path.stem))
        with contextlib.suppress(OSError):
            if started is None or started > path.lstat().st_mtime + _START_TIME_TOLERANCE_S:
                path.unlink()


def find_run(pid: int, state: Path | None = None) -> RuntimeInfo:
    """The run whose daemon is `pid`, or whose trainer (or any descendant of the daemon) is `pid`."""
    state = state or state_dir()
    if not psutil.pid_exists(pid):
        raise RunNotFound(f"no process has pid {pid}{_running_hint(state)}")
    runs = {info.pid: info for info in live_runs(state)}
    try:
        lineage = [psutil.Process(pid), *psutil.Process(pid).parents()]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        lineage = []
    for process in lineage:
        if process.pid in runs:
            return runs[process.pid]
    for info in runs.values():
        if pid in info.trainer_pids:
            return info
    daemon = next((process for process in lineage if _is_verl_train(process)), None)
    if daemon is not None:
        role = "the daemon" if daemon.pid == pid else f"a process under the daemon (pid {daemon.pid})"
        raise RunNotFound(f"pid {pid} is {role} of a `verl train` run, but no runtime file for it is in "
                          f"{runtime_dir(state)}: the run keeps its runtime files in another state dir, or is "
                          "still starting", _state_dir_hint(daemon))
    raise RunNotFound(f"pid {pid} is not a verl run (neither a daemon nor one of its trainers){_running_hint(state)}")


def _is_verl_train(process: psutil.Process) -> bool:
    """Whether the process runs `verl train` (the console script) or `python -m daemon.cli train`."""
    try:
        arguments = process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    for index, argument in enumerate(arguments[:-1]):
        if (Path(argument).name == "verl" or argument == "daemon.cli") and arguments[index + 1] == "train":
            return True
    return False


def _state_dir_hint(daemon: psutil.Process) -> str:
    """Which --state-dir to pass: the one the daemon's command line sets, when it does."""
    hint = (f"pass --state-dir DIR with the run's {KEYS.daemon.state_dir} (`verl train` printed the whole command "
            "at start)")
    try:
        arguments, folder = daemon.cmdline(), daemon.cwd()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return hint
    given = [argument.partition("=")[2] for argument in arguments if argument.startswith(f"{KEYS.daemon.state_dir}=")]
    if not given or not given[-1]:
        return hint
    return (f"its command line sets {KEYS.daemon.state_dir}: pass --state-dir "
            f"{Path(folder) / Path(given[-1]).expanduser()}")


def _running_hint(state: Path) -> str:
    runs = live_runs(state)
    if not runs:
        return f"; no verl run is going (runtime files in {runtime_dir(state)})"
    return "; running: " + ", ".join(f"pid {info.pid} ({info.name})" for info in runs)


# ---------------------------------------------------------------------------------- run ownership

LOCK_FILE = "daemon.lock"


class RunDirInUse(RuntimeError):
    """Another live daemon (or its trainer) owns the run directory; the message names it and what to do."""


class RunLock:
    """The flock on <run dir>/daemon.lock: `acquire` it before writing into the run directory, `release` at exit.

    The file holds JSON: the daemon's pid and its trainers' pids (`record_trainers` updates them), for the
    message a second daemon gives. `descriptor` is the locked file's: a child that inherits it (the trainer)
    keeps the run directory locked until it exits too.
    """

    def __init__(self, path: Path, descriptor: int, pid: int, previous_pid: int | None):
        self.path = path
        self.descriptor = descriptor
        self.pid = pid
        self.previous_pid = previous_pid
        """The pid a lock file left by a dead process named (None: there was none): taken over."""

    @classmethod
    def acquire(cls, run_dir: Path, pid: int | None = None) -> RunLock:
        """Lock `run_dir` for the daemon `pid` (this process); RunDirInUse when another process holds it."""
        pid = os.getpid() if pid is None else pid
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_lock(descriptor)
            os.close(descriptor)
            raise RunDirInUse(_in_use_message(run_dir, path, holder)) from None
        except BaseException:
            os.close(descriptor)
            raise
        previous = _read_lock(descriptor).get("pid")
        lock = cls(path, descriptor, pid, previous if isinstance(previous, int) and previous != pid else None)
        lock.record_trainers([])
        return lock

    def record_trainers(self, trainer_pids: list[int]) -> None:
        """Rewrite the file's contents (the lock stays held throughout)."""
        text = json.dumps({"pid": self.pid, "trainer_pids": list(trainer_pids)}).encode()
        with contextlib.suppress(OSError):  # a full disk: the lock holds all the same, only the message is poorer
            os.ftruncate(self.descriptor, 0)
            os.pwrite(self.descriptor, text, 0)

    def release(self) -> None:
        if self.descriptor < 0:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.descriptor, 0)
        os.close(self.descriptor)  # the lock goes with the last descriptor (a trainer may hold one still)
        self.descriptor = -1


def _read_lock(descriptor: int) -> dict[str, Any]:
    try:
        holder = json.loads(os.pread(descriptor, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _in_use_message(run_dir: Path, path: Path, holder: dict[str, Any]) -> str:
    """One line: who holds `run_dir` and what the user may do instead."""
    daemon = holder.get("pid")
    trainers = [pid for pid in holder.get("trainer_pids") or [] if isinstance(pid, int) and psutil.pid_exists(pid)]
    if isinstance(daemon, int) and psutil.pid_exists(daemon):
        return (f"run directory {run_dir} is in use by `verl train` pid {daemon} (it holds {path}); stop that run "
                f"first (`verl stop --pid {daemon}`), or give this one another {KEYS.trainer.experiment_name}")
    if trainers:
        return (f"run directory {run_dir} is in use by trainer pid {trainers[0]}, whose daemon (pid {daemon}) has "
                "exited: it checkpoints at its next safe point and exits; start this run again once it has, or "
                f"give it another {KEYS.trainer.experiment_name}")
    return (f"run directory {run_dir} is locked by another process ({path}); stop the run that uses it, or give "
            f"this one another {KEYS.trainer.experiment_name}")
