"""A failure of rank 1 alone, through the real `verl train` on 2 CPU ranks (issue 41, item 2): its cause is where the
user looks, the daemon's "exited with code N" line, /v1/status and the monitor, and its traceback is in trainer.log
(trainer/distributed/failed_rank.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.e2e.runs import VERL, verl_train

TWO_RANKS = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
             "trainer.total_training_steps=2"]

CRASH_ON_RANK_1 = """
import os

import torch


def _broken_backward(self, *args, **kwargs):
    raise RuntimeError("injected on rank 1")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if os.environ.get("RANK") == "1":  # rank 1's update crashes: a fault of that rank alone
        torch.Tensor.backward = _broken_backward
    return 0.5
"""


def test_a_crash_of_rank_1_alone_is_the_cause_in_daemon_log_status_monitor_and_trainer_log(tmp_path: Path) -> None:
    """It was: rank 0 then failed in its next collective (gloo's "Connection closed by peer"), its traceback was the
    last in trainer.log, and daemon.log, /v1/status and the monitor gave that as the cause; rank 1's traceback was in
    trainer-rank1.log alone."""
    reward = tmp_path / "reward.py"
    reward.write_text(CRASH_ON_RANK_1)
    cause = "RuntimeError: injected on rank 1"
    # A long back-off: the daemon waits with the failure in /v1/status, where the test reads it.
    with verl_train(tmp_path, *TWO_RANKS, f"custom_reward_function.path={reward}", "daemon.restart_backoff_s=300",
                    "daemon.restart_backoff_max_s=300") as run:
        run.wait(lambda: run.json("/v1/status")["restarts"]["last_failure"], timeout=300, what="the group's failure")
        assert run.json("/v1/status")["restarts"]["last_failure"] == cause
        view = subprocess.run([str(VERL), "monitor", "--pid", str(run.process.pid), "--once"], capture_output=True,
                              text=True, timeout=60, env={**run.env, "COLUMNS": "200"})  # the line unwrapped
        assert f"last failure: {cause}" in view.stdout, view.stdout
        assert f"last failure: {cause}" in run.verl("status", "--pid", str(run.process.pid)).stdout
        daemon_log = (run.run_dir / "logs" / "daemon.log").read_text()
        assert f"exited with code 1: {cause}" in daemon_log, daemon_log
        trainer_log = (run.run_dir / "logs" / "trainer.log").read_text()
        mark = trainer_log.index("ERROR rank 1 failed first (exit code 1), and the group ended with it")
        rank_1 = trainer_log[mark:]
        assert "the trainer crashed: RuntimeError: injected on rank 1" in rank_1
        assert 'raise RuntimeError("injected on rank 1")' in rank_1  # its traceback, down to the user's frame
        assert rank_1.rstrip().endswith(cause)
