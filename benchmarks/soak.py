"""Soak (issue 19, item 15): does a long run leak memory or file descriptors?

    nice -n 19 python benchmarks/soak.py --duration 3600 --out benchmarks/results/soak-2core-DATE.json
    python benchmarks/soak.py --report FILE      # a saved result's table again

A real `verl train` of examples/quickstart.yaml (small batches, on the CPU, a checkpoint every
`--save-freq` steps, two kept) runs for `--duration` seconds with everything a long run meets
attached: `verl monitor --pid` (a child process, its screen thrown away), a WebSocket client on
/v1/stream (resuming after a drop with the last seq it saw) and a Prometheus-like scrape of
/metrics every `--scrape-interval` seconds. Every `--sample-interval` seconds the script records
the resident set size (RSS) and open file descriptors of the daemon, the trainer and the monitor.

Until the daemon's history window (`telemetry.history_seconds`, `--history-seconds` here) has
filled, the daemon's memory grows by design; the slopes are fitted (least squares) over the
samples after it, plus `--settle` seconds for the trainer's own warm-up. Targets: RSS under
1 MiB/h and no lasting growth of descriptors, for the daemon and the trainer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.environment import repository_first  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
# The quickstart shrunk to the e2e tests' size: a step well under a second on two cores, so an hour
# is thousands of steps, dozens of checkpoints and every kind of event many times over.
RUN_OVERRIDES = ("data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.device=cpu",
                 "trainer.total_training_steps=1000000", "trainer.max_ckpt_to_keep=2",
                 "trainer.experiment_name=soak")
RSS_TARGET_MIB_PER_HOUR = 1.0
PROCESSES = ("daemon", "trainer", "monitor")
MiB = 2**20


class SoakError(Exception):
    """The soak could not run (the run failed to start or ended early): one line for the user."""


@dataclass
class Sample:
    time: float
    step: int | None
    processes: dict[str, dict[str, int]] = field(default_factory=dict)  # name -> {"pid", "rss_bytes", "fds"}


@dataclass
class Traffic:
    """What the attached clients saw: counted from their threads, read at the end."""

    ws_events: int = 0
    ws_gaps: int = 0
    ws_reconnects: int = 0
    scrapes: int = 0
    scrape_errors: list[str] = field(default_factory=list)
    ws_errors: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------- the run


def verl_command() -> list[str]:
    return [sys.executable, "-c", "import sys; from daemon.cli import main; sys.exit(main())"]


def start_run(work: Path, overrides: list[str], env: dict[str, str] | None = None
              ) -> tuple[subprocess.Popen[bytes], dict[str, str], dict[str, str]]:
    """`verl train` of the quickstart in `work` (with `env` added to the environment): the daemon process, its
    runtime info and environment."""
    from daemon.runtime import live_runs

    env = {**os.environ, **(env or {}), "VERL_STATE_DIR": str(work / "state"),
           "PYTHONPATH": repository_first(os.environ)}
    with (work / "verl.out").open("w") as log:
        process = subprocess.Popen([*verl_command(), "train", "--config", str(QUICKSTART),
                                    f"trainer.runs_dir={work / 'runs'}", *RUN_OVERRIDES, *overrides],
                                   cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SoakError(f"verl train exited with {process.returncode}: "
                            f"{(work / 'verl.out').read_text()[-2000:]}")
        runs = [run for run in live_runs(work / "state") if run.pid == process.pid]
        if runs:
            return process, {"url": runs[0].url, "token": runs[0].token}, env
        time.sleep(0.2)
    process.kill()
    raise SoakError("verl train did not write its runtime file within 120 s")


def trainer_pid(state: Path, daemon_pid: int) -> int | None:
    """The trainer the daemon runs now (from its runtime file; it changes at a restart)."""
    with contextlib.suppress(OSError, ValueError):
        pids = json.loads((state / "run" / f"{daemon_pid}.json").read_text())["trainer_pids"]
        return pids[0] if pids else None
    return None


def measure(pid: int | None) -> dict[str, int] | None:
    import psutil

    if pid is None:
        return None
    try:
        process = psutil.Process(pid)
        return {"pid": pid, "rss_bytes": process.memory_info().rss, "fds": process.num_fds()}
    except psutil.Error:
        return None


# ----------------------------------------------------------------------------------- the clients


def follow_stream(url: str, token: str, stop: threading.Event, traffic: Traffic) -> None:
    """A WebSocket client that stays attached: counts events and gaps, resumes after a drop."""
    from api.client import ApiClient, ApiError

    async def follow() -> None:
        last_seq: int | None = None
        with ApiClient(url, token) as client:
            while not stop.is_set():
                try:
                    async for event in client.stream(since=last_seq):
                        if event["kind"] == "gap":
                            traffic.ws_gaps += 1
                        else:
                            traffic.ws_events += 1
                        last_seq = event["seq"]
                        if stop.is_set():
                            return
                except ApiError as error:
                    traffic.ws_errors.append(str(error)[:200])
                if not stop.is_set():
                    traffic.ws_reconnects += 1
                    await asyncio.sleep(1)

    asyncio.run(follow())


def scrape_metrics(url: str, token: str, interval_s: float, stop: threading.Event, traffic: Traffic) -> None:
    """A Prometheus-like scraper of /metrics on one kept-alive connection."""
    import httpx

    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10,
                      trust_env=False) as client:
        while not stop.wait(interval_s):
            try:
                client.get("/metrics").raise_for_status()
                traffic.scrapes += 1
            except httpx.HTTPError as error:
                traffic.scrape_errors.append(str(error)[:200])


# ---------------------------------------------------------------------------------------- the soak


def soak(*, duration_s: float, history_s: int, settle_s: float, sample_interval_s: float,
         scrape_interval_s: float, save_freq: int, overrides: list[str],
         folder: Path | None = None, progress: Callable[[Sample], None] | None = None) -> dict[str, Any]:
    """Run the soak and return its result (see `summarize`); `folder` keeps the run's files there."""
    with contextlib.ExitStack() as stack:
        work = folder or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="verl-soak-")))
        run_overrides = [f"telemetry.history_seconds={history_s}", f"trainer.save_freq={save_freq}", *overrides]
        process, info, env = start_run(work, run_overrides)
        started = time.time()
        stop = threading.Event()
        traffic = Traffic()
        threads = [threading.Thread(target=follow_stream, args=(info["url"], info["token"], stop, traffic),
                                    daemon=True),
                   threading.Thread(target=scrape_metrics,
                                    args=(info["url"], info["token"], scrape_interval_s, stop, traffic), daemon=True)]
        monitor = subprocess.Popen([*verl_command(), "monitor", "--pid", str(process.pid)], env=env, cwd=work,
                                   stdout=subprocess.DEVNULL, stderr=(work / "monitor.err").open("w"))
        samples: list[Sample] = []
        try:
            for thread in threads:
                thread.start()
            samples = sample_until(process, monitor, info, work, started + duration_s, sample_interval_s, progress)
        finally:
            stop.set()
            monitor.terminate()
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(180)
            except subprocess.TimeoutExpired:
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                monitor.wait(30)
            for thread in threads:
                thread.join(10)
        setup = {"config": "examples/quickstart.yaml", "overrides": [*RUN_OVERRIDES, *run_overrides],
                 "duration_s": duration_s, "history_seconds": history_s, "settle_s": settle_s,
                 "sample_interval_s": sample_interval_s, "scrape_interval_s": scrape_interval_s}
        return summarize(setup, samples, traffic, started, exit_code=process.returncode)


