"""A real `verl train` on loopback for the e2e tests: started in a temporary folder with its own
state dir, found through its runtime file, stopped with SIGTERM at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
VERL = Path(sys.executable).parent / "verl"
QUICKSTART = str(REPO / "examples" / "quickstart.yaml")
SMALL_RUN = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.device=cpu",
             "telemetry.gpu_sample_interval_s=0.2", "daemon.restart_backoff_s=0.2"]


def wait_for(condition: Callable[[], object], *, timeout: float = 90, interval: float = 0.1, what: str) -> object:
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
    output_name: str = "verl.out"

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def state_dir(self) -> Path:
        return self.folder / "state"

    @property
    def run_dir(self) -> Path:
        return self.folder / "runs" / "quickstart"

    def runtime(self) -> dict:
        return json.loads((self.state_dir / "run" / f"{self.process.pid}.json").read_text())

    def get(self, path: str, **params) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, params=params, timeout=10, trust_env=False)

    def json(self, path: str, **params) -> dict:
        response = self.get(path, **params)
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
        return (self.folder / self.output_name).read_text(encoding="utf-8")

    def verl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(VERL), *args], env=self.env, capture_output=True, text=True, timeout=timeout)


@contextmanager
def verl_train(folder: Path, *overrides: str, new_session: bool = False, output: str = "verl.out"
               ) -> Iterator[LiveRun]:
    """`verl train` of the quickstart with SMALL_RUN and `overrides`, in `folder`, printing to `folder`/`output`;
    `new_session`: in a session (and process group) of its own, as a shell runs a command."""
    env = {**os.environ, "VERL_STATE_DIR": str(folder / "state")}
    with (folder / output).open("w") as log:
        process = subprocess.Popen([str(VERL), "train", "--config", QUICKSTART, *SMALL_RUN, *overrides], cwd=folder,
                                   env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=new_session)
        runtime_file = folder / "state" / "run" / f"{process.pid}.json"
        try:
            wait_for(lambda: runtime_file.exists() or process.poll() is not None, what="the runtime file")
            assert process.poll() is None, (folder / output).read_text()
            info = json.loads(runtime_file.read_text())
            yield LiveRun(process, info["url"], info["token"], folder, env, output)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
