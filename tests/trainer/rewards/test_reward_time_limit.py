"""A user's reward function has a time limit (issue 41, item 4): a stuck call ends the run with one error naming the
function, the data source and the limit; a stop during a stuck call still checkpoints the last completed step."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from trainer.checkpoint import list_checkpoints
from trainer.config import load_config
from trainer.loop import Trainer
from trainer.rewards.time_limit import RewardTimeoutError, StepInterrupted, call_with_time_limit

TINY = [
    "actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
    "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "data.max_prompt_length=8",
    "data.max_response_length=4", "trainer.device=cpu", "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=2", "trainer.save_freq=-1",
]

# Scores the first `FREE` responses, then (a marker file written) sleeps for ever: compute_score hanging mid-run.
STUCK_REWARD = """
import pathlib, time
FREE = {free}
calls = 0

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls += 1
    if calls > FREE:
        pathlib.Path({marker!r}).touch()
        time.sleep(3600)
    return 0.5
"""


def reward_file(tmp_path, free: int):
    path = tmp_path / "stuck_reward.py"
    path.write_text(STUCK_REWARD.format(free=free, marker=str(tmp_path / "stuck")))
    return path


def test_a_reward_call_that_hangs_ends_the_run_naming_the_function_the_data_source_and_the_limit(tmp_path):
    """Probe 2: compute_score sleeping for ever hung the run (nothing reported for 150 s, then restarted into the
    same hang). Now the call is abandoned at the limit and the run stops with a user error (exit 2)."""
    config = load_config(None, [*TINY, f"trainer.runs_dir={tmp_path}", "trainer.total_training_steps=1",
                                f"custom_reward_function.path={reward_file(tmp_path, free=0)}",
                                "reward_model.reward_timeout_s=0.5"])
    trainer = Trainer(config, log=lambda *_: None, warn=lambda *_: None)
    start = time.monotonic()
    with pytest.raises(RewardTimeoutError) as caught:
        trainer.fit()
    assert time.monotonic() - start < 30
    message = str(caught.value)
    assert "custom_reward_function 'compute_score'" in message and "stuck_reward.py" in message
    assert "data_source 'counting'" in message  # the built-in prompts' data source
    assert "did not return within reward_model.reward_timeout_s=0.5 s" in message


def test_a_stop_during_a_stuck_reward_call_checkpoints_the_last_completed_step(tmp_path):
    """Probe 2: `verl stop --wait` during a stuck compute_score waited 300 s and killed the trainer without a
    checkpoint. Now the stop abandons the step and the last completed one (step 1) is saved, its prompt order as
    after step 1, so a resume redoes step 2 from its start."""
    config = load_config(None, [*TINY, f"trainer.runs_dir={tmp_path}", "trainer.total_training_steps=3",
                                f"custom_reward_function.path={reward_file(tmp_path, free=8)}"])
    trainer = Trainer(config, log=lambda *_: None, warn=lambda *_: None)

    def stop_once_stuck() -> None:
        while not (tmp_path / "stuck").exists():
            time.sleep(0.05)
        trainer.control.request_stop()

    threading.Thread(target=stop_once_stuck, daemon=True).start()
    trainer.fit()
    assert trainer.step == 1
    checkpoints = list_checkpoints(trainer.checkpointer.directory)
    assert [step for step, _ in checkpoints] == [1]
    state = torch.load(checkpoints[0][1] / "trainer_state.pt", weights_only=False)
    assert state["sampler"]["position"] == 1  # one batch drawn: the abandoned step's draw was undone


def test_what_the_function_raises_is_raised_and_no_limit_calls_on_this_thread():
    def fails():
        raise KeyError("x")

    with pytest.raises(KeyError):
        call_with_time_limit(fails, (), {}, limit_s=5, what=lambda: "f")
    assert call_with_time_limit(threading.current_thread, (), {}, limit_s=None, what=lambda: "f") \
        is threading.current_thread()
    with pytest.raises(StepInterrupted, match="while f was running"):
        call_with_time_limit(time.sleep, (5,), {}, limit_s=10, what=lambda: "f", stopping=lambda: True)
