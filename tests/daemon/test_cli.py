"""`verl monitor/set/status/stop --pid` and `verl train --monitor`, in process, against a fake daemon.

The fake is a small FastAPI app with the API's JSON shapes (settings validated by the real live
settings table) served by uvicorn on loopback; a runtime file in a temporary state directory names
it as the run of this very test process, the way a daemon names itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import daemon.cli as cli
from daemon.runtime import RuntimeInfo, runtime_file, write_runtime_file
from tests.support import serve_app as serve
from trainer.config.live import LiveSettings, SettingsRejected, apply_change
from trainer.config.messages import (
    OffloadPlacement,
    Phase,
    Progress,
    Restarts,
    RunInfo,
    RunStatus,
    SettingsState,
    TelemetryHealth,
)

TOKEN = "test-token"
REPO = Path(__file__).resolve().parents[2]


class FakeRun:
    """The API of a daemon at step 45 of 200; the trainer acknowledges a settings change after
    `ack_delay_s` (never when None)."""

    def __init__(self):
        self.settings = LiveSettings()
        self.version = 3
        self.acknowledged = 3
        self.applied_at_step = 12
        self.changed_at = 0.0
        self.ack_delay_s: float | None = 0.2
        self.patches: list[dict] = []
        self.stops = 0
        self.forced_stops = 0
        self.on_stop = lambda: None
        self.phase_since = time.time() - 2
        self.url = ""  # where the test serves it
        self.missing: tuple[str, str] | None = None  # (section, field) left out of the status, as another version
        self.app = self._build_app()

    def settings_body(self) -> dict:
        if (self.acknowledged < self.version and self.ack_delay_s is not None
                and time.monotonic() - self.changed_at >= self.ack_delay_s):
            self.acknowledged, self.applied_at_step = self.version, 46
        return {"values": self.settings.public(), "version": self.version,
                "acknowledged_version": self.acknowledged, "applied_at_step": self.applied_at_step}

    def status(self) -> RunStatus:
        return RunStatus(
            run=RunInfo(name="quickstart", project="verl", run_dir="runs/quickstart",
                        config_path="runs/quickstart/config.yaml", daemon_pid=os.getpid(), trainer_pids=[4243],
                        state="running", started_at=1.0, uptime_s=3725.0, url="http://127.0.0.1:1"),
            progress=Progress(step=45, total_steps=200, phase=Phase.GEN, phase_since=self.phase_since),
            restarts=Restarts(total=1, max=3, by_reason={"crash": 1, "signal": 0}),
            settings=SettingsState.model_validate(self.settings_body()),
            telemetry=TelemetryHealth(nvml=False, dropped_messages=7),
            offload=OffloadPlacement(summary=[]))

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def check_token(request: Request, call_next):
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401)
            return await call_next(request)

        @app.get("/v1/status")
        def status() -> dict:
            body = self.status().model_dump(mode="json", by_alias=True)
            if self.missing:
                section, field = self.missing
                del body[section][field]
            return body

        @app.get("/v1/metrics/latest")
        def latest():
            return {"seq": 9, "step": None, "gpu": None,
                    "offload": {"copy_latency_p50_s": 0.01, "copy_latency_p99_s": 0.07,
                                "bandwidth_bytes_per_second": 1e9, "copies": 10}}

        @app.get("/v1/metrics/history")
        def history(since: int = 0):
            return {"events": [], "last_seq": 9}

        @app.get("/v1/settings")
        def settings():
            return self.settings_body()

        @app.patch("/v1/settings")
        async def update(request: Request):
            change = await request.json()
            self.patches.append(change)
            try:
                new = apply_change(self.settings, change)
            except SettingsRejected as rejected:
                return JSONResponse({"detail": [{"loc": ["body", problem.setting], "msg": problem.message,
                                                 "type": "value_error"} for problem in rejected.problems]},
                                    status_code=422)
            old_values, new_values = self.settings.public(), new.public()
            changed = [name for name in new_values if new_values[name] != old_values[name]]
            if not changed:  # as the daemon answers (daemon/service.py update_settings)
                return {"version": self.version, "old": {}, "new": {}, "values": new_values,
                        "applies_at_step": None, "status": "unchanged"}
            self.settings, self.version, self.changed_at = new, self.version + 1, time.monotonic()
            return {"version": self.version, "old": {name: old_values[name] for name in changed},
                    "new": {name: new_values[name] for name in changed}, "values": new_values,
                    "applies_at_step": 46, "status": "pending"}

        @app.post("/v1/stop")
        def stop(force: bool = False):
            self.stops += 1
            self.forced_stops += force
            self.on_stop()
            return {"requested": "stop"}

        return app


def runtime_info(pid: int, url: str, tmp_path: Path, *, token: str = TOKEN, trainer_pids=()) -> RuntimeInfo:
    return RuntimeInfo(pid=pid, url=url, token=token, run_dir=str(tmp_path / "runs" / "quickstart"),
                       config_path=str(tmp_path / "runs" / "quickstart" / "config.yaml"), name="quickstart",
                       started_at=psutil.Process(pid).create_time(), trainer_pids=list(trainer_pids))


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("VERL_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture
def run(state, tmp_path) -> Iterator[FakeRun]:
    """A fake daemon whose runtime file names this test process as the daemon."""
    fake = FakeRun()
    with serve(fake.app) as url:
        fake.url = url
        write_runtime_file(state, runtime_info(os.getpid(), url, tmp_path))
        yield fake


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    process = subprocess.Popen(["sleep", "60"])
    yield process
    process.kill()
    process.wait()


def verl(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_user_error(code: int, err: str, *expected: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    assert err.startswith("ERROR: ") and "\nHINT: " in err, err
    for text in expected:
        assert text in err, err


PID = str(os.getpid())


# ------------------------------------------------------------------------------------------- status


def test_status_summarizes_the_run(run, capsys):
    code, out, _ = verl(capsys, "status", "--pid", PID)
    assert code == 0
    assert "quickstart: running, step 45/200 (phase gen), up 1:02:05" in out
    assert f"daemon pid {PID}, trainer pid 4243" in out
    assert "restarts 1 of at most 3 (crash 1)" in out
    assert "settings v3 (in effect from step 12): dynamic_offload.gpu_memory_threshold=0.85" in out
    assert "dynamic_offload.enabled=false" in out
    assert "NVML unavailable, 7 messages dropped" in out


def test_status_json_is_the_api_body(run, capsys):
    code, out, _ = verl(capsys, "status", "--pid", PID, "--json")
    assert code == 0
    body = json.loads(out)
    assert body == httpx.get(f"{run.url}/v1/status", headers={"Authorization": f"Bearer {TOKEN}"},
                             trust_env=False).json()
    assert body["run"]["daemon_pid"] == os.getpid()


@pytest.mark.parametrize("command", ["status", "monitor"])
def test_a_status_of_another_version_is_one_error_naming_the_field(run, capsys, command):
    run.missing = ("run", "url")
    code, out, err = verl(capsys, command, "--pid", PID, "--once" if command == "monitor" else "--json")
    assert_user_error(code, err, "GET /v1/status with a body this verl cannot read: run.url: field required",
                      "HINT: the daemon likely runs another verl version")
    assert len(err.splitlines()) == 2 and out == ""


def orphan_sleep() -> int:
    """A process that is not a descendant of this one (its parent exits at once): a trainer found
    only through the runtime file's trainer_pids."""
    output = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                            check=True).stdout
    return int(output)


