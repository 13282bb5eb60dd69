"""What the telemetry costs (issue 3), measured side by side in one run.

    python benchmarks/telemetry_bench.py api --out api.json          # on the 2-core CPU machine
    python benchmarks/telemetry_bench.py overhead --out gpu.json     # on a GPU
    python benchmarks/telemetry_bench.py --report FILE               # a saved result's table again

``api``: a real ``verl train`` of examples/quickstart.yaml (the daemon, its API and the trainer
child, as a user starts them) runs while this script alternates quiet windows (nobody attached)
with loaded ones: 50 WebSocket clients on /v1/stream and an open-loop load of `--rate` requests a
second, half /metrics and half /v1/status, each timed from the moment it was due (a late
generator counts against the API, not for it). It prints each endpoint's p50/p99 and the mean
step time of the loaded windows against the quiet ones (steps are assigned to a window by their
start and end times, from the daemon's history).

``overhead``: the daemon (API, NVML sampler, IPC) runs in this process and supervises a trainer
child that alternates blocks of steps with its telemetry on and off (on, off, off, on per cycle,
so a drift cancels out). On: the trainer's telemetry client sends phases, step metrics and the
offload engine's copy statistics; the daemon samples NVML every second and PCIe every 10 s; one
WebSocket client follows the stream and /metrics is scraped every second (a monitor and a
Prometheus). Off: the trainer has no client, the sampler waits a minute between samples, and no
client is attached. The CUDA events that time each copy also order the compute after it, so they
stay in both. The model is the built-in Qwen2 at `--shape` (random init, tiny vocabulary), the
actor with param and optimizer offload, so the engine's copies are timed and reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.environment import repository_first  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
SHAPES = {
    # The built-in preset's own shape: the most telemetry per second of compute.
    "tiny": {},
    # About 0.2 B parameters: a step of a few seconds on a GPU with offload.
    "small": dict(hidden_size=1024, num_hidden_layers=16, intermediate_size=2816, num_attention_heads=16,
                  num_key_value_heads=4),
}
CONTROL_ENV = "VERL_TELEMETRY_BENCH_CONTROL"
# Each cycle's blocks, in an order that is the same read backwards (a drift cancels out). on: all of
# the telemetry; off: none; trainer: the trainer's client only; daemon: the sampler and clients only.
PATTERN = ("on", "off", "trainer", "daemon", "daemon", "trainer", "off", "on")


class BenchError(Exception):
    """The benchmark cannot run as asked; the message says why."""


def machine() -> dict:
    info = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host_cores": os.cpu_count(), "python": platform.python_version()}
    with contextlib.suppress(Exception):
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    return info


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile by the nearest-rank method (no interpolation: p99 of 100 values is the 99th)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# ----------------------------------------------------------------------------------------------- api


def verl_command() -> list[str]:
    return [sys.executable, "-c", "import sys; from daemon.cli import main; sys.exit(main())"]


def start_run(work: Path, overrides: list[str]) -> tuple[subprocess.Popen, dict]:
    """`verl train` of the quickstart in `work`; returns the daemon process and its runtime info."""
    from daemon.runtime import live_runs

    env = {**os.environ, "VERL_STATE_DIR": str(work / "state"), "PYTHONPATH": repository_first(os.environ)}
    log = (work / "verl.out").open("w")
    process = subprocess.Popen([*verl_command(), "train", "--config", str(QUICKSTART),
                                f"trainer.runs_dir={work / 'runs'}", "trainer.experiment_name=telemetry-bench",
                                "trainer.total_training_steps=100000", "trainer.save_freq=0", *overrides],
                               cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(f"verl train exited with {process.returncode}: {(work / 'verl.out').read_text()[-2000:]}")
        runs = [run for run in live_runs(work / "state") if run.pid == process.pid]
        if runs:
            return process, {"url": runs[0].url, "token": runs[0].token}
        time.sleep(0.2)
    process.kill()
    raise BenchError("verl train did not write its runtime file within 60 s")


def wait_for_step(client, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (client.get("/v1/status").json().get("progress") or {}).get("step", 0) >= step:
            return
        time.sleep(0.5)
    raise BenchError(f"the run did not reach step {step} within {timeout_s:.0f} s")


class KeepAliveGetter:
    """GETs over a few persistent HTTP/1.1 connections, written on asyncio streams.

    By hand rather than httpx: the load generator shares the two cores with the daemon and the
    trainer, and httpx costs about 1 ms of CPU a request, as much as the API it measures; this costs
    a tenth of that, so the step time measures the API, not its client.
    """

    def __init__(self, url: str, token: str, connections: int):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host.strip("[]"), int(port)
        self.header = f"Host: {host}:{port}\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
        self.free: asyncio.Queue = asyncio.Queue()
        self.connections = connections

    async def open(self) -> None:
        for _ in range(self.connections):
            self.free.put_nowait(await asyncio.open_connection(self.host, self.port))

    async def get(self, path: str) -> int:
        """The status code; the body is read and dropped."""
        reader, writer = await self.free.get()
        try:
            writer.write(f"GET {path} HTTP/1.1\r\n".encode() + self.header)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if length is None:
                raise BenchError(f"{path}: a response without Content-Length")
            await reader.readexactly(length)
        except BaseException:
            writer.close()
            self.free.put_nowait(await asyncio.open_connection(self.host, self.port))
            raise
        self.free.put_nowait((reader, writer))
        return status

    async def close(self) -> None:
        while not self.free.empty():
            _, writer = self.free.get_nowait()
            writer.close()


async def load_window(url: str, token: str, *, seconds: float, rate: float, clients: int) -> dict:
    """`clients` WebSocket followers and `rate` requests a second for `seconds`; latencies in seconds."""
    import websockets

    headers = {"Authorization": f"Bearer {token}"}
    ws_url = url.replace("http://", "ws://", 1) + "/v1/stream"
    received = [0] * clients
    stop = asyncio.Event()

    async def follow(index: int) -> None:
        async with websockets.connect(ws_url, additional_headers=headers, max_size=None) as socket:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(socket.recv(), 0.5)
                    received[index] += 1
                except TimeoutError:
                    continue

    latencies: dict[str, list[float]] = {"/metrics": [], "/v1/status": []}
    errors: list[str] = []
    lateness: list[float] = []
    getter = KeepAliveGetter(url, token, connections=32)
    await getter.open()
    followers = [asyncio.create_task(follow(index)) for index in range(clients)]
    await asyncio.sleep(1.0)  # every follower connected before the clock starts
    # perf_counter, not the loop's clock: uvloop's counts whole milliseconds.
    clock = time.perf_counter
    cpu_started = time.process_time()
    started = clock()
    total = int(seconds * rate)
    requests: list[asyncio.Task] = []

    async def one(path: str, due: float) -> None:
        lateness.append(clock() - due)
        try:
            status = await getter.get(path)
        except (OSError, asyncio.IncompleteReadError, BenchError) as error:
            errors.append(f"{path}: {error!r}")
            return
        if status != 200:
            errors.append(f"{path}: HTTP {status}")
            return
        latencies[path].append(clock() - due)

    for index in range(total):
        due = started + index / rate
        delay = due - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        requests.append(asyncio.create_task(one("/metrics" if index % 2 == 0 else "/v1/status", due)))
    await asyncio.gather(*requests)
    elapsed = clock() - started
    generator_cpu = time.process_time() - cpu_started
    stop.set()
    done = await asyncio.gather(*followers, return_exceptions=True)
    await getter.close()
    failed = [repr(result) for result in done if isinstance(result, BaseException)]
    return {"latencies": latencies, "errors": errors + failed, "achieved_rate": total / elapsed,
            "generator_lateness_p99_s": percentile(lateness, 99), "ws_messages": sum(received),
            "ws_clients_ok": clients - len(failed), "generator_cpu_ratio": generator_cpu / elapsed}


def step_spans(client) -> list[dict]:
    """Each step's start and end (epoch seconds) and its timing_s/step, from the daemon's history."""
    body = client.get("/v1/metrics/history", params={"kinds": "step", "keys": "timing_s/step"}).json()
    spans = []
    for event in body["events"]:
        seconds = (event["data"].get("metrics") or {}).get("timing_s/step")
        if seconds is not None:
            end = event["data"].get("time") or event["time"]
            spans.append({"step": event["data"]["step"], "start": end - seconds, "end": end, "seconds": seconds})
    return spans


def event_loop_factory():
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_api(args: argparse.Namespace) -> dict:
    import httpx
    import psutil

    with tempfile.TemporaryDirectory(prefix="verl-telemetry-bench-") as directory:
        work = Path(directory)
        process, info = start_run(work, args.override)
        windows: list[dict] = []
        try:
            with httpx.Client(base_url=info["url"], headers={"Authorization": f"Bearer {info['token']}"},
                              timeout=10) as client:
                wait_for_step(client, args.warmup_steps)
                daemon = psutil.Process(process.pid)
                for cycle in range(args.cycles):
                    for kind in ("quiet", "loaded"):
                        window = {"kind": kind, "cycle": cycle, "start": time.time()}
                        cpu = daemon.cpu_times()
                        if kind == "quiet":
                            time.sleep(args.window_s)
                        else:
                            with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                                window.update(runner.run(load_window(info["url"], info["token"],
                                                                     seconds=args.window_s, rate=args.rate,
                                                                     clients=args.clients)))
                        window["end"] = time.time()
                        used = daemon.cpu_times()
                        window["daemon_cpu_ratio"] = ((used.user + used.system - cpu.user - cpu.system)
                                                      / (window["end"] - window["start"]))
                        windows.append(window)
                        print(f"  {kind} window {cycle + 1}/{args.cycles} done", file=sys.stderr, flush=True)
                spans = step_spans(client)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                process.kill()
    return summarize_api(args, windows, spans)


def summarize_api(args: argparse.Namespace, windows: list[dict], spans: list[dict]) -> dict:
    steps: dict[str, list[float]] = {"quiet": [], "loaded": []}
    for window in windows:
        # A step counts for a window when it ran wholly inside it (after the followers connected).
        inside = [span["seconds"] for span in spans
                  if span["start"] >= window["start"] + 1.5 and span["end"] <= window["end"]]
        window["steps"] = len(inside)
        steps[window["kind"]].extend(inside)
    loaded = [window for window in windows if window["kind"] == "loaded"]
    endpoints = {}
    for path in ("/metrics", "/v1/status"):
        values = [value for window in loaded for value in window["latencies"][path]]
        endpoints[path] = {"requests": len(values), "p50_ms": _ms(percentile(values, 50)),
                           "p99_ms": _ms(percentile(values, 99)), "max_ms": _ms(max(values, default=None))}
    quiet_mean = statistics.fmean(steps["quiet"]) if steps["quiet"] else None
    loaded_mean = statistics.fmean(steps["loaded"]) if steps["loaded"] else None
    return {
        "kind": "api", "machine": machine(),
        "setup": {"config": "examples/quickstart.yaml", "overrides": list(args.override), "rate_per_s": args.rate,
                  "ws_clients": args.clients, "window_s": args.window_s, "cycles": args.cycles},
        "endpoints": endpoints,
        "achieved_rate_per_s": [round(window["achieved_rate"], 1) for window in loaded],
        "generator_lateness_p99_ms": [_ms(window["generator_lateness_p99_s"]) for window in loaded],
        "errors": [error for window in loaded for error in window["errors"]][:20],
        "ws_messages": sum(window["ws_messages"] for window in loaded),
        "ws_clients_ok": min((window["ws_clients_ok"] for window in loaded), default=0),
        "cpu_ratio": {"daemon_quiet": _mean(window["daemon_cpu_ratio"] for window in windows
                                            if window["kind"] == "quiet"),
                      "daemon_loaded": _mean(window["daemon_cpu_ratio"] for window in loaded),
                      "generator": _mean(window["generator_cpu_ratio"] for window in loaded)},
        "steps": {"quiet": len(steps["quiet"]), "loaded": len(steps["loaded"])},
        "step_s": {"quiet": quiet_mean, "loaded": loaded_mean},
        "step_ratio": loaded_mean / quiet_mean if quiet_mean and loaded_mean else None,
    }


def _mean(values) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


# ------------------------------------------------------------------------------------------ overhead


def overhead_config(args: argparse.Namespace, work: Path):
    from trainer.config import load_config

    shape = json.dumps(SHAPES[args.shape])
    overrides = [
        f"trainer.runs_dir={work / 'runs'}", "trainer.experiment_name=telemetry-overhead",
        f"trainer.device={args.device}", "trainer.save_freq=0", "trainer.total_training_steps=100000",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.actor.ppo_epochs=1", "data.max_response_length=32",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
        f"actor_rollout_ref.model.override_config={shape}",
        *args.override,
    ]
    return load_config(QUICKSTART, overrides)


def run_overhead(args: argparse.Namespace) -> dict:
    from daemon.cli import write_run_config
    from daemon.service import Daemon

    with tempfile.TemporaryDirectory(prefix="verl-telemetry-overhead-") as directory:
        work = Path(directory)
        config = overhead_config(args, work)
        config_path = write_run_config(config)
        result_path = work / "result.json"
        control = work / "control"
        os.mkfifo(control)
        command = [sys.executable, str(Path(__file__).resolve()), "trainer-side", "--config", str(config_path),
                   "--result", str(result_path), "--block-steps", str(args.block_steps),
                   "--cycles", str(args.cycles), "--warmup-steps", str(args.warmup_steps)]
        daemon = Daemon(config, config_path, trainer_command=command, state=work / "state")
        daemon.supervisor.env[CONTROL_ENV] = str(control)
        attached: list[tuple[threading.Event, threading.Thread]] = []
        conductor = threading.Thread(target=conduct, args=(daemon, control, config, attached), daemon=True)
        conductor.start()
        try:
            code = asyncio.run(daemon.run())
        finally:  # the last block's clients go with the daemon (they would scrape a closed port in the next test)
            for stop, client in list(attached):
                stop.set()
                client.join(timeout=5)
        if code != 0 or not result_path.exists():
            log = config.trainer.run_dir / "logs"
            raise BenchError(f"the trainer side failed (daemon exit {code}); see the output above and {log}")
        result = json.loads(result_path.read_text())
    return summarize_overhead(args, result)


def conduct(daemon, control: Path, config, attached: list[tuple[threading.Event, threading.Thread]]) -> None:
    """The daemon's side of each block: on, NVML at the configured cadence and two clients attached;
    off, the sampler all but idle and nobody attached. `attached` holds the clients of the current block (with
    the events that stop them), for the caller to stop at the end."""
    with control.open("r") as lines:
        for line in lines:
            mode = line.strip()
            for stop, client in attached:
                stop.set()
                client.join(timeout=5)
            attached.clear()
            sampler = daemon.sampler
            if mode in ("on", "daemon"):
                if sampler is not None:
                    sampler.set_intervals(gpu_interval_s=config.telemetry.gpu_sample_interval_s,
                                          pcie_interval_s=config.telemetry.pcie_sample_interval_s)
                for target in (follow_stream, scrape_metrics):
                    stop = threading.Event()
                    client = threading.Thread(target=target, args=(daemon.url, daemon.token, stop), daemon=True)
                    client.start()
                    attached.append((stop, client))
            elif sampler is not None:
                sampler.set_intervals(gpu_interval_s=60.0, pcie_interval_s=600.0)


def follow_stream(url: str, token: str, stop: threading.Event) -> None:
    from websockets.sync.client import connect

    with contextlib.suppress(Exception), connect(url.replace("http://", "ws://", 1) + "/v1/stream",
                                                 additional_headers={"Authorization": f"Bearer {token}"}) as socket:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                socket.recv(timeout=0.5)


def scrape_metrics(url: str, token: str, stop: threading.Event) -> None:
    import httpx

    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10) as client:
        while not stop.wait(1.0):
            with contextlib.suppress(httpx.HTTPError):
                client.get("/metrics")


def trainer_side(args: argparse.Namespace) -> int:
    """The trainer child: blocks of steps with telemetry on and off; writes each step's time."""
    import torch

    from trainer.config import load_config
    from trainer.config.messages import UpMessage
    from trainer.loop import Trainer
    from trainer.telemetry import TelemetryClient

    config = load_config(args.config)
    client = TelemetryClient.from_env(run_dir=str(config.trainer.run_dir))
    if client is None:
        raise BenchError("trainer-side runs under the daemon of `telemetry_bench.py overhead`")
    trainer = Trainer(config, log=print, telemetry=client)
    # Every response runs to the full length, so every step has the same shape and step times
    # compare (a random model's EOS comes at random, and the rollout's length with it).
    trainer.rollout.generation_config.min_new_tokens = config.data.max_response_length
    client.hello(start_step=0, total_steps=trainer.total_steps)
    trainer.control.receive_initial_settings()
    control = open(os.environ[CONTROL_ENV], "w", buffering=1)  # noqa: SIM115 - open for the whole run

    # What the trainer's thread spends in the client's send (encoding and queueing each message).
    sent = [0.0]
    send = client.send

    def timed_send(message: UpMessage) -> None:
        started = time.perf_counter()
        send(message)
        sent[0] += time.perf_counter() - started

    client.send = timed_send

    def run_steps(count: int, mode: str) -> list[dict]:
        control.write(mode + "\n")
        time.sleep(2.0)  # the clients attach (or leave) and the sampler takes its new cadence
        trainer.control.telemetry = client if mode in ("on", "trainer") else None
        steps = []
        for _ in range(count):
            trainer.control.take_messages()
            trainer.memory.safe_point()
            records = [trainer.records[index] for index in trainer.sampler.next_batch()]
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            sent[0] = 0.0
            metrics = trainer.train_step(records)
            trainer.step += 1
            recorded = time.perf_counter()
            trainer._record_step(metrics)
            recorded = time.perf_counter() - recorded
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            steps.append({"mode": mode, "step": trainer.step, "seconds": seconds,
                          "tokens": metrics.get("perf/total_num_tokens"),
                          "send_s": sent[0], "record_step_s": recorded,
                          "phases": {key.removeprefix("timing_s/"): value for key, value in metrics.items()
                                     if key.startswith("timing_s/")}})
            print(f"step {trainer.step} telemetry {mode}: {seconds:.3f} s", flush=True)
        return steps

    run_steps(args.warmup_steps, "on")
    steps: list[dict] = []
    for _ in range(args.cycles):
        for mode in PATTERN:
            steps += run_steps(args.block_steps, mode)
    trainer.control.telemetry = client
    Path(args.result).write_text(json.dumps({"steps": steps, "machine": machine(),
                                             "dropped": client.dropped}))
    control.close()
    client.close()
    return 0


