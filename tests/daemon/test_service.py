"""The whole daemon in this process (real IPC, API, sampler and supervisor) around the fake trainer, and
`run_daemon` around the real trainer."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shlex
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from daemon.runtime import RuntimeInfo, runtime_file
from daemon.service import Daemon, derived_hang_timeout
from trainer.config import dump_config, load_config

REPO = Path(__file__).resolve().parents[2]
FAKE_TRAINER = [sys.executable, str(Path(__file__).with_name("fake_trainer.py"))]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
THRESHOLD = "dynamic_offload.gpu_memory_threshold"


def make_daemon(tmp_path: Path, monkeypatch, *overrides: str, **fake: str) -> Daemon:
    for key in [key for key in os.environ if key.startswith("FAKE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    for key, value in fake.items():
        monkeypatch.setenv(f"FAKE_{key.upper()}", value)
    config = load_config(QUICKSTART, [f"trainer.runs_dir={tmp_path / 'runs'}", "trainer.experiment_name=fake",
                                      "daemon.restart_backoff_s=0.1", "telemetry.gpu_sample_interval_s=0.1",
                                      *overrides])
    config_path = config.trainer.run_dir / "config.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)  # exists when a test resumes a run
    config_path.write_text(dump_config(config))
    return Daemon(config, config_path, trainer_command=FAKE_TRAINER, state=tmp_path / "state", out=io.StringIO())


async def eventually(condition, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = await condition() if asyncio.iscoroutinefunction(condition) else condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def fake_events(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]


def audit(daemon: Daemon) -> list[dict]:
    return [json.loads(line) for line in (daemon.run_dir / "settings_audit.jsonl").read_text().splitlines()]


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def test_a_run_is_served_restarted_and_keeps_its_live_settings(tmp_path: Path, monkeypatch) -> None:
    crash_file = tmp_path / "crash-now"
    daemon = make_daemon(tmp_path, monkeypatch, total_steps="25", step_s="0.1", crash_file=str(crash_file))
    path = runtime_file(daemon.state, daemon.pid)

    async def scenario() -> tuple[int, dict]:
        run = asyncio.create_task(daemon.run())
        await eventually(lambda: path.exists() and RuntimeInfo.from_json(path.read_text()).trainer_pids,
                         what="the runtime file with the trainer's pid")
        info = RuntimeInfo.from_json(path.read_text())
        assert oct(path.stat().st_mode & 0o777) == "0o600" and info.token == daemon.token
        async with httpx.AsyncClient(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}) as api:
            async def status() -> dict:
                return (await api.get("/v1/status")).json()

            await eventually(lambda: daemon.progress.step >= 1, what="a first step")
            assert (await status())["run"]["state"] == "running"
            patched = await api.patch("/v1/settings", json={"gpu_memory_threshold": 0.5})  # by its short name
            assert patched.status_code == 200, patched.text
            body = patched.json()
            assert body["version"] == 1 and body["status"] == "pending"
            assert body["old"] == {THRESHOLD: 0.85} and body["new"] == {THRESHOLD: 0.5}
            assert body["applies_at_step"] > (await status())["progress"]["step"] - 2
            rejected = await api.patch("/v1/settings", json={"gpu_memory_threshold": 1.5})
            assert rejected.status_code == 422
            await eventually(lambda: daemon.settings_store.acknowledged_version == 1, what="the acknowledgement")
            # The value it already has: no new version, nothing sent down, nothing audited.
            again = (await api.patch("/v1/settings", json={THRESHOLD: 0.5})).json()
            assert again["version"] == 1 and again["new"] == {} and again["status"] == "unchanged"

            crash_file.touch()  # the fake trainer SIGKILLs itself at its next step
            await eventually(lambda: daemon.supervisor.restarts == 1, what="the restart")
            await eventually(lambda: daemon.supervisor.state == "running", what="the restarted trainer")
            assert info.trainer_pids != RuntimeInfo.from_json(path.read_text()).trainer_pids
            middle = await status()
            metrics_text = (await api.get("/metrics")).text
        return await asyncio.wait_for(run, 30), {"status": middle, "metrics": metrics_text}

    code, seen = asyncio.run(scenario())
    assert code == 0 and daemon.supervisor.state == "finished"
    assert not path.exists() and not daemon.ipc.path.exists()

    # The restarted trainer got version 1 right after its hello, and acknowledged it.
    runs = [event for event in fake_events(tmp_path) if event["event"] in ("start", "down")]
    second_start = [index for index, event in enumerate(runs) if event["event"] == "start"][1]
    first_message = runs[second_start + 1]["message"]
    assert first_message["type"] == "settings" and first_message["version"] == 1
    assert first_message["values"][THRESHOLD] == 0.5
    # The trainer may acknowledge version 1 before or after the rejected change is audited (a loaded host).
    results = [line["result"] for line in audit(daemon)]
    assert results[0] == "accepted" and sorted(results[1:3]) == ["applied", "rejected"] and results[3:] == ["applied"]
    assert all(line["new"] == {THRESHOLD: 0.5} for line in audit(daemon) if line["result"] != "rejected")

    assert seen["status"]["restarts"]["total"] == 1 and seen["status"]["restarts"]["by_reason"]["signal"] == 1
    assert seen["status"]["settings"]["values"][THRESHOLD] == 0.5
    assert seen["status"]["telemetry"]["nvml"] is False
    text = seen["metrics"]
    assert metric(text, 'verl_trainer_restarts_total{reason="signal"}') == 1.0
    assert metric(text, "verl_setting_gpu_memory_threshold_ratio") == 0.5
    # Labelled by the canonical name, whichever name the change used.
    assert metric(text, f'verl_setting_updates_total{{result="accepted",setting="{THRESHOLD}"}}') == 1.0
    assert metric(text, f'verl_setting_updates_total{{result="rejected",setting="{THRESHOLD}"}}') == 1.0
    assert metric(text, f'verl_setting_updates_total{{result="applied",setting="{THRESHOLD}"}}') == 1.0
    assert 'setting="gpu_memory_threshold"' not in text
    assert metric(text, "verl_telemetry_nvml_up") == 0.0

    steps = {event.data.step for event in daemon.hub.since(0, kinds=["step"])}
    assert steps == set(range(1, 26))
    kinds = {event.kind for event in daemon.hub.since(0)}
    assert {"gpu", "step", "phase", "settings", "restart", "status", "log"} <= kinds
    assert "restart" in (daemon.run_dir / "logs" / "daemon.log").read_text()


def test_sigterm_stops_the_trainer_at_a_safe_point_and_the_daemon_exits_0(tmp_path: Path, monkeypatch) -> None:
    daemon = make_daemon(tmp_path, monkeypatch, total_steps="100000", step_s="0.05")

    async def scenario() -> int:
        run = asyncio.create_task(daemon.run())
        await eventually(lambda: daemon.progress.step >= 2, what="two steps")
        os.kill(os.getpid(), signal.SIGTERM)
        return await asyncio.wait_for(run, 30)

    assert asyncio.run(scenario()) == 0
    assert daemon.supervisor.state == "finished"
    events = fake_events(tmp_path)
    assert events[-1]["event"] == "exit" and events[-1]["stopped"] is True
    assert any(event["event"] == "down" and event["message"]["type"] == "stop" for event in events) or \
        any(event["event"] == "sigterm" for event in events)
    assert not runtime_file(daemon.state, daemon.pid).exists()


@pytest.mark.parametrize("environment", ["unset", "same dir"])
def test_the_printed_monitor_command_finds_a_run_in_a_state_dir_of_its_own(tmp_path: Path, monkeypatch, capsys,
                                                                          environment: str) -> None:
    """daemon.state_dir away from where `verl` looks by default: the start message's command says where."""
    import daemon.cli as cli

    state = tmp_path / "state"
    if environment == "unset":
        monkeypatch.delenv("VERL_STATE_DIR", raising=False)
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))  # the default is elsewhere
    else:
        monkeypatch.setenv("VERL_STATE_DIR", str(state))
    daemon = make_daemon(tmp_path, monkeypatch, f"daemon.state_dir={state}", total_steps="100000", step_s="0.05")

    async def scenario() -> tuple[int, str, int]:
        run = asyncio.create_task(daemon.run())
        await eventually(lambda: daemon.progress.step >= 1, what="a first step")
        command = next(line.split("monitor: ", 1)[1] for line in daemon._out.getvalue().splitlines()
                       if "monitor: " in line)
        found = await asyncio.to_thread(cli.main, [*shlex.split(command)[1:], "--once", "--json"])
        daemon.request_stop()
        return await asyncio.wait_for(run, 30), command, found

    code, command, found = asyncio.run(scenario())
    assert code == 0
    expected = f"verl monitor --pid {os.getpid()}"
    assert command == (f"{expected} --state-dir {state}" if environment == "unset" else expected)
    assert found == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["status"]["run"]["daemon_pid"] == os.getpid()