@pytest.mark.parametrize("relation", ["listed trainer", "child process"])
def test_a_trainer_pid_finds_its_daemon(state, tmp_path, capsys, relation):
    fake = FakeRun()
    trainer = orphan_sleep() if relation == "listed trainer" else None
    child = subprocess.Popen(["sleep", "60"]) if relation == "child process" else None
    try:
        pid = trainer or child.pid
        assert (os.getpid() in [parent.pid for parent in psutil.Process(pid).parents()]) == (child is not None)
        with serve(fake.app) as url:
            write_runtime_file(state, runtime_info(os.getpid(), url, tmp_path,
                                                   trainer_pids=[trainer] if trainer else []))
            code, out, err = verl(capsys, "status", "--pid", str(pid), "--json")
        assert code == 0, err
        assert json.loads(out)["run"]["name"] == "quickstart"
    finally:
        if trainer:
            psutil.Process(trainer).kill()
        if child:
            child.kill()
            child.wait()


# ------------------------------------------------------------------------------------------ monitor


def test_monitor_once_json_prints_a_snapshot_with_hints(run, capsys):
    code, out, err = verl(capsys, "monitor", "--pid", PID, "--once", "--json")
    assert code == 0, err
    snapshot = json.loads(out)
    assert snapshot["status"]["progress"]["step"] == 45
    assert snapshot["latest"]["offload"]["copies"] == 10
    assert any("p99 70 ms" in hint for hint in snapshot["hints"])


