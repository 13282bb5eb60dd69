"""A trainer that hangs is noticed: a user's reward function that sleeps stops the heartbeats, the daemon has the
trainer write its Python stacks to logs/trainer.log, kills it and restarts it from its latest checkpoint."""

from __future__ import annotations

import json

from tests.e2e.runs import verl_train

SLEEPING_REWARD = '''\
import os
import time

from trainer.rewards import default_compute_score

HANG = {hang!r}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if os.path.exists(HANG):  # once: the restarted trainer scores as usual
        os.remove(HANG)
        time.sleep(3600)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
'''


def test_a_hung_trainer_dumps_its_stacks_and_is_restarted_from_its_checkpoint(tmp_path):
    hang = tmp_path / "hang-now"
    reward = tmp_path / "sleepy_reward.py"
    reward.write_text(SLEEPING_REWARD.format(hang=str(hang)))
    total = 8
    with verl_train(tmp_path, f"trainer.total_training_steps={total}", "trainer.save_freq=2",
                    f"custom_reward_function.path={reward}", "daemon.hang_timeout_s=6") as run:
        run.wait(lambda: run.step() >= 2, what="step 2")
        hung = run.runtime()["trainer_pids"][0]
        hang.touch()
        run.wait(lambda: run.runtime()["trainer_pids"] and run.runtime()["trainer_pids"][0] != hung, timeout=90,
                 what="a new trainer")
        assert 'verl_trainer_restarts_total{reason="hang"} 1.0' in run.get("/metrics").text
        assert run.json("/v1/status")["restarts"]["by_reason"]["hang"] == 1
        assert run.process.wait(timeout=180) == 0, run.output()
    trainer_log = (run.run_dir / "logs" / "trainer.log").read_text()
    marker = trainer_log.index(f"the verl daemon heard nothing from trainer pid {hung}")
    stacks = trainer_log[marker:]
    assert "most recent call first" in stacks and "in compute_score" in stacks, stacks[:3000]
    sleep_line = SLEEPING_REWARD.splitlines().index("        time.sleep(3600)") + 1
    assert f'sleepy_reward.py", line {sleep_line} in compute_score' in stacks  # where it is stuck
    daemon_log = (run.run_dir / "logs" / "daemon.log").read_text()
    assert f"the trainer (pid {hung}) sent no heartbeat for" in daemon_log
    assert "resumed from runs/quickstart/checkpoints/global_step_" in run.output()
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, total + 1))
