"""A step whose prompts' groups span ranks (verl splits the sequences, not the prompts): fewer prompts than ranks,
per step or per mini-batch. Each rank takes its slice of every mini-batch of sequences, and every advantage
estimator sees its whole groups, as verl's driver computes them over the whole batch."""

from __future__ import annotations

import math

import pytest
import torch

from tests.trainer.distributed.test_ranks import rank_script_reports
from tests.trainer.distributed.whole_groups_ranks import ESTIMATORS, ROWS, WIDTHS, hand_batch, my_rows
from trainer.algorithms import AdvantageInputs, get_advantage_estimator
from trainer.algorithms.advantages import compute_grpo_outcome_advantage
from trainer.config import AlgorithmConfig, load_config
from trainer.data import sequence_share
from trainer.distributed.run_wide import RunWide, StepShare
from trainer.distributed.whole_groups import advantages_over_whole_groups

SCORE_BY_TEXT = """def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(sum(map(ord, solution_str)) % 11) / 10.0
"""


def test_each_rank_takes_its_slice_of_every_mini_batch_of_sequences():
    # 2 prompts x 4 responses on 4 ranks, mini-batches of 1 prompt: verl's 1 x 4 // 4 = 1 sequence per rank.
    shares = [sequence_share([7, 3], copies=4, rank=rank, world_size=4, mini_batch_size=1) for rank in range(4)]
    assert shares == [([7, 3], [0, 1]), ([7, 3], [0, 1]), ([7, 3], [0, 1]), ([7, 3], [0, 1])]
    # 1 prompt x 4 responses on 2 ranks: 2 each, the one group on both.
    assert [sequence_share([5], copies=4, rank=rank, world_size=2, mini_batch_size=2) for rank in (0, 1)] == [
        ([5, 5], [0, 0]), ([5, 5], [0, 0])]
    # 3 prompts x 2 on 2 ranks in verl's rounded-down mini-batches of 3 // 2 = 1 per rank: sequences 0,2,4 and 1,3,5.
    assert [sequence_share([4, 8, 6], copies=2, rank=rank, world_size=2, mini_batch_size=1)[1] for rank in (0, 1)] == [
        [0, 1, 2], [0, 1, 2]]
    # A last, shorter mini-batch: 6 sequences in per-rank mini-batches of 2 on 2 ranks -> 0,1,4 and 2,3,5.
    assert sequence_share([1, 2, 3, 4, 5, 6], copies=1, rank=1, world_size=2, mini_batch_size=2) == (
        [3, 4, 6], [2, 3, 5])
    with pytest.raises(ValueError, match="do not split among 2 ranks"):
        sequence_share([1], copies=3, rank=0, world_size=2, mini_batch_size=1)


class FakeRanks:
    """Rank `rank` of 2 data-parallel ranks (no sequence parallelism) whose gather returns `everyone`'s values."""

    distributed, sp_size, dp_size, device = True, 1, 2, torch.device("cpu")

    def __init__(self, rank: int, everyone: list | None = None):
        self.dp_rank = self.rank = rank
        self.everyone = everyone

    def gather_objects(self, value):
        assert self.everyone is not None
        return self.everyone