def summarize_overhead(args: argparse.Namespace, result: dict) -> dict:
    by_mode: dict[str, list[dict]] = {mode: [] for mode in dict.fromkeys(PATTERN)}
    for step in result["steps"]:
        by_mode[step["mode"]].append(step)
    modes = {}
    for mode, steps in by_mode.items():
        phases = sorted({name for step in steps for name in step["phases"]})
        modes[mode] = {
            "steps": len(steps),
            "step_s": statistics.fmean(step["seconds"] for step in steps),
            "step_median_s": statistics.median(step["seconds"] for step in steps),
            "step_stdev_s": statistics.stdev(step["seconds"] for step in steps) if len(steps) > 1 else 0.0,
            "seconds_per_token": statistics.fmean(step["seconds"] / step["tokens"] for step in steps if step["tokens"]),
            "phase_s": {name: statistics.fmean(step["phases"].get(name, 0.0) for step in steps) for name in phases},
            "send_s": statistics.fmean(step["send_s"] for step in steps),
            "record_step_s": statistics.fmean(step["record_step_s"] for step in steps),
        }
    off = modes["off"]
    return {
        "kind": "overhead", "machine": result["machine"],
        "setup": {"shape": args.shape, "model": SHAPES[args.shape] or "builtin tiny-qwen2",
                  "device": args.device, "block_steps": args.block_steps, "cycles": args.cycles,
                  "pattern": " ".join(PATTERN)},
        "modes": modes,
        "cost": {mode: {"mean": figures["step_s"] / off["step_s"] - 1,
                        # The standard error of that difference, from the steps' spread in both modes.
                        "mean_error": math.hypot(figures["step_stdev_s"] / math.sqrt(figures["steps"]),
                                                 off["step_stdev_s"] / math.sqrt(off["steps"])) / off["step_s"],
                        "main_thread_s": figures["record_step_s"] - off["record_step_s"],
                        "median": figures["step_median_s"] / off["step_median_s"] - 1,
                        "per_token": figures["seconds_per_token"] / off["seconds_per_token"] - 1}
                 for mode, figures in modes.items() if mode != "off"},
        "dropped_messages": result.get("dropped"),
    }


