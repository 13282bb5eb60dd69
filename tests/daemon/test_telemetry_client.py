"""The trainer's telemetry client: sending never costs training time, whatever the daemon does."""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.config.ipc import ENV_DAEMON_PID, ENV_SOCKET, ENV_TOKEN
from trainer.config.messages import LogMessage, StepMessage, StopMessage
from trainer.telemetry import TelemetryClient


def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


def timed_sends(client: TelemetryClient, count: int, payload: str = "") -> list[float]:
    """How long each of `count` sends took: step messages, or log lines of `payload` when one is given."""
    durations = []
    for step in range(count):
        message = LogMessage(level="info", message=payload) if payload else StepMessage(
            step=step, metrics={"actor/pg_loss": 0.1})
        started = time.perf_counter()
        client.send(message)
        durations.append(time.perf_counter() - started)
    return durations


def test_from_env_is_none_without_a_daemon(monkeypatch) -> None:
    monkeypatch.delenv(ENV_SOCKET, raising=False)
    assert TelemetryClient.from_env() is None


def test_from_env_reads_the_socket_and_token(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_SOCKET, str(tmp_path / "daemon.sock"))
    monkeypatch.setenv(ENV_TOKEN, "secret")
    client = TelemetryClient.from_env(start_step=0, total_steps=3)
    try:
        assert client is not None and client.socket_path == str(tmp_path / "daemon.sock")
    finally:
        client.close()


def test_sends_cost_microseconds_and_are_counted_as_dropped_when_no_daemon_listens(tmp_path: Path) -> None:
    client = TelemetryClient(str(tmp_path / "absent.sock"), "token", start_step=0, total_steps=10,
                             queue_size=256, reconnect_interval_s=0.05)
    durations = timed_sends(client, 5000)
    client.close()
    assert statistics.mean(durations) < 100e-6, f"mean send {statistics.mean(durations) * 1e6:.1f} us"
    assert sorted(durations)[int(len(durations) * 0.99)] < 1e-3
    assert not client.connected
    assert client.dropped == 5000


def test_a_daemon_that_stops_reading_costs_drops_not_time(tmp_path: Path) -> None:
    path = tmp_path / "stuck.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)  # accepts into the backlog, never reads
    client = TelemetryClient(str(path), "token", start_step=0, total_steps=10, queue_size=256,
                             send_timeout_s=0.2)
    try:
        wait_until(lambda: client.connected)
        started = time.perf_counter()
        durations = timed_sends(client, 5000, payload="x" * 2000)  # ~10 MB: far beyond the socket buffers
        elapsed = time.perf_counter() - started
        assert elapsed < 1.0, f"5000 sends took {elapsed:.2f} s"
        assert statistics.mean(durations) < 200e-6
        wait_until(lambda: client.dropped > 0)
    finally:
        client.close(timeout=0.5)
        listener.close()


def test_messages_wait_for_hello_then_flow(tmp_path: Path) -> None:
    path = tmp_path / "daemon.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    listener.settimeout(5)
    client = TelemetryClient(str(path), "token")
    client.send(LogMessage(level="info", message="before hello"))
    time.sleep(0.2)
    assert not client.connected  # no hello fields yet: it must not connect
    client.hello(start_step=4, total_steps=9, run_dir="runs/x")
    connection, _ = listener.accept()
    connection.settimeout(5)
    received = b""
    while received.count(b"\n") < 2:
        received += connection.recv(65536)
    hello, log, *_ = [line for line in received.split(b"\n") if line]
    assert b'"type":"hello"' in hello and b'"start_step":4' in hello and b'"token":"token"' in hello
    assert b"before hello" in log
    connection.close()
    client.close(timeout=0.5)
    listener.close()


def test_poll_returns_at_once_with_nothing_received(tmp_path: Path) -> None:
    client = TelemetryClient(str(tmp_path / "absent.sock"), "token", start_step=0, total_steps=1)
    started = time.perf_counter()
    assert client.poll() == []
    assert time.perf_counter() - started < 1e-3
    client.close()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_metrics_go_out_as_null(tmp_path: Path, value: float) -> None:
    path = tmp_path / "daemon.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    listener.settimeout(5)
    client = TelemetryClient(str(path), "token", start_step=0, total_steps=1)
    client.send(StepMessage(step=1, metrics={"actor/pg_loss": value}))
    connection, _ = listener.accept()
    connection.settimeout(5)
    received = b""
    while received.count(b"\n") < 2:
        received += connection.recv(65536)
    assert b'"actor/pg_loss":null' in received
    connection.close()
    client.close(timeout=0.5)
    listener.close()


def test_a_daemon_that_is_gone_hands_the_trainer_a_stop_and_one_that_drops_the_link_does_not(tmp_path: Path) -> None:
    path = tmp_path / "daemon.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    listener.settimeout(5)
    client = TelemetryClient(str(path), "token", start_step=0, total_steps=10, reconnect_interval_s=0.05)
    try:
        first, _ = listener.accept()
        first.close()  # the daemon drops a slow client, but still listens: the client reconnects
        second, _ = listener.accept()
        time.sleep(0.2)
        assert client.poll() == [] and not client.daemon_gone
        second.close()
        listener.close()  # killed: the socket file stays, nobody listens
        wait_until(lambda: client.daemon_gone)
        assert client.poll() == [StopMessage()]
    finally:
        client.close(timeout=0.5)
        listener.close()


ORPHAN = """\
import os, signal, sys, time
from trainer.telemetry import die_with_daemon
assert die_with_daemon()
signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], "w").write("SIGTERM"), os._exit(0)))
open(sys.argv[1] + ".ready", "w").close()
time.sleep(60)
"""
DAEMON = """\
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env={**os.environ, sys.argv[3]: str(os.getpid())})
time.sleep(60)
"""


def test_a_trainer_gets_sigterm_when_its_daemon_is_killed(tmp_path: Path) -> None:
    signalled = tmp_path / "signalled"
    daemon = subprocess.Popen([sys.executable, "-c", DAEMON, ORPHAN, str(signalled), ENV_DAEMON_PID],
                              cwd=Path(__file__).parents[2])
    try:
        wait_until(lambda: Path(f"{signalled}.ready").exists(), timeout=30)
        daemon.kill()
        daemon.wait()
        wait_until(lambda: signalled.exists() and signalled.read_text() == "SIGTERM", timeout=10)
    finally:
        daemon.kill()


def test_a_trainer_whose_daemon_died_before_it_started_does_not_train(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    result = subprocess.run([sys.executable, "-c", "from trainer.telemetry import die_with_daemon; "
                             "print(die_with_daemon())"], env={**os.environ, ENV_DAEMON_PID: str(gone.pid)},
                            cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=30)
    assert result.stdout.strip() == "False", result.stderr
