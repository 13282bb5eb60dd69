"""The daemon as a user meets it: the real `verl train` in a subprocess, real HTTP, WebSocket and
Prometheus clients on loopback, the trainer child killed and restarted, live settings changed."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import websockets

from tests.e2e.runs import LiveRun, verl_train, wait_for

THRESHOLD = "dynamic_offload.gpu_memory_threshold"

def current_step(run: LiveRun) -> int:
    return run.json("/v1/status")["progress"]["step"]


def test_status_history_metrics_and_stream_fill_as_steps_pass(tmp_path):
    with verl_train(tmp_path, "trainer.total_training_steps=400") as run:
        assert oct(os.stat(run.state_dir / "run" / f"{run.process.pid}.json").st_mode & 0o777) == "0o600"
        assert httpx.get(run.url + "/healthz", timeout=5).status_code == 200
        assert httpx.get(run.url + "/v1/status", timeout=5).status_code == 401
        wait_for(lambda: current_step(run) >= 3, what="three steps")
        status = run.json("/v1/status")
        assert status["run"]["state"] == "running" and status["run"]["daemon_pid"] == run.process.pid
        assert status["progress"]["total_steps"] == 400
        history = run.json("/v1/metrics/history", kinds="step", keys="critic/score/mean")
        steps = [event["data"]["step"] for event in history["events"]]
        assert steps == sorted(steps) and len(steps) >= 3
        assert set(history["events"][0]["data"]["metrics"]) == {"critic/score/mean"}
        latest = run.json("/v1/metrics/latest")
        assert "actor/pg_loss" in latest["step"]["metrics"]
        assert latest["gpu"]["host"]["trainer_rss_bytes"] > 0

        first = _counter(run.get("/metrics").text, "verl_trainer_steps_total")
        wait_for(lambda: _counter(run.get("/metrics").text, "verl_trainer_steps_total") > first,
                 what="the step counter to move")
        _promtool_check(run.get("/metrics").text, tmp_path)

        events = asyncio.run(_stream(run, since=0, count=5))
        assert [event["seq"] for event in events] == sorted(event["seq"] for event in events)
        assert {event["kind"] for event in events} & {"step", "gpu", "phase"}
        live = asyncio.run(_stream(run, since=run.json("/v1/metrics/history")["last_seq"], count=2))
        assert all(event["seq"] > events[-1]["seq"] for event in live)


def test_a_killed_trainer_is_restarted_and_resumes_from_its_checkpoint(tmp_path):
    total = 12
    with verl_train(tmp_path, f"trainer.total_training_steps={total}", "trainer.save_freq=3") as run:
        wait_for(lambda: current_step(run) >= 5, what="step 5")
        trainer_pid = run.runtime()["trainer_pids"][0]
        os.kill(trainer_pid, signal.SIGKILL)
        wait_for(lambda: run.runtime()["trainer_pids"] and run.runtime()["trainer_pids"][0] != trainer_pid,
                 what="a new trainer")
        assert 'verl_trainer_restarts_total{reason="signal"} 1.0' in run.get("/metrics").text
        assert run.json("/v1/status")["restarts"]["total"] == 1
        assert run.process.wait(timeout=300) == 0
    # The new trainer resumed from the latest checkpoint (the steps after it ran twice), and the run
    # ends with one line per step, like an unbroken one.
    resumed = re.search(r"resumed from runs/quickstart/checkpoints/global_step_(\d+) at step (\d+)",
                        (tmp_path / "verl.out").read_text())
    assert resumed and resumed[1] == resumed[2] and int(resumed[1]) % 3 == 0 and int(resumed[1]) >= 3
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, total + 1))


def test_live_setting_is_acknowledged_audited_exported_and_survives_a_restart(tmp_path):
    with verl_train(tmp_path, "trainer.total_training_steps=400", "trainer.save_freq=5") as run:
        wait_for(lambda: current_step(run) >= 2, what="step 2")
        for bad in (1.5, -1, "abc"):
            response = httpx.patch(run.url + "/v1/settings", headers=run.headers,
                                   json={"gpu_memory_threshold": bad}, timeout=10)
            assert response.status_code == 422, response.text
            assert response.json()["detail"][0]["loc"][-1] == THRESHOLD  # the canonical name, asked by the short
        unknown = httpx.patch(run.url + "/v1/settings", headers=run.headers, json={"no_such_setting": 1}, timeout=10)
        assert unknown.status_code == 422
        assert run.json("/v1/settings")["values"][THRESHOLD] == 0.85

        response = httpx.patch(run.url + "/v1/settings", headers=run.headers, json={THRESHOLD: 0.8}, timeout=10)
        assert response.status_code == 200, response.text
        change = response.json()
        assert change["old"] == {THRESHOLD: 0.85} and change["new"] == {THRESHOLD: 0.8}
        version = change["version"]
        acknowledged = wait_for(lambda: (body := run.json("/v1/settings"))["acknowledged_version"] >= version
                                and body, what="the trainer's acknowledgement")
        assert acknowledged["applied_at_step"] >= change["applies_at_step"] - 1
        assert "verl_setting_gpu_memory_threshold_ratio 0.8" in run.get("/metrics").text
        audit = [json.loads(line) for line in (run.run_dir / "settings_audit.jsonl").read_text().splitlines()]
        assert any(entry["new"] == {THRESHOLD: 0.8} for entry in audit)

        trainer_pid = run.runtime()["trainer_pids"][0]
        os.kill(trainer_pid, signal.SIGKILL)
        wait_for(lambda: run.runtime()["trainer_pids"] and run.runtime()["trainer_pids"][0] != trainer_pid,
                 what="a new trainer")
        restarted_step = current_step(run)
        wait_for(lambda: current_step(run) > restarted_step + 1, what="steps after the restart")
        settings = run.json("/v1/settings")
        assert settings["values"][THRESHOLD] == 0.8
        assert settings["acknowledged_version"] == settings["version"]
        assert 'verl_trainer_restarts_total{reason="signal"} 1.0' in run.get("/metrics").text


def test_the_cli_reaches_a_run_through_its_pid(tmp_path):
    with verl_train(tmp_path, "trainer.total_training_steps=400") as run:
        wait_for(lambda: current_step(run) >= 1, what="step 1")
        trainer_pid = run.runtime()["trainer_pids"][0]
        snapshot = run.verl("monitor", "--pid", str(trainer_pid), "--once", "--json")
        assert snapshot.returncode == 0, snapshot.stderr
        assert json.loads(snapshot.stdout)["status"]["run"]["daemon_pid"] == run.process.pid

        changed = run.verl("set", "gpu_memory_threshold=0.7", "--pid", str(run.process.pid))  # as DESIGN.md shows it
        assert changed.returncode == 0, changed.stderr
        assert f"{THRESHOLD}: 0.85 -> 0.7" in changed.stdout
        rejected = run.verl("set", "gpu_memory_threshold=1.5", "--pid", str(run.process.pid))
        assert rejected.returncode == 2 and rejected.stderr.startswith("ERROR:")
        both = run.verl("set", "gpu_memory_threshold=0.6", f"{THRESHOLD}=0.5", "--pid", str(run.process.pid))
        assert both.returncode == 2 and both.stderr.startswith(f"ERROR: {THRESHOLD}: given twice")
        canonical = run.verl("set", f"{THRESHOLD}=0.75", "--pid", str(run.process.pid), "--wait", "0")
        assert canonical.returncode == 0 and f"{THRESHOLD}: 0.7 -> 0.75" in canonical.stdout, canonical.stderr
        assert run.json("/v1/settings")["values"][THRESHOLD] == 0.75

        not_a_run = run.verl("monitor", "--pid", str(os.getpid()), "--once")
        assert not_a_run.returncode == 2 and "ERROR:" in not_a_run.stderr and "Traceback" not in not_a_run.stderr

        stopped = run.verl("stop", "--pid", str(run.process.pid))
        assert stopped.returncode == 0, stopped.stderr
        assert run.process.wait(timeout=120) == 0
    assert not (tmp_path / "state" / "run" / f"{run.process.pid}.json").exists()
    assert any(path.name.startswith("global_step_") for path in (run.run_dir / "checkpoints").iterdir())


def _counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _promtool_check(text: str, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is missing: `make test` installs Debian's prometheus package where it can")
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


async def _stream(run: LiveRun, since: int, count: int) -> list[dict]:
    url = run.url.replace("http://", "ws://") + f"/v1/stream?since={since}"
    events = []
    async with websockets.connect(url, additional_headers=run.headers) as socket:
        while len(events) < count:
            events.append(json.loads(await asyncio.wait_for(socket.recv(), timeout=30)))
    return events
