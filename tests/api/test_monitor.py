"""The monitor's client and live view against a fake daemon: a small FastAPI app answering with the
API's JSON shapes, served by a real uvicorn on loopback, so that HTTP, the token and the WebSocket
all go over a real socket."""

from __future__ import annotations

import _thread
import asyncio
import io
import json
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from fastapi import FastAPI, HTTPException, Request, WebSocket
from fastapi.responses import JSONResponse
from rich.console import Console

from api.advisor import Snapshot
from api.client import ApiClient, ApiError, DaemonUnreachable, IncompatibleDaemon, Unauthorized
from api.monitor import MonitorFeed, RunSummary, describe_status, render, run_monitor, sparkline
from api.schemas import LatestBody, OffloadSummary, StepSnapshot
from tests.support import serve_app as serve
from trainer.config.live import LiveSettings
from trainer.config.messages import (
    Group,
    OffloadPlacement,
    OffloadSummaryRow,
    Phase,
    PhasePlanRow,
    Progress,
    RankStatus,
    Restarts,
    Role,
    RunInfo,
    RunState,
    RunStatus,
    SettingsState,
    TelemetryHealth,
)

TOKEN = "test-token"
NOW = 1_700_000_000.0
GIB = 2**30


# ---------------------------------------------------------------------------------- the run's data


def gpu_data(utilization: float = 0.93, used: float = 120 * GIB) -> dict:
    return {"nvml": True,
            "gpus": [{"index": 0, "uuid": "GPU-0", "name": "NVIDIA H200", "utilization_ratio": utilization,
                      "memory_used_bytes": used, "memory_total_bytes": 141 * GIB, "power_watts": 301.0,
                      "temperature_celsius": 55, "pcie_tx_bytes_per_second": 1.2e9,
                      "pcie_rx_bytes_per_second": 3.4e9,
                      "processes": [{"pid": 2, "memory_bytes": used, "role": "trainer"}]}],
            "host": {"cpu_ratio": 0.5, "memory_used_bytes": 12 * GIB, "memory_total_bytes": 64 * GIB,
                     "daemon_rss_bytes": 80 * 2**20, "trainer_rss_bytes": 3.2 * GIB}}


def run_status(state: RunState = "running") -> RunStatus:
    settings = LiveSettings(gpu_memory_threshold=0.8, min_transformer_layers_on_gpu=4, dynamic_offload_enabled=True,
                            gpu_sample_interval_s=1.0, pcie_sample_interval_s=10.0, log_level="info")
    return RunStatus(
        run=RunInfo(name="quickstart", project="verl", run_dir="runs/quickstart",
                    config_path="runs/quickstart/config.yaml", daemon_pid=4242, trainer_pids=[4243], state=state,
                    started_at=NOW - 754, uptime_s=754.0, url="http://127.0.0.1:41234"),
        progress=Progress(step=45, total_steps=200, phase=Phase.UPDATE_ACTOR, phase_since=NOW - 3),
        restarts=Restarts(total=1, max=3, by_reason={"crash": 1, "oom": 0}),
        settings=SettingsState(values=settings, version=3, acknowledged_version=3, applied_at_step=12),
        telemetry=TelemetryHealth(nvml=True, dropped_messages=0),
        offload=OffloadPlacement(summary=[OffloadSummaryRow(role=Role.ACTOR, group=Group.TRANSFORMER, placement="cpu",
                                                            device="cpu", bytes=2 * GIB)]))


def latest_body(p99_s: float = 0.083) -> LatestBody:
    metrics = {"timing_s/step": 2.31, "timing_s/gen": 1.2, "timing_s/update_actor": 0.8, "timing_s/reward": 0.01,
               "perf/throughput": 1234.4, "critic/score/mean": 0.45, "actor/ppo_kl": 0.0045, "actor/pg_loss": -0.12}
    return LatestBody(seq=300, step=StepSnapshot(step=45, time=NOW - 1, metrics=metrics), gpu=gpu_data(),
                      offload=OffloadSummary(copy_latency_p50_s=0.0012, copy_latency_p99_s=p99_s,
                                             bandwidth_bytes_per_second=12.3e9, copies=1234))


def step_event(seq: int, step: int, time_s: float, score: float) -> dict:
    return {"seq": seq, "time": time_s, "kind": "step",
            "data": {"step": step, "metrics": {"critic/score/mean": score, "actor/ppo_kl": 0.001 * step,
                                               "actor/pg_loss": -0.01 * step}}}


