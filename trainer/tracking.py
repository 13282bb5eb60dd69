"""Experiment trackers (``trainer.logger``): each step's metrics, under verl's names, to wandb, TensorBoard,
MLflow, SwanLab or verl's JSON-lines file, with the resolved config as the run's config or hyperparameters.

verl's ``verl/utils/tracking.py`` is the model: the same backends, the same environment variables, the same
``{"step": N, "data": {...}}`` records of the ``file`` backend. Where this differs, and why:

- a tracker's files go into the run directory (runs/<name>/wandb, tensorboard, swanlog, tracking.jsonl; MLflow's
  store is runs/mlflow.db, shared by the runs) unless verl's environment variable names another place;
- a run that resumes (the daemon restarts a crashed trainer) goes on in the same tracker run: the ids are kept
  in runs/<name>/tracker_runs.json, and the steps after the checkpoint are dropped from TensorBoard and the file;
- a tracker that fails while the run trains (or as a resumed run starts) is dropped with one warning and
  training goes on: a long run must not die because a metrics server is down; one that cannot start a new run
  stops it before it trains;
- ``console`` is the trainer's own step line (trainer/reporting.py), so it has no tracker here.

trainer.log_val_generations' validation responses go where verl's ValidationGenerationsLogger puts them: a wandb table
and a SwanLab table (``val/generations``), TensorBoard text (``val/generations``), an MLflow artifact
(``val_step<N>.json``); the ``file`` backend keeps none (verl's neither: they are in the run's log).

Only the first process of a rank group logs, on a thread of its own (Tracking). Each library is imported when
its tracker starts; the config check (trainer/config/environment.py) has already refused one whose library is missing.
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import tempfile
import threading
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from trainer.config import KEYS, RunConfig
from trainer.errors import RunSetupError

Generations = list[tuple[str, str, float]]
"""(prompt, response, score) of each validation response shown (trainer.log_val_generations), in verl's order."""


class Tracker(Protocol):
    """One backend's run. One that shows validation responses also has log_generations(step, Generations)."""

    where: str
    """Where its run is, for the log line at start."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def finish(self, *, failed: bool) -> None: ...


@dataclass(frozen=True)
class TrackedRun:
    """What every tracker starts from."""

    project: str
    experiment: str
    run_dir: Path
    runs_dir: Path
    config: dict[str, Any]
    """The resolved config, JSON-ready: the run's config (wandb, SwanLab) or hyperparameters (TensorBoard, MLflow)."""
    start_step: int
    """Steps done before this process started: 0 for a new run, the checkpoint's step for a resumed one."""

    @property
    def resumed(self) -> bool:
        return self.start_step > 0

    @property
    def ids_file(self) -> Path:
        return self.run_dir / "tracker_runs.json"

    def resumed_id(self, backend: str) -> str | None:
        """The id of the tracker run this run logged to before it stopped, when it resumes; None for a new run."""
        if not self.resumed or not self.ids_file.exists():
            return None
        try:
            identifier = json.loads(self.ids_file.read_text(encoding="utf-8")).get(backend)
        except ValueError:  # a file cut short: the run starts a new tracker run rather than failing
            return None
        return identifier if isinstance(identifier, str) else None

    def remember_id(self, backend: str, identifier: str) -> None:
        try:
            known = json.loads(self.ids_file.read_text(encoding="utf-8")) if self.ids_file.exists() else {}
        except ValueError:
            known = {}
        known[backend] = identifier
        self.ids_file.write_text(json.dumps(known, indent=1) + "\n", encoding="utf-8")


FINISH_TIMEOUT_S = 60.0
"""At the end of a run, how long the trackers may take to log the steps still queued for them."""


