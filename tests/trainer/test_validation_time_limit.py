"""A stuck reward call during validation (issue 41's remaining faults, item 3): it is bounded by
reward_model.reward_timeout_s with the training's one-line error (the function, the validation prompts' data source,
the limit), and a stop while it is stuck still checkpoints the step validation followed."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from trainer.checkpoint import list_checkpoints
from trainer.config import load_config
from trainer.data import write_records
from trainer.data.builtin import counting_records
from trainer.loop import Trainer
from trainer.rewards.time_limit import RewardTimeoutError

ARO = "actor_rollout_ref"
TINY = [
    f"{ARO}.model.override_config={{num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}}",
    "data.train_batch_size=4", f"{ARO}.actor.ppo_mini_batch_size=4", f"{ARO}.actor.ppo_micro_batch_size_per_gpu=4",
    "data.max_prompt_length=8", "data.max_response_length=4", "trainer.device=cpu", "trainer.save_freq=-1",
    "algorithm.adv_estimator=grpo", f"{ARO}.rollout.n=2", "data.val_batch_size=2",
]

# Scores the first `FREE` responses (a step's training), then (a marker file written) sleeps for ever.
STUCK_REWARD = """
import pathlib, time
calls = 0

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls += 1
    if calls > {free}:
        pathlib.Path({marker!r}).touch()
        time.sleep(3600)
    return 0.5
"""


def overrides(tmp_path: Path, free: int, *more: str) -> list[str]:
    reward = tmp_path / "stuck_reward.py"
    reward.write_text(STUCK_REWARD.format(free=free, marker=str(tmp_path / "stuck")))
    prompts = tmp_path / "validation.jsonl"
    # The counting task's prompts (the tiny tokenizer's words) under a data source of their own.
    write_records([replace(record, data_source="held_out_counting") for record in counting_records(2, seed=1)],
                  prompts)
    return [*TINY, f"data.val_files=[{prompts}]", f"trainer.runs_dir={tmp_path / 'runs'}",
            f"custom_reward_function.path={reward}", *more]


def test_a_stuck_reward_call_in_validation_ends_the_run_naming_the_function_the_data_source_and_the_limit(tmp_path):
    config = load_config(None, overrides(tmp_path, 0, "trainer.val_before_train=true", "trainer.val_only=true",
                                         "trainer.total_training_steps=1", "reward_model.reward_timeout_s=0.5"))
    trainer = Trainer(config, log=lambda *_: None, warn=lambda *_: None)
    start = time.monotonic()
    with pytest.raises(RewardTimeoutError) as caught:
        trainer.fit()
    assert time.monotonic() - start < 30
    assert str(caught.value).startswith(
        f"custom_reward_function 'compute_score' ({tmp_path / 'stuck_reward.py'}) scoring a response of data_source "
        "'held_out_counting' did not return within reward_model.reward_timeout_s=0.5 s; the run stops")


def test_a_stop_during_a_stuck_validation_call_checkpoints_the_step_it_followed(tmp_path):
    """It was: the stop's StepInterrupted went up through the loop uncaught (a crash, the trained step not saved)."""
    config = load_config(None, overrides(tmp_path, 8, "trainer.test_freq=1", "trainer.total_training_steps=3",
                                         "trainer.val_before_train=false"))
    logged: list[str] = []
    trainer = Trainer(config, log=logged.append, warn=lambda *_: None)

    def stop_once_stuck() -> None:
        while not (tmp_path / "stuck").exists():
            time.sleep(0.05)
        trainer.control.request_stop()

    threading.Thread(target=stop_once_stuck, daemon=True).start()
    trainer.fit()
    assert trainer.step == 1
    assert [step for step, _ in list_checkpoints(trainer.checkpointer.directory)] == [1]
    [row] = trainer.metrics_log.read()
    assert row["step"] == 1 and not any(key.startswith("val-") for key in row)
    assert any(line.endswith("validation at step 1 is abandoned; the step is checkpointed") for line in logged)
