"""One daemon owns a run directory, and its trainer lives no longer than it: a second `verl train` on the run
directory refuses, a killed daemon takes its trainer with it (after a checkpoint) and the next `verl train` takes
over the lock it left, and a signal to the whole process group is one checkpointed stop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil

from tests.e2e.runs import QUICKSTART, SMALL_RUN, VERL, LiveRun, verl_train, wait_for


def trainer_pid(run: LiveRun) -> int:
    return run.wait(lambda: run.runtime()["trainer_pids"] and run.runtime()["trainer_pids"][0], what="the trainer")


def running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may never reap an orphan)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stopped_step(run_dir: Path, total: int) -> int:
    """The step of the trainer's "stopped ... on request; checkpoint saved" line in its log."""
    log = (run_dir / "logs" / "trainer.log").read_text()
    stopped = re.search(rf"stopped at step (\d+)/{total} on request; checkpoint saved", log)
    assert stopped, log[-3000:]
    return int(stopped[1])


def test_a_second_verl_train_on_the_run_directory_refuses_in_one_line(tmp_path):
    with verl_train(tmp_path, "trainer.total_training_steps=2000") as run:
        run.wait(lambda: run.step() >= 1, what="step 1")
        config = (run.run_dir / "config.yaml").read_text()
        second = subprocess.run([str(VERL), "train", "--config", QUICKSTART, *SMALL_RUN,
                                 "trainer.total_training_steps=5"], cwd=tmp_path, env=run.env, capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        lines = second.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("ERROR: run directory "), second.stderr
        assert f"`verl train` pid {run.process.pid}" in lines[0] and "trainer.experiment_name" in lines[0]
        # The run goes on, with its own config.
        assert (run.run_dir / "config.yaml").read_text() == config
        assert run.process.poll() is None
        assert json.loads((run.run_dir / "daemon.lock").read_text())["pid"] == run.process.pid


def test_a_killed_daemon_takes_its_trainer_with_it_and_the_next_run_takes_over(tmp_path):
    with verl_train(tmp_path, "trainer.total_training_steps=2000", "trainer.save_freq=1000") as run:
        run.wait(lambda: run.step() >= 3, what="step 3")
        trainer, daemon = trainer_pid(run), run.process.pid
        run.process.kill()
        run.process.wait()
        wait_for(lambda: not running(trainer), timeout=60, what="the orphaned trainer to exit")
    step = stopped_step(run.run_dir, 2000)
    assert (run.run_dir / "checkpoints" / f"global_step_{step}").is_dir()
    assert (tmp_path / "state" / "run" / f"{daemon}.sock").exists()  # what the killed daemon left

    with verl_train(tmp_path, f"trainer.total_training_steps={step + 3}", output="resumed.out") as resumed:
        assert resumed.process.wait(timeout=180) == 0, resumed.output()
    assert f"resumed from runs/quickstart/checkpoints/global_step_{step} at step {step}" in resumed.output()
    assert f"daemon.lock from pid {daemon}, which is no longer running" in (
        run.run_dir / "logs" / "daemon.log").read_text()
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, step + 4))  # no step twice, none from a second trainer
    assert not (tmp_path / "state" / "run" / f"{daemon}.sock").exists()


def test_a_sigterm_to_the_whole_process_group_is_one_checkpointed_stop(tmp_path):
    """As `timeout` and Ctrl-C do: the daemon's group gets the signal (here twice), the trainer is not in it."""
    with verl_train(tmp_path, "trainer.total_training_steps=2000", "trainer.save_freq=1000",
                    new_session=True) as run:
        run.wait(lambda: run.step() >= 2, what="step 2")
        trainer = trainer_pid(run)
        assert os.getpgid(trainer) != os.getpgid(run.process.pid)
        daemon_log = run.run_dir / "logs" / "daemon.log"
        os.killpg(run.process.pid, signal.SIGTERM)
        # The second once the first is handled: two signals sent at once arrive as one.
        run.wait(lambda: "received SIGTERM" in daemon_log.read_text(), what="the first signal handled")
        os.killpg(run.process.pid, signal.SIGTERM)
        assert run.process.wait(timeout=120) == 0, run.output()
    step = stopped_step(run.run_dir, 2000)
    assert (run.run_dir / "checkpoints" / f"global_step_{step}").is_dir()
    log = daemon_log.read_text()
    assert "received SIGTERM again within daemon.force_stop_grace_s" in log and "killing" not in log
    assert f"trainer pid {trainer} exited with code 0" in log


def test_a_repeated_signal_once_the_trainer_has_stopped_leaves_the_exit_code_and_the_summary(tmp_path):
    """`timeout` signalling the group and then the pid, a second Ctrl-C: a repeat that lands while the daemon
    tears down after a clean stop is the same stop; it used to kill the daemon (exit 143, no summary)."""
    with verl_train(tmp_path, "trainer.total_training_steps=2000", "trainer.save_freq=1000",
                    new_session=True) as run:
        run.wait(lambda: run.step() >= 2, what="step 2")
        daemon_log = run.run_dir / "logs" / "daemon.log"
        os.kill(run.process.pid, signal.SIGTERM)
        run.wait(lambda: "exited with code 0" in daemon_log.read_text(), what="the trainer's exit")
        for _ in range(20):  # through the daemon's teardown, until it has exited
            if run.process.poll() is not None:
                break
            os.kill(run.process.pid, signal.SIGTERM)
            time.sleep(0.05)
        assert run.process.wait(timeout=60) == 0, run.output()
    assert "last reward" in run.output()