class Tracking:
    """The run's trackers as one step observer. They log on a thread of their own, so that a slow one (MLflow's
    sqlite store takes ~50 ms a step; a server may stall for minutes) does not hold training up. A tracker that
    raises is dropped with one warning: third-party libraries raise anything (network, disk, their own bugs),
    and none of it may stop training."""

    def __init__(self, trackers: Mapping[str, Tracker], warn: Callable[[str], None] = print):
        self.trackers = dict(trackers)
        self.warn = warn
        self._steps: queue.SimpleQueue[tuple[int, dict[str, float] | Generations] | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._log_steps, name="verl-trackers", daemon=True)
        self._worker.start()

    def on_step(self, step: int, metrics: Mapping[str, float]) -> None:
        self._steps.put((step, dict(metrics)))

    def on_validation_generations(self, step: int, samples: Sequence[Any]) -> None:
        """trainer.log_val_generations' responses (ValidationSamples) of the validation at `step`, to every tracker
        that shows them."""
        self._steps.put((step, [(sample.prompt, sample.response, sample.score) for sample in samples]))

    def close(self, *, failed: bool = False, timeout: float = FINISH_TIMEOUT_S) -> None:
        """Log what is queued, then finish every tracker's run; `failed` marks them failed (the trainer crashed)."""
        self._steps.put(None)
        self._worker.join(timeout)
        if self._worker.is_alive():  # stuck in a tracker: finishing now would race it
            self.warn(f"trackers {', '.join(self.trackers)} were still logging after {timeout:g} s; not waiting")
            return
        trackers, self.trackers = self.trackers, {}
        for name, tracker in trackers.items():
            try:
                tracker.finish(failed=failed)
            except Exception as error:
                self.warn(f"tracker {name} could not finish its run ({_describe(error)})")

    def _log_steps(self) -> None:
        while (item := self._steps.get()) is not None:
            step, logged = item
            for name, tracker in list(self.trackers.items()):
                if isinstance(logged, list):
                    self._log_generations(name, tracker, step, logged)
                    continue
                try:
                    tracker.log(step, logged)
                except Exception as error:  # anything: see the class docstring
                    self._drop(name, f"could not log step {step}", error)

    def _log_generations(self, name: str, tracker: Tracker, step: int, generations: Generations) -> None:
        """A tracker that fails to show them warns and goes on logging the metrics (verl's warns, too)."""
        log_generations = getattr(tracker, "log_generations", None)
        if log_generations is None:
            return
        try:
            log_generations(step, generations)
        except Exception as error:  # anything: see the class docstring
            self.warn(f"tracker {name} could not log the validation generations of step {step} ({_describe(error)})")

    def _drop(self, name: str, what: str, error: BaseException) -> None:
        tracker = self.trackers.pop(name)
        self.warn(f"tracker {name} {what} ({_describe(error)}); it is dropped and training goes on without it")
        try:
            tracker.finish(failed=True)
        except Exception:
            pass  # it has failed already, and the warning said so


def start_tracking(config: RunConfig, *, start_step: int, warn: Callable[[str], None] = print,
                   log: Callable[[str], None] = print) -> Tracking:
    """Start the trackers of trainer.logger (none outside the first process). `start_step`: the step the run
    starts from, after resuming. A tracker that cannot start stops a new run before it trains (RunSetupError: a
    missing API key is better found now than after days of training), and is left out of a resumed one with a
    warning (the daemon's restart of a long run must not fail on a metrics server)."""
    if not is_logging_process():
        return Tracking({}, warn)
    run = TrackedRun(project=config.trainer.project_name, experiment=config.trainer.experiment_name,
                     run_dir=config.trainer.run_dir, runs_dir=Path(config.trainer.runs_dir),
                     config=config.model_dump(mode="json"), start_step=start_step)
    run.run_dir.mkdir(parents=True, exist_ok=True)
    trackers: dict[str, Tracker] = {}
    for name in config.trainer.logger:
        starter = TRACKERS.get(name)
        if starter is None:  # console: the trainer's step line
            continue
        try:
            trackers[name] = starter(run)
        except Exception as error:  # anything: see Tracking
            if not run.resumed:
                Tracking(trackers, warn).close(failed=True)
                raise RunSetupError(f"{KEYS.trainer.logger}: tracker {name} could not start ({_describe(error)}); "
                                    f"fix that, or leave {name} out of {KEYS.trainer.logger}") from error
            warn(f"tracker {name} could not start ({_describe(error)}); training goes on without it")
            continue
        log(f"tracker {name}: {trackers[name].where}")
    return Tracking(trackers, warn)


def is_logging_process() -> bool:
    """Rank 0 of a torch.distributed group (torchrun's RANK before the group forms); a lone process logs."""
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def _describe(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}" if text else type(error).__name__


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """The config's leaves by dotted key path (as overrides name them); lists and nulls as JSON text, since
    hyperparameter stores take only scalars."""
    flat: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(flat_config(value, f"{prefix}{key}."))
        elif isinstance(value, str | int | float | bool):
            flat[prefix + key] = value
        else:
            flat[prefix + key] = json.dumps(value)
    return flat


def _finite_or_none(value: float) -> float | None:
    # JSON has no NaN or infinity: null, as verl's orjson writes them.
    return value if not isinstance(value, float) or math.isfinite(value) else None


# ------------------------------------------------------------------------------------------- file