def test_a_port_in_use_is_a_clear_error_and_no_trainer_starts(tmp_path: Path, monkeypatch, capsys) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        daemon = make_daemon(tmp_path, monkeypatch, f"telemetry.port={port}", total_steps="3")
        assert asyncio.run(daemon.run()) == 2
    finally:
        taken.close()
    assert "ERROR: telemetry.port" in capsys.readouterr().err
    assert not (tmp_path / "events.jsonl").exists()
    assert not runtime_file(daemon.state, daemon.pid).exists()


def test_a_trainer_that_keeps_crashing_makes_the_daemon_exit_1(tmp_path: Path, monkeypatch) -> None:
    daemon = make_daemon(tmp_path, monkeypatch, "daemon.max_restarts=1", crash="exit:3", crash_at_step="1")
    assert asyncio.run(daemon.run()) == 1
    assert daemon.supervisor.state == "failed" and daemon.supervisor.restarts == 1
    assert "giving up after 1 restart" in (daemon.run_dir / "logs" / "daemon.log").read_text()


def run_until_stopped(daemon: Daemon, change: dict | None = None) -> int:
    """Run `daemon` until a step has run with its settings acknowledged, make `change`, then stop it."""
    async def scenario() -> int:
        run = asyncio.create_task(daemon.run())
        await eventually(lambda: daemon.progress.step >= 1 and daemon.settings_store.acknowledged_version
                         == daemon.settings_store.version, what="a step with the settings acknowledged")
        if change:
            daemon.update_settings(change)
            await eventually(lambda: daemon.settings_store.acknowledged_version == daemon.settings_store.version,
                             what="the acknowledgement")
        daemon.request_stop()
        return await asyncio.wait_for(run, 30)

    return asyncio.run(scenario())


