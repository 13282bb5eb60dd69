"""A failure's cause where the user looks, and a crash loop recognised (issue 41, items 2 and 3)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from daemon.failures import Failure, hang_place, last_error_line
from tests.daemon.test_service import QUICKSTART, make_daemon

TRACEBACK = """2026-12-07 10:00:00 INFO step 3
2026-12-07 10:00:01 ERROR the trainer crashed: RuntimeError: probability tensor contains either inf, nan or element < 0
Traceback (most recent call last):
  File "/x/trainer/loop.py", line 170, in fit
    local = self.train_step(records)
  File "/x/trainer/rollout/hf_rollout.py", line 88, in generate
    tokens = torch.multinomial(probabilities, 1)
RuntimeError: probability tensor contains either inf, nan or element < 0
"""

STACKS = """2026-12-07 10:00:00 ERROR the verl daemon heard nothing from trainer pid 12 for 20 s: its stacks follow
Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
Current thread 0x00007f0000000002 (most recent call first):
  File "/home/user/reward.py", line 7 in compute_score
  File "/x/trainer/rewards/custom.py", line 120 in __call__
"""


def test_the_cause_is_the_final_line_of_the_last_traceback():
    assert last_error_line(TRACEBACK) == "RuntimeError: probability tensor contains either inf, nan or element < 0"
    later = TRACEBACK + "2026-12-07 10:00:02 ERROR data file rows.parquet row 7: no prompt\n"
    assert last_error_line(later) == "data file rows.parquet row 7: no prompt"
    assert last_error_line("2026-12-07 10:00:00 INFO step 1\n") is None


def test_a_hang_is_placed_at_the_main_threads_innermost_frame():
    assert hang_place(STACKS) == "/home/user/reward.py:7 in compute_score"
    assert hang_place("2026-12-07 10:00:00 ERROR the verl daemon got no Python stacks\n") is None
    waiting = STACKS.replace('"/home/user/reward.py", line 7 in compute_score',
                             '"/usr/lib/python3.11/threading.py", line 359 in wait')
    waiting += 'Thread 0x00007f0000000003 (most recent call first):\n  File "/home/user/reward.py", line 9 in score\n'
    assert hang_place(waiting) == "/home/user/reward.py:9 in score"  # the main thread waits on the reward's thread


def test_only_the_same_step_and_the_same_known_cause_repeat():
    assert Failure(3, "RuntimeError: x").repeats(Failure(3, "RuntimeError: x"))
    assert not Failure(4, "RuntimeError: x").repeats(Failure(3, "RuntimeError: x"))
    assert not Failure(3, "RuntimeError: y").repeats(Failure(3, "RuntimeError: x"))
    assert not Failure(3, None, shown="killed by SIGKILL").repeats(Failure(3, None, shown="killed by SIGKILL"))


def test_a_restart_that_fails_the_same_way_at_the_same_step_ends_the_run_with_its_cause(tmp_path: Path, monkeypatch,
                                                                                       capsys) -> None:
    """Probes 1 and 4: a trainer that crashed the same way at the same step was restarted until daemon.max_restarts
    ran out, and daemon.log said only "exited with code 1". Now the first repeat ends the run, the cause in
    daemon.log's exit line and in /v1/status."""
    log = tmp_path / "runs" / "fake" / "logs" / "trainer.log"
    daemon = make_daemon(tmp_path, monkeypatch, "daemon.max_restarts=5", crash="raise:probability tensor contains nan",
                         crash_at_step="2", log=str(log))
    assert asyncio.run(daemon.run()) == 1
    assert daemon.supervisor.state == "failed" and daemon.supervisor.restarts == 1  # 4 restarts left unspent
    text = (daemon.run_dir / "logs" / "daemon.log").read_text()
    assert "exited with code 1: RuntimeError: probability tensor contains nan" in text
    assert ("the restarted trainer failed at step 1 as the previous one did (RuntimeError: probability tensor "
            "contains nan): restarting cannot help") in text
    assert daemon.status().restarts.last_failure == "RuntimeError: probability tensor contains nan"
    assert "restarting cannot help" in capsys.readouterr().err


def test_the_stack_dump_says_when_a_stopped_trainer_could_not_write_its_stacks(tmp_path: Path, monkeypatch) -> None:
    """Probe (hang watchdog): a SIGSTOPped trainer writes no stacks; the log now says so plainly."""
    daemon = make_daemon(tmp_path, monkeypatch)
    log = daemon.run_dir / "logs" / "trainer.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    stopped = os.fork()
    if stopped == 0:  # a child that is stopped at once
        os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)
    try:
        for _ in range(200):
            if open(f"/proc/{stopped}/stat").read().split()[2] == "T":
                break
            asyncio.run(asyncio.sleep(0.01))
        daemon._trainer_hangs(stopped, 20.0)
        daemon._stacks_due(stopped)
    finally:
        os.kill(stopped, signal.SIGKILL)
        os.waitpid(stopped, 0)
    lines = log.read_text().splitlines()
    assert f"got no Python stacks from trainer pid {stopped}" in lines[-1]
    assert "it is stopped (SIGSTOP or SIGTSTP): a stopped process runs no signal handler" in lines[-1]


def test_a_crash_leaves_its_traceback_in_trainer_log_where_the_daemon_finds_its_cause(tmp_path, monkeypatch):
    """Probe 1: the crash's traceback (generation's "probability tensor contains ... nan") was in neither trainer.log
    nor daemon.log. Now trainer.log holds it, and the cause the daemon reads from it is its final line."""
    import pytest

    import trainer.loop
    import trainer.main
    from trainer.config.ipc import ENV_SOCKET, ENV_TOKEN

    class CrashingTrainer:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    monkeypatch.delenv(ENV_SOCKET, raising=False)
    monkeypatch.delenv(ENV_TOKEN, raising=False)
    monkeypatch.setattr(trainer.loop, "Trainer", CrashingTrainer)
    with pytest.raises(RuntimeError):
        trainer.main.main(["--config", str(QUICKSTART), f"trainer.runs_dir={tmp_path}"])
    text = next(tmp_path.glob("*/logs/trainer.log")).read_text()
    assert "ERROR the trainer crashed: RuntimeError: probability tensor" in text
    assert "Traceback (most recent call last):" in text and "in __init__" in text
    assert last_error_line(text) == "RuntimeError: probability tensor contains either inf, nan or element < 0"