class FileTracker:
    """verl's ``file`` logger: one ``{"step": N, "data": {...}}`` JSON line per step, flushed as it is written."""

    def __init__(self, run: TrackedRun):
        self.path = file_tracker_path(run)
        self.where = str(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _keep_records_up_to(self.path, run.start_step)
        self.file = self.path.open("ab")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, "data": {key: _finite_or_none(value) for key, value in metrics.items()}}
        self.file.write((json.dumps(record, allow_nan=False) + "\n").encode("utf-8"))
        self.file.flush()

    def finish(self, *, failed: bool) -> None:
        self.file.close()


def file_tracker_path(run: TrackedRun) -> Path:
    """VERL_FILE_LOGGER_PATH, else VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl (verl's), else the run
    directory's tracking.jsonl."""
    if os.environ.get("VERL_FILE_LOGGER_PATH"):
        return Path(os.environ["VERL_FILE_LOGGER_PATH"]).expanduser()
    if os.environ.get("VERL_FILE_LOGGER_ROOT"):
        return Path(os.environ["VERL_FILE_LOGGER_ROOT"]).expanduser() / run.project / f"{run.experiment}.jsonl"
    return run.run_dir / "tracking.jsonl"


def _keep_records_up_to(path: Path, step: int) -> None:
    """Drop the records after `step` (they run again) and any line that is not a whole record. Only a regular
    file: VERL_FILE_LOGGER_PATH may name a pipe or a device."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_bytes().splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if line.endswith(b"\n") and isinstance(record, dict) and isinstance(record.get("step"), int) \
                and record["step"] <= step:
            kept.append(line)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(b"".join(kept))
    os.replace(temporary, path)


# ------------------------------------------------------------------------------------ tensorboard


class TensorboardTracker:
    """Scalars per step in TensorBoard event files; the config as hyperparameters and as text."""

    def __init__(self, run: TrackedRun):
        from torch.utils.tensorboard.summary import hparams
        from torch.utils.tensorboard.writer import FileWriter, SummaryWriter

        directory = Path(os.environ.get("TENSORBOARD_DIR") or run.run_dir / "tensorboard")
        self.where = str(directory)
        # purge_step: TensorBoard hides what an earlier process logged after the step this one resumes from.
        self.writer = SummaryWriter(str(directory), purge_step=run.start_step + 1)
        if not run.resumed:
            file_writer = typing.cast(FileWriter, self.writer.file_writer)  # opened by SummaryWriter.__init__
            for summary in hparams(flat_config(run.config), {})[:2]:  # the experiment and this session's start
                file_writer.add_summary(summary)
            config_text = yaml.safe_dump(run.config, sort_keys=False)
            # Indented four spaces: TensorBoard shows text as Markdown, and this keeps it a code block.
            self.writer.add_text("config", "".join(f"    {line}\n" for line in config_text.splitlines()), 0)
        self.writer.flush()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_generations(self, step: int, generations: Generations) -> None:
        """Markdown text under val/generations, as verl's."""
        text = f"**Generation Results - Step {step}**\n\n" + "".join(
            f"### Sample {number}\n**Input:** {prompt}\n\n**Output:** {response}\n\n**Score:** {score}\n\n---\n\n"
            for number, (prompt, response, score) in enumerate(generations, 1))
        self.writer.add_text("val/generations", text, step)
        self.writer.flush()

    def finish(self, *, failed: bool) -> None:
        self.writer.close()


# ------------------------------------------------------------------------------------------ wandb


