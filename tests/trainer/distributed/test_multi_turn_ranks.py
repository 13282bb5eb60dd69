"""The multi-turn rollout on 2 CPU ranks (gloo) through the real trainer with verl's gsm8k tool config: rank 0's
conversations call the tool and go on while rank 1's end after one turn (multi_turn_ranks.py); on both ranks the
loss mask marks the model's turns alone, tool turns stay out of the advantages and the reference, and rank 0's
metrics are finite."""

from __future__ import annotations

import math

import pytest

from tests.trainer.distributed.test_ranks import rank_script_reports
from tests.trainer.rollout.test_multi_turn_training import TOOL_CONFIG, gsm8k_multi_turn_data


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("multi_turn_ranks")
    data = gsm8k_multi_turn_data(out / "train.parquet", prompts=4)
    return rank_script_reports("multi_turn_ranks.py", out, str(data), str(TOOL_CONFIG), str(out / "runs"))


def test_each_ranks_loss_mask_marks_the_models_turns_alone(reports) -> None:
    for report in reports:
        [step] = report["steps"]
        assert step["rows"] == 4  # 4 prompts x 2 responses, half on each rank
        assert step["own_within_real"] and step["advantages_outside_mask_zero"] and step["ref_outside_mask_zero"]
        for turns, num_turns in zip(step["turns_in_mask"], step["num_turns"], strict=True):
            # One run of the mask per turn, the model's and the tool's alternating (the prompt is verl's first turn).
            assert len(turns) == num_turns - 1 and turns[::2] == ["model"] * len(turns[::2])
            assert turns[1::2] == ["tool"] * len(turns[1::2])
    rank_0, rank_1 = (report["steps"][0] for report in reports)
    assert any("tool" in turns for turns in rank_0["turns_in_mask"]) and sum(rank_0["tool_tokens"]) > 0
    assert all(turns == ["model"] for turns in rank_1["turns_in_mask"]) and sum(rank_1["tool_tokens"]) == 0


def test_the_step_on_two_ranks_has_finite_metrics_on_rank_0(reports) -> None:
    [row] = reports[0]["metrics"]
    assert reports[0]["finite"] and "metrics" not in reports[1]  # rank 0 alone writes them
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/score/mean", "response_length/mean"):
        assert math.isfinite(row[key]), key
    # The model's tokens of both ranks' responses, as verl counts its response_mask (the tools' left out).
    tokens = sum(sum(report["steps"][0]["own_tokens"]) for report in reports)
    assert row["perf/total_num_response_tokens"] == pytest.approx(tokens)
