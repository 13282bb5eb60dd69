"""benchmarks/real_model.py in its quick form (the tiny built-in model, 2 steps): offloaded and resident with the
same seed give the same curves on the CPU, and the results carry the summary the README's plot is drawn from."""

import json

import pytest

from benchmarks import real_model


@pytest.mark.slow
def test_offloaded_and_resident_curves_are_identical_on_the_cpu(tmp_path):
    out = tmp_path / "real-model.json"
    assert real_model.main(["--quick", "--out", str(out), "--runs-dir", str(tmp_path / "runs")]) == 0
    result = json.loads(out.read_text())
    offload, resident = result["curves"]["offload"], result["curves"]["resident"]
    assert [step for step, _ in resident["val_accuracy"]] == [0, 1, 2]  # before training and after each step
    assert [step for step, _ in resident["reward"]] == [1, 2] and [step for step, _ in resident["kl"]] == [1, 2]
    assert offload == resident
    assert result["offload_vs_resident_identical"] is True
    assert result["offload_vs_resident_max_abs_diff"]["reward"] == 0.0
    assert result["offload_vs_resident_max_abs_diff"]["kl"] == 0.0
    assert result["val_accuracy_start"] == resident["val_accuracy"][0][1]
    assert result["val_accuracy_end"] == resident["val_accuracy"][-1][1]
    assert result["steps"] == 2 and set(result["minutes"]) == {"offload", "resident"}
    # The offloaded run did offload: its overrides put the actor's groups and optimizer on the CPU.
    assert "actor_rollout_ref.actor.fsdp_config.param_offload=true" in result["overrides"]["offload"]
    assert not any("offload=true" in row for row in result["overrides"]["resident"])


def test_the_curves_gap_is_taken_over_the_steps_both_runs_reached():
    assert real_model.max_abs_diff([[1, 0.5], [2, 0.25], [3, 1.0]], [[1, 0.5], [2, 0.5]]) == 0.25
    assert real_model.max_abs_diff([[4, 1.0]], [[1, 0.5]]) is None


def test_an_unknown_variant_is_one_line(capsys):
    assert real_model.main(["--quick", "--variants", "offload,gpu"]) == 2
    assert capsys.readouterr().err.strip() == "ERROR: --variants: unknown ['gpu']; allowed: offload, resident"
