"""verl's reward managers (trainer/rewards/managers.py): naive, dapo, prime and batch, chosen by
reward_model.reward_manager as verl's scripts write it, each against scores worked out by hand."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch

from trainer.config import ConfigError, RunConfig, load_config
from trainer.config.schema import OverlongBuffer, RewardModelConfig
from trainer.data import PromptRecord
from trainer.models import load_tokenizer
from trainer.rewards import CustomRewardError, RewardFunctionError, default_compute_score
from trainer.rewards.custom import CustomScore
from trainer.rewards.manager import RuleReward
from trainer.rewards.managers import (
    REWARD_MANAGERS,
    BatchReward,
    DapoReward,
    PrimeReward,
    RemoteReward,
    build_rule_reward,
)
from trainer.rollout.batch import RolloutBatch

TOKENIZER = load_tokenizer("builtin:tiny-qwen2")
KWARGS = "+reward_model.reward_kwargs"


def batch_of(responses: list[str], truths: list[str], data_source: str = "counting") -> RolloutBatch:
    """The responses (words of the tiny vocabulary), each ended by EOS and right-padded, to one prompt each."""
    rows = [TOKENIZER.convert_tokens_to_ids(text.split()) + [TOKENIZER.eos_token_id] for text in responses]
    width = max(len(row) for row in rows)
    response_ids = torch.tensor([row + [TOKENIZER.pad_token_id] * (width - len(row)) for row in rows])
    response_mask = torch.tensor([[1.0] * len(row) + [0.0] * (width - len(row)) for row in rows])
    prompt_ids = torch.tensor([TOKENIZER.convert_tokens_to_ids(["1", "+"])] * len(rows))
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), response_ids=response_ids,
                        response_mask=response_mask, group_index=torch.arange(len(rows)),
                        records=[PromptRecord(prompt="1 +", data_source=data_source, ground_truth=truth)
                                 for truth in truths])


def write_function(tmp_path: Path, source: str) -> str:
    path = tmp_path / "scoring.py"
    path.write_text(source, encoding="utf-8")
    return str(path)


# ----------------------------------------------------------------------------------------- naive


def test_naive_reports_what_a_dict_result_holds_besides_the_score(tmp_path: Path) -> None:
    path = write_function(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                    "    right = solution_str == ground_truth\n"
                                    "    return {'score': 2.0 if right else -1.0, 'pred': solution_str}\n")
    reward = RuleReward(TOKENIZER, CustomScore(path, "compute_score"))
    scored = reward.score(batch_of(["1 2", "3"], ["1 2", "1 2"]))
    assert scored.scores.tolist() == [2.0, -1.0]
    assert scored.extra == [{"score": 2.0, "pred": "1 2"}, {"score": -1.0, "pred": "3"}]
    assert scored.metrics() == {"reward/score/mean": 0.5}, "a number is averaged, an answer is not"


# ------------------------------------------------------------------------------------------ dapo


def test_dapo_adds_the_overlong_penalty_and_reports_the_raw_score_as_acc() -> None:
    # Lengths with EOS: 2, 5, 7 tokens. max_resp_len 6 and a buffer of 4: free up to 2 tokens, then -(L - 2) / 4.
    batch = batch_of(["0", "0 1 2 3", "0 1 2 3 4 5"], ["0", "0 1 2 3", "0 1 2 3"])
    reward = DapoReward(TOKENIZER, default_compute_score, max_response_length=6,
                        buffer=OverlongBuffer(enable=True, len=4, penalty_factor=1.0, log=True))
    scored = reward.score(batch)
    # counting: 1 for the right words, 4/6 for four right of six words.
    assert scored.scores.tolist() == pytest.approx([1.0, 1.0 - 0.75, 4 / 6 - 1.25])
    assert [reported["acc"] for reported in scored.extra] == pytest.approx([1.0, 1.0, 4 / 6])
    assert [reported["overlong_reward"] for reported in scored.extra] == [0.0, -0.75, -1.25]
    assert [reported["overlong"] for reported in scored.extra] == [False, True, True]
    assert scored.metrics() == pytest.approx({"reward/acc/mean": (2 + 4 / 6) / 3, "reward/overlong_reward/mean": -2 / 3,
                                              "reward/overlong/mean": 2 / 3})


def test_dapo_without_the_buffer_scores_as_naive_and_logs_no_penalty() -> None:
    batch = batch_of(["0 1 2 3 4 5"], ["0 1 2 3"])
    quiet = DapoReward(TOKENIZER, default_compute_score, max_response_length=6,
                       buffer=OverlongBuffer(enable=True, len=4, penalty_factor=0.5))
    assert quiet.score(batch).scores.tolist() == pytest.approx([4 / 6 - 0.625])
    assert quiet.score(batch).extra == [{"acc": pytest.approx(4 / 6)}], "log: false reports no penalty"
    off = DapoReward(TOKENIZER, default_compute_score, max_response_length=None, buffer=OverlongBuffer())
    assert off.score(batch).scores.tolist() == pytest.approx([4 / 6])


def test_verls_dapo_lines_build_the_dapo_manager_with_its_buffer() -> None:
    buffer = f"{KWARGS}.overlong_buffer_cfg"
    config = load_config(None, ["reward_model.reward_manager=dapo", f"{buffer}.enable=True", f"{buffer}.len=4",
                                f"{buffer}.penalty_factor=1.0", f"{buffer}.log=False", f"{KWARGS}.max_resp_len=6"])
    reward = build_rule_reward(config, TOKENIZER)
    assert isinstance(reward, DapoReward)
    scores = reward(batch_of(["0 1 2 3"], ["0 1 2 3"]))
    assert scores.tolist() == pytest.approx([0.25]), "1 less (5 - 2) / 4"


# ----------------------------------------------------------------------------------------- batch

BATCH_FUNCTION = """
calls = []
def score_all(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
    calls.append(len(solution_strs))
    assert len(calls) == 1 or calls[-1] > 0
    return [{"score": float(text == truth) + bonus, "length": len(text.split())}
            for text, truth in zip(solution_strs, ground_truths)]
def too_few(data_sources, solution_strs, ground_truths, extra_infos):
    return [1.0]
def broken(data_sources, solution_strs, ground_truths, extra_infos):
    raise RuntimeError("the judge is down")
"""


def test_batch_scores_the_whole_batch_in_one_call_with_the_reward_kwargs(tmp_path: Path) -> None:
    path = write_function(tmp_path, BATCH_FUNCTION)
    config = load_config(None, ["reward_model.reward_manager=batch", f"custom_reward_function.path={path}",
                                "custom_reward_function.name=score_all", f"{KWARGS}.bonus=0.5"])
    reward = build_rule_reward(config, TOKENIZER)
    assert isinstance(reward, BatchReward)
    scored = reward.score(batch_of(["1 2", "3", "4 5 6"], ["1 2", "1 2", "4 5 6"]))
    assert scored.scores.tolist() == [1.5, 0.5, 1.5]
    assert [reported["length"] for reported in scored.extra] == [2, 1, 3]
    assert typing.cast(typing.Any, reward).function.__globals__["calls"] == [3], "one call for the batch"


def test_batch_refuses_a_result_per_response_missing_and_passes_on_what_the_function_raises(tmp_path: Path) -> None:
    path = write_function(tmp_path, BATCH_FUNCTION)
    from trainer.rewards import load_custom_score

    short = BatchReward(TOKENIZER, load_custom_score(path, "too_few"), {}, path=path, name="too_few")
    with pytest.raises(CustomRewardError, match="returned 1 results for a batch of 2 responses"):
        short(batch_of(["1", "2"], ["1", "2"]))
    broken = BatchReward(TOKENIZER, load_custom_score(path, "broken"), {}, path=path, name="broken")
    with pytest.raises(RewardFunctionError, match="RuntimeError: the judge is down .scoring a batch of 2 responses"):
        broken(batch_of(["1", "2"], ["1", "2"]))
    warnings: list[str] = []
    zeroed = BatchReward(TOKENIZER, load_custom_score(path, "broken"), {}, path=path, name="broken", on_error="zero",
                         warn=warnings.append)
    assert zeroed(batch_of(["1", "2"], ["1", "2"])).tolist() == [0.0, 0.0]
    assert zeroed.errors == 2 and len(warnings) == 1 and "reward/errors" in warnings[0]


# ----------------------------------------------------------------------------------------- prime

PRIME_FUNCTION = """
import time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "raise":
        raise ValueError("no such answer")
    if ground_truth == "hang":
        time.sleep(60)
    return float(solution_str == ground_truth)
"""


def test_prime_scores_in_worker_processes_and_scores_a_failure_or_a_late_response_zero(tmp_path: Path) -> None:
    path = write_function(tmp_path, PRIME_FUNCTION)
    warnings: list[str] = []
    reward = PrimeReward(TOKENIZER, CustomScore(path, "compute_score"), processes=2, timeout_s=1.5,
                         warn=warnings.append)
    try:
        scores = reward(batch_of(["1", "2", "3", "4"], ["1", "raise", "hang", "5"]))
        assert scores.tolist() == [1.0, 0.0, 0.0, 0.0]
        assert reward.errors == 2
        assert any("ValueError: no such answer" in line for line in warnings)
        assert any("not scored within 1.5 s" in line for line in warnings)
        # The worker stuck on the late response was stopped; the next batch gets new ones.
        assert reward(batch_of(["7"], ["7"])).tolist() == [1.0] and reward.errors == 2
    finally:
        reward.close()


REMOTE_FUNCTION = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "raise":
        raise ValueError("no such answer")
    return {"score": float(solution_str == ground_truth), "words": len(solution_str.split())}
"""


def test_remote_scores_in_worker_processes_reports_a_dict_and_a_failure_is_the_runs_error(tmp_path: Path) -> None:
    path = write_function(tmp_path, REMOTE_FUNCTION)
    reward = RemoteReward(TOKENIZER, CustomScore(path, "compute_score"), processes=2)
    warnings: list[str] = []
    zeroed = RemoteReward(TOKENIZER, CustomScore(path, "compute_score"), processes=1, on_error="zero",
                          warn=warnings.append)
    try:
        scored = reward.score(batch_of(["1 2", "3"], ["1 2", "4"]))
        assert scored.scores.tolist() == [1.0, 0.0] and [extra["words"] for extra in scored.extra] == [2, 1]
        raised = "remote: a response was not scored: .*scoring.py:4 raised ValueError: no such answer"
        with pytest.raises(RewardFunctionError, match=raised):
            reward(batch_of(["1", "2"], ["1", "raise"]))
        assert zeroed(batch_of(["1", "2"], ["1", "raise"])).tolist() == [1.0, 0.0] and zeroed.errors == 1
        assert len(warnings) == 1 and "custom_reward_function.on_error: zero" in warnings[0]
    finally:
        reward.close()
        zeroed.close()


# -------------------------------------------------------------------------------------- the config


def test_the_schema_takes_exactly_the_registered_managers() -> None:
    assert set(typing.get_args(RewardModelConfig.model_fields["reward_manager"].annotation)) == set(REWARD_MANAGERS)


def test_verls_newer_place_of_the_managers_name_is_read_as_reward_model_reward_manager() -> None:
    assert load_config(None, ["reward_manager.name=prime"]).reward_model.reward_manager == "prime"
    with pytest.raises(ConfigError, match="reward_manager.name: got 'prime', but reward_model.reward_manager is "
                                          "'dapo'"):
        load_config(None, ["reward_manager.name=prime", "reward_model.reward_manager=dapo"])


@pytest.mark.parametrize(("overrides", "problems"), [
    (["reward_model.reward_manager=naive", f"{KWARGS}.max_resp_len=8"],
     {"reward_model.reward_kwargs.max_resp_len": "the naive reward manager (reward_model.reward_manager) takes no "
                                                 "such argument"}),
    (["reward_model.reward_manager=dapo", f"{KWARGS}.bonus=1"],
     {"reward_model.reward_kwargs.bonus": "allowed: max_resp_len, overlong_buffer_cfg, or leave the key out"}),
    (["reward_model.reward_manager=dapo", f"{KWARGS}.overlong_buffer_cfg.enable=True",
      f"{KWARGS}.overlong_buffer_cfg.len=4"],
     {"reward_model.reward_kwargs.max_resp_len": "is not set, but overlong_buffer_cfg.enable is true"}),
    (["reward_model.reward_manager=dapo", f"{KWARGS}.overlong_buffer_cfg.enable=True", f"{KWARGS}.max_resp_len=8"],
     {"reward_model.reward_kwargs.overlong_buffer_cfg.len": "got 0, but the buffer's penalty grows over its tokens"}),
    (["reward_model.reward_manager=dapo", f"{KWARGS}.overlong_buffer_cfg.enable=True", f"{KWARGS}.max_resp_len=8",
      f"{KWARGS}.overlong_buffer_cfg.len=9"],
     {"reward_model.reward_kwargs.overlong_buffer_cfg.len": "allowed: an integer >= 1 and <= 8"}),
    (["reward_model.reward_manager=batch"], {"reward_model.reward_manager": "custom_reward_function.path is not set"}),
    (["reward_model.reward_manager=judge"],
     {"reward_model.reward_manager": "'naive' or 'dapo' or 'prime' or 'batch' or 'remote'"}),
])
def test_a_manager_given_what_it_cannot_take_is_one_line_naming_the_key(overrides: list[str],
                                                                       problems: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    assert {problem.path for problem in caught.value.problems} == set(problems), caught.value.problems
    for problem in caught.value.problems:
        assert problems[problem.path] in problem.message and "allowed: " in problem.message


def test_the_resolved_config_of_a_batch_run_passes_only_the_keys_given() -> None:
    """The trainer reads the resolved config, every default written out: those are not the function's arguments."""
    resolved = RunConfig.model_validate({"reward_model": {
        "reward_manager": "batch", "reward_kwargs": {"bonus": 0.5, "max_resp_len": None,
                                                     "overlong_buffer_cfg": OverlongBuffer().model_dump()}}})
    assert resolved.reward_model.reward_kwargs.given() == {"bonus": 0.5}