def gpu_event(seq: int, time_s: float, utilization: float = 0.93) -> dict:
    return {"seq": seq, "time": time_s, "kind": "gpu", "data": gpu_data(utilization)}


def snapshot(**changes) -> Snapshot:
    """A run at step 45 of 200, one GPU busy at 93%, slow offload copies (p99 83 ms)."""
    history = ([gpu_event(seq, NOW - 60 + seq) for seq in range(1, 61)]
               + [step_event(100 + step, step, NOW - 90 + 2 * step, 0.01 * step) for step in range(1, 46)])
    return Snapshot(time=NOW, status=run_status(), latest=latest_body(), history=history) | changes


# ------------------------------------------------------------------------------------ a fake daemon


class FakeDaemon:
    """The daemon's API with canned answers; tests change `states`, `events`, `latest`, and read `requests`."""

    def __init__(self):
        self.states = ["running"]  # one per status request; the last one stays
        self.broken = False  # answer 500 to the status request
        self.missing: tuple[str, str] | None = None  # (section, field) left out of the status, as another version
        self.latest = latest_body()
        self.events: list[dict] = []
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.stream_headers: list[str | None] = []
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def check_token(request: Request, call_next):
            self.requests.append((request.url.path, dict(request.query_params)))
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401)
            return await call_next(request)

        @app.get("/v1/status")
        def status() -> dict:
            if self.broken:
                raise HTTPException(500, "boom")
            state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
            body = run_status(state).model_dump(mode="json", by_alias=True)
            if self.missing:
                section, field = self.missing
                del body[section][field]
            return body

        @app.get("/v1/metrics/latest")
        def latest() -> dict:
            return self.latest.model_dump(mode="json")

        @app.get("/v1/metrics/history")
        def history(since: int = 0):
            events = [event for event in self.events if event["seq"] > since]
            return {"events": events, "last_seq": max((event["seq"] for event in self.events), default=0)}

        @app.post("/v1/checkpoint")
        def checkpoint():
            return {"requested": True}

        @app.websocket("/v1/stream")
        async def stream(websocket: WebSocket, since: int = 0):
            self.stream_headers.append(websocket.headers.get("authorization"))
            if websocket.headers.get("authorization") != f"Bearer {TOKEN}":
                await websocket.close(code=1008)
                return
            await websocket.accept()
            for event in self.events:
                if event["seq"] > since:
                    await websocket.send_text(json.dumps(event))
            await websocket.close()

        return app


@pytest.fixture
def daemon() -> Iterator[tuple[FakeDaemon, str]]:
    fake = FakeDaemon()
    with serve(fake.app) as url:
        yield fake, url


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ------------------------------------------------------------------------------------------ client


def test_the_client_sends_the_token_and_passes_the_history_filters(daemon):
    fake, url = daemon
    with ApiClient(url, TOKEN) as client:
        assert client.status() == run_status()
        assert client.latest() == latest_body()
        assert client.history(since=7, keys=["actor/pg_loss", "perf/throughput"], kinds=["gpu", "step"]) == {
            "events": [], "last_seq": 0}
        assert client.checkpoint() == {"requested": True}
    assert fake.requests[-2] == ("/v1/metrics/history",
                                 {"since": "7", "keys": "actor/pg_loss,perf/throughput", "kinds": "gpu,step"})


def test_a_wrong_token_is_unauthorized_and_a_server_error_names_the_route(daemon):
    fake, url = daemon
    with ApiClient(url, "not-the-token") as client, pytest.raises(Unauthorized) as refused:
        client.status()
    assert refused.value.status == 401 and url in str(refused.value)
    fake.broken = True
    with ApiClient(url, TOKEN) as client, pytest.raises(ApiError, match="GET /v1/status failed with HTTP 500: boom"):
        client.status()


def test_a_status_this_client_cannot_read_is_one_line_naming_the_field(daemon):
    fake, url = daemon
    fake.missing = ("progress", "total_steps")
    with ApiClient(url, TOKEN) as client, pytest.raises(IncompatibleDaemon) as unreadable:
        client.status()
    assert isinstance(unreadable.value, ApiError)
    assert unreadable.value.lines() == [f"the daemon at {url} answered GET /v1/status with a body this verl cannot "
                                        "read: progress.total_steps: field required"]


