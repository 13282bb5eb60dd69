"""The chaos soak (issue 41, item 6): `python benchmarks/soak.py --chaos --steps N [--out FILE]`.

A real `verl train` of the soak's shrunk quickstart runs N steps on the CPU while faults are injected at random
times (one every `--mean-interval` seconds on average, exponentially spaced, from `--seed`):

- kill:   SIGKILL of the trainer (the daemon restarts it; it resumes from its latest checkpoint);
- stop:   SIGSTOP of the trainer (the hang watchdog, daemon.hang_timeout_s, kills and restarts it);
- damage: the latest checkpoint's actor weights overwritten in place with NaN bytes of the same length, then
          SIGKILL (the resume must catch the damage and fall back to the checkpoint before);
- burst:  `--burst` concurrent API clients (GET /v1/status, /metrics) at once; none may get a 5xx;
- disk:   a full disk at the next save (before the final one): its write or its rename fails with ENOSPC, through
          the trainer's fault hook (VERL_FAULT_FULL_DISK, trainer/faults.py: no tmpfs, so no root); the run must
          warn, leave no partial checkpoint, train on and save at a later step.

Afterwards the same run goes again without faults, with the same seed: the metrics that do not
measure the machine (metrics.jsonl without timing_s/, timing_per_token_ms/, perf/, checkpoint/) and the final
weights must be equal to the bit. The report says how long it ran, what it injected and what it recovered from.
"""

from __future__ import annotations

import json
import random
import signal
import struct
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainer.faults import FULL_DISK_ENV

MACHINE_METRICS = ("timing_s/", "timing_per_token_ms/", "perf/", "checkpoint/")
FAULTS = ("kill", "stop", "damage", "burst", "disk")
RECOVERY_TIMEOUT_S = 600.0


def chaos_overrides(steps: int, save_freq: int, hang_timeout_s: float) -> list[str]:
    return [f"trainer.total_training_steps={steps}", f"trainer.save_freq={save_freq}", "trainer.max_ckpt_to_keep=3",
            "daemon.max_restarts=100000", "daemon.restart_backoff_s=0.5", "daemon.restart_backoff_max_s=2",
            f"daemon.hang_timeout_s={hang_timeout_s}"]


class Api:
    def __init__(self, url: str, token: str):
        import httpx

        self.client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def status(self) -> dict[str, Any] | None:
        try:
            response = self.client.get("/v1/status")
            return response.json() if response.status_code == 200 else None
        except Exception:  # the daemon is exiting: no status
            return None

    def burst(self, clients: int) -> Counter[int]:
        """`clients` requests at once (status and /metrics alternately): the count of each HTTP status."""
        def one(index: int) -> int:
            try:
                return self.client.get("/v1/status" if index % 2 else "/metrics").status_code
            except Exception:
                return 0
        with ThreadPoolExecutor(max_workers=clients) as pool:
            return Counter(pool.map(one, range(clients)))


def damage_latest(checkpoints: Path) -> str | None:
    """The latest checkpoint's actor weights with their last 4 bytes a float32 NaN, the size unchanged."""
    steps = sorted((int(path.name.rsplit("_", 1)[1]), path) for path in checkpoints.glob("global_step_*"))
    if not steps:
        return None
    weights = steps[-1][1] / "actor" / "model.safetensors"
    try:
        with open(weights, "r+b") as file:
            file.seek(-4, 2)
            file.write(struct.pack("<f", float("nan")))
    except OSError:
        return None
    return str(weights)


def wait_for_progress(api: Api, after_step: int, process: subprocess.Popen[bytes]) -> float | None:
    """Seconds until the run reports a step past `after_step` (or finishes); None if it never does."""
    start = time.monotonic()
    while time.monotonic() - start < RECOVERY_TIMEOUT_S:
        if process.poll() is not None:
            return time.monotonic() - start if process.returncode == 0 else None
        status = api.status()
        if status is not None and status["progress"]["step"] > after_step:
            return time.monotonic() - start
        time.sleep(0.5)
    return None