def test_monitor_once_prints_the_view(run, capsys):
    code, out, _ = verl(capsys, "monitor", "--pid", PID, "--once")
    assert code == 0
    assert "45/200" in out and "restarts 1/3" in out and "dynamic_offload.gpu_memory_threshold=0.85" in out


# ---------------------------------------------------------------------------------------------- set


def test_set_prints_old_and_new_and_waits_for_the_acknowledgement(run, capsys):
    code, out, err = verl(capsys, "set", "gpu_memory_threshold=0.8", "dynamic_offload.enabled=true", "--pid", PID)
    assert code == 0, err
    assert run.patches == [{"gpu_memory_threshold": 0.8, "dynamic_offload.enabled": True}]
    assert "dynamic_offload.gpu_memory_threshold: 0.85 -> 0.8" in out
    assert "dynamic_offload.enabled: false -> true" in out
    assert "settings version 4; the trainer applies it at step 46" in out
    assert "acknowledged by the trainer: in effect from step 46" in out


def test_set_to_the_values_in_effect_says_so_and_waits_for_nothing(run, capsys):
    run.ack_delay_s = None  # nothing will be acknowledged: a wait would time out
    code, out, err = verl(capsys, "set", "gpu_memory_threshold=0.85", "--pid", PID)
    assert code == 0, err
    assert out.strip() == "nothing to change: the settings already have these values (settings version 3)"


def test_set_reads_values_as_yaml_scalars(run, capsys):
    code, _, err = verl(capsys, "set", "min_transformer_layers_on_gpu=4", "log_level=debug",
                        "gpu_sample_interval_s=5e-1", "--pid", PID, "--wait", "0")
    assert code == 0, err
    assert run.patches == [{"min_transformer_layers_on_gpu": 4, "log_level": "debug", "gpu_sample_interval_s": 0.5}]
    assert isinstance(run.patches[0]["gpu_sample_interval_s"], float)


def test_set_says_when_the_trainer_has_not_acknowledged(run, capsys):
    run.ack_delay_s = None
    started = time.monotonic()
    code, out, _ = verl(capsys, "set", "gpu_memory_threshold=0.7", "--pid", PID, "--wait", "0.5")
    assert code == 0
    assert 0.5 <= time.monotonic() - started < 5
    assert "the trainer has not acknowledged version 4 within 0.5 s" in out


def test_a_rejected_setting_names_every_bad_field_and_changes_nothing(run, capsys):
    code, out, err = verl(capsys, "set", "gpu_memory_threshold=1.5", "min_transformer_layers_on_gpu=-1",
                          "--pid", PID)
    assert_user_error(code, err, "nothing was changed")
    errors = [line for line in err.splitlines() if line.startswith("ERROR: ")]
    assert len(errors) == 2
    assert errors[0].startswith("ERROR: dynamic_offload.gpu_memory_threshold: got 1.5")
    assert "a number > 0 and <= 1" in errors[0]
    assert errors[1].startswith("ERROR: dynamic_offload.min_transformer_layers_on_gpu: got -1")
    assert run.version == 3 and run.settings == LiveSettings()
    assert out == ""


def test_an_unknown_setting_lists_the_allowed_ones(run, capsys):
    code, _, err = verl(capsys, "set", "gpu_memory=0.5", "--pid", PID)
    assert_user_error(code, err, "ERROR: gpu_memory: unknown setting; allowed: dynamic_offload.gpu_memory_threshold")
    assert "(or their short names: gpu_memory_threshold, min_transformer_layers_on_gpu" in err


@pytest.mark.parametrize(("assignment", "expected"), [
    ("gpu_memory_threshold", "expected NAME=VALUE, got 'gpu_memory_threshold'"),
    ("=0.8", "expected NAME=VALUE, got '=0.8'"),
    ("gpu_memory_threshold=", "expected NAME=VALUE, got 'gpu_memory_threshold='"),
    ("gpu_memory_threshold=[0.8, 0.9]", "gpu_memory_threshold: expected a single value"),
])
def test_a_malformed_assignment_is_refused_before_any_request(run, capsys, assignment, expected):
    code, _, err = verl(capsys, "set", assignment, "--pid", PID)
    assert_user_error(code, err, expected, "HINT: write NAME=VALUE")
    assert run.patches == []


def test_a_setting_given_twice_is_refused(run, capsys):
    code, _, err = verl(capsys, "set", "log_level=debug", "log_level=info", "--pid", PID)
    assert_user_error(code, err, "log_level is given twice")
    assert run.patches == []


