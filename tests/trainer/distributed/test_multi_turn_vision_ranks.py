"""verl's geo3k multi-turn run on 2 CPU ranks (gloo) through the real trainer with the tiny Qwen2-VL: rank 0's
conversations call the Geo3kTool and go on while rank 1's end after one turn (multi_turn_vision_ranks.py); each
turn's sampling gets the going rows' images, every row keeps its image, and rank 0's metrics are finite. (On CPU
ranks each rank holds the whole weights and decodes alone; the synced ranks' stand-in with images is checked against
a scripted model in tests/trainer/rollout/test_multi_turn_images.py.)"""

from __future__ import annotations

import math

import pytest

from tests.trainer.distributed.test_ranks import rank_script_reports
from tests.trainer.rollout.test_multi_turn_vision import TOOL_CONFIG, geo3k_multi_turn_data


@pytest.mark.slow
def test_a_geo3k_multi_turn_step_on_two_ranks_keeps_every_rows_images(tmp_path) -> None:
    data = geo3k_multi_turn_data(tmp_path / "train.parquet", rows=4)
    rank_0, rank_1 = rank_script_reports("multi_turn_vision_ranks.py", tmp_path, str(data), str(TOOL_CONFIG),
                                         str(tmp_path / "runs"))
    for report in (rank_0, rank_1):
        assert report["rows"] == report["images"] == 4  # 4 prompts x 2 responses, half on each rank
        assert report["prompt_image_tokens"] == [4] * 4
    # The prompt, the model's turn, the tool's, the model's again (the next tool response would not fit the 12 tokens).
    assert sum(rank_0["tool_tokens"]) > 0 and rank_0["num_turns"] == [4] * 4
    assert [(turn["rows"], turn["images"]) for turn in rank_0["turns"]] == [(4, 4)] * 2
    assert [(turn["rows"], turn["images"]) for turn in rank_1["turns"]] == [(4, 4)]
    assert sum(rank_1["tool_tokens"]) == 0 and rank_1["num_turns"] == [2] * 4  # the prompt and one turn
    assert rank_0["finite"] and "metrics" not in rank_1
    [row] = rank_0["metrics"]
    for key in ("actor/pg_loss", "actor/kl_loss", "critic/score/mean"):
        assert math.isfinite(row[key]), key
