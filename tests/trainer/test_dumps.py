"""verl's dumps of generations (trainer/dumps.py): the lines of trainer.rollout_data_dir and validation_data_dir."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.dumps import generation_lines, write_generations


def test_a_line_holds_verls_entries_and_what_every_response_reported(tmp_path: Path) -> None:
    reported = [{"acc": 1.0, "pred": "2", "score": 9.0}, {"acc": 0.0, "score": 9.0}]
    lines = generation_lines(["1 +", "2 +"], ["2", "3"], ["2", {"x": 1}], [1.0, -0.5], reported, step=3)
    assert lines == [{"input": "1 +", "output": "2", "gts": "2", "score": 1.0, "step": 3, "acc": 1.0},
                     {"input": "2 +", "output": "3", "gts": {"x": 1}, "score": -0.5, "step": 3, "acc": 0.0}], \
        "pred is not every response's; a reported score does not replace verl's"
    path = write_generations(str(tmp_path / "dumps"), 3, lines)
    assert path == tmp_path / "dumps" / "3.jsonl"
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == lines
