"""The reward time limit with verl's batched managers (issue 41's remaining faults, item 4): `batch` calls the
function once for the batch, within one reward_model.reward_timeout_s; `prime` keeps verl's own deadline for each
response (a late one scores 0 and the run goes on), which reward_model.reward_timeout_s does not shorten."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from trainer.config import load_config
from trainer.data import PromptRecord
from trainer.models import load_tokenizer
from trainer.rewards.custom import CustomScore
from trainer.rewards.managers import BatchReward, PrimeReward, RemoteReward, build_rule_reward
from trainer.rewards.time_limit import MAX_LOST_THREADS, RewardThreadsExhausted, RewardTimeoutError
from trainer.rollout.batch import RolloutBatch

TOKENIZER = load_tokenizer("builtin:tiny-qwen2")

FUNCTIONS = """
import time
def score_all(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    time.sleep(0.2 * len(solution_strs))  # each response takes 0.2 s: the batch, 0.8 s
    return [1.0] * len(solution_strs)

def hangs(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(60)

def slow_one(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "slow":
        time.sleep(1.5)
    return float(solution_str == ground_truth) + 0.5
"""


def batch_of(truths: list[str]) -> RolloutBatch:
    """One response ("1", then EOS) to one prompt each."""
    response_ids = torch.tensor([TOKENIZER.convert_tokens_to_ids(["1"]) + [TOKENIZER.eos_token_id]] * len(truths))
    prompt_ids = torch.tensor([TOKENIZER.convert_tokens_to_ids(["1", "+"])] * len(truths))
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), response_ids=response_ids,
                        response_mask=torch.ones_like(response_ids, dtype=torch.float32),
                        group_index=torch.arange(len(truths)),
                        records=[PromptRecord(prompt="1 +", data_source="counting", ground_truth=truth)
                                 for truth in truths])


def functions(tmp_path: Path) -> Path:
    path = tmp_path / "scoring.py"
    path.write_text(FUNCTIONS, encoding="utf-8")
    return path


def test_the_batch_manager_s_one_call_has_one_limit_for_the_whole_batch(tmp_path: Path) -> None:
    """Each response's 0.2 s is within a 0.5 s limit; the batch's 0.8 s is not, and ends the run as a single
    stuck call does (the limit is the call's, not each response's)."""
    config = load_config(None, ["reward_model.reward_manager=batch", "reward_model.reward_timeout_s=0.5",
                                f"custom_reward_function.path={functions(tmp_path)}",
                                "custom_reward_function.name=score_all"])
    reward = build_rule_reward(config, TOKENIZER)
    assert isinstance(reward, BatchReward)
    assert reward(batch_of(["1", "1"])).tolist() == [1.0, 1.0]  # 0.4 s
    with pytest.raises(RewardTimeoutError) as caught:
        reward(batch_of(["1"] * 4))
    assert str(caught.value).startswith(
        f"custom_reward_function 'score_all' ({tmp_path / 'scoring.py'}) scoring a batch of 4 responses (data_source "
        "'counting') did not return within reward_model.reward_timeout_s=0.5 s")


def test_prime_keeps_verls_deadline_for_each_response_not_the_reward_time_limit(tmp_path: Path) -> None:
    """It was: the function's calls in prime's worker processes carried reward_model.reward_timeout_s too, so a
    response that took 1.5 s of prime's 300 scored 0 (and left a thread stuck in the worker)."""
    config = load_config(None, ["reward_model.reward_manager=prime", "reward_model.reward_timeout_s=0.5",
                                f"custom_reward_function.path={functions(tmp_path)}",
                                "custom_reward_function.name=slow_one"])
    warnings: list[str] = []
    reward = build_rule_reward(config, TOKENIZER, warn=warnings.append)
    assert isinstance(reward, PrimeReward)
    try:
        start = time.monotonic()
        assert reward(batch_of(["1", "slow"])).tolist() == [1.5, 0.5]
        assert time.monotonic() - start >= 1.5
        assert reward.errors == 0 and warnings == []
    finally:
        reward.close()


def test_remote_stops_the_run_once_a_worker_has_no_thread_left_to_give_even_with_on_error_zero(tmp_path: Path) -> None:
    """remote scores in worker processes, each call within reward_model.reward_timeout_s there; with on_error: zero a
    stuck call scores 0 and leaves its thread behind in the worker. It was: past the bound of lost threads, every
    later response of that worker scored 0 at once, under the one warning already given. Now the refusal is the
    run's error."""
    reward = RemoteReward(TOKENIZER, CustomScore(str(functions(tmp_path)), "hangs", timeout_s=0.1), processes=1,
                          on_error="zero", warn=lambda _: None)
    try:
        with pytest.raises(RewardThreadsExhausted, match=r"^reward_model.reward_manager remote: a response was refused "
                                                         rf"in a worker: {MAX_LOST_THREADS} calls of the reward "
                                                         "function that did not return within"):
            reward(batch_of(["1"] * (MAX_LOST_THREADS + 1)))
        assert reward.errors == MAX_LOST_THREADS  # the stuck ones, each scored 0 as on_error: zero says
    finally:
        reward.close()
