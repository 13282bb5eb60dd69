"""trainer.log_val_generations' responses to the experiment trackers (trainer/tracking.py), where verl's
ValidationGenerationsLogger puts them, each read back with its backend's own reader; a tracker that cannot show them
warns and goes on logging the metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainer.test_tracking import (  # noqa: F401 (the autouse fixture: trackers offline, under tmp_path)
    _no_tracker_environment,
    run_config,
    step_metrics,
    tensorboard_events,
    wandb_runs,
)
from trainer.config import RunConfig
from trainer.tracking import Tracking, start_tracking
from trainer.validation import ValidationSample

SHOWN = [ValidationSample("counting", 0, 0, 0.75, prompt="count: 0 1", response="0 1 2 9"),
         ValidationSample("counting", 1, 0, 1.0, prompt="count: 3", response="3 4 5 6")]


def track_with_generations(config: RunConfig) -> list[str]:
    warnings: list[str] = []
    tracking = start_tracking(config, start_step=0, warn=warnings.append, log=lambda message: None)
    tracking.on_step(1, step_metrics(1))
    tracking.on_validation_generations(2, SHOWN)
    tracking.on_step(2, step_metrics(2))
    tracking.close()
    return warnings


def test_tensorboard_gets_the_generations_as_text(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    config = run_config(tmp_path, "tensorboard")
    assert track_with_generations(config) == []
    events = tensorboard_events(config.trainer.run_dir / "tensorboard")
    [text] = events.Tensors("val/generations/text_summary")
    written = text.tensor_proto.string_val[0].decode()
    assert text.step == 2 and "**Input:** count: 0 1" in written and "**Output:** 3 4 5 6" in written
    assert "**Score:** 0.75" in written
    assert [event.step for event in events.Scalars("actor/pg_loss")] == [1, 2], "the metrics go on"


def test_mlflow_gets_the_generations_as_an_artifact(tmp_path: Path) -> None:
    mlflow = pytest.importorskip("mlflow")
    config = run_config(tmp_path, "mlflow")
    assert track_with_generations(config) == []
    uri = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("tracking-tests").experiment_id])
    assert [artifact.path for artifact in client.list_artifacts(run.info.run_id)] == ["val_step2.json"]
    local = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="val_step2.json",
                                                dst_path=str(tmp_path / "downloaded"), tracking_uri=uri)
    assert json.loads(Path(local).read_text()) == [{"input": "count: 0 1", "output": "0 1 2 9", "score": 0.75},
                                                   {"input": "count: 3", "output": "3 4 5 6", "score": 1.0}]


def test_wandb_gets_the_generations_as_a_table(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    config = run_config(tmp_path, "wandb")
    assert track_with_generations(config) == []
    run_id = json.loads((config.trainer.run_dir / "tracker_runs.json").read_text())["wandb"]
    [run] = wandb_runs(config.trainer.run_dir, run_id)
    assert run["history"][2]["val/generations/ncols"] == 7 and run["history"][2]["val/generations/nrows"] == 1
    [table] = config.trainer.run_dir.glob(f"wandb/offline-run-*-{run_id}/files/media/table/val/generations_*.json")
    written = json.loads(table.read_text())
    assert written["columns"] == ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]
    assert written["data"] == [[2, "count: 0 1", "0 1 2 9", 0.75, "count: 3", "3 4 5 6", 1.0]]


def test_swanlab_takes_the_generations(tmp_path: Path) -> None:
    pytest.importorskip("swanlab")
    assert track_with_generations(run_config(tmp_path, "swanlab")) == []


def test_a_tracker_that_cannot_show_them_warns_and_goes_on_logging() -> None:
    class Failing:
        where = "nowhere"
        logged: list[int] = []

        def log(self, step: int, metrics: object) -> None:
            self.logged.append(step)

        def log_generations(self, step: int, generations: object) -> None:
            raise ConnectionError("server gone")

        def finish(self, *, failed: bool) -> None:
            pass

    warnings: list[str] = []
    failing = Failing()
    tracking = Tracking({"failing": failing}, warn=warnings.append)
    tracking.on_validation_generations(3, SHOWN)
    tracking.on_step(3, {"actor/pg_loss": 1.0})
    tracking.close()
    assert warnings == ["tracker failing could not log the validation generations of step 3 (ConnectionError: "
                        "server gone)"]
    assert failing.logged == [3]