class WandbTracker:
    """A Weights & Biases run: project and name from trainer.*, the config as its config. wandb reads its own
    environment (WANDB_API_KEY, WANDB_MODE=offline, WANDB_ENTITY, WANDB_DIR, WANDB_RUN_ID)."""

    def __init__(self, run: TrackedRun):
        import wandb

        resumed_id = run.resumed_id("wandb")
        self.run = wandb.init(
            project=run.project, name=run.experiment, id=resumed_id, resume="allow" if resumed_id else None,
            # A resumed run keeps the config it started with (wandb refuses changed values).
            config=None if resumed_id else run.config,
            dir=None if os.environ.get("WANDB_DIR") else str(run.run_dir),
        )
        run.remember_id("wandb", self.run.id)
        self.where = f"run {self.run.id} ({self.run.settings.mode}) in {self.run.dir}"
        self.generation_rows: list[list[Any]] = []

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_generations(self, step: int, generations: Generations) -> None:
        """A table under val/generations with a row per validation (step, input_1, output_1, score_1, ...), logged
        whole each time (a wandb table cannot grow once logged), as verl's."""
        import wandb

        columns = ["step"] + [f"{kind}_{number}" for number in range(1, len(generations) + 1)
                              for kind in ("input", "output", "score")]
        self.generation_rows.append([step, *(item for sample in generations for item in sample)])
        rows = [row for row in self.generation_rows if len(row) == len(columns)]
        self.run.log({"val/generations": wandb.Table(columns=columns, data=rows)}, step=step)

    def finish(self, *, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


# ----------------------------------------------------------------------------------------- mlflow

MLFLOW_PARAMS_PER_CALL = 100
"""MLflow's tracking servers take at most 100 parameters per request."""
MLFLOW_PARAM_LENGTH = 6000
"""MLflow's longest parameter value."""
_MLFLOW_FORBIDDEN = re.compile(r"[^/\w.\- :]")


class MlflowTracker:
    """An MLflow run: the experiment is trainer.project_name, the run's name trainer.experiment_name (verl's),
    the config as its parameters. MLFLOW_TRACKING_URI names the store (default: sqlite:///<runs_dir>/mlflow.db);
    MLFLOW_RUN_ID logs to a run that exists already."""

    def __init__(self, run: TrackedRun):
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run.runs_dir / 'mlflow.db').resolve()}"
        run.runs_dir.mkdir(parents=True, exist_ok=True)
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        existing = os.environ.get("MLFLOW_RUN_ID") or run.resumed_id("mlflow")
        if existing is None:
            self.run_id = self._new_run(run, default_store=not os.environ.get("MLFLOW_TRACKING_URI"))
        else:
            self.run_id = existing
            self.client.update_run(self.run_id, status="RUNNING")
        run.remember_id("mlflow", self.run_id)
        self.where = f"run {self.run_id} in {uri}"

    def _new_run(self, run: TrackedRun, *, default_store: bool) -> str:
        from mlflow.entities import Param

        experiment = self.client.get_experiment_by_name(run.project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # in the default store its artifacts go beside it, not into ./mlruns of wherever the run started
            artifacts = (run.runs_dir / "mlartifacts").resolve().as_uri() if default_store else None
            experiment_id = self.client.create_experiment(run.project, artifact_location=artifacts)
        run_id: str = self.client.create_run(experiment_id, run_name=run.experiment).info.run_id
        params = [Param(key, str(value)[:MLFLOW_PARAM_LENGTH]) for key, value in flat_config(run.config).items()]
        for start in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(run_id, params=params[start:start + MLFLOW_PARAMS_PER_CALL])
        return run_id

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(key), float(value), now, step)
                                                    for key, value in metrics.items()])

    def log_generations(self, step: int, generations: Generations) -> None:
        """An artifact val_step<N>.json: [{"input", "output", "score"}, ...], as verl's."""
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / f"val_step{step}.json"
            path.write_text(json.dumps([{"input": prompt, "output": response, "score": score}
                                        for prompt, response, score in generations]), encoding="utf-8")
            self.client.log_artifact(self.run_id, str(path))

    def finish(self, *, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts (letters, digits, ``/_.- :``), as verl rewrites it: ``@`` -> ``_at_``."""
    return _MLFLOW_FORBIDDEN.sub("_", re.sub("/+", "/", key.replace("@", "_at_")))


# ---------------------------------------------------------------------------------------- swanlab


class SwanlabTracker:
    """A SwanLab run: project and name from trainer.*, the config as its config. SwanLab reads its own
    environment (SWANLAB_API_KEY, SWANLAB_MODE: online, offline, local or disabled; SWANLAB_LOG_DIR)."""

    def __init__(self, run: TrackedRun):
        import swanlab  # type: ignore[import-untyped]

        resumed_id = run.resumed_id("swanlab")
        self.run = swanlab.init(
            project=run.project, name=run.experiment, id=resumed_id, resume="allow" if resumed_id else None,
            config=None if resumed_id else run.config,
            log_dir=None if os.environ.get("SWANLAB_LOG_DIR") else str(run.run_dir / "swanlog"),
            # No prompt for an API key: the trainer has no one at its terminal; a missing key is an error.
            settings=swanlab.Settings(interactive=False),
        )
        run.remember_id("swanlab", self.run.id)
        self.where = f"run {self.run.id} ({self.run.mode}) in {self.run.dir}"

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_generations(self, step: int, generations: Generations) -> None:
        """A table under val/generations (step, input, output, score), as verl's."""
        import swanlab

        table = swanlab.echarts.Table()
        table.add(headers=["step", "input", "output", "score"], rows=[[step, *sample] for sample in generations])
        self.run.log({"val/generations": table}, step=step)

    def finish(self, *, failed: bool) -> None:
        if failed:
            self.run.finish(state="crashed", error="the trainer stopped on an error (see its log)")
        else:
            self.run.finish()


TRACKERS: dict[str, Callable[[TrackedRun], Tracker]] = {
    "file": FileTracker, "tensorboard": TensorboardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker,
    "swanlab": SwanlabTracker,
}
"""Every backend of trainer.logger but console, by name."""