def test_live_settings_survive_a_stop_and_resume_unless_the_config_changed_them(tmp_path: Path, monkeypatch) -> None:
    first = make_daemon(tmp_path, monkeypatch, total_steps="100000", step_s="0.05")
    assert run_until_stopped(first, {"gpu_memory_threshold": 0.5, "log_level": "debug"}) == 0

    resumed = make_daemon(tmp_path, monkeypatch, total_steps="100000", step_s="0.05")
    assert run_until_stopped(resumed) == 0
    assert resumed.settings_store.values.gpu_memory_threshold == 0.5
    assert resumed.settings_store.values.log_level == "debug"
    # The resumed trainer ran with them from its first step: they came right after its hello.
    down = [event for event in fake_events(tmp_path) if event["event"] in ("start", "down")]
    second_start = [index for index, event in enumerate(down) if event["event"] == "start"][1]
    assert down[second_start + 1]["message"]["values"][THRESHOLD] == 0.5
    log = (resumed.run_dir / "logs" / "daemon.log").read_text()
    assert "re-applied the live settings of this run from before its stop" in log
    assert audit(resumed)[-2:][0]["source"] == "resume"

    # A value the config changes since wins over the live one it had replaced.
    edited = make_daemon(tmp_path, monkeypatch, "dynamic_offload.gpu_memory_threshold=0.7", total_steps="100000",
                         step_s="0.05")
    assert run_until_stopped(edited) == 0
    assert edited.settings_store.values.gpu_memory_threshold == 0.7
    assert edited.settings_store.values.log_level == "debug"
    assert "the config changed it from 0.85 to 0.7 since" in (edited.run_dir / "logs" / "daemon.log").read_text()