def run_wide(*overrides: str) -> RunWide:
    config = load_config(None, ["trainer.n_gpus_per_node=2", "trainer.device=cpu",
                                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", *overrides])
    return RunWide(FakeRanks(1), config, send=lambda message: None)


def test_prompts_that_divide_among_the_ranks_stay_whole_and_fewer_are_split_by_sequence():
    whole = run_wide("data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                     "actor_rollout_ref.rollout.n=3")
    assert not whole.splits_groups
    assert whole.share_of([9, 8, 7, 6]) == StepShare([8, 6], 3)
    split = run_wide("data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                     "actor_rollout_ref.rollout.n=4")
    assert split.splits_groups
    share = split.share_of([9])
    assert share == StepShare([9, 9], 1, [0, 0]) and share.sequences == 2
    # 4 prompts, but mini-batches of 1 prompt: the mini-batches, not the step, decide.
    assert run_wide("data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                    "actor_rollout_ref.rollout.n=2").share_of([9, 8, 7, 6]) == StepShare([9, 8, 7, 6], 1, [0, 1, 2, 3])


@pytest.mark.parametrize("name", ESTIMATORS)
def test_every_estimator_on_a_ranks_rows_gives_the_whole_batchs_advantages_of_those_rows(name):
    whole = hand_batch()
    estimator = get_advantage_estimator(name)
    expected = estimator(AdvantageInputs(**whole), AlgorithmConfig())
    shares = [{key: value.detach() for key, value in vars(my_rows(whole, rank)).items()
               if isinstance(value, torch.Tensor)} for rank in (0, 1)]
    inputs = my_rows(whole, 1)
    advantages, returns = advantages_over_whole_groups(estimator, inputs, AlgorithmConfig(), FakeRanks(1, shares))
    assert advantages.shape == (ROWS[1], WIDTHS[1])
    torch.testing.assert_close(advantages, expected[0][ROWS[0]:, :WIDTHS[1]])
    torch.testing.assert_close(returns, expected[1][ROWS[0]:, :WIDTHS[1]])


def test_grpo_of_a_group_split_over_ranks_is_not_what_each_half_alone_gives():
    """The gather matters: GRPO of a rank's half of group 1 alone compares its 2 responses to each other."""
    whole = hand_batch()
    half = my_rows(whole, 1)
    alone = compute_grpo_outcome_advantage(half.token_level_rewards, half.response_mask, half.group_index)[0]
    shares = [{key: value for key, value in vars(my_rows(whole, rank)).items() if isinstance(value, torch.Tensor)}
              for rank in (0, 1)]
    gathered = advantages_over_whole_groups(get_advantage_estimator("grpo"), half, AlgorithmConfig(),
                                            FakeRanks(1, shares))[0]
    assert not torch.allclose(alone[:2], gathered[:2], atol=1e-3)


@pytest.mark.slow
def test_one_prompt_with_four_responses_on_two_ranks_trains_with_the_one_process_advantages(tmp_path):
    reward = tmp_path / "score.py"
    reward.write_text(SCORE_BY_TEXT)
    out = tmp_path / "out"
    out.mkdir()
    reports = rank_script_reports("whole_groups_ranks.py", out, str(tmp_path / "runs"), str(reward))
    # Every estimator on the gloo ranks: each rank's rows of the one-process result over the whole batch.
    whole = hand_batch()
    for name in ESTIMATORS:
        advantages, returns = get_advantage_estimator(name)(AdvantageInputs(**whole), AlgorithmConfig())
        for rank, report in enumerate(reports):
            rows = slice(sum(ROWS[:rank]), sum(ROWS[:rank + 1]))
            found_advantages, found_returns = (torch.tensor(values) for values in report["estimators"][name])
            torch.testing.assert_close(found_advantages, advantages[rows, :WIDTHS[rank]], msg=name)
            torch.testing.assert_close(found_returns, returns[rows, :WIDTHS[rank]], msg=name)
    # The trainer: the prompt's 4 responses, 2 on each rank, one group.
    steps = [report["trainer"] for report in reports]
    assert [step["group_index"] for step in steps] == [[0, 0], [0, 0]]
    scores = torch.tensor([score for step in steps for score in step["scores"]])
    assert len(set(scores.tolist())) > 1, "the responses' scores are alike: the check below would prove nothing"
    width = max(len(step["response_mask"][0]) for step in steps)
    mask = torch.cat([torch.nn.functional.pad(torch.tensor(step["response_mask"]),
                                              (0, width - len(step["response_mask"][0]))) for step in steps])
    rewards = torch.zeros_like(mask)
    rewards[:, 0] = scores  # where in the response the score lies does not change a sequence's GRPO advantage
    expected = compute_grpo_outcome_advantage(rewards, mask, torch.zeros(4, dtype=torch.long))[0]
    for rank, step in enumerate(steps):
        found = torch.tensor(step["advantages"])
        torch.testing.assert_close(found, expected[2 * rank:2 * rank + 2, :found.shape[1]])
    # verl's normalized mini-batch: 1 prompt x 4 // 2 ranks = 2 sequences, one optimizer step; the loss is finite.
    metrics = steps[0]["metrics"]
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["training/global_step"] == 1