def test_nothing_listening_is_daemon_unreachable():
    url = f"http://127.0.0.1:{free_port()}"
    with ApiClient(url, TOKEN, timeout=2) as client, pytest.raises(DaemonUnreachable, match="does not answer"):
        client.status()


def test_the_stream_replays_the_events_after_since_with_the_token_in_a_header(daemon):
    fake, url = daemon
    fake.events = [gpu_event(seq, NOW + seq) for seq in range(1, 6)]

    async def collect(token: str) -> list[dict]:
        return [event async for event in ApiClient(url, token).stream(since=2)]

    received = asyncio.run(collect(TOKEN))
    assert [event["seq"] for event in received] == [3, 4, 5]
    assert received[0]["kind"] == "gpu" and received[0]["data"]["gpus"][0]["uuid"] == "GPU-0"
    assert fake.stream_headers == [f"Bearer {TOKEN}"]
    with pytest.raises(Unauthorized):
        asyncio.run(collect("not-the-token"))


def test_the_stream_from_nowhere_is_daemon_unreachable():
    async def first():
        async for event in ApiClient(f"http://127.0.0.1:{free_port()}", TOKEN).stream():
            return event

    with pytest.raises(DaemonUnreachable):
        asyncio.run(first())


# -------------------------------------------------------------------------------------------- feed


def test_the_feed_fetches_the_history_once_then_only_what_is_new(daemon):
    fake, url = daemon
    clock = [NOW]
    fake.events = [gpu_event(1, NOW - 100), gpu_event(2, NOW - 30), step_event(3, 1, NOW - 20, 0.1),
                   step_event(4, 2, NOW - 10, 0.2)]
    with ApiClient(url, TOKEN) as client:
        feed = MonitorFeed(client, clock=lambda: clock[0])
        first = feed.poll()
        # A GPU sample older than the advisor's minute is dropped; the steps stay.
        assert [event["seq"] for event in first["history"]] == [2, 3, 4]
        assert first["status"] == run_status() and first["latest"] == fake.latest

        # The trainer crashed after step 2, resumed from its step-1 checkpoint and redid step 2.
        fake.events.append(step_event(5, 2, NOW + 5, 0.25))
        clock[0] = NOW + 5
        second = feed.poll()
    history_requests = [query for path, query in fake.requests if path == "/v1/metrics/history"]
    assert [query["since"] for query in history_requests] == ["0", "4"]
    assert history_requests[0]["kinds"] == "gpu,step"
    steps = [event for event in second["history"] if event["kind"] == "step"]
    assert [(event["data"]["step"], event["data"]["metrics"]["critic/score/mean"]) for event in steps] == [
        (1, 0.1), (2, 0.25)]


# -------------------------------------------------------------------------------------------- view


def rendered(snap: Snapshot, width: int = 100) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(render(snap))
    return console.export_text()


def test_the_view_shows_the_key_figures():
    text = rendered(snapshot())
    for figure in ["quickstart", "running", "45/200", "22%", "update_actor for 3 s", "restarts 1/3 (crash 1)",
                   "GPU 0", "93%", "120.0/141.0 GiB", "85%", "301 W", "55°C", "PCIe ↑1.2 ↓3.4 GB/s",
                   "CPU 50%", "RSS daemon 80 MiB, trainer 3.2 GiB",
                   "p50 1.2 ms", "p99 83.0 ms", "12.3 GB/s", "1,234 copies/min",
                   "2.31 s/step", "1,234 tokens/s", "gen 1.20 s",
                   "critic/score/mean", "actor/ppo_kl", "actor/pg_loss",
                   "v3 in effect from step 12", "dynamic_offload.gpu_memory_threshold=0.8",
                   "dynamic_offload.min_transformer_layers_on_gpu=4",
                   "dynamic_offload.enabled=true", "CPU/PCIe bandwidth bound", "pid 4242", "up 12:34"]:
        assert figure in text, f"{figure!r} missing from\n{text}"
    # The reward trend rises over the last steps: its sparkline ends higher than it starts.
    reward_line = next(line for line in text.splitlines() if "critic/score/mean" in line)
    spark = reward_line.split()[2]
    assert spark[0] == "▁" and spark[-1] == "█"


def test_the_view_fits_an_80_by_24_terminal():
    text = rendered(snapshot(), width=80)
    lines = text.splitlines()
    assert len(lines) <= 24, text
    assert all(len(line) <= 80 for line in lines)
    gpu_line = next(line for line in lines if "GPU 0" in line)
    assert "PCIe ↑1.2 ↓3.4 GB/s" in gpu_line, "a GPU's figures share one line"


