"""The chaos soak's own parts (benchmarks/chaos.py): its damage is what the resume must catch, and its comparison
tells a faulted run that drifted from one that did not."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from benchmarks.chaos import compare, damage_latest, prune_below
from trainer.checkpoint_manifest import verify_checkpoint, write_manifest


def fake_run(folder, rows, weight: float):
    checkpoint = folder / "checkpoints" / "global_step_2"
    (checkpoint / "actor").mkdir(parents=True)
    save_file({"w": torch.full((4,), weight)}, str(checkpoint / "actor" / "model.safetensors"))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return checkpoint


def test_the_damage_keeps_the_size_and_the_manifest_catches_it(tmp_path):
    checkpoint = fake_run(tmp_path, [], 1.0)
    write_manifest(checkpoint)
    weights = checkpoint / "actor" / "model.safetensors"
    size = weights.stat().st_size
    assert damage_latest(tmp_path / "checkpoints") == str(weights)
    assert weights.stat().st_size == size
    assert "checksum differs" in (verify_checkpoint(checkpoint).problem or "")


def test_the_comparison_ignores_the_machine_and_sees_a_drift(tmp_path):
    rows = [{"step": 1, "actor/pg_loss": 0.5, "timing_s/step": 1.0}, {"step": 2, "actor/pg_loss": 0.25}]
    same = fake_run(tmp_path / "a", rows, 1.0).parents[1]
    timed = fake_run(tmp_path / "b", [{**rows[0], "timing_s/step": 9.0}, rows[1]], 1.0).parents[1]
    drifted = fake_run(tmp_path / "c", [rows[0], {"step": 2, "actor/pg_loss": 0.2500001}],
                       1.0 + 2**-20).parents[1]
    assert compare(same, timed, 2) == {"metrics_rows": [2, 2], "metrics_equal": True,
                                       "metrics_differing_steps": [], "weights_equal": True}
    result = compare(same, drifted, 2)
    assert result["metrics_differing_steps"] == [2] and result["weights_equal"] is False


def test_a_time_bound_compares_up_to_the_step_both_runs_saved(tmp_path):
    """--minutes: both runs are ended after a common checkpoint, each with rows past it (the faulted one
    resumed from older checkpoints, so its later rows differ): the comparison stops at that step."""
    rows = [{"step": 1, "actor/pg_loss": 0.5}, {"step": 2, "actor/pg_loss": 0.25}]
    ours = fake_run(tmp_path / "a", [*rows, {"step": 3, "actor/pg_loss": 0.1}], 1.0).parents[1]
    theirs = fake_run(tmp_path / "b", [*rows, {"step": 3, "actor/pg_loss": 0.2}, {"step": 4}], 1.0).parents[1]
    assert compare(ours, theirs, 2)["metrics_equal"] is True
    assert compare(ours, theirs, 3)["metrics_differing_steps"] == [3]


def test_the_reference_keeps_only_the_checkpoints_a_comparison_can_still_need(tmp_path):
    for step in (10, 20, 30):
        (tmp_path / f"global_step_{step}").mkdir()
    prune_below(tmp_path, 20)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["global_step_20", "global_step_30"]