def sample_until(process: subprocess.Popen[bytes], monitor: subprocess.Popen[bytes], info: dict[str, str],
                 work: Path, end: float, interval_s: float,
                 progress: Callable[[Sample], None] | None) -> list[Sample]:
    import httpx

    samples = []
    with httpx.Client(base_url=info["url"], headers={"Authorization": f"Bearer {info['token']}"}, timeout=10,
                      trust_env=False) as client:
        next_sample = time.time()
        while next_sample < end:
            if process.poll() is not None:
                raise SoakError(f"verl train ended early with {process.returncode}: "
                                f"{(work / 'verl.out').read_text()[-2000:]}")
            step = None
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                step = client.get("/v1/status").json()["progress"]["step"]
            sample = Sample(time.time(), step)
            for name, pid in (("daemon", process.pid), ("trainer", trainer_pid(work / "state", process.pid)),
                              ("monitor", monitor.pid if monitor.poll() is None else None)):
                figures = measure(pid)
                if figures is not None:
                    sample.processes[name] = figures
            samples.append(sample)
            if progress is not None:
                progress(sample)
            next_sample += interval_s
            time.sleep(max(0.0, next_sample - time.time()))
    return samples


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per hour; None for fewer than 3 points."""
    if len(points) < 3:
        return None
    times = [t for t, _ in points]
    values = [v for _, v in points]
    mean_t, mean_v = statistics.fmean(times), statistics.fmean(values)
    spread = sum((t - mean_t) ** 2 for t in times)
    if spread == 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / spread * 3600


def summarize(setup: dict[str, Any], samples: list[Sample], traffic: Traffic, started: float,
              exit_code: int | None) -> dict[str, Any]:
    """The run's samples, what the clients saw, and `analyze`'s figures."""
    steps = [sample.step for sample in samples if sample.step is not None]
    result: dict[str, Any] = {
        "kind": "soak", "machine": machine(), "setup": setup, "exit_code": exit_code,
        "steps": {"first": steps[0] if steps else None, "last": steps[-1] if steps else None},
        "traffic": {"ws_events": traffic.ws_events, "ws_gaps": traffic.ws_gaps,
                    "ws_reconnects": traffic.ws_reconnects, "ws_errors": traffic.ws_errors[:10],
                    "scrapes": traffic.scrapes, "scrape_errors": traffic.scrape_errors[:10]},
        "samples": [{"t": round(sample.time - started, 1), "step": sample.step, **{
            name: [figures["pid"], figures["rss_bytes"], figures["fds"]]
            for name, figures in sample.processes.items()}} for sample in samples],
    }
    return {**result, **analyze(setup, result["samples"])}


def analyze(setup: dict[str, Any], samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per process, over the samples after the history window and the settling time: RSS and fds at the
    start and the end, their slopes per hour, whether the fds stay flat; and the targets.

    The daemon's history holds the events of the last `history_seconds` (at most api.hub's max_events), so
    its memory follows the run's event rate, i.e. its steps per second, even once the window is full: on a
    shared machine they change with the other load. And the RSS of a Python process is a high-water mark:
    it rises when the history holds more than ever before and stays there when it holds less. So the
    daemon's RSS is also measured over the stretches in which the history held no more steps than it had
    already held: a leak grows there too; a fuller history does not. The daemon's target is checked on
    that figure.
    """
    measured_from = setup["history_seconds"] + setup["settle_s"]
    processes: dict[str, dict[str, Any]] = {}
    for name in PROCESSES:
        series = [(sample["t"], sample[name], sample["step"]) for sample in samples if name in sample]
        last_pid = series[-1][1][0] if series else None
        # A restarted trainer is another process: its slope is its own, from its own start.
        measured = [(t, figures, step) for t, figures, step in series if figures[0] == last_pid and t >= measured_from]
        rss = [(t, figures[1] / MiB) for t, figures, _ in measured]
        fds = [(t, figures[2]) for t, figures, _ in measured]
        quarter = max(1, len(fds) // 4)
        processes[name] = {
            "pids": sorted({figures[0] for _, figures, _ in series}),
            "samples": len(measured),
            "rss_mib_first": rss[0][1] if rss else None, "rss_mib_last": rss[-1][1] if rss else None,
            "rss_mib_max": max((value for _, value in rss), default=None),
            "rss_mib_per_hour": slope_per_hour(rss),
            "fds_first": fds[0][1] if fds else None, "fds_last": fds[-1][1] if fds else None,
            "fds_max": max((value for _, value in fds), default=None),
            "fds_per_hour": slope_per_hour([(t, float(count)) for t, count in fds]),
            # Flat: the last quarter never holds more descriptors than the first quarter did at most
            # (a request in flight at a sample may hold one for a moment; a leak keeps adding them).
            "fds_flat": bool(fds) and min(v for _, v in fds[-quarter:]) <= max(v for _, v in fds[:quarter]),
        }
    daemon = processes["daemon"]
    daemon.update(growth_below_history_high([sample for sample in samples if sample["t"] >= measured_from],
                                            steps_in_window(samples, setup["history_seconds"])))
    steady = daemon["rss_mib_per_hour_below_history_high"]
    targets = {name: {"rss": (processes[name]["rss_mib_per_hour"] or 0.0) < RSS_TARGET_MIB_PER_HOUR,
                      "fds": bool(processes[name]["fds_flat"])} for name in ("daemon", "trainer")}
    if steady is not None:
        targets["daemon"]["rss"] = steady < RSS_TARGET_MIB_PER_HOUR
    return {"measured_from_s": measured_from, "processes": processes, "targets_met": targets}


def steps_in_window(samples: list[dict[str, Any]], window_s: float) -> dict[float, int]:
    """For each sample's time, where it is known: the steps the run made in the `window_s` before it."""
    known = [(sample["t"], sample["step"]) for sample in samples if sample["step"] is not None]
    window: dict[float, int] = {}
    earlier = 0
    for t, step in known:
        while earlier + 1 < len(known) and known[earlier + 1][0] <= t - window_s:
            earlier += 1
        if known[earlier][0] <= t - window_s:
            window[t] = step - known[earlier][1]
    return window


def growth_below_history_high(samples: list[dict[str, Any]], window: dict[float, int]) -> dict[str, Any]:
    """The daemon's RSS growth per hour over the intervals between samples in which the history held no more
    steps than its most so far (None when there are none), the seconds those intervals add up to, and the
    fewest and most steps the history held."""
    most, seconds, growth = 0, 0.0, 0.0
    previous: tuple[float, int] | None = None
    held = []
    for sample in samples:
        if "daemon" not in sample or sample["t"] not in window:
            continue
        steps, rss = window[sample["t"]], sample["daemon"][1]
        held.append(steps)
        if previous is not None and steps <= most:
            seconds += sample["t"] - previous[0]
            growth += (rss - previous[1]) / MiB
        most = max(most, steps)
        previous = (sample["t"], rss)
    return {"rss_mib_per_hour_below_history_high": growth / seconds * 3600 if seconds > 0 else None,
            "seconds_below_history_high": seconds,
            "steps_in_history": {"min": min(held, default=None), "max": max(held, default=None)}}


def machine() -> dict[str, Any]:
    import psutil

    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host_cores": os.cpu_count(), "memory_bytes": psutil.virtual_memory().total,
            "python": platform.python_version(), "load_average": os.getloadavg()}


