"""Helpers shared by the test folders (not tests themselves)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from trainer.config.live import LiveSettings
from trainer.config.messages import (
    OffloadPlacement,
    OffloadSummaryRow,
    Progress,
    Restarts,
    RunInfo,
    RunState,
    RunStatus,
    SettingsState,
    TelemetryHealth,
)

REPO = Path(__file__).resolve().parents[1]
"""The repository's root: tests name its files from here, wherever their own folder lies."""


@contextmanager
def serve_app(app: FastAPI) -> Iterator[str]:
    """Serve `app` as the daemon does (uvicorn, loopback, port 0) until the block ends; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def run_status(*, name: str = "fake", state: RunState = "running", step: int = 5, total_steps: int = 200,
               summary: Sequence[OffloadSummaryRow] = ()) -> RunStatus:
    """A whole /v1/status body for fake daemons: a running run with nothing else to report."""
    return RunStatus(
        run=RunInfo(name=name, project="verl", run_dir=f"runs/{name}", config_path=f"runs/{name}/config.yaml",
                    daemon_pid=4242, trainer_pids=[4243], state=state, started_at=1.0, uptime_s=60.0,
                    url="http://127.0.0.1:1"),
        progress=Progress(step=step, total_steps=total_steps, phase=None, phase_since=None),
        restarts=Restarts(total=0, max=3, by_reason={}),
        settings=SettingsState(version=0, values=LiveSettings(), acknowledged_version=0, applied_at_step=None),
        telemetry=TelemetryHealth(nvml=False, dropped_messages=0),
        offload=OffloadPlacement(summary=list(summary)),
    )
