"""Experiment trackers (trainer.logger): verl's config forms, and each backend's output read back with its own
library's reader. Nothing reaches the network: wandb and SwanLab run offline, MLflow's store is a file in
tmp_path, and every tracker writes under tmp_path."""

from __future__ import annotations

import json
import math
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from trainer.config import ConfigError, RunConfig, load_config
from trainer.config import environment as config_environment
from trainer.errors import RunSetupError
from trainer.tracking import TRACKERS, Tracking, flat_config, mlflow_key, start_tracking

BACKENDS = ("console", "wandb", "tensorboard", "mlflow", "swanlab", "file")


@pytest.fixture(autouse=True)
def _no_tracker_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each test starts from none of the trackers' variables, with wandb and SwanLab offline and their
    per-user files under tmp_path."""
    for name in ("VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT", "TENSORBOARD_DIR", "MLFLOW_TRACKING_URI",
                 "MLFLOW_RUN_ID", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_API_KEY", "SWANLAB_LOG_DIR",
                 "SWANLAB_API_KEY", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # pytest captures the output wandb would wrap
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "swanlab-home"))


def run_config(tmp_path: Path, *logger: str, experiment: str = "tracked") -> RunConfig:
    return load_config(None, [f"trainer.runs_dir={tmp_path / 'runs'}", f"trainer.experiment_name={experiment}",
                              "trainer.project_name=tracking-tests", f"trainer.logger=[{','.join(logger)}]"])


def step_metrics(step: int) -> dict[str, float]:
    """What the trainer hands its observers, under verl's names."""
    return {"actor/pg_loss": -0.125 * step, "critic/score/mean": 0.25 * step, "training/global_step": step,
            "val-core/counting/acc/mean@4": 0.5}


def track(config: RunConfig, steps: range, *, start_step: int = 0, failed: bool = False,
          metrics=step_metrics) -> list[str]:
    """Start the config's trackers, log `steps`, finish; the warnings they gave."""
    warnings: list[str] = []
    tracking = start_tracking(config, start_step=start_step, warn=warnings.append, log=lambda message: None)
    for step in steps:
        tracking.on_step(step, metrics(step))
    tracking.close(failed=failed)
    return warnings


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], ["console"]),
    (["trainer.logger=[console,file]"], ["console", "file"]),  # as Hydra gives a verl script's list
    (['trainer.logger=["file","console"]'], ["file", "console"]),  # verl's docs: trainer.logger='["console","wandb"]'
    (["trainer.logger=file"], ["file"]),  # one name
    (["trainer.logger=[console,file,console]"], ["console", "file"]),
    (["trainer.logger=[]"], []),
])
def test_the_logger_takes_verls_forms(overrides: list[str], expected: list[str]) -> None:
    assert load_config(None, overrides).trainer.logger == expected


def test_every_backend_of_verl_is_known() -> None:
    for module in ("wandb", "tensorboard", "mlflow", "swanlab"):
        pytest.importorskip(module)
    assert load_config(None, [f"trainer.logger=[{','.join(BACKENDS)}]"]).trainer.logger == list(BACKENDS)
    assert set(TRACKERS) == set(BACKENDS) - {"console"}


def test_an_unknown_tracker_is_one_line_naming_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["trainer.logger=[console,neptune]"])
    [problem] = caught.value.problems
    assert problem.path == "trainer.logger[1]"
    assert "'neptune'" in problem.message
    assert all(repr(name) in problem.message for name in BACKENDS)
    assert "\n" not in str(problem)


def test_a_tracker_whose_library_is_missing_is_refused_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = config_environment.importlib.util.find_spec
    monkeypatch.setattr(config_environment.importlib.util, "find_spec",
                        lambda name, *args: None if name == "wandb" else real_find_spec(name, *args))
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["trainer.logger=[console,wandb,file]"])
    [problem] = caught.value.problems
    assert problem.path == "trainer.logger"
    assert "wandb is not installed" in problem.message
    assert "pip install 'verl-offload[trackers]'" in problem.message


def test_the_config_is_flattened_to_its_dotted_keys(tmp_path: Path) -> None:
    flat = flat_config(run_config(tmp_path, "file").model_dump(mode="json"))
    assert flat["actor_rollout_ref.actor.optim.lr"] == 1e-6
    assert flat["trainer.logger"] == '["file"]'
    assert flat["trainer.total_training_steps"] == "null"
    assert all(isinstance(value, str | int | float | bool) for value in flat.values())


# --------------------------------------------------------------------------- failures and ranks


