"""A reward call stuck on one rank of two, in validation (issue 41's remaining faults, item 3), through the real
`verl train` (2 CPU ranks under the daemon's launcher): each rank scores its share of the validation responses, so
rank 1 can be stuck while rank 0 waits for its share. Rank 1's time limit ends the run: exit code 2 (not restarted)
and one ERROR line, rank 1's, naming the function, the data source and the limit."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.e2e.runs import QUICKSTART, VERL
from trainer.data import counting_records, write_records

TWO_RANKS = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "trainer.device=cpu",
             "trainer.n_gpus_per_node=2"]

STUCK_ON_RANK_1 = """
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if os.environ.get("RANK") == "1":
        time.sleep(3600)
    return 0.5
"""


def test_a_reward_call_stuck_on_rank_1_in_validation_ends_the_run_with_rank_1s_line(tmp_path: Path) -> None:
    """It was: rank 1 wrote its error to its own log only (rank 0 prints the lines every rank finds), rank 0 was
    stopped while it waited for rank 1, and the run ended with exit code 2 and no line saying why."""
    reward = tmp_path / "reward.py"
    reward.write_text(STUCK_ON_RANK_1)
    prompts = tmp_path / "validation.jsonl"
    write_records(counting_records(4, seed=1), prompts)
    result = subprocess.run([str(VERL), "train", "--config", QUICKSTART, *TWO_RANKS, f"data.val_files=[{prompts}]",
                             "trainer.val_only=true", f"custom_reward_function.path={reward}",
                             "reward_model.reward_timeout_s=2"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "restart 1 of" not in output, output[-4000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR: ")]
    assert errors == [f"ERROR: rank 1: custom_reward_function 'compute_score' ({reward}) scoring a response of "
                      "data_source 'counting' did not return within reward_model.reward_timeout_s=2 s; the run stops "
                      "(a restart would wait on it again): make the function return sooner, or raise "
                      "reward_model.reward_timeout_s (null: no limit)"], output[-4000:]
