"""The live terminal view of a run: `verl monitor --pid PID` and `verl train --monitor`.

`MonitorFeed` polls the daemon's REST API and keeps what the view and the advisor need beyond
the latest values: the GPU samples of the last minute and the metrics of the last steps (the
history is fetched once, then only what is new). `render(snapshot)` turns one snapshot into a
rich renderable that fits an 80x24 terminal for one GPU; `run_monitor` shows it once, as JSON,
or live until the run ends, the daemon goes away or the user presses Ctrl-C.

`RunSummary` is what a run that has ended leaves for its user: steps, time, the last reward and
where the checkpoints are, read from the run directory (`verl train` prints it at the end, as plain
lines or, with --monitor, as a panel under the live view's last frame).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from api.advisor import SUSTAINED_WINDOW_S, Snapshot, advise
from api.client import ApiClient, DaemonUnreachable
from api.schemas import OffloadSummary, StepSnapshot
from trainer.config.messages import PhasePlanRow, Progress, RankStatus, Restarts, RunStatus, SettingsState
from trainer.config.run_files import CHECKPOINTS_DIR, LATEST_CHECKPOINT_FILE, METRICS_FILE

# (label, verl metric key) of the trend lines, in the order shown.
TRENDS = (("reward", "critic/score/mean"), ("KL", "actor/ppo_kl"), ("loss", "actor/pg_loss"),
          ("value loss", "critic/vf_loss"))
# Step metrics the history request keeps (the latest step comes whole from /v1/metrics/latest).
TREND_KEYS = tuple(key for _, key in TRENDS)
MAX_STEPS = 60
SPARK_WIDTH = 24
GPU_SPARK_WIDTH = 8
ENDED_STATES = ("finished", "failed")
# Polls that may fail in a row (a daemon busy for a moment) before the view decides it is gone.
MAX_MISSED_POLLS = 3
REWARD_KEY = "critic/score/mean"
# metrics.jsonl grows by a line a step (~2 KB): the summary reads only its end.
METRICS_TAIL_BYTES = 256 * 1024
BLOCKS = "▁▂▃▄▅▆▇█"


class MonitorFeed:
    """Polls one daemon and keeps the recent history; each poll() returns a fresh snapshot."""

    def __init__(self, client: ApiClient, *, clock: Callable[[], float] = time.time,
                 window_s: float = SUSTAINED_WINDOW_S, max_steps: int = MAX_STEPS):
        self._client = client
        self._clock = clock
        self._window_s = window_s
        self._max_steps = max_steps
        self._last_seq = 0
        self._gpu_events: list[dict] = []
        self._step_events: list[dict] = []

    def poll(self) -> Snapshot:
        status = self._client.status()
        latest = self._client.latest()
        history = self._client.history(since=self._last_seq, keys=TREND_KEYS, kinds=("gpu", "step"))
        self._last_seq = history["last_seq"]
        for event in history["events"]:
            if event["kind"] == "gpu":
                self._gpu_events.append(event)
            elif event["kind"] == "step":
                self._add_step(event)
        now = self._clock()
        self._gpu_events = [event for event in self._gpu_events if event["time"] >= now - self._window_s]
        self._step_events = self._step_events[-self._max_steps:]
        events = sorted(self._gpu_events + self._step_events, key=lambda event: event["seq"])
        return Snapshot(time=now, status=status, latest=latest, history=events)

    def _add_step(self, event: dict) -> None:
        # After a crash the trainer redoes the steps after its checkpoint: the redone step replaces
        # the old one and everything after it, so the trends read as if the run had never stopped.
        step = event["data"]["step"]
        self._step_events = [kept for kept in self._step_events if kept["data"]["step"] < step]
        self._step_events.append(event)


def snapshot_json(snapshot: Snapshot) -> dict[str, Any]:
    """What `verl monitor --once --json` prints: status and latest values (as the API sends them) and hints."""
    return {"time": snapshot["time"], "status": snapshot["status"].model_dump(mode="json", by_alias=True),
            "latest": snapshot["latest"].model_dump(mode="json"), "hints": advise(snapshot)}


def run_monitor(client: ApiClient, *, once: bool, as_json: bool, refresh_s: float = 1.0,
                console: Console | None = None, stop: threading.Event | None = None,
                clock: Callable[[], float] = time.time) -> int:
    """Show the run once (as a view or as JSON) or live; `stop` ends a live view from another thread
    (as `verl train --monitor` does when the run ends) without a closing line. Errors of the first
    poll (ApiError) propagate for the caller to report; later a daemon that goes away ends the view."""
    console = console or Console()
    feed = MonitorFeed(client, clock=clock)
    if as_json or once:
        snapshot = feed.poll()
        if as_json:
            print(json.dumps(snapshot_json(snapshot)), file=console.file, flush=True)
        else:
            console.print(render(snapshot))
        return 0
    return _watch(feed, console, refresh_s, stop or threading.Event())


def _watch(feed: MonitorFeed, console: Console, refresh_s: float, stop: threading.Event) -> int:
    missed = 0
    farewell = ""  # stopped by the caller, who says what happened
    try:  # Ctrl-C may come during the first poll too
        snapshot = feed.poll()
        with Live(render(snapshot), console=console, auto_refresh=False) as live:
            while not stop.wait(refresh_s):
                try:
                    snapshot = feed.poll()
                    missed = 0
                    note = None
                except DaemonUnreachable as error:
                    missed += 1
                    note = f"{error}; retrying ({missed}/{MAX_MISSED_POLLS})"
                if missed >= MAX_MISSED_POLLS:
                    farewell = "the daemon stopped answering: the run has ended or was stopped"
                    break
                live.update(render(snapshot, note=note), refresh=True)
                state = snapshot["status"].run.state
                if state in ENDED_STATES:
                    farewell = f"the run has {state}"
                    break
    except KeyboardInterrupt:
        farewell = "monitor closed; the run goes on"
    if not console.is_terminal:
        console.line()  # written to a file, the last frame ends without its line end
    if farewell:
        console.print(farewell)
    return 0


# ------------------------------------------------------------------------------ the final summary


@dataclass(frozen=True)
class RunSummary:
    """How a run ended, for the lines `verl train` and `verl monitor` print at its end."""

    name: str
    outcome: str
    """finished, stopped (before its last step), ended (no total to tell the two apart) or failed."""
    step: int
    """The last step in metrics.jsonl (0: none)."""
    total_steps: int | None
    """trainer.total_training_steps (None: the trainer derives it from total_epochs)."""
    elapsed_s: float
    reward: float | None
    """critic/score/mean of that step."""
    checkpoints: Path
    latest_checkpoint: Path | None

    @classmethod
    def from_run_dir(cls, run_dir: Path, *, name: str, total_steps: int | None, elapsed_s: float,
                     failed: bool, checkpoints: Path | None = None) -> RunSummary:
        """`checkpoints`: the run's checkpoint folder when trainer.default_local_dir moves it out of `run_dir`."""
        last = last_step_metrics(Path(run_dir) / METRICS_FILE)
        step = int(last["step"]) if last else 0
        reward = last.get(REWARD_KEY) if last else None
        if failed:
            outcome = "failed"
        elif total_steps is None:
            outcome = "ended"
        else:
            outcome = "finished" if step >= total_steps else "stopped"
        checkpoints = Path(run_dir) / CHECKPOINTS_DIR if checkpoints is None else Path(checkpoints)
        return cls(name=name, outcome=outcome, step=step, total_steps=total_steps, elapsed_s=elapsed_s,
                   reward=reward if isinstance(reward, int | float) else None, checkpoints=checkpoints,
                   latest_checkpoint=latest_checkpoint(checkpoints))

    def lines(self) -> list[str]:
        """The plain output's lines."""
        return [f"run {self.name} {self.outcome} at step {self._steps()} after {_clock_time(self.elapsed_s)}",
                f"  last reward: {self._reward()}",
                f"  checkpoints: {self._checkpoints()}"]

    def render(self) -> RenderableType:
        """The summary as a panel, to sit under the live view's last frame."""
        rows = Table.grid(padding=(0, 1))
        rows.add_column(style="bold", no_wrap=True, min_width=8)
        rows.add_column()
        rows.add_row("steps", f"{self._steps()} in {_clock_time(self.elapsed_s)}")
        rows.add_row("reward", self._reward())
        rows.add_row("checkpoints", self._checkpoints())
        style = {"finished": "green", "failed": "red"}.get(self.outcome, "cyan")
        title = Text.assemble(("verl ", "bold"), (f"{self.name} · ", ""), (self.outcome, style))
        return Panel(rows, title=title, padding=(0, 1))

    def _steps(self) -> str:
        return f"{self.step}/{self.total_steps}" if self.total_steps else str(self.step)

    def _reward(self) -> str:
        if self.reward is None:
            return "none reported"
        return f"{_number(self.reward, '.4g')} ({REWARD_KEY} at step {self.step})"

    def _checkpoints(self) -> str:
        if self.latest_checkpoint is None:
            return f"none saved in {self.checkpoints}"
        return f"{self.checkpoints} (latest: {self.latest_checkpoint.name})"