class RecordingTracker:
    where = "memory"

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.finished: list[bool] = []

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.steps.append(step)

    def finish(self, *, failed: bool) -> None:
        self.finished.append(failed)


class BrokenTracker(RecordingTracker):
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        super().log(step, metrics)
        raise ConnectionError("tracking server went away")


def test_a_tracker_that_raises_is_dropped_with_one_warning_and_the_others_go_on() -> None:
    broken, healthy, warnings = BrokenTracker(), RecordingTracker(), []
    tracking = Tracking({"wandb": broken, "file": healthy}, warn=warnings.append)
    for step in (1, 2, 3):
        tracking.on_step(step, step_metrics(step))
    tracking.close()
    assert broken.steps == [1] and broken.finished == [True]
    assert healthy.steps == [1, 2, 3] and healthy.finished == [False]
    [warning] = warnings
    assert "tracker wandb could not log step 1" in warning and "tracking server went away" in warning
    assert "training goes on" in warning


def test_a_tracker_that_stalls_does_not_hold_training_up() -> None:
    released = threading.Event()

    class Stalled(RecordingTracker):
        def log(self, step: int, metrics: Mapping[str, float]) -> None:
            released.wait(30)  # a tracking server that does not answer
            super().log(step, metrics)

    stalled, warnings = Stalled(), []
    tracking = Tracking({"mlflow": stalled}, warn=warnings.append)
    started = time.monotonic()
    for step in range(1, 101):
        tracking.on_step(step, step_metrics(step))
    assert time.monotonic() - started < 1.0
    tracking.close(timeout=0.2)
    assert warnings == ["trackers mlflow were still logging after 0.2 s; not waiting"]
    released.set()


def test_a_tracker_that_cannot_finish_is_a_warning(tmp_path: Path) -> None:
    class Unfinishable(RecordingTracker):
        def finish(self, *, failed: bool) -> None:
            raise OSError("disk full")

    warnings: list[str] = []
    Tracking({"mlflow": Unfinishable()}, warn=warnings.append).close()
    assert warnings == ["tracker mlflow could not finish its run (OSError: disk full)"]


def _cannot_start(run) -> RecordingTracker:
    raise PermissionError("no API key configured")


def test_a_tracker_that_cannot_start_stops_a_new_run_before_it_trains(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")  # for the config check; the tracker is the one below
    monkeypatch.setitem(TRACKERS, "wandb", _cannot_start)
    with pytest.raises(RunSetupError, match=r"trainer.logger: tracker wandb could not start \(PermissionError: no "
                                            r"API key configured\); fix that, or leave wandb out of trainer.logger"):
        track(run_config(tmp_path, "console", "file", "wandb"), range(1, 2))


def test_a_resumed_run_goes_on_without_a_tracker_that_cannot_start(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")  # for the config check; the tracker is the one below
    monkeypatch.setitem(TRACKERS, "wandb", _cannot_start)
    config = run_config(tmp_path, "wandb", "file")
    warnings = track(config, range(8, 10), start_step=7)
    assert warnings == ["tracker wandb could not start (PermissionError: no API key configured); training goes on "
                        "without it"]
    records = [json.loads(line) for line in (config.trainer.run_dir / "tracking.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [8, 9]


def test_only_the_first_process_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    config = run_config(tmp_path, "file")
    assert start_tracking(config, start_step=0).trackers == {}
    assert not config.trainer.run_dir.exists()


# -------------------------------------------------------------------------------------------- file


def read_file_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_file_tracker_writes_verls_records(tmp_path: Path) -> None:
    config = run_config(tmp_path, "file")
    track(config, range(1, 3), metrics=lambda step: {**step_metrics(step), "actor/kl_loss": math.nan})
    records = read_file_records(config.trainer.run_dir / "tracking.jsonl")
    assert records == [{"step": step, "data": {**step_metrics(step), "actor/kl_loss": None}} for step in (1, 2)]


def test_the_file_tracker_goes_where_verls_variables_say(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "root"))
    track(run_config(tmp_path, "file"), range(1, 2))
    assert read_file_records(tmp_path / "root" / "tracking-tests" / "tracked.jsonl")[0]["step"] == 1
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "exact.jsonl"))  # wins over the root
    track(run_config(tmp_path, "file"), range(1, 2))
    assert read_file_records(tmp_path / "exact.jsonl")[0]["step"] == 1


def test_a_resumed_file_drops_the_steps_after_the_checkpoint(tmp_path: Path) -> None:
    config = run_config(tmp_path, "file")
    track(config, range(1, 5))
    path = config.trainer.run_dir / "tracking.jsonl"
    with path.open("a") as file:
        file.write('{"step": 5, "da')  # cut short by the crash
    track(config, range(3, 4), start_step=2, metrics=lambda step: {"actor/pg_loss": 99.0})
    records = read_file_records(path)
    assert [record["step"] for record in records] == [1, 2, 3]
    assert records[2]["data"] == {"actor/pg_loss": 99.0}


# ------------------------------------------------------------------------------------- tensorboard


def tensorboard_events(directory: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_tensorboard_gets_each_steps_metrics_and_the_config(tmp_path: Path) -> None:
    plugin_data_pb2 = pytest.importorskip("tensorboard.plugins.hparams.plugin_data_pb2")

    config = run_config(tmp_path, "tensorboard")
    track(config, range(1, 4))
    events = tensorboard_events(config.trainer.run_dir / "tensorboard")
    assert set(step_metrics(1)) <= set(events.Tags()["scalars"])
    assert [(event.step, event.value) for event in events.Scalars("actor/pg_loss")] == [
        (1, -0.125), (2, -0.25), (3, -0.375)]
    hyperparameters = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info.hparams
    assert hyperparameters["actor_rollout_ref.actor.optim.lr"].number_value == pytest.approx(1e-6)
    assert hyperparameters["trainer.experiment_name"].string_value == "tracked"
    [text] = events.Tensors("config/text_summary")
    assert "experiment_name: tracked" in text.tensor_proto.string_val[0].decode()


def test_a_resumed_tensorboard_run_hides_the_steps_after_the_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    config = run_config(tmp_path, "tensorboard")
    track(config, range(1, 5))
    track(config, range(3, 4), start_step=2, metrics=lambda step: {"actor/pg_loss": 99.0})
    events = tensorboard_events(config.trainer.run_dir / "tensorboard")
    assert [(event.step, event.value) for event in events.Scalars("actor/pg_loss")] == [
        (1, -0.125), (2, -0.25), (3, 99.0)]


def test_tensorboard_dir_is_verls_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "board"))
    track(run_config(tmp_path, "tensorboard"), range(1, 2))
    assert [event.step for event in tensorboard_events(tmp_path / "board").Scalars("critic/score/mean")] == [1]