def test_live_settings_kept_under_their_short_names_by_an_older_verl_come_back(tmp_path: Path, monkeypatch) -> None:
    """live_settings.json as the daemon wrote it before the settings were named by their config keys."""
    daemon = make_daemon(tmp_path, monkeypatch, total_steps="100000", step_s="0.05")
    now = daemon.settings_store.values
    configured = {"gpu_memory_threshold": now.gpu_memory_threshold,
                  "min_transformer_layers_on_gpu": now.min_transformer_layers_on_gpu,
                  "dynamic_offload.enabled": now.dynamic_offload_enabled,
                  "gpu_sample_interval_s": now.gpu_sample_interval_s,
                  "pcie_sample_interval_s": now.pcie_sample_interval_s, "log_level": now.log_level}
    kept = daemon.run_dir / "live_settings.json"
    kept.write_text(json.dumps({"values": {**configured, "gpu_memory_threshold": 0.5, "log_level": "debug"},
                                "config": configured}, indent=2) + "\n")
    assert run_until_stopped(daemon) == 0
    values = daemon.settings_store.values
    assert (values.gpu_memory_threshold, values.log_level) == (0.5, "debug")
    [resumed] = [line for line in audit(daemon) if line["source"] == "resume"]
    assert resumed["new"] == {THRESHOLD: 0.5, "daemon.log_level": "debug"}
    # Written again under the canonical names.
    assert json.loads(kept.read_text())["values"] == daemon.settings_store.values.public()


def test_a_stop_asked_twice_is_one_checkpointed_stop_and_a_forced_one_kills(tmp_path: Path, monkeypatch) -> None:
    def stop(daemon: Daemon, *queries: str) -> tuple[int, list[dict]]:
        async def scenario() -> tuple[int, list[dict]]:
            run = asyncio.create_task(daemon.run())
            await eventually(lambda: daemon.progress.step >= 2, what="two steps")
            async with httpx.AsyncClient(base_url=daemon.url, headers={"Authorization": f"Bearer {daemon.token}"}) \
                    as api:
                answers = [(await api.post("/v1/stop" + query)).json() for query in queries]
            return await asyncio.wait_for(run, 30), answers

        return asyncio.run(scenario())

    daemon = make_daemon(tmp_path, monkeypatch, total_steps="100000", step_s="0.05")
    code, answers = stop(daemon, "", "")
    assert code == 0 and daemon.supervisor.last_exit_code == 0
    assert fake_events(tmp_path)[-1]["event"] == "exit" and fake_events(tmp_path)[-1]["stopped"] is True
    assert answers[1]["status"] == "stopping" and answers[1]["detail"].startswith("already stopping")

    forced = make_daemon(tmp_path, monkeypatch, total_steps="100000", step_s="0.05", ignore_stop="1")
    code, answers = stop(forced, "?force=true")
    assert code == 0 and forced.supervisor.last_exit_code == -signal.SIGKILL
    assert answers[0]["status"] == "killing"


