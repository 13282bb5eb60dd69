"""`verl train` with verl's experiment trackers, as a migrating user writes them: the step metrics read back
from TensorBoard's event files and the `file` tracker's records, and a tracker that breaks mid-run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.runs import QUICKSTART, VERL

SMALL = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.device=cpu",
         "trainer.total_training_steps=2"]


def verl_train(folder: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(VERL), "train", "--config", QUICKSTART, *SMALL, *overrides], cwd=folder,
                          env={**os.environ, "VERL_STATE_DIR": str(folder / "state"), **(env or {})},
                          capture_output=True, text=True, timeout=300)


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def step_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("step ")]


@pytest.mark.slow
def test_verl_train_logs_the_step_metrics_to_tensorboard_and_the_file(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    result = verl_train(tmp_path, "trainer.logger=[console,tensorboard,file]")
    assert result.returncode == 0, result.stderr
    run = tmp_path / "runs" / "quickstart"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (run / "tracking.jsonl").read_text().splitlines()]
    # verl's record: {"step": N, "data": {...}} with the metrics under verl's names, as metrics.jsonl has them.
    assert records == [{"step": row.pop("step"), "data": row} for row in rows]
    assert {"actor/pg_loss", "critic/score/mean", "timing_s/gen", "training/global_step"} <= records[0]["data"].keys()
    scalars = tensorboard_scalars(run / "tensorboard")
    assert set(scalars) == set(records[0]["data"])
    for name in ("actor/pg_loss", "critic/score/mean", "perf/throughput"):
        assert scalars[name] == [(record["step"], pytest.approx(record["data"][name], rel=1e-6, abs=1e-9))
                                 for record in records]
    assert [line.split()[1] for line in step_lines(result)] == ["1/2", "2/2"]  # console: the step lines


@pytest.mark.slow
def test_a_tracker_that_breaks_mid_run_is_dropped_and_the_run_finishes(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    # /dev/full opens, and every write to it fails (ENOSPC): the file tracker breaks at its first step.
    result = verl_train(tmp_path, "trainer.logger=[tensorboard,file]", env={"VERL_FILE_LOGGER_PATH": "/dev/full"})
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    warnings = [line for line in output.splitlines() if "tracker file" in line and "WARNING" in line]
    assert len(warnings) == 1 and "could not log step 1" in warnings[0] and "No space left" in warnings[0]
    run = tmp_path / "runs" / "quickstart"
    assert [step for step, _ in tensorboard_scalars(run / "tensorboard")["critic/score/mean"]] == [1, 2]
    assert step_lines(result) == []  # no console in trainer.logger: the step lines go to the run's log only
    assert "step 2/2" in (run / "logs" / "trainer.log").read_text()