# ------------------------------------------------------------------------------------------- wandb


def wandb_records(path: Path) -> Iterator:
    """The records of a wandb run file (runs/<name>/wandb/offline-run-*/run-<id>.wandb). wandb 0.31 writes it from
    its Go core and ships no Python reader: the file is LevelDB's log format (32 KiB blocks of records, each a
    7-byte header of checksum, length and type; a record split over blocks is FIRST, MIDDLE..., LAST) after a
    7-byte ":W&B" file header, and each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    offset, pending = 7, b""
    while offset + 7 <= len(data):
        if 32768 - offset % 32768 < 7:  # a block's tail too short for a header is padding
            offset += 32768 - offset % 32768
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        if kind == 0 or offset + 7 + length > len(data):  # the end, or a record still being written
            break
        pending += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # FULL or LAST
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def _wandb_key(item) -> str:
    return item.key or "/".join(item.nested_key)  # wandb-core puts a key with a "/" in nested_key


def wandb_runs(run_dir: Path, run_id: str) -> list[dict]:
    """What each process wrote of the offline run `run_id`, oldest first (a resumed run's process writes its own
    folder, offline-run-<time>-<id>[-N]; `wandb sync` sends them to the one run)."""
    folders = sorted(run_dir.glob(f"wandb/offline-run-*-{run_id}*"), key=lambda folder: folder.stat().st_mtime_ns)
    return [_finished_wandb_run(folder / f"run-{run_id}.wandb") for folder in folders]


def _finished_wandb_run(path: Path, timeout: float = 60) -> dict:
    """The run once its file holds the exit record: run.finish() returns before wandb's core process (which
    lives on past it) has written the records out."""
    deadline = time.monotonic() + timeout
    while "exit_code" not in (run := _wandb_run(path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return run


def _wandb_run(path: Path) -> dict:
    found: dict = {"history": {}}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            found.update(project=record.run.project, name=record.run.display_name,
                         config={_wandb_key(item): json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "history":
            items = {_wandb_key(item): json.loads(item.value_json) for item in record.history.item}
            found["history"][record.history.step.num] = {key: value for key, value in items.items()
                                                         if not key.startswith("_")}
        elif kind == "exit":
            found["exit_code"] = record.exit.exit_code
    return found


def test_wandb_offline_run_gets_each_steps_metrics_and_the_config(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    config = run_config(tmp_path, "wandb")
    track(config, range(1, 3))
    run_id = json.loads((config.trainer.run_dir / "tracker_runs.json").read_text())["wandb"]
    [run] = wandb_runs(config.trainer.run_dir, run_id)
    assert (run["project"], run["name"]) == ("tracking-tests", "tracked")
    assert run["config"]["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1e-6
    assert run["config"]["trainer"]["logger"] == ["wandb"]
    assert run["history"] == {step: step_metrics(step) for step in (1, 2)}
    assert run["exit_code"] == 0


def test_a_resumed_wandb_run_goes_on_in_the_same_run(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    config = run_config(tmp_path, "wandb")
    track(config, range(1, 3), failed=True)  # the trainer crashed after step 2...
    ids_file = config.trainer.run_dir / "tracker_runs.json"
    run_id = json.loads(ids_file.read_text())["wandb"]
    track(config, range(3, 4), start_step=2)  # ...and the daemon's restart resumed from its checkpoint
    assert json.loads(ids_file.read_text())["wandb"] == run_id
    first, resumed = wandb_runs(config.trainer.run_dir, run_id)
    assert (sorted(first["history"]), first["exit_code"]) == ([1, 2], 1)
    assert (sorted(resumed["history"]), resumed["exit_code"]) == ([3], 0)


# ------------------------------------------------------------------------------------------ mlflow


def mlflow_client(uri: str):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri)


def test_mlflow_run_in_the_default_store_gets_the_metrics_and_the_config(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    config = run_config(tmp_path, "mlflow")
    track(config, range(1, 4))
    client = mlflow_client(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tracking-tests")
    [run] = client.search_runs([experiment.experiment_id])
    assert (run.info.run_name, run.info.status) == ("tracked", "FINISHED")
    assert run.data.params["actor_rollout_ref.actor.optim.lr"] == "1e-06"
    assert run.data.params["trainer.logger"] == '["mlflow"]'
    history = client.get_metric_history(run.info.run_id, "actor/pg_loss")
    assert [(metric.step, metric.value) for metric in history] == [(1, -0.125), (2, -0.25), (3, -0.375)]
    # verl's rewrite of a name MLflow refuses
    assert client.get_metric_history(run.info.run_id, "val-core/counting/acc/mean_at_4")[0].value == 0.5
    assert experiment.artifact_location == (tmp_path / "runs" / "mlartifacts").as_uri()


def test_mlflow_file_store_and_a_resumed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this
    config = run_config(tmp_path, "mlflow")
    track(config, range(1, 3), failed=True)
    client = mlflow_client(store.as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("tracking-tests").experiment_id])
    assert run.info.status == "FAILED"
    track(config, range(3, 4), start_step=2)
    [resumed] = client.search_runs([client.get_experiment_by_name("tracking-tests").experiment_id])
    assert (resumed.info.run_id, resumed.info.status) == (run.info.run_id, "FINISHED")
    assert [metric.step for metric in client.get_metric_history(run.info.run_id, "critic/score/mean")] == [1, 2, 3]


def test_mlflow_keys_as_verl_rewrites_them() -> None:
    assert mlflow_key("val-core/counting/acc/mean@4") == "val-core/counting/acc/mean_at_4"
    assert mlflow_key("timing_s//gen") == "timing_s/gen"
    assert mlflow_key("perf/mfu(actor)") == "perf/mfu_actor_"


# ----------------------------------------------------------------------------------------- swanlab


def swanlab_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Each scalar's (step, value) from the offline run's file, read with SwanLab's own reader."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    [path] = run_dir.glob("swanlog/run-*/run-*.swanlab")
    reader = DataStoreReader()
    reader.open(path)
    scalars: dict[str, list[tuple[int, float]]] = {}
    for data in reader:
        record = Record.FromString(data)
        if record.WhichOneof("record_type") == "scalar":
            scalars.setdefault(record.scalar.key, []).append((record.scalar.step, record.scalar.value.number))
    return scalars


def test_swanlab_offline_run_gets_each_steps_metrics_and_the_config(tmp_path: Path) -> None:
    pytest.importorskip("swanlab")
    import yaml

    config = run_config(tmp_path, "swanlab")
    track(config, range(1, 3))
    scalars = swanlab_scalars(config.trainer.run_dir)
    assert scalars["actor/pg_loss"] == [(1, -0.125), (2, -0.25)]
    assert scalars["training/global_step"] == [(1, 1.0), (2, 2.0)]
    [config_file] = config.trainer.run_dir.glob("swanlog/run-*/files/config.yaml")
    saved = yaml.safe_load(config_file.read_text())
    assert saved["trainer"]["value"]["experiment_name"] == "tracked"