# -------------------------------------------------------------------------------------------- report


def report(result: dict) -> str:
    machine_line = ", ".join(f"{key} {value}" for key, value in result["machine"].items())
    if result.get("kind") == "api":
        setup = result["setup"]
        overrides = " ".join(setup.get("overrides") or [])
        lines = [f"API under load: {setup['config']}{' ' + overrides if overrides else ''} running, "
                 f"{setup['ws_clients']} WebSocket clients, "
                 f"{setup['rate_per_s']:g} requests/s (half /metrics, half /v1/status), "
                 f"{setup['cycles']} x {setup['window_s']:g} s loaded against as many quiet windows; {machine_line}",
                 f"{'endpoint':<12} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"]
        for path, figures in result["endpoints"].items():
            lines.append(f"{path:<12} {figures['requests']:>8} {_num(figures['p50_ms'])} {_num(figures['p99_ms'])} "
                         f"{_num(figures['max_ms'])}")
        lines.append(f"achieved rate {result['achieved_rate_per_s']} /s, generator late by p99 "
                     f"{result['generator_lateness_p99_ms']} ms, {result['ws_messages']} stream messages to "
                     f"{result['ws_clients_ok']} clients, {len(result['errors'])} errors")
        cpu = result["cpu_ratio"]
        lines.append(f"CPU (share of one core): daemon {cpu['daemon_quiet']:.3f} quiet, {cpu['daemon_loaded']:.3f} "
                     f"loaded; load generator {cpu['generator']:.3f}")
        steps, step_s = result["steps"], result["step_s"]
        if result["step_ratio"] is None:
            lines.append(f"step time: too few steps inside the windows ({steps}); lengthen --window-s")
        else:
            lines.append(f"step time: quiet {step_s['quiet']:.3f} s ({steps['quiet']} steps), loaded "
                         f"{step_s['loaded']:.3f} s ({steps['loaded']} steps): {result['step_ratio']:.3f}x")
        return "\n".join(lines)
    if result.get("kind") == "overhead":
        setup, modes, cost = result["setup"], result["modes"], result["cost"]
        names = list(modes)
        lines = [f"Telemetry on vs off in one run: model {setup['model']}, {setup['device']}, blocks of "
                 f"{setup['block_steps']} steps, {setup['cycles']} cycles of {setup['pattern']}; {machine_line}",
                 "on: all telemetry; off: none; trainer: the trainer's client only; daemon: NVML sampling and "
                 "two attached clients only",
                 f"{'':<22}" + "".join(f"{name:>10}" for name in names),
                 f"{'steps':<22}" + "".join(f"{modes[name]['steps']:>10}" for name in names),
                 f"{'mean step s':<22}" + "".join(f"{modes[name]['step_s']:>10.4f}" for name in names),
                 f"{'median step s':<22}" + "".join(f"{modes[name]['step_median_s']:>10.4f}" for name in names),
                 f"{'ms per token':<22}" + "".join(f"{modes[name]['seconds_per_token'] * 1e3:>10.4f}"
                                                   for name in names)]
        lines.append(f"{'  in client.send ms':<22}" + "".join(f"{modes[name]['send_s'] * 1e3:>10.3f}"
                                                           for name in names))
        lines.append(f"{'  recording a step ms':<22}" + "".join(f"{modes[name]['record_step_s'] * 1e3:>10.3f}"
                                                             for name in names))
        phases = sorted({phase for figures in modes.values() for phase in figures["phase_s"]})
        for phase in phases:
            lines.append(f"{'  ' + phase + ' s':<22}" + "".join(f"{modes[name]['phase_s'].get(phase, 0.0):>10.4f}"
                                                               for name in names))
        for mode, figures in cost.items():
            lines.append(f"cost of {mode:<8} vs off: {figures['mean'] * 100:+6.2f}% "
                         f"± {figures['mean_error'] * 100:.2f}% of the mean step, "
                         f"{figures['median'] * 100:+6.2f}% of the median, "
                         f"{figures['per_token'] * 100:+6.2f}% per token; the trainer's thread spends "
                         f"{figures['main_thread_s'] * 1e3:+.2f} ms a step recording it "
                         f"({figures['main_thread_s'] / modes['off']['step_s'] * 100:+.2f}%)")
        lines.append(f"{result['dropped_messages']} telemetry messages dropped")
        return "\n".join(lines)
    raise BenchError("not a telemetry_bench result (no kind 'api' or 'overhead')")


