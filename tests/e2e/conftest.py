"""A real `verl train` on loopback for the e2e tests of the dashboards and the live page.

`live_run` starts the quickstart on the CPU (small batches, GPU samples every 0.2 s, many steps) in a
temporary folder, waits for its runtime file and stops it (SIGTERM) at the end of the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
VERL = Path(sys.executable).parent / "verl"
QUICKSTART = str(REPO / "examples" / "quickstart.yaml")
SMALL_RUN = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.device=cpu",
             "telemetry.gpu_sample_interval_s=0.2", "trainer.total_training_steps=2000"]


def wait_for(condition: Callable[[], object], *, timeout: float = 60, interval: float = 0.2, what: str) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


@dataclass
class LiveRun:
    process: subprocess.Popen
    url: str
    token: str
    folder: Path
    env: dict

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=10, trust_env=False)

    def json(self, path: str) -> dict:
        response = self.get(path)
        response.raise_for_status()
        return response.json()

    def wait(self, condition: Callable[[], object], *, timeout: float = 60, what: str) -> object:
        """wait_for, failing at once (with the run's output) if `verl train` has exited meanwhile."""

        def met_or_ended() -> object:
            assert self.process.poll() is None, f"verl train exited ({self.process.returncode}):\n{self.output()}"
            return condition()

        return wait_for(met_or_ended, timeout=timeout, what=what)

    def step(self) -> int:
        return self.json("/v1/status")["progress"]["step"]

    def output(self) -> str:
        """What `verl train` printed so far (stdout and stderr)."""
        return (self.folder / "verl.out").read_text(encoding="utf-8")

    def verl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(VERL), *args], env=self.env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def live_run(tmp_path: Path) -> Iterator[LiveRun]:
    env = {**os.environ, "VERL_STATE_DIR": str(tmp_path / "state")}
    with (tmp_path / "verl.out").open("w") as log:
        process = subprocess.Popen([str(VERL), "train", "--config", QUICKSTART, *SMALL_RUN], cwd=tmp_path, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
        runtime_file = tmp_path / "state" / "run" / f"{process.pid}.json"
        try:
            wait_for(lambda: runtime_file.exists() or process.poll() is not None, what="the runtime file")
            assert process.poll() is None, (tmp_path / "verl.out").read_text()
            info = json.loads(runtime_file.read_text())
            yield LiveRun(process, info["url"], info["token"], tmp_path, env)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
