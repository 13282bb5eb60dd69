"""A stand-in for ``python -m trainer`` in the daemon's tests: starts in a fraction of a second, speaks the
IPC protocol through the real client (trainer/telemetry.py) and fails on demand.

It keeps its "checkpoint" (the last completed step) in FAKE_DIR/progress, so a restart resumes where
the last run stopped, and appends what happens to FAKE_DIR/events.jsonl: one {"event": ...} line for
each start, down message, crash and exit.

Environment:
  FAKE_DIR           folder for progress and events.jsonl (required)
  FAKE_TOTAL_STEPS   steps of the run (default 5)
  FAKE_STEP_S        seconds per step (default 0.05)
  FAKE_EXIT_CODE     exit at once with this code (e.g. 2: a config problem)
  FAKE_CRASH         "exit:N" (exit code N) or "kill" (SIGKILL itself), at step FAKE_CRASH_AT_STEP (default 2) ...
  FAKE_CRASH_RUNS    ... on the first this many starts (default: every start)
  FAKE_CRASH_FILE    also crash (SIGKILL) as soon as this file exists; the file is removed first
  FAKE_IGNORE_STOP   "1": ignore SIGTERM and the IPC stop (the daemon must kill it)
  FAKE_CRASH_RANK    crash (FAKE_CRASH, FAKE_CRASH_FILE) only as this rank
  FAKE_LOG           with FAKE_CRASH "raise:MESSAGE": the log a traceback ending in RuntimeError: MESSAGE goes to

As a rank of a group (trainer/distributed/launch.py runs it with `-- fake_trainer.py`; RANK set), each event
also names the rank; the ranks start stepping together, once all of them have started (they share the progress
file, as ranks share a checkpoint), and only rank 0 reads down messages (it would pass them on to the others).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for trainer.telemetry

from trainer.config.messages import (  # noqa: E402
    CheckpointMessage,
    Phase,
    PhaseMessage,
    SettingsAckMessage,
    SettingsMessage,
    StepMessage,
    StopMessage,
)
from trainer.telemetry import TelemetryClient  # noqa: E402

FOLDER = Path(os.environ["FAKE_DIR"])
EVENTS = FOLDER / "events.jsonl"
PROGRESS = FOLDER / "progress"


RANK = int(os.environ["RANK"]) if os.environ.get("RANK") else None


def record(event: str, **fields) -> None:
    ranked = {} if RANK is None else {"rank": RANK}
    with EVENTS.open("a", encoding="utf-8") as file:
        file.write(json.dumps({"event": event, "pid": os.getpid(), "time": time.time(), **ranked, **fields}) + "\n")


def starts_so_far() -> int:
    if not EVENTS.exists():
        return 0
    return sum(event["event"] == "start" and event.get("rank") == RANK
               for event in map(json.loads, EVENTS.read_text().splitlines()))


def wait_for_the_other_ranks(run: int) -> None:
    """Start stepping once every rank of the group has started this run (as real ranks meet in their first
    collective): a rank started late on a loaded machine would find the others' progress past its crash step, or
    the run over."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lines = EVENTS.read_text().splitlines()
        events = [json.loads(line) for line in lines if line.endswith("}")]  # not a line another rank is writing
        started = {event.get("rank") for event in events if event["event"] == "start" and event.get("run") == run}
        if len(started) >= world:
            return
        time.sleep(0.02)


def crash(how: str) -> None:
    record("crash", how=how)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how.startswith("raise:"):  # as the real trainer logs a crash: an ERROR line, then the traceback
        with open(os.environ["FAKE_LOG"], "a", encoding="utf-8") as log:
            log.write(f"2026-01-01 00:00:00 ERROR the trainer crashed: RuntimeError: {how[6:]}\n"
                      "Traceback (most recent call last):\n  File \"loop.py\", line 1, in fit\n"
                      f"RuntimeError: {how[6:]}\n")
        os._exit(1)
    os._exit(int(how.split(":")[1]))


def main() -> int:
    if os.environ.get("FAKE_EXIT_CODE"):
        record("start", step=0)
        return int(os.environ["FAKE_EXIT_CODE"])
    total = int(os.environ.get("FAKE_TOTAL_STEPS", "5"))
    step_s = float(os.environ.get("FAKE_STEP_S", "0.05"))
    ignore_stop = os.environ.get("FAKE_IGNORE_STOP") == "1"
    crash_how = os.environ.get("FAKE_CRASH")
    crash_at = int(os.environ.get("FAKE_CRASH_AT_STEP", "2"))
    crash_runs = int(os.environ.get("FAKE_CRASH_RUNS", "1000000"))
    crash_file = Path(os.environ["FAKE_CRASH_FILE"]) if os.environ.get("FAKE_CRASH_FILE") else None
    if os.environ.get("FAKE_CRASH_RANK") and int(os.environ["FAKE_CRASH_RANK"]) != RANK:
        crash_how = crash_file = None
    run = starts_so_far() + 1
    step = int(PROGRESS.read_text()) if PROGRESS.exists() else 0
    # The handler first: a test that sees "start" may stop the trainer at once.
    stop = {"requested": False}
    if not ignore_stop:
        signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True) or record("sigterm"))
    else:
        signal.signal(signal.SIGTERM, lambda *_: record("sigterm_ignored"))
    record("start", step=step, run=run)
    if RANK is not None:
        wait_for_the_other_ranks(run)
    client = TelemetryClient.from_env(run_dir=str(FOLDER))
    if client is not None:
        client.hello(start_step=step, total_steps=total)

    def safe_point(next_step: int) -> None:
        for message in client.poll() if client is not None and not RANK else []:
            record("down", message=message.model_dump(mode="json", by_alias=True))
            if isinstance(message, SettingsMessage):
                client.send(SettingsAckMessage(version=message.version, step=next_step, values=message.values))
            elif isinstance(message, StopMessage) and not ignore_stop:
                stop["requested"] = True

    while step < total:
        safe_point(step + 1)
        if stop["requested"]:
            break
        if client is not None:
            client.send(PhaseMessage(step=step + 1, phase=Phase.GEN))
        time.sleep(step_s)
        if crash_file is not None and crash_file.exists():
            crash_file.unlink(missing_ok=True)
            crash("kill")
        if crash_how and step + 1 == crash_at and run <= crash_runs:
            crash(crash_how)
        step += 1
        # Written whole or not at all (a rename): a group's ranks write it, and a restart's reads it.
        partial = PROGRESS.with_name(f"progress.{os.getpid()}")
        partial.write_text(str(step))
        os.replace(partial, PROGRESS)
        if client is not None:
            client.send(StepMessage(step=step, metrics={"critic/score/mean": step / total, "timing_s/step": step_s}))
    safe_point(step + 1)
    if client is not None:
        client.send(CheckpointMessage(step=step, path=str(PROGRESS)))
        client.close()
    record("exit", step=step, stopped=stop["requested"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