def _num(value: float | None) -> str:
    return f"{'-':>8}" if value is None else f"{value:>8.2f}"


# ---------------------------------------------------------------------------------------------- main


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise BenchError(message)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", metavar="FILE", help="print the table of a saved result and exit")
    commands = parser.add_subparsers(dest="command")
    api = commands.add_parser("api", help="API latency under load and the trainer's step time, one run")
    api.add_argument("--rate", type=float, default=200.0, help="requests a second (default 200)")
    api.add_argument("--clients", type=int, default=50, help="WebSocket clients (default 50)")
    api.add_argument("--window-s", type=float, default=40.0, help="seconds of each window (default 40)")
    api.add_argument("--cycles", type=int, default=2, help="quiet+loaded window pairs (default 2)")
    api.add_argument("--warmup-steps", type=int, default=3)
    overhead = commands.add_parser("overhead", help="step time with telemetry on vs off, one run")
    overhead.add_argument("--shape", choices=sorted(SHAPES), default="small")
    overhead.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    overhead.add_argument("--block-steps", type=int, default=3)
    overhead.add_argument("--cycles", type=int, default=2, help="cycles of the PATTERN's blocks (default 2)")
    overhead.add_argument("--warmup-steps", type=int, default=3)
    side = commands.add_parser("trainer-side", help=argparse.SUPPRESS)
    side.add_argument("--config", required=True)
    side.add_argument("--result", required=True)
    side.add_argument("--block-steps", type=int, required=True)
    side.add_argument("--cycles", type=int, required=True)
    side.add_argument("--warmup-steps", type=int, required=True)
    for command in (api, overhead):
        command.add_argument("--out", metavar="FILE", help="also write the result as JSON")
        command.add_argument("override", nargs="*", help="key.path=value overrides of the run's config")
    args = parser.parse_args(argv)
    if args.report is None and args.command is None:
        parser.error("name a command (api or overhead) or --report FILE")
    for name in ("rate", "clients", "window_s", "cycles", "block_steps"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value:g}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        if args.report is not None:
            try:
                result = json.loads(Path(args.report).read_text())
            except (OSError, ValueError) as error:
                raise BenchError(f"cannot read {args.report}: {error}") from None
            print(report(result))
            return 0
        if args.command == "trainer-side":
            return trainer_side(args)
        if args.command == "overhead" and args.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise BenchError("--device cuda needs a GPU; use --device cpu for a run of the script here")
        result = run_api(args) if args.command == "api" else run_overhead(args)
    except BenchError as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
