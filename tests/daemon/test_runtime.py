"""What a daemon leaves in the state dir and the run directory: stale sockets go, and the run directory's lock
refuses a second owner, names it, and passes to the next daemon once its holders are gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.runtime import LOCK_FILE, RunDirInUse, RunLock, live_runs, runtime_dir


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_the_socket_of_a_dead_daemon_is_removed_when_runs_are_looked_up(tmp_path: Path) -> None:
    folder = runtime_dir(tmp_path)
    stale, live = folder / f"{dead_pid()}.sock", folder / f"{os.getpid()}.sock"
    stale.touch()
    live.touch()
    reused = folder / f"{os.getppid()}.sock"  # made "before" that process started: its pid was reused
    reused.touch()
    os.utime(reused, (time.time() - 10**7, time.time() - 10**7))
    assert live_runs(tmp_path) == []
    assert not stale.exists() and not reused.exists()
    assert live.exists()


def test_a_second_owner_is_refused_with_the_holders_pid(tmp_path: Path) -> None:
    lock = RunLock.acquire(tmp_path / "run", pid=os.getpid())
    try:
        with pytest.raises(RunDirInUse) as refused:
            RunLock.acquire(tmp_path / "run", pid=12345)
        assert f"in use by `verl train` pid {os.getpid()}" in str(refused.value)
        assert "\n" not in str(refused.value)
    finally:
        lock.release()
    RunLock.acquire(tmp_path / "run").release()  # released: free again


def test_a_lock_an_orphaned_trainer_holds_names_the_trainer(tmp_path: Path) -> None:
    """The trainer inherits the locked descriptor: while it finishes its last step, its daemon gone, the run
    directory stays locked, and the refusal says who holds it."""
    lock = RunLock.acquire(tmp_path / "run", pid=dead_pid())
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(lock.descriptor,))
    try:
        lock.record_trainers([trainer.pid])
        os.close(lock.descriptor)  # the daemon is gone, its trainer still runs
        with pytest.raises(RunDirInUse) as refused:
            RunLock.acquire(tmp_path / "run")
        assert f"in use by trainer pid {trainer.pid}, whose daemon (pid {lock.pid}) has exited" in str(refused.value)
    finally:
        trainer.kill()
        trainer.wait()
    taken = RunLock.acquire(tmp_path / "run")  # both gone: the next daemon takes it over
    try:
        assert taken.previous_pid == lock.pid
        assert json.loads((tmp_path / "run" / LOCK_FILE).read_text()) == {"pid": os.getpid(), "trainer_pids": []}
    finally:
        taken.release()