def test_set_takes_the_canonical_name_and_shows_it(run, capsys):
    code, out, err = verl(capsys, "set", "dynamic_offload.min_transformer_layers_on_gpu=2", "daemon.log_level=debug",
                          "--pid", PID, "--wait", "0")
    assert code == 0, err
    assert run.patches == [{"dynamic_offload.min_transformer_layers_on_gpu": 2, "daemon.log_level": "debug"}]
    assert "dynamic_offload.min_transformer_layers_on_gpu: 0 -> 2" in out and "daemon.log_level: info -> debug" in out
    assert run.settings.min_transformer_layers_on_gpu == 2 and run.settings.log_level == "debug"


def test_a_setting_given_by_both_its_names_is_one_error_naming_both(run, capsys):
    code, _, err = verl(capsys, "set", "gpu_memory_threshold=0.8", "dynamic_offload.gpu_memory_threshold=0.7",
                        "--pid", PID)
    assert_user_error(code, err, "ERROR: dynamic_offload.gpu_memory_threshold: given twice, as "
                                 "gpu_memory_threshold=0.8 and dynamic_offload.gpu_memory_threshold=0.7")
    assert len([line for line in err.splitlines() if line.startswith("ERROR: ")]) == 1
    assert run.patches == [] and run.version == 3 and run.settings == LiveSettings()


# --------------------------------------------------------------------------------------------- stop


def test_stop_asks_the_run_to_checkpoint_and_exit(run, capsys):
    code, out, _ = verl(capsys, "stop", "--pid", PID)
    assert code == 0
    assert run.stops == 1
    assert f"asked run quickstart (daemon pid {PID}) to checkpoint" in out


def test_stop_force_asks_the_run_to_kill_its_trainer_without_a_checkpoint(run, capsys):
    code, out, _ = verl(capsys, "stop", "--force", "--pid", PID)
    assert code == 0
    assert run.stops == 1 and run.forced_stops == 1
    assert "without a checkpoint" in out
    verl(capsys, "stop", "--pid", PID)
    assert run.stops == 2 and run.forced_stops == 1  # a plain stop is not forced


def test_stop_wait_returns_once_the_daemon_has_exited(state, tmp_path, capsys, sleeper):
    fake = FakeRun()
    fake.on_stop = lambda: threading.Timer(0.3, sleeper.terminate).start()
    with serve(fake.app) as url:
        write_runtime_file(state, runtime_info(sleeper.pid, url, tmp_path))
        code, out, err = verl(capsys, "stop", "--pid", str(sleeper.pid), "--wait")
    assert code == 0, err
    assert not psutil.pid_exists(sleeper.pid) or psutil.Process(sleeper.pid).status() == psutil.STATUS_ZOMBIE
    assert "run quickstart has stopped (last seen at step 45)" in out


# ------------------------------------------------------------------------------------------- errors


def test_a_pid_that_is_not_a_run_is_one_error(state, capsys):
    code, _, err = verl(capsys, "status", "--pid", "1")
    assert_user_error(code, err, "ERROR: pid 1 is not a verl run", "no verl run is going")
    assert len(err.splitlines()) == 2