def report(result: dict[str, Any]) -> str:
    setup = result["setup"]
    lines = [f"soak of {setup['duration_s']:g} s (history window {setup['history_seconds']} s, measured from "
             f"{result['measured_from_s']:g} s), steps {result['steps']['first']} to {result['steps']['last']}",
             "| process | RSS MiB (first → last) | RSS MiB/h | fds (first → last, max) | fds/h | flat |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for name, figures in result["processes"].items():
        if not figures["samples"]:
            lines.append(f"| {name} | – | – | – | – | – |")
            continue
        lines.append(f"| {name} | {figures['rss_mib_first']:.1f} → {figures['rss_mib_last']:.1f} "
                     f"| {_signed(figures['rss_mib_per_hour'])} | {figures['fds_first']} → {figures['fds_last']}, "
                     f"{figures['fds_max']} | {_signed(figures['fds_per_hour'])} | "
                     f"{'yes' if figures['fds_flat'] else 'NO'} |")
    daemon = result["processes"]["daemon"]
    if daemon.get("rss_mib_per_hour_below_history_high") is not None:
        history = daemon["steps_in_history"]
        lines.append(f"daemon RSS while its history held no more than it had before: "
                     f"{_signed(daemon['rss_mib_per_hour_below_history_high'])} MiB/h over "
                     f"{daemon['seconds_below_history_high']:.0f} s (the history held {history['min']} to "
                     f"{history['max']} steps)")
    traffic = result["traffic"]
    lines.append(f"stream: {traffic['ws_events']} events, {traffic['ws_gaps']} gaps, {traffic['ws_reconnects']} "
                 f"reconnects; /metrics: {traffic['scrapes']} scrapes, {len(traffic['scrape_errors'])} errors")
    met = all(all(checks.values()) for checks in result["targets_met"].values())
    lines.append(f"targets (RSS < {RSS_TARGET_MIB_PER_HOUR:g} MiB/h, flat fds, daemon and trainer): "
                 + ("met" if met else f"NOT met: {result['targets_met']}"))
    return "\n".join(lines)


def _signed(value: float | None) -> str:
    return "–" if value is None else f"{value:+.2f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds of the run (default 3600)")
    parser.add_argument("--history-seconds", type=int, default=900,
                        help="the daemon's telemetry.history_seconds (default 900, the config's default)")
    parser.add_argument("--settle", type=float, default=120.0,
                        help="seconds after the history window fills before the slopes start (default 120)")
    parser.add_argument("--sample-interval", type=float, default=5.0, help="seconds between samples (default 5)")
    parser.add_argument("--scrape-interval", type=float, default=2.0, help="seconds between /metrics scrapes")
    parser.add_argument("--save-freq", type=int, default=50, help="trainer.save_freq of the run (default 50)")
    parser.add_argument("--override", action="append", default=[], metavar="key.path=value",
                        help="more config overrides for the run")
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("--report", metavar="FILE", help="print a saved result's table and exit")
    chaos = parser.add_argument_group("the chaos soak (benchmarks/chaos.py): faults injected, then compared")
    chaos.add_argument("--chaos", action="store_true", help="inject faults into a run of --steps steps")
    chaos.add_argument("--steps", type=int, default=2000, help="steps of the chaos run (default 2000)")
    chaos.add_argument("--minutes", type=float, help="inject faults for this long, then end both runs at the next "
                       "checkpoint but one and compare to there (--steps then only bounds the run)")
    chaos.add_argument("--mean-interval", type=float, default=30.0, help="mean seconds between faults (default 30)")
    chaos.add_argument("--hang-timeout", type=float, default=20.0, help="daemon.hang_timeout_s (default 20)")
    chaos.add_argument("--burst", type=int, default=100, help="API clients of a burst (default 100)")
    chaos.add_argument("--seed", type=int, default=1, help="the faults' random seed (default 1)")
    chaos.add_argument("--faults", default="kill,stop,damage,burst,disk",
                       help="the faults drawn from, comma-separated (default all: kill,stop,damage,burst,disk)")
    args = parser.parse_args(argv)
    if args.report is None and not args.chaos and not args.duration > args.history_seconds + args.settle:
        parser.error("--duration must exceed --history-seconds + --settle: the slopes are fitted after both")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:  # analyzed again: a result saved by an older version of this script reads the same
        saved = json.loads(Path(args.report).read_text())
        result = {**saved, **analyze(saved["setup"], saved["samples"])}
        print(report(result))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        return 0

    if args.chaos:
        return _chaos(args)

    def progress(sample: Sample) -> None:
        figures = "  ".join(f"{name} {values['rss_bytes'] / MiB:.1f} MiB {values['fds']} fds"
                            for name, values in sample.processes.items())
        print(f"  step {sample.step}: {figures}", file=sys.stderr, flush=True)

    try:
        result = soak(duration_s=args.duration, history_s=args.history_seconds, settle_s=args.settle,
                      sample_interval_s=args.sample_interval, scrape_interval_s=args.scrape_interval,
                      save_freq=args.save_freq, overrides=args.override, progress=progress)
    except SoakError as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    met = all(all(checks.values()) for checks in result["targets_met"].values())
    return 0 if met else 1


def _chaos(args: argparse.Namespace) -> int:
    from benchmarks.chaos import chaos_report, run_chaos
    from benchmarks.soak import SoakError as StartError  # the class chaos.py raises (this file runs as __main__)

    with tempfile.TemporaryDirectory(prefix="verl-chaos-") as work:
        try:
            result = run_chaos(Path(work), steps=args.steps, save_freq=args.save_freq, hang_timeout_s=args.hang_timeout,
                               mean_interval_s=args.mean_interval, seed=args.seed, burst=args.burst,
                               faults=tuple(args.faults.split(",")), minutes=args.minutes,
                               log=lambda line: print(line, file=sys.stderr, flush=True))
        except (SoakError, StartError) as error:
            print(f"ERROR: {error}", file=sys.stderr)
            return 2
    result["machine"] = machine()
    print(chaos_report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    faults_recovered = result["injected"] == result["recovered"]
    return 0 if faults_recovered and result["metrics_equal"] and result["weights_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