def fill_disk(api: Api, process: subprocess.Popen[bytes], checkpoints: Path, marker: Path, *, step: int,
              save_freq: int, steps: int, where: str) -> dict[str, Any]:
    """The next save before the final one meets a full disk (at its `where`: write or rename); recovered when the run
    trains past it, saves a later step and leaves no partial checkpoint."""
    failing = (max(step, 0) // save_freq + 1) * save_freq
    if failing >= steps:
        return {"skipped": "no save left before the final one"}
    marker.write_text(f"{where}@{failing}")
    try:
        seconds = wait_for_progress(api, failing, process)
        saved = seconds is not None and (process.poll() is not None or wait_for_checkpoint_after(
            checkpoints, failing, process))
    finally:
        marker.unlink(missing_ok=True)  # a resume that redoes the step saves it
    partial = list(checkpoints.glob(f".global_step_{failing}.partial-*"))
    return {"full_disk_at_step": failing, "where": where, "recovered": bool(saved) and not partial,
            "recovery_s": seconds, "partial_left": [str(path) for path in partial]}


def wait_for_checkpoint_after(checkpoints: Path, step: int, process: subprocess.Popen[bytes]) -> bool:
    """Whether a checkpoint of a step after `step` appears (or the run ends) within the recovery time."""
    start = time.monotonic()
    while time.monotonic() - start < RECOVERY_TIMEOUT_S and process.poll() is None:
        if any(int(path.name.rsplit("_", 1)[1]) > step for path in checkpoints.glob("global_step_*")):
            return True
        time.sleep(0.5)
    return process.poll() is not None and process.returncode == 0


def inject(fault: str, api: Api, process: subprocess.Popen[bytes], state: Path, checkpoints: Path,
           burst: int, *, disk: dict[str, Any] | None = None) -> dict[str, Any]:
    """`disk`: the full disk's marker file, save_freq, steps and where it fails (write or rename)."""
    from benchmarks.soak import trainer_pid

    status = api.status() or {"progress": {"step": -1}}
    step = status["progress"]["step"]
    event: dict[str, Any] = {"fault": fault, "at_step": step, "time": time.time()}
    pid = trainer_pid(state, process.pid)
    if fault == "disk":
        assert disk is not None
        event.update(fill_disk(api, process, checkpoints, step=step, **disk))
        return event
    if fault == "burst":
        codes = api.burst(burst)
        event.update(codes={str(code): count for code, count in codes.items()},
                     recovered=all(200 <= code < 500 for code in codes))
        return event
    if pid is None:
        event.update(skipped="no trainer running")
        return event
    if fault == "damage":
        event["damaged"] = damage_latest(checkpoints)
    import os

    os.kill(pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
    seconds = wait_for_progress(api, step, process)
    event.update(recovered=seconds is not None, recovery_s=seconds)
    return event


def run_chaos(work: Path, *, steps: int, save_freq: int, hang_timeout_s: float, mean_interval_s: float, seed: int,
              burst: int, faults: tuple[str, ...] = FAULTS, minutes: float | None = None, log=print) -> dict[str, Any]:
    """The faulted run (each fault drawn from `faults`) and, beside it, the same run untouched; the comparison and
    what happened. With `minutes`, faults are injected for that long (the run's `steps` only an upper bound), then
    both runs train on to the faulted run's next regular checkpoint but one and are ended there: the comparison
    covers the metrics and weights up to that step."""
    from benchmarks.soak import SoakError, start_run

    if unknown := set(faults) - set(FAULTS):
        raise SoakError(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}")

    randomness = random.Random(seed)
    overrides = chaos_overrides(steps, save_freq, hang_timeout_s)
    started = time.monotonic()
    chaos_dir = work / "chaos"
    chaos_dir.mkdir(parents=True, exist_ok=True)
    marker = chaos_dir / "full_disk"  # the full disk's fault hook reads it (trainer/faults.py)
    process, info, _ = start_run(chaos_dir, [*overrides, "trainer.experiment_name=chaos"],
                                 env={FULL_DISK_ENV: str(marker)})
    # The same run untouched, beside it: a run of its own (its own state dir and daemon), so the soak takes the
    # faulted run's time rather than both runs' one after the other.
    reference_dir = work / "reference"
    reference_dir.mkdir(parents=True, exist_ok=True)
    # With a time bound, the reference keeps every checkpoint (pruned below as the faulted run passes them): the
    # step both end at is known only when the time is up.
    reference, _, _ = start_run(reference_dir, [*overrides, "trainer.experiment_name=chaos",
                                                *(["trainer.max_ckpt_to_keep=null"] if minutes else [])])
    end_step = steps
    try:
        api = Api(info["url"], info["token"])
        checkpoints = chaos_dir / "runs" / "chaos" / "checkpoints"
        events: list[dict[str, Any]] = []
        stop = threading.Event()
        reference_checkpoints = reference_dir / "runs" / "chaos" / "checkpoints"
        while process.poll() is None and not stop.is_set():
            if minutes is not None and time.monotonic() - started >= minutes * 60:
                break
            deadline = time.monotonic() + randomness.expovariate(1.0 / mean_interval_s)
            while time.monotonic() < deadline and process.poll() is None:
                time.sleep(0.2)
            if process.poll() is not None:
                break
            fault = randomness.choice(faults)
            disk = {"marker": marker, "save_freq": save_freq, "steps": steps,
                    "where": randomness.choice(("write", "rename")) if fault == "disk" else "write"}
            event = inject(fault, api, process, chaos_dir / "state", checkpoints, burst, disk=disk)
            log(f"  {fault} at step {event['at_step']}: "
                + ("recovered" if event.get("recovered") else f"NOT recovered ({event})"))
            events.append(event)
            if minutes is not None:
                prune_below(reference_checkpoints, event["at_step"] - 3 * save_freq)
        if minutes is not None and process.poll() is None:
            end_step = end_both(api, (process, checkpoints), (reference, reference_checkpoints), save_freq, steps)
            log(f"  time is up: both runs ended after their checkpoint of step {end_step}")
        process.wait()
        chaos_s = time.monotonic() - started
        reference.wait()
    finally:
        if reference.poll() is None:  # the faulted run broke off: the reference has no use
            reference.kill()
    if end_step == steps and (process.returncode != 0 or reference.returncode != 0):
        raise SoakError(f"the faulted run exited {process.returncode}, the reference {reference.returncode}; see "
                        f"{chaos_dir / 'verl.out'} and {reference_dir / 'verl.out'}")
    comparison = compare(chaos_dir / "runs" / "chaos", reference_dir / "runs" / "chaos", end_step)
    return {"steps": end_step, "seed": seed, "minutes": minutes, "chaos_run_s": chaos_s,
            "total_s": time.monotonic() - started,
            "injected": dict(Counter(event["fault"] for event in events)),
            "recovered": dict(Counter(event["fault"] for event in events if event.get("recovered"))),
            "full_disk": "through VERL_FAULT_FULL_DISK (ENOSPC at a save's write or rename), no tmpfs",
            "events": events, **comparison}


def prune_below(checkpoints: Path, step: int) -> None:
    """The reference's checkpoints before `step` removed (the faulted run is past them: no comparison needs them)."""
    import shutil

    for path in checkpoints.glob("global_step_*"):
        if int(path.name.rsplit("_", 1)[1]) < step:
            shutil.rmtree(path, ignore_errors=True)


def end_both(api: Api, chaos: tuple[subprocess.Popen[bytes], Path], reference: tuple[subprocess.Popen[bytes], Path],
             save_freq: int, steps: int) -> int:
    """Both runs trained to the faulted run's next regular checkpoint but one (a save not already under way), then
    ended (SIGTERM to each daemon, SIGKILL after 120 s): that step."""
    step = (api.status() or {"progress": {"step": 0}})["progress"]["step"]
    end = min((max(step, 0) // save_freq + 2) * save_freq, steps)
    for process, checkpoints in (chaos, reference):
        start = time.monotonic()
        while not (checkpoints / f"global_step_{end}").is_dir() and process.poll() is None:
            if time.monotonic() - start > RECOVERY_TIMEOUT_S:
                from benchmarks.soak import SoakError  # the error soak.py's --chaos reports in one line

                raise SoakError(f"no checkpoint of step {end} in {checkpoints} within {RECOVERY_TIMEOUT_S:.0f} s")
            time.sleep(0.5)
    for process, _ in (chaos, reference):
        process.terminate()
    for process, _ in (chaos, reference):
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
    return end


def computed(run_dir: Path, last_step: int | None = None) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{key: value for key, value in row.items() if not key.startswith(MACHINE_METRICS)} for row in rows
            if last_step is None or row["step"] <= last_step]


def compare(chaos: Path, reference: Path, steps: int) -> dict[str, Any]:
    """Whether the faulted run's metrics and final weights equal the reference's, to the bit."""
    import torch
    from safetensors.torch import load_file

    ours, theirs = computed(chaos, steps), computed(reference, steps)
    differing = [row["step"] for row, other in zip(ours, theirs, strict=False) if row != other]
    weights_equal = True
    for role in ("actor", "critic"):
        mine = chaos / "checkpoints" / f"global_step_{steps}" / role / "model.safetensors"
        other = reference / "checkpoints" / f"global_step_{steps}" / role / "model.safetensors"
        if not mine.is_file() and not other.is_file():
            continue
        first, second = load_file(str(mine)), load_file(str(other))
        weights_equal &= first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    return {"metrics_rows": [len(ours), len(theirs)], "metrics_equal": ours == theirs,
            "metrics_differing_steps": differing[:20], "weights_equal": weights_equal}


def chaos_report(result: dict[str, Any]) -> str:
    injected = ", ".join(f"{fault} {count}" for fault, count in result["injected"].items()) or "nothing"
    recovered = ", ".join(f"{fault} {count}" for fault, count in result["recovered"].items()) or "nothing"
    return "\n".join([
        f"chaos soak: {result['steps']} steps"
        + (f" (faults for {result['minutes']:g} min)" if result.get("minutes") else "")
        + f", seed {result['seed']}; the faulted run took "
        f"{result['chaos_run_s'] / 60:.1f} min, {result['total_s'] / 60:.1f} min with the reference run",
        f"injected: {injected}; recovered: {recovered}; full disk: {result['full_disk']}",
        f"metrics equal to the uninterrupted run's: {result['metrics_equal']} (rows {result['metrics_rows']}"
        + (f", first differing steps {result['metrics_differing_steps']}" if result["metrics_differing_steps"]
           else "") + ")",
        f"final weights equal to the bit: {result['weights_equal']}",
    ])