FAKE_VERL_TRAIN = """\
import subprocess, sys, time
trainer = subprocess.Popen(["sleep", "60"])
print(trainer.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize(("relation", "override"), [("daemon", "daemon.state_dir=elsewhere"),
                                                    ("trainer", "daemon.state_dir=elsewhere"),
                                                    ("daemon", "trainer.total_training_steps=3")])
def test_a_run_whose_runtime_file_is_in_another_state_dir_says_so(state, tmp_path, capsys, relation, override):
    """A live `verl train` (a stand-in with its command line) that keeps its runtime file elsewhere is not
    called "not a verl run": the error says where it looked and the hint names --state-dir."""
    script = tmp_path / "verl"
    script.write_text(FAKE_VERL_TRAIN)
    daemon = subprocess.Popen([sys.executable, str(script), "train", "--config", "run.yaml", override],
                              cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    trainer = int(daemon.stdout.readline())
    try:
        pid = daemon.pid if relation == "daemon" else trainer
        code, _, err = verl(capsys, "status", "--pid", str(pid))
    finally:
        psutil.Process(trainer).kill()
        daemon.kill()
        daemon.wait()
    assert_user_error(code, err, f"ERROR: pid {pid} is ", "of a `verl train` run", str(state / "run"),
                      "another state dir")
    assert "not a verl run" not in err
    if relation == "trainer":
        assert f"a process under the daemon (pid {daemon.pid})" in err
    if override.startswith("daemon.state_dir="):
        assert f"HINT: its command line sets daemon.state_dir: pass --state-dir {tmp_path / 'elsewhere'}" in err
    else:
        assert "HINT: pass --state-dir DIR with the run's daemon.state_dir" in err


def test_the_state_dir_help_claims_no_default_it_cannot_know(capsys):
    assert cli.main(["status", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "the run's daemon.state_dir, else" not in help_text
    assert "a run started with daemon.state_dir=DIR needs --state-dir DIR" in help_text


def test_a_pid_of_no_process_is_one_error(state, capsys):
    ended = subprocess.Popen(["true"])
    ended.wait()
    code, _, err = verl(capsys, "monitor", "--pid", str(ended.pid), "--once")
    assert_user_error(code, err, f"ERROR: no process has pid {ended.pid}")


def test_a_stale_runtime_file_is_removed_and_its_pid_is_not_a_run(state, tmp_path, capsys):
    stale = runtime_info(os.getpid(), "http://127.0.0.1:1", tmp_path)
    stale.started_at -= 3600  # this pid belonged to another process an hour ago
    path = write_runtime_file(state, stale)
    code, _, err = verl(capsys, "status", "--pid", PID)
    assert_user_error(code, err, f"pid {PID} is not a verl run")
    assert not path.exists()


def test_a_daemon_that_does_not_answer_is_one_error(state, tmp_path, capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    write_runtime_file(state, runtime_info(os.getpid(), f"http://127.0.0.1:{port}", tmp_path))
    code, _, err = verl(capsys, "status", "--pid", PID)
    assert_user_error(code, err, "does not answer", "logs/daemon.log")


def test_a_token_the_daemon_refuses_points_at_the_runtime_file(state, tmp_path, capsys):
    fake = FakeRun()
    with serve(fake.app) as url:
        write_runtime_file(state, runtime_info(os.getpid(), url, tmp_path, token="an-old-runs-token"))
        code, _, err = verl(capsys, "set", "log_level=debug", "--pid", PID)
    assert_user_error(code, err, "refused the token", str(runtime_file(state, os.getpid())))
    assert fake.patches == []


@pytest.mark.parametrize("args", [["status", "--pid", "abc"], ["status", "--pid", "-3"], ["status"],
                                  ["monitor", "--pid", PID, "--refresh", "0"]])
def test_bad_arguments_are_one_error_with_a_hint(state, capsys, args):
    code, _, err = verl(capsys, *args)
    assert_user_error(code, err, "HINT: `verl")
    assert len(err.splitlines()) == 2


# -------------------------------------------------------------------------------------------- train


@pytest.mark.parametrize("flag", [[], ["--monitor"]])
def test_train_passes_the_monitor_flag_to_the_run(tmp_path, monkeypatch, flag):
    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr(cli, "start_run", lambda config, config_path, monitor, run_lock: started.append(
        (config.trainer.total_training_steps, config_path, monitor)) or 0)
    code = cli.main(["train", "--config", str(REPO / "examples" / "quickstart.yaml"), *flag,
                     "trainer.total_training_steps=3"])
    assert code == 0
    assert started == [(3, Path("runs/quickstart/config.yaml"), bool(flag))]
    assert (tmp_path / "runs" / "quickstart" / "config.yaml").is_file()


def test_the_live_view_runs_in_a_terminal_until_ctrl_c(run, state):
    """The real command in a pseudo-terminal: the view draws, Ctrl-C ends it with exit code 0."""
    leader, follower = pty.openpty()
    env = {**os.environ, "VERL_STATE_DIR": str(state), "COLUMNS": "80", "LINES": "24", "TERM": "xterm-256color"}
    process = subprocess.Popen([str(Path(sys.executable).parent / "verl"), "monitor", "--pid", PID,
                                "--refresh", "0.1"], stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    screen = b""
    deadline = time.monotonic() + 60
    try:
        while b"restarts 1/3" not in screen or screen.count(b"45/200") < 3:
            assert process.poll() is None and time.monotonic() < deadline, screen.decode(errors="replace")
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                screen += os.read(leader, 65536)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 0
        with contextlib.suppress(OSError):  # the terminal closes with the process
            while chunk := os.read(leader, 65536):
                screen += chunk
    finally:
        process.kill()
        os.close(leader)
    text = screen.decode(errors="replace")
    assert "Traceback" not in text
    assert "monitor closed; the run goes on" in text