def last_step_metrics(path: Path) -> dict[str, Any] | None:
    """The last whole line of metrics.jsonl (None without one); only the file's end is read."""
    try:
        with path.open("rb") as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - METRICS_TAIL_BYTES))
            tail = file.read()
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:  # a partial line: the start of the window, or a write cut short
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            return record
    return None


def latest_checkpoint(checkpoints: Path) -> Path | None:
    """The checkpoint latest_checkpointed_iteration.txt names, when it is there; None without one."""
    try:
        step = int((checkpoints / LATEST_CHECKPOINT_FILE).read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return None
    path = checkpoints / f"global_step_{step}"
    return path if path.is_dir() else None


# ------------------------------------------------------------------------------------- the view


def render(snapshot: Snapshot, *, note: str | None = None) -> RenderableType:
    """One screen: progress, GPUs, host, offload, step, trends, settings and hints."""
    status, latest = snapshot["status"], snapshot["latest"]
    rows = Table.grid(padding=(0, 1), expand=True)
    rows.add_column(style="bold", no_wrap=True, min_width=8)
    rows.add_column(ratio=1)
    if note:
        rows.add_row(Text("!", style="red"), Text(note, style="red"))
    rows.add_row("step", _progress(status.progress))
    rows.add_row("phase", _phase(status, snapshot["time"]))
    for label, line in _gpu_lines(latest.gpu, _events(snapshot, "gpu")):
        rows.add_row(label, line)
    if status.run.world_size > 1:
        for label, line in _rank_lines(status.ranks):
            rows.add_row(label, line)
    rows.add_row("host", _host(latest.gpu.get("host") if latest.gpu else None))
    rows.add_row("offload", _offload(latest.offload))
    rows.add_row("speed", _speed(latest.step))
    for label, line in _trends(_events(snapshot, "step")):
        rows.add_row(label, line)
    rows.add_row("settings", _settings(status.settings))
    hints = advise(snapshot)
    rows.add_row("hints", Group(*(Text(f"• {hint}", style="yellow") for hint in hints))
                 if hints else Text("none", style="dim"))
    run = status.run
    state_style = {"running": "green", "failed": "red", "restarting": "yellow"}.get(run.state, "cyan")
    title = Text.assemble(("verl ", "bold"), (f"{run.name} · ", ""), (run.state, state_style))
    subtitle = f"pid {run.daemon_pid} · up {_clock_time(run.uptime_s)} · {run.url}"
    if run.nnodes > 1:
        subtitle = f"node {run.node_rank} of {run.nnodes} · {subtitle}"
    return Panel(rows, title=title, subtitle=subtitle, padding=(0, 1))


def _progress(progress: Progress) -> RenderableType:
    step, total = progress.step, progress.total_steps
    if not total:
        return Text(f"{step}")
    line = Table.grid(padding=(0, 1), expand=True)
    line.add_column(no_wrap=True)
    line.add_column(ratio=1)
    line.add_column(no_wrap=True)
    line.add_row(f"{step}/{total}", ProgressBar(total=total, completed=step), f"{step / total:.0%}")
    return line


def _phase(status: RunStatus, now: float) -> Text:
    phase, since = status.progress.phase, status.progress.phase_since
    text = Text(phase or "-", style="cyan")
    if phase and since is not None:
        text.append(f" for {_seconds(max(0.0, now - since))}")
    restarts = status.restarts
    text.append(f" · restarts {restarts.total}/{restarts.max}", style="red" if restarts.total else "")
    reasons = _reasons(restarts)
    if reasons:
        text.append(f" ({reasons})")
    if restarts.last_failure:
        text.append(f" · last failure: {restarts.last_failure}", style="red")
    return text


def _rank_lines(ranks: Sequence[RankStatus]) -> list[tuple[str, Text]]:
    """One row per trainer rank of the run this daemon knows (its node's; node 0's: every node's): its node when
    there are several, its GPU, process, step, memory, copies and last word."""
    if not ranks:
        return [("ranks", Text("none connected yet", style="dim"))]
    several_nodes = len({rank.node_rank for rank in ranks}) > 1
    lines = []
    for rank in ranks:
        where = f"node {rank.node_rank} · GPU {rank.local_rank}" if several_nodes else f"GPU {rank.local_rank}"
        if not rank.connected:
            lines.append((f"rank {rank.rank}", Text(f"{where} · not connected", style="dim")))
            continue
        process = f"pid {rank.pid}" if rank.pid is not None else "reported by rank 0"
        text = Text(f"{where} · {process} · step {'-' if rank.step is None else rank.step}")
        text.append(f" · peak {_gib(rank.gpu_memory_bytes)} GiB" if rank.gpu_memory_bytes is not None else "")
        if rank.copy_latency_mean_s is not None:
            text.append(f" · copies {rank.copy_latency_mean_s * 1e3:.1f} ms")
        if rank.gpu_utilization_percent is not None:
            text.append(f" · GPU {rank.gpu_utilization_percent:.0f}% busy")
        if rank.heard_s_ago is not None:
            text.append(f" · heard {_seconds(rank.heard_s_ago)} ago", style="dim")
        lines.append((f"rank {rank.rank}", text))
    return lines


def _gpu_lines(sample: Mapping | None, history: Sequence[Mapping]) -> list[tuple[str, Text]]:
    if not sample:
        return [("GPU", Text("no sample yet", style="dim"))]
    if not sample.get("nvml"):
        return [("GPU", Text("NVML unavailable (no GPU or driver): GPU figures are off", style="dim"))]
    lines = []
    for gpu in sample.get("gpus", []):
        past = [next((other.get("utilization_ratio") for other in event["data"].get("gpus", [])
                      if other.get("index") == gpu["index"]), None) for event in history[-GPU_SPARK_WIDTH:]]
        utilization = gpu.get("utilization_ratio")
        text = Text(f"{_percent(utilization):>4} ", style=_load_style(utilization))
        text.append(sparkline(past, low=0.0, high=1.0), style="green")
        used, total = gpu.get("memory_used_bytes"), gpu.get("memory_total_bytes")
        text.append(f"  {_gib(used)}/{_gib(total)} GiB")
        if used is not None and total:
            text.append(f" {used / total:.0%}", style=_load_style(used / total))
        if gpu.get("power_watts") is not None:
            text.append(f"  {gpu['power_watts']:.0f} W")
        if gpu.get("temperature_celsius") is not None:
            text.append(f" {gpu['temperature_celsius']:.0f}°C")
        tx, rx = gpu.get("pcie_tx_bytes_per_second"), gpu.get("pcie_rx_bytes_per_second")
        if tx is not None or rx is not None:
            text.append(f"  PCIe ↑{_gigabytes(tx)} ↓{_gigabytes(rx)} GB/s")
        lines.append((f"GPU {gpu['index']}", text))
    return lines or [("GPU", Text("no GPU visible", style="dim"))]


def _host(host: Mapping | None) -> Text:
    if not host:
        return Text("no sample yet", style="dim")
    parts = [f"CPU {_percent(host.get('cpu_ratio'))}",
             f"RAM {_gib(host.get('memory_used_bytes'))}/{_gib(host.get('memory_total_bytes'))} GiB",
             f"RSS daemon {_size(host.get('daemon_rss_bytes'))}, trainer {_size(host.get('trainer_rss_bytes'))}"]
    return Text("  ".join(parts))


def _offload(offload: OffloadSummary) -> Text:
    if not offload.copies:
        return Text("no copies in the last minute", style="dim")
    p99 = offload.copy_latency_p99_s
    text = Text(f"p50 {_milliseconds(offload.copy_latency_p50_s)}  ")
    text.append(f"p99 {_milliseconds(p99)}", style="red" if p99 is not None and p99 > 0.050 else "")
    text.append(f"  {_rate(offload.bandwidth_bytes_per_second)}  {offload.copies:,} copies/min")
    return text


def _speed(step: StepSnapshot | None) -> Text:
    if step is None:
        return Text("waiting for the first step", style="dim")
    metrics = step.metrics
    parts = [f"{_number(metrics.get('timing_s/step'))} s/step",
             f"{_number(metrics.get('perf/throughput'), ',.0f')} tokens/s"]
    phases = sorted(((key.removeprefix("timing_s/"), value) for key, value in metrics.items()
                     if key.startswith("timing_s/") and key != "timing_s/step" and value is not None),
                    key=lambda item: -item[1])
    parts += [f"{name} {seconds:.2f} s" for name, seconds in phases[:2]]
    return Text("  ".join(parts))


def _trends(steps: Sequence[Mapping]) -> list[tuple[str, Text]]:
    steps = steps[-SPARK_WIDTH:]
    lines = []
    for label, key in TRENDS:
        values = [event["data"]["metrics"].get(key) for event in steps]
        present = [value for value in values if value is not None]
        if not present:
            continue
        text = Text(sparkline(values), style="magenta")
        text.append(f" {_number(present[-1], '.4g'):>9}  ")
        text.append(key, style="dim")
        lines.append((label, text))
    return lines


def _settings(settings: SettingsState) -> Text:
    acknowledgement = _acknowledgement(settings)
    text = Text(f"v{settings.version} {acknowledgement}",
                style="yellow" if acknowledgement.startswith("pending") else "green")
    for name, value in settings.values.public().items():
        text.append(f"  {name}={format_value(value)}")
    return text


def _events(snapshot: Snapshot, kind: str) -> list[Mapping]:
    return [event for event in snapshot["history"] if event["kind"] == kind]


def describe_status(status: RunStatus) -> list[str]:
    """GET /v1/status as a few plain lines (`verl status`): what runs, where, how far, with what settings."""
    run, progress = status.run, status.progress
    trainers = ", ".join(str(pid) for pid in run.trainer_pids) or "none"
    lines = [f"{run.name}: {run.state}, step {progress.step}/{progress.total_steps}"
             + (f" (phase {progress.phase})" if progress.phase else "")
             + f", up {_clock_time(run.uptime_s)}",
             f"daemon pid {run.daemon_pid}, trainer pid {trainers}; API {run.url}",
             f"run dir {run.run_dir}"]
    reasons = _reasons(status.restarts)
    lines.append(f"restarts {status.restarts.total} of at most {status.restarts.max}"
                 + (f" ({reasons})" if reasons else ""))
    if status.restarts.last_failure:
        lines.append(f"last failure: {status.restarts.last_failure}")
    settings = status.settings
    values = ", ".join(f"{name}={format_value(value)}" for name, value in settings.values.public().items())
    lines.append(f"settings v{settings.version} ({_acknowledgement(settings)}): {values}")
    telemetry = status.telemetry
    lines.append(f"telemetry: NVML {'available' if telemetry.nvml else 'unavailable'}, "
                 f"{telemetry.dropped_messages} messages dropped")
    lines += [f"placement plan: {describe_plan(plan)}" for plan in status.offload.plans]
    if run.world_size > 1:
        where = f"node {run.node_rank} of {run.nnodes}: " if run.nnodes > 1 else ""
        ranks = ", ".join(f"{rank.rank} ({_rank_place(rank, run.node_rank)}, {_rank_process(rank)})"
                          for rank in status.ranks) or "none connected yet"
        lines.append(f"ranks: {where}{ranks}; {run.world_size} in the run")
    return lines


def _rank_place(rank: RankStatus, node_rank: int) -> str:
    return f"GPU {rank.local_rank}" if rank.node_rank == node_rank else f"node {rank.node_rank} GPU {rank.local_rank}"


def _rank_process(rank: RankStatus) -> str:
    if not rank.connected:
        return "down"
    return f"pid {rank.pid}" if rank.pid is not None else "as rank 0 reports it"


def describe_plan(plan: PhasePlanRow) -> str:
    """One phase's plan of the dynamic layers: "rollout/actor: actor 36, critic 0 layers on the GPU (working
    memory 0.71 GiB, threshold 0.9)"."""
    layers = ", ".join(f"{role} {count}" for role, count in plan.layers_on_gpu.items())
    working = f"{plan.working_bytes / 2**30:.2f} GiB" if plan.working_bytes is not None else "not yet learned"
    return f"{plan.phase}: {layers} layers on the GPU (working memory {working}, threshold {plan.threshold:g})"


def _reasons(restarts: Restarts) -> str:
    """The restarts' causes that occurred, with their counts: "crash 1, oom 2"."""
    return ", ".join(f"{reason} {count}" for reason, count in restarts.by_reason.items() if count)


def _acknowledgement(settings: SettingsState) -> str:
    if settings.acknowledged_version >= settings.version:
        applied = settings.applied_at_step
        return "in effect" + (f" from step {applied}" if applied is not None else "")
    return f"pending: the trainer has v{settings.acknowledged_version}"


# ---------------------------------------------------------------------------------- formatting


def sparkline(values: Sequence[float | None], *, low: float | None = None, high: float | None = None) -> str:
    """One block character per value, scaled between low and high (the values' own range unless
    given); a missing value is a blank. Written here because rich has no sparkline."""
    present = [value for value in values if value is not None and math.isfinite(value)]
    if not present:
        return " " * len(values)
    low = min(present) if low is None else low
    high = max(present) if high is None else high
    characters = []
    for value in values:
        if value is None or not math.isfinite(value):
            characters.append(" ")
            continue
        level = 0.5 if high <= low else (min(max(value, low), high) - low) / (high - low)
        characters.append(BLOCKS[round(level * (len(BLOCKS) - 1))])
    return "".join(characters)


def _load_style(ratio: float | None) -> str:
    if ratio is None:
        return ""
    return "red" if ratio > 0.95 else "yellow" if ratio < 0.6 else "green"


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.0%}"


def _gib(size: float | None) -> str:
    return "-" if size is None else f"{size / 2**30:.1f}"


def _size(size: float | None) -> str:
    if size is None:
        return "-"
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"


def _rate(bytes_per_second: float | None) -> str:
    return "-" if bytes_per_second is None else f"{_gigabytes(bytes_per_second)} GB/s"


def _gigabytes(size: float | None) -> str:
    return "-" if size is None else f"{size / 1e9:.1f}"


def _milliseconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _number(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def _seconds(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else _clock_time(seconds)


def _clock_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_value(value: Any) -> str:
    """A setting's value as `verl set` takes it (YAML scalars: true/false, not Python's True/False)."""
    return json.dumps(value) if isinstance(value, bool) or value is None else str(value)
