"""use_dynamic_bsz with a step whose sequences do not divide among the ranks (verl skips its batch-size check then):
the ranks take uneven shares of each mini-batch, the shorter one runs filler micro-batches that weigh nothing, and the
update is one process's over the whole batch."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

from tests.trainer.distributed.test_ranks import rank_script_reports
from tests.trainer.distributed.uneven_shares_ranks import PPO, uneven
from trainer.config import load_config
from trainer.data import sequence_share
from trainer.data.sampler import rank_mini_batches
from trainer.loop import Trainer
from trainer.rollout.batch import RolloutBatch
from trainer.workers.packing import plan_micro_batches

SCORE_BY_TEXT = """def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(sum(map(ord, solution_str)) % 11) / 10.0
"""


def test_sequences_that_do_not_divide_are_dealt_per_mini_batch_first_ranks_one_more():
    # 1 prompt x 3 on 2 ranks, one mini-batch of 3: sequences 0, 1 and 2.
    assert [sequence_share([5], copies=3, rank=rank, world_size=2, mini_batch_size=1, global_mini_batch=3)
            for rank in (0, 1)] == [([5, 5], [0, 0]), ([5], [0])]
    # 3 prompts x 1 in mini-batches of 3 on 2 ranks... and 5 in mini-batches of 5 (2 x 5 = 10 sequences), 4 ranks.
    assert [sequence_share([4, 8, 6, 1, 2, 3, 7, 9, 0, 5], copies=1, rank=rank, world_size=4, mini_batch_size=1,
                           global_mini_batch=5)[0] for rank in range(4)] == [[4, 8, 3, 7], [6, 9], [1, 0], [2, 5]]
    assert [rank_mini_batches(10, 5, rank, 4) for rank in range(4)] == [[2, 2], [1, 1], [1, 1], [1, 1]]


def test_a_short_rank_runs_fillers_that_are_dropped_from_its_results():
    batch = RolloutBatch(prompt_ids=torch.ones(2, 3, dtype=torch.long), prompt_mask=torch.ones(2, 3),
                         response_ids=torch.ones(2, 2, dtype=torch.long), response_mask=torch.ones(2, 2),
                         group_index=torch.zeros(2, dtype=torch.long), records=[None, None])
    # Another rank needs 4 micro-batches of at most 5 tokens; this one's 2 sequences fit in 2: 2 fillers.
    plan = plan_micro_batches(batch, 1, 5, agree=lambda count: max(count, 4))
    assert len(plan.pieces) == 4 and plan.fillers == 2
    assert [plan.is_filler(piece) for piece in plan.pieces] == [False, False, True, True]
    assert len(plan.arrange(batch)) == 4
    assert plan.restore(torch.tensor([10.0, 20.0, 0.0, 0.0])).tolist() == [10.0, 20.0]
    # Fixed sizes agree too: 2 micro-batches of 1 where another rank runs 3.
    fixed = plan_micro_batches(batch, 1, None, agree=lambda count: 3)
    assert fixed.fillers == 1 and fixed.restore(torch.tensor([1.0, 2.0, 9.0])).tolist() == [1.0, 2.0]


def whole_batch(parts: list[RolloutBatch]) -> RolloutBatch:
    """The ranks' batches as one, in rank order (their global order), responses right-padded to the widest."""
    width = max(part.response_ids.shape[1] for part in parts)
    joined = {}
    for field in fields(RolloutBatch):
        values = [getattr(part, field.name) for part in parts]
        if values[0] is None or field.name == "records":
            continue
        if field.name not in ("prompt_ids", "prompt_mask") and values[0].dim() == 2:
            values = [torch.nn.functional.pad(value, (0, width - value.shape[1])) for value in values]
        joined[field.name] = torch.cat(values)
    return replace(parts[0], **joined, records=[record for part in parts for record in part.records])


@pytest.mark.slow
@pytest.mark.parametrize("more", [(), tuple(PPO)], ids=["grpo", "ppo"])
def test_uneven_shares_with_token_budgets_train_as_one_process_on_the_whole_batch(tmp_path: Path, more):
    reward = tmp_path / "score.py"
    reward.write_text(SCORE_BY_TEXT)
    out = tmp_path / "out"
    out.mkdir()
    reports = rank_script_reports("uneven_shares_ranks.py", out, str(tmp_path / "runs"), str(reward), *more)
    parts = [torch.load(out / f"batch{rank}.pt", weights_only=False) for rank in (0, 1)]
    assert [len(part) for part in parts] == [2, 1]  # 3 sequences: 2 and 1
    whole = whole_batch(parts)
    assert whole.advantages.abs().sum() > 0, "no advantages: the comparison below would prove nothing"

    one = Trainer(load_config(None, uneven(1, str(tmp_path / "one"), str(reward), *more)), log=lambda *_: None)
    models = [(one.actor, "weights.pt")] + ([(one.critic, "critic.pt")] if one.critic is not None else [])
    assert len(models) == 1 + bool(more)
    for worker, saved in models:
        before = {name: parameter.detach().clone() for name, parameter in worker.model.named_parameters()}
        metrics = worker.update(whole)
        two = torch.load(out / saved)
        for name, parameter in worker.model.named_parameters():
            torch.testing.assert_close(two[name], parameter.detach(), atol=1e-6, rtol=1e-5, msg=name)
        assert any(not torch.equal(before[name], two[name]) for name in before), "the step changed no weight"
        # Rank 0's step metrics are the run's (every rank's combined): the one process's, the loss weighed by
        # tokens (rank 0's 2 sequences' and rank 1's one, not each rank's half).
        found = reports[0]["metrics"]
        keys = [key for key in metrics if key.endswith(("grad_norm", "pg_loss", "entropy", "vf_loss", "vpred_mean"))]
        assert len(keys) == 3
        for key in keys:
            assert found[key] == pytest.approx(sum(metrics[key]) / len(metrics[key]), rel=1e-4, abs=1e-7), key
    assert found["training/global_step"] == 1