def test_the_view_before_any_sample_says_what_is_missing():
    status = run_status("starting")
    status = status.model_copy(update={
        "progress": Progress(step=0, total_steps=200, phase=None, phase_since=None),
        "settings": status.settings.model_copy(update={"acknowledged_version": 2})})
    latest = LatestBody(seq=0, step=None, gpu={"nvml": False, "gpus": [], "host": gpu_data()["host"]},
                        offload=OffloadSummary(copy_latency_p50_s=None, copy_latency_p99_s=None,
                                               bandwidth_bytes_per_second=None, copies=0))
    text = rendered(snapshot(status=status, latest=latest, history=[]))
    for figure in ["starting", "0/200", "NVML unavailable", "waiting for the first step", "no copies",
                   "v3 pending: the trainer has v2", "hints    none", "CPU 50%"]:
        assert figure in text, f"{figure!r} missing from\n{text}"


def test_sparklines_scale_between_bounds_and_leave_gaps_blank():
    assert sparkline([0.0, 0.5, 1.0], low=0.0, high=1.0) == "▁▅█"
    assert sparkline([2.0, None, 4.0, float("nan")]) == "▁ █ "
    assert sparkline([3.0, 3.0]) == "▅▅"
    assert sparkline([None, None]) == "  "


# --------------------------------------------------------------------------------------- run_monitor


def test_once_json_prints_status_latest_and_hints(daemon):
    fake, url = daemon
    output = io.StringIO()
    with ApiClient(url, TOKEN) as client:
        assert run_monitor(client, once=True, as_json=True, console=Console(file=output)) == 0
    snapshot_printed = json.loads(output.getvalue())
    assert snapshot_printed.keys() == {"time", "status", "latest", "hints"}
    for name, path in [("status", "/v1/status"), ("latest", "/v1/metrics/latest")]:
        served = httpx.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"}, trust_env=False).json()
        assert snapshot_printed[name] == served, f"{path} as the daemon sent it"
    assert snapshot_printed["status"]["progress"]["step"] == 45
    assert snapshot_printed["latest"]["offload"]["copies"] == 1234
    assert len(snapshot_printed["hints"]) == 1 and "p99 83 ms" in snapshot_printed["hints"][0]


def test_once_prints_the_view(daemon):
    _, url = daemon
    console = Console(record=True, width=100, file=io.StringIO())
    with ApiClient(url, TOKEN) as client:
        assert run_monitor(client, once=True, as_json=False, console=console) == 0
    assert "45/200" in console.export_text()


def test_the_live_view_updates_until_the_run_finishes(daemon):
    fake, url = daemon
    fake.states = ["running", "running", "running", "finished"]
    output = io.StringIO()
    console = Console(file=output, force_terminal=True, width=100)
    with ApiClient(url, TOKEN) as client:
        assert run_monitor(client, once=False, as_json=False, refresh_s=0.02, console=console) == 0
    statuses = [path for path, _ in fake.requests if path == "/v1/status"]
    assert len(statuses) == 4
    text = output.getvalue()
    assert "45/200" in text and "finished" in text
    assert text.rstrip().endswith("the run has finished")


def test_the_live_view_written_to_a_file_ends_its_last_frame_before_the_farewell(daemon):
    fake, url = daemon
    fake.states = ["running", "finished"]
    output = io.StringIO()
    console = Console(file=output, force_terminal=False, width=100)
    with ApiClient(url, TOKEN) as client:
        assert run_monitor(client, once=False, as_json=False, refresh_s=0.02, console=console) == 0
    lines = output.getvalue().splitlines()
    assert lines[-1] == "the run has finished" and lines[-2].startswith("╰")


