"""Each of verl's reward managers (reward_model.reward_manager) scores a real training step on the CPU, with the
tiny model: the scores the advantages start from (critic/score/mean) are the manager's, worked out by hand, and what
the manager reports is in the step's metrics under verl's names (and, with trainer.rollout_data_dir, in the step's
dumped responses)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.data import write_records
from trainer.data.builtin import counting_records
from trainer.loop import Trainer
from trainer.rewards.managers import PrimeReward

ARO = "actor_rollout_ref"
KWARGS = "+reward_model.reward_kwargs"
TINY = [
    f"{ARO}.model.override_config={{num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}}",
    "data.train_batch_size=2", f"{ARO}.actor.ppo_mini_batch_size=2", f"{ARO}.actor.ppo_micro_batch_size_per_gpu=4",
    "data.max_prompt_length=8", "data.max_response_length=4", "trainer.device=cpu", "trainer.save_freq=-1",
    "trainer.total_training_steps=1", "algorithm.adv_estimator=grpo", f"{ARO}.rollout.n=2",
]
SCORING = """
def quarter(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return 0.25 * scale
def all_at_once(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
    return [{"score": 0.25 + bonus, "words": len(text.split())} for text in solution_strs]
"""


def trained(tmp_path: Path, *overrides: str) -> tuple[Trainer, dict[str, float]]:
    """One GRPO step on two counting prompts (two responses each) with the reward `overrides` set."""
    prompts, scoring = tmp_path / "train.jsonl", tmp_path / "scoring.py"
    write_records(counting_records(2, seed=3), prompts)
    scoring.write_text(SCORING, encoding="utf-8")
    config = load_config(None, [*TINY, f"data.train_files=[{prompts}]", f"trainer.runs_dir={tmp_path / 'runs'}",
                                *(line.replace("SCORING", str(scoring)) for line in overrides)])
    trainer = Trainer(config, log=lambda *_: None, warn=lambda *_: None)
    try:
        trainer.fit()
    finally:
        if isinstance(trainer.models.reward, PrimeReward):
            trainer.models.reward.close()
    [row] = trainer.metrics_log.read()
    assert math.isfinite(row["actor/pg_loss"]) and row["reward/errors"] == 0
    return trainer, row


@pytest.mark.parametrize("manager", ["naive", "prime", "remote"])
def test_naive_prime_and_remote_score_each_response_with_the_function(tmp_path: Path, manager: str) -> None:
    _, row = trained(tmp_path, f"reward_model.reward_manager={manager}", "custom_reward_function.path=SCORING",
                     "custom_reward_function.name=quarter", "+custom_reward_function.reward_kwargs.scale=2")
    assert row["critic/score/mean"] == pytest.approx(0.5), "the function's reward_kwargs reach it, in workers too"


def test_batch_scores_the_batch_with_the_reward_kwargs_and_reports_what_the_function_does(tmp_path: Path) -> None:
    _, row = trained(tmp_path, "reward_model.reward_manager=batch", "custom_reward_function.path=SCORING",
                     "custom_reward_function.name=all_at_once", f"{KWARGS}.bonus=0.5")
    assert row["critic/score/mean"] == pytest.approx(0.75)
    assert 0 <= row["reward/words/mean"] <= 4


def test_dapo_trains_on_the_counting_score_less_the_overlong_penalty(tmp_path: Path) -> None:
    buffer, dumps = f"{KWARGS}.overlong_buffer_cfg", tmp_path / "rollouts"
    _, row = trained(tmp_path, "reward_model.reward_manager=dapo", f"{KWARGS}.max_resp_len=4", f"{buffer}.enable=True",
                     f"{buffer}.len=2", f"{buffer}.penalty_factor=1.0", f"{buffer}.log=True",
                     f"trainer.rollout_data_dir={dumps}")
    assert row["critic/score/mean"] == pytest.approx(row["reward/acc/mean"] + row["reward/overlong_reward/mean"])
    # A response of L tokens (EOS included) past 4 - 2 loses (L - 2) / 2: 0.5 at L = 3, 1 at L = 4, none below.
    overlong, penalty = row["reward/overlong/mean"], row["reward/overlong_reward/mean"]
    assert overlong > 0, "the untrained model's responses run into the buffer"
    assert -overlong <= penalty <= -0.5 * overlong
    # trainer.rollout_data_dir: the step's four responses as verl dumps them, with what dapo reported.
    lines = [json.loads(line) for line in (dumps / "1.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 4 and all(line["step"] == 1 and line["input"] and line["gts"] for line in lines)
    assert all(line["score"] == pytest.approx(line["acc"] + line["overlong_reward"]) for line in lines)
    assert sum(line["score"] for line in lines) / 4 == pytest.approx(row["critic/score/mean"])