def test_a_repeated_signal_kills_without_a_checkpoint_only_after_the_grace(tmp_path: Path, monkeypatch) -> None:
    daemon = make_daemon(tmp_path, monkeypatch, "daemon.force_stop_grace_s=1.5", total_steps="100000",
                         step_s="0.05", ignore_stop="1")

    async def scenario() -> int:
        run = asyncio.create_task(daemon.run())
        await eventually(lambda: daemon.progress.step >= 2, what="two steps")
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C soon after: the same stop
        await asyncio.sleep(0.5)
        assert daemon.supervisor.pids, "the trainer was killed by a signal within the grace"
        await asyncio.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)
        return await asyncio.wait_for(run, 30)

    assert asyncio.run(scenario()) == 0
    assert daemon.supervisor.last_exit_code == -signal.SIGKILL
    log = (daemon.run_dir / "logs" / "daemon.log").read_text()
    assert "signal again 1.5 s or more after this to kill the trainer without a checkpoint" in log
    assert "received SIGINT again within daemon.force_stop_grace_s=1.5 s of the first: the same stop" in log
    assert "received SIGTERM again" in log and "killing the trainer without a checkpoint" in log


def test_a_full_disk_at_exit_does_not_crash_the_daemon(tmp_path: Path, monkeypatch) -> None:
    daemon = make_daemon(tmp_path, monkeypatch, total_steps="2")
    logs = daemon.run_dir / "logs"
    logs.mkdir(parents=True)
    (logs / "daemon.log").symlink_to("/dev/full")  # every write fails with ENOSPC
    assert asyncio.run(daemon.run()) == 0


def test_the_hang_timeout_defaults_to_five_median_steps_and_never_under_ten_minutes() -> None:
    assert derived_hang_timeout([]) == 600.0
    assert derived_hang_timeout([1.0, 2.0, 500.0]) == 600.0
    assert derived_hang_timeout([200.0, 300.0, 1.0, 250.0, 260.0]) == 1250.0


@pytest.mark.slow
def test_run_daemon_runs_the_real_trainer_for_three_steps(tmp_path: Path) -> None:
    """`run_daemon` as `verl train` calls it, in a subprocess, around the real trainer on the tiny config."""
    script = (
        "import sys; from pathlib import Path\n"
        "from trainer.config import load_config, dump_config\n"
        "from daemon.service import run_daemon\n"
        f"config = load_config({str(QUICKSTART)!r}, sys.argv[1:])\n"
        "path = config.trainer.run_dir / 'config.yaml'; path.parent.mkdir(parents=True, exist_ok=True)\n"
        "path.write_text(dump_config(config))\n"
        "sys.exit(run_daemon(config, path, monitor=False))\n")
    overrides = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.total_training_steps=3",
                 "trainer.device=cpu", f"trainer.runs_dir={tmp_path / 'runs'}"]
    env = {**os.environ, "VERL_STATE_DIR": str(tmp_path / "state")}
    result = _run(script, overrides, env, tmp_path)
    run_dir = tmp_path / "runs" / "quickstart"
    assert result.returncode == 0, result.stdout + result.stderr
    assert "monitor: verl monitor --pid" in result.stdout and "http://127.0.0.1:" in result.stdout
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    assert "trainer finished" in (run_dir / "logs" / "daemon.log").read_text()
    assert list((tmp_path / "state" / "run").glob("*.json")) == []
    daemon_log = (run_dir / "logs" / "daemon.log").read_text()
    if _trainer_sends_telemetry():  # once trainer/main.py hands the trainer a TelemetryClient
        assert "connected (rank 0, step 0 of 3)" in daemon_log
        assert "runs settings version 0 from step 1" in daemon_log


def _run(script: str, overrides: list[str], env: dict, cwd: Path):
    import subprocess

    return subprocess.run([sys.executable, "-c", script, *overrides], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def _trainer_sends_telemetry() -> bool:
    return "TelemetryClient" in (REPO / "trainer" / "main.py").read_text()