def test_the_live_view_ends_when_asked_or_when_the_daemon_goes_away():
    fake = FakeDaemon()
    stop = threading.Event()
    with serve(fake.app) as url, ApiClient(url, TOKEN) as client:
        console = Console(file=io.StringIO(), force_terminal=True, width=100)

        def polls() -> int:
            return len([path for path, _ in fake.requests if path == "/v1/status"])

        def stop_after_three_polls() -> None:  # not after a fixed time: a slow first frame made that flaky
            deadline = time.monotonic() + 4
            while polls() < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            stop.set()

        threading.Thread(target=stop_after_three_polls, daemon=True).start()
        started = time.monotonic()
        assert run_monitor(client, once=False, as_json=False, refresh_s=0.02, console=console, stop=stop) == 0
        assert time.monotonic() - started < 5
        assert "45/200" in console.file.getvalue()
        assert polls() >= 3, "it polled until stopped"

    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    result: list[int] = []
    with serve(FakeDaemon().app) as url:
        client = ApiClient(url, TOKEN, timeout=1)
        watcher = threading.Thread(target=lambda: result.append(
            run_monitor(client, once=False, as_json=False, refresh_s=0.05, console=console)))
        watcher.start()
        time.sleep(0.3)
    # The server is gone now: three missed polls later the view says so and returns.
    watcher.join(timeout=10)
    client.close()
    assert result == [0]
    assert "the daemon stopped answering" in console.file.getvalue()


def _interrupt_when(condition: Callable[[], bool], done: threading.Event) -> None:
    """Ctrl-C in the main thread as soon as `condition` holds (checked from a helper thread), and
    again every two seconds until `done`: the test cannot hang on an interrupt that went astray."""

    def watch():
        deadline = time.monotonic() + 30
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.005)
        while not done.is_set():
            _thread.interrupt_main()
            done.wait(2.0)

    threading.Thread(target=watch, daemon=True).start()


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt in the main thread, whatever an earlier test left installed."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("when", ["while the view polls", "during the first poll"])
def test_ctrl_c_closes_the_live_view_and_leaves_the_run_alone(daemon, ctrl_c_raises, when):
    fake, url = daemon
    done = threading.Event()
    if when == "during the first poll":
        _interrupt_when(lambda: len(fake.requests) >= 1, done)
    else:
        _interrupt_when(lambda: sum(path == "/v1/status" for path, _ in fake.requests) >= 3, done)
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    try:
        with ApiClient(url, TOKEN) as client:
            assert run_monitor(client, once=False, as_json=False, refresh_s=0.02, console=console) == 0
    finally:
        done.set()
    assert console.file.getvalue().rstrip().endswith("monitor closed; the run goes on")
    assert not any(path in ("/v1/stop", "/v1/checkpoint") for path, _ in fake.requests)


def test_the_status_lines_show_how_each_phase_places_the_dynamic_layers():
    status = run_status()
    assert not any(line.startswith("placement plan") for line in describe_status(status))  # none yet
    plans = [PhasePlanRow(phase="rollout/actor", layers_on_gpu={"actor": 36, "critic": 0}, working_bytes=3 << 29,
                          threshold=0.9),
             PhasePlanRow(phase="training/critic", layers_on_gpu={"actor": 0, "critic": 15}, working_bytes=None,
                          threshold=0.9)]
    status = status.model_copy(update={"offload": OffloadPlacement(summary=[], plans=plans)})
    assert describe_status(status)[-2:] == [
        "placement plan: rollout/actor: actor 36, critic 0 layers on the GPU (working memory 1.50 GiB, threshold 0.9)",
        "placement plan: training/critic: actor 0, critic 15 layers on the GPU (working memory not yet learned, "
        "threshold 0.9)"]


# --------------------------------------------------------------------------------- the final summary


def write_run_dir(run_dir, steps: int, *, checkpoint: int | None, partial_last_line: bool = False):
    run_dir.mkdir(parents=True)
    lines = [json.dumps({"step": step, "critic/score/mean": step / 10, "actor/pg_loss": 0.1})
             for step in range(1, steps + 1)]
    text = "\n".join(lines) + "\n" + ('{"step": 99, "critic/sco' if partial_last_line else "")
    (run_dir / "metrics.jsonl").write_text(text)
    if checkpoint is not None:
        (run_dir / "checkpoints" / f"global_step_{checkpoint}").mkdir(parents=True)
        (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(str(checkpoint))


def test_the_summary_of_a_finished_run_gives_steps_time_reward_and_checkpoints(tmp_path):
    write_run_dir(tmp_path / "run", 20, checkpoint=20, partial_last_line=True)
    summary = RunSummary.from_run_dir(tmp_path / "run", name="r", total_steps=20, elapsed_s=3725, failed=False)
    assert summary.lines() == ["run r finished at step 20/20 after 1:02:05",
                               "  last reward: 2 (critic/score/mean at step 20)",
                               f"  checkpoints: {tmp_path / 'run' / 'checkpoints'} (latest: global_step_20)"]
    console = Console(file=io.StringIO(), width=80, color_system=None)
    console.print(summary.render())
    panel = console.file.getvalue()
    assert "r · finished" in panel and "20/20 in 1:02:05" in panel and "global_step_20" in panel


def test_the_summary_of_a_stopped_or_failed_run_says_so_and_what_it_lacks(tmp_path):
    write_run_dir(tmp_path / "run", 7, checkpoint=None)
    stopped = RunSummary.from_run_dir(tmp_path / "run", name="r", total_steps=20, elapsed_s=5, failed=False)
    assert stopped.lines()[0] == "run r stopped at step 7/20 after 0:05"
    assert stopped.lines()[2] == f"  checkpoints: none saved in {tmp_path / 'run' / 'checkpoints'}"
    failed = RunSummary.from_run_dir(tmp_path / "nothing", name="r", total_steps=20, elapsed_s=5, failed=True)
    assert failed.lines()[:2] == ["run r failed at step 0/20 after 0:05", "  last reward: none reported"]
    # Without trainer.total_training_steps (the trainer derives it from total_epochs) no total to compare with.
    ended = RunSummary.from_run_dir(tmp_path / "run", name="r", total_steps=None, elapsed_s=5, failed=False)
    assert ended.lines()[0] == "run r ended at step 7 after 0:05"


def test_the_view_shows_a_row_per_rank_of_the_node():
    ranks = [RankStatus(rank=2, local_rank=0, pid=5001, connected=True, step=45, heard_s_ago=0.4,
                        gpu_memory_bytes=8 * GIB, copy_latency_mean_s=0.0021),
             RankStatus(rank=3, local_rank=1, pid=None, connected=False, step=44, heard_s_ago=30.0,
                        gpu_memory_bytes=None, copy_latency_mean_s=None)]
    base = run_status()
    status = base.model_copy(update={"ranks": ranks, "run": base.run.model_copy(
        update={"node_rank": 1, "nnodes": 2, "world_size": 4})})
    lines = rendered(snapshot(status=status)).splitlines()
    first = next(line for line in lines if "rank 2" in line)
    assert "GPU 0 · pid 5001 · step 45 · peak 8.0 GiB · copies 2.1 ms" in first
    assert "GPU 1 · not connected" in next(line for line in lines if "rank 3" in line)
    assert any("node 1 of 2" in line for line in lines)
    one_process = rendered(snapshot())
    assert "rank 0" not in one_process, "a run of one process shows no rank rows"


def test_node_0_shows_every_nodes_ranks():
    ranks = [RankStatus(rank=0, local_rank=0, node_rank=0, pid=5001, connected=True, step=45, heard_s_ago=0.4,
                        gpu_memory_bytes=8 * GIB, copy_latency_mean_s=None),
             RankStatus(rank=1, local_rank=0, node_rank=1, pid=None, connected=True, step=45, heard_s_ago=1.2,
                        gpu_memory_bytes=9 * GIB, copy_latency_mean_s=None, gpu_utilization_percent=73.0)]
    base = run_status()
    status = base.model_copy(update={"ranks": ranks, "run": base.run.model_copy(
        update={"node_rank": 0, "nnodes": 2, "world_size": 2})})
    lines = rendered(snapshot(status=status)).splitlines()
    assert "node 1 · GPU 0 · reported by rank 0 · step 45 · peak 9.0 GiB · GPU 73% busy" in next(
        line for line in lines if "rank 1" in line)
    assert "node 0 · GPU 0 · pid 5001" in next(line for line in lines if "rank 0" in line)
    assert describe_status(status)[-1] == ("ranks: node 0 of 2: 0 (GPU 0, pid 5001), 1 (node 1 GPU 0, as rank 0 "
                                           "reports it); 2 in the run")


def test_the_status_lines_list_the_nodes_ranks():
    ranks = [RankStatus(rank=0, local_rank=0, pid=5001, connected=True, step=45, heard_s_ago=0.4,
                        gpu_memory_bytes=None, copy_latency_mean_s=None),
             RankStatus(rank=1, local_rank=1, pid=None, connected=False, step=None, heard_s_ago=None,
                        gpu_memory_bytes=None, copy_latency_mean_s=None)]
    base = run_status()
    status = base.model_copy(update={"ranks": ranks, "run": base.run.model_copy(update={"world_size": 2})})
    assert describe_status(status)[-1] == "ranks: 0 (GPU 0, pid 5001), 1 (GPU 1, down); 2 in the run"
    assert not any(line.startswith("ranks:") for line in describe_status(base))
