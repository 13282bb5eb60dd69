"""The daemon: one asyncio process that supervises the trainer and serves its telemetry.

    run_daemon(config, config_path, monitor=False) -> exit code

Inside one event loop: the trainer child (daemon/supervisor.py), the IPC server the trainer
reports to (daemon/ipc.py), the HTTP API (api/app.py on uvicorn), and the live settings
(daemon/settings.py); the GPU sampler (daemon/gpu.py) runs on a thread and hands its samples
to the loop. Everything learned is published once to the hub (history + WebSocket fan-out)
and the Prometheus metrics. The runtime file (daemon/runtime.py) lets `verl monitor/set/
status/stop --pid` find the daemon; it is removed on exit.

The daemon owns its run directory through a lock (daemon/runtime.py: RunLock) that its trainer
inherits; a second daemon on the same run directory refuses to start. Live settings changed through
the API are kept in <run dir>/live_settings.json and re-applied when the run is resumed.

Several ranks (trainer.nnodes * trainer.n_gpus_per_node > 1): the supervised child is the launcher of this
node's ranks (trainer/distributed/launch.py), and every rank reports over IPC with its rank (daemon/ranks.py).
Rank 0's step metrics, phases and acknowledgements are the run's; down messages (settings, checkpoint now,
stop) go to rank 0 alone, which passes them to the other ranks at its safe point. One daemon per node; only
node 0's (which runs rank 0) takes run-wide requests: another node's answers them with a line naming node 0.

Exit codes: 0 the run finished or was stopped on request; 1 the trainer kept crashing and the
daemon gave up after daemon.max_restarts; 2 the trainer reported a config/data problem, or the
daemon could not start (port in use, run directory in use, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import psutil
import uvicorn
from prometheus_client import CollectorRegistry

from api.app import create_app
from api.client import page_url
from api.hub import TelemetryHub
from api.prometheus import GIB, MEMORY_KEY, TelemetryMetrics
from api.schemas import NotControlNodeError, SettingsBody, SettingsRejectedError
from daemon.failures import Failure, hang_place, last_error_line, read_tail
from daemon.gpu import GpuSampler
from daemon.ipc import MAX_SOCKET_PATH_BYTES, IpcServer, TrainerConnection
from daemon.ranks import RankTable
from daemon.runtime import (
    RunDirInUse,
    RunLock,
    RuntimeInfo,
    process_start_time,
    remove_runtime_file,
    remove_stale_sockets,
    runtime_dir,
    state_dir,
    write_runtime_file,
)
from daemon.settings import SettingsStore
from daemon.supervisor import STACK_DUMP_WAIT_S, RestartPolicy, Supervisor, describe_exit
from trainer.config import FSDP_CONFIG, KEYS, RunConfig
from trainer.config.exit_codes import EXIT_OUT_OF_MEMORY, EXIT_USAGE
from trainer.config.ipc import ENV_DAEMON_PID, ENV_SOCKET, ENV_TOKEN
from trainer.config.live import NAME_OF, SettingsRejected, canonical_change, initial_live_settings
from trainer.config.messages import (
    CheckpointMessage,
    CheckpointNowMessage,
    DownMessage,
    DroppedMessage,
    HeartbeatMessage,
    HelloMessage,
    LogMessage,
    OffloadMessage,
    OffloadPlacement,
    OffloadSummaryRow,
    PhaseMessage,
    PhasePlanRow,
    Progress,
    RanksMessage,
    Restarts,
    RunInfo,
    RunStatus,
    SettingsAckMessage,
    StepMessage,
    StopMessage,
    TelemetryHealth,
    UpMessage,
)

log = logging.getLogger("verl.daemon")

LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
RESTART_REASONS = ("crash", "signal", "oom", "hang")
LIVE_SETTINGS_FILE = "live_settings.json"
"""In the run directory: the live settings now and the config's values they were changed from."""
HANG_TIMEOUT_FLOOR_S = 600.0
HANG_TIMEOUT_STEPS = 5
"""Unless daemon.hang_timeout_s is set, a trainer hangs after this many median steps without a heartbeat (at least
HANG_TIMEOUT_FLOOR_S)."""
STEP_TIMES_KEPT = 101
# Messages only the trainer's main thread sends as it goes: each one shows it is not stuck.
SIGNS_OF_LIFE = (HeartbeatMessage, StepMessage, PhaseMessage, CheckpointMessage, SettingsAckMessage)


def default_trainer_command(config: RunConfig, config_path: Path) -> list[str]:
    """The daemon's child: the trainer itself for a run of one process, else the launcher of this node's ranks."""
    if config.trainer.nnodes * config.trainer.n_gpus_per_node > 1:
        return [sys.executable, "-m", "trainer.distributed.launch", "--config", str(config_path)]
    return [sys.executable, "-m", "trainer", "--config", str(config_path)]


def derived_hang_timeout(step_seconds: Sequence[float]) -> float:
    """daemon.hang_timeout_s's default: HANG_TIMEOUT_STEPS median steps, never under HANG_TIMEOUT_FLOOR_S."""
    if not step_seconds:
        return HANG_TIMEOUT_FLOOR_S
    return max(HANG_TIMEOUT_FLOOR_S, HANG_TIMEOUT_STEPS * statistics.median(step_seconds))


class DaemonStartError(Exception):
    """The daemon cannot start; the message names the setting to change."""


def run_daemon(config: RunConfig, config_path: Path, *, monitor: bool, run_lock: RunLock | None = None) -> int:
    """Supervise the trainer for `config` (already written to `config_path`) and serve telemetry until the run
    ends; `monitor` shows the live view in this terminal (the trainer's output then goes to logs/trainer.out).
    `run_lock`: the run directory's lock when the caller took it already (before it wrote the config there)."""
    with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
        # The process ends after the run's summary: a late repeat of the stop signal stays ignored until then.
        return runner.run(Daemon(config, Path(config_path), monitor=monitor, run_lock=run_lock,
                                 restore_signals=False).run())


def _event_loop_factory():
    """uvloop's event loop where it is installed (uvicorn[standard] brings it): it serves the API's
    requests and the stream's fan-out for less CPU, taken from the trainer on a small host. None: asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class _ApiServer(uvicorn.Server):
    """uvicorn without its signal handling: SIGTERM/SIGINT are the daemon's (stop the trainer first)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Daemon:
    """The daemon's state and wiring; also the API's RunControl (status, settings, checkpoint, stop).

    `trainer_command` replaces ``python -m trainer --config CONFIG`` (or the launcher of several ranks: see
    `default_trainer_command`; tests run a fake trainer), `nvml` the
    pynvml module (tests pass a fake), `state` the state directory, `run_lock` the run directory's lock when
    the caller holds it already (else `run` takes it). `restore_signals`: SIGTERM's and SIGINT's handlers as they
    were once `run` ends (a stop ignores late repeats of its signal while it tears down); False for the `verl`
    process, which ends after the run's summary and keeps ignoring them until then.
    """

    def __init__(self, config: RunConfig, config_path: Path, *, monitor: bool = False,
                 trainer_command: Sequence[str] | None = None, nvml: Any = None, state: Path | None = None,
                 out: TextIO | None = None, run_lock: RunLock | None = None, restore_signals: bool = True):
        self.config = config
        self.config_path = Path(config_path).resolve()
        self.monitor = monitor
        self.name = config.trainer.experiment_name
        self.run_dir = Path(config.trainer.run_dir).resolve()
        self.state = state or state_dir(config.daemon.state_dir)
        self.pid = os.getpid()
        self.token = secrets.token_urlsafe(32)
        self._ipc_token = secrets.token_urlsafe(32)  # kept apart: the API token never enters the trainer's env
        self._out = out or sys.stdout
        self.registry = CollectorRegistry()
        self.hub = TelemetryHub(history_seconds=config.telemetry.history_seconds)
        self.metrics = TelemetryMetrics(self.registry, run=self.name, project=config.trainer.project_name,
                                        config=str(self.config_path))
        self.settings_store = SettingsStore(initial_live_settings(config),
                                            audit_path=self.run_dir / "settings_audit.jsonl")
        self.supervisor = Supervisor(
            list(trainer_command or default_trainer_command(config, self.config_path)),
            policy=RestartPolicy(config.daemon.max_restarts, config.daemon.restart_backoff_s,
                                 config.daemon.restart_backoff_max_s),
            stop_timeout_s=config.daemon.stop_timeout_s,
            output=self.run_dir / "logs" / "trainer.out" if monitor else None,
            on_started=self._trainer_started, on_exited=self._trainer_exited, on_restart=self._trainer_restarting,
            on_state=self._state_changed, request_trainer_stop=lambda: self._send_down(StopMessage()),
            hang_timeout_s=self.hang_timeout_s, on_hang=self._trainer_hangs, on_stacks_due=self._stacks_due,
            explain_failure=lambda: self.last_failure)
        self.last_failure: Failure | None = None  # the latest failed trainer's step and cause (daemon/failures.py)
        self._log_start = 0  # where the current trainer's lines begin in logs/trainer.log
        self._hang_marker_end: int | None = None  # where a hung trainer's stacks begin in logs/trainer.log
        self.run_lock = run_lock
        # Rank 0 reports the other nodes' ranks at every step's end: silent past the hang timeout, they may be gone.
        self.ranks = RankTable(node_rank=config.trainer.node_rank, ranks_per_node=config.trainer.n_gpus_per_node,
                               world_size=config.trainer.nnodes * config.trainer.n_gpus_per_node,
                               stale_after_s=self.hang_timeout_s)
        self._step_seconds: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        self._first_signal_at: float | None = None
        self._restore_signals = restore_signals
        self._signals_before: dict[int, Any] = {}  # SIGTERM's and SIGINT's handlers before the daemon's own
        self._nvml = nvml
        self.sampler: GpuSampler | None = None
        self.ipc: IpcServer | None = None
        self.url = ""
        self.started_at = time.time()
        self.progress = Progress(step=0, total_steps=config.trainer.total_training_steps, phase=None,
                                 phase_since=None)
        self._phase_step: int | None = None  # the step the latest phase message is part of
        self.offload_summary: list[OffloadSummaryRow] = []
        self.offload_plans: list[PhasePlanRow] = []
        self.dropped_messages = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._api: _ApiServer | None = None
        self._api_task: asyncio.Task | None = None
        self._socket_dir: Path | None = None
        self._log_handlers: list[tuple[logging.Logger, logging.Handler]] = []
        self._monitor_thread: threading.Thread | None = None
        self._monitor_stop = threading.Event()

    # ------------------------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        self._loop = asyncio.get_running_loop()
        try:
            self._claim_run_dir()
        except RunDirInUse as error:
            print(f"ERROR: {error}", file=sys.stderr)
            return EXIT_USAGE
        except OSError as error:
            print(f"ERROR: the daemon cannot lock its run directory: {error}\nHINT: check that {self.run_dir} is "
                  "writable", file=sys.stderr)
            return EXIT_USAGE
        lock = self.run_lock
        assert lock is not None
        try:
            return await self._run_owned(lock)
        finally:
            lock.release()
            if self._restore_signals:  # a process that goes on (a test, a caller's own loop) gets them back
                for signum, handler in self._signals_before.items():
                    signal.signal(signum, handler)

    async def _run_owned(self, lock: RunLock) -> int:
        """run(), once the run directory is this daemon's."""
        self._setup_logging()
        if lock.previous_pid is not None:
            log.info("took over %s from pid %d, which is no longer running", lock.path, lock.previous_pid)
        try:
            try:
                self._restore_live_settings()
                await self._start()
            except DaemonStartError as error:
                print(f"ERROR: {error}", file=sys.stderr)
                return EXIT_USAGE
            except OSError as error:  # the state or run directory cannot be written, the socket not made
                print(f"ERROR: the daemon cannot start: {error}\nHINT: check that {KEYS.daemon.state_dir} (now "
                      f"{self.state}) and {self.run_dir} are writable", file=sys.stderr)
                return EXIT_USAGE
            code = await self.supervisor.run()
        finally:
            await self._shutdown()
            self._teardown_logging()
        return code

    def _claim_run_dir(self) -> None:
        """Own the run directory (RunDirInUse when another daemon does); the trainer inherits the lock."""
        if self.run_lock is None:
            self.run_lock = RunLock.acquire(self.run_dir, self.pid)
        self.supervisor.pass_fds = (self.run_lock.descriptor,)

    async def _start(self) -> None:
        remove_stale_sockets(self.state)
        self.ipc = IpcServer(self._socket_path(), self._ipc_token, on_hello=self._trainer_hello,
                             on_message=self._trainer_message, on_disconnect=self._trainer_disconnected,
                             on_invalid=self._invalid_message)
        await self.ipc.start()
        self.supervisor.env.update({ENV_SOCKET: str(self.ipc.path), ENV_TOKEN: self._ipc_token,
                                    ENV_DAEMON_PID: str(self.pid)})
        if self.monitor:
            self.supervisor.env["PYTHONUNBUFFERED"] = "1"  # trainer.out should follow the run, not lag a buffer
        await self._start_api()
        for name, value in self.settings_store.values.public().items():
            self.metrics.set_setting(name, value)
        path = self._write_runtime_file()
        print(f"verl daemon pid {self.pid}: run {self.name} in {self.run_dir}\n"
              f"  API:     {self.url}\n"
              f"  page:    {page_url(self.url, self.token)}\n"
              f"  monitor: {self.monitor_command()}\n"
              f"  token:   in {path} (mode 0600)", file=self._out, flush=True)
        live = self.settings_store.values
        self.sampler = GpuSampler(self._sampled, gpu_interval_s=live.gpu_sample_interval_s,
                                  pcie_interval_s=live.pcie_sample_interval_s,
                                  trainer_pids=self.trainer_pids, nvml=self._nvml, gpu_indices=self._local_gpus())
        self.metrics.set_nvml_up(self.sampler.nvml_up)
        self.sampler.start()
        for signum in (signal.SIGTERM, signal.SIGINT):
            handler = signal.getsignal(signum)
            if handler is not None:  # None: not set from Python, and so not restorable from it
                self._signals_before[signum] = handler
            self._loop.add_signal_handler(signum, self._on_signal, signum)
        if self.monitor:
            self._start_monitor()

    def monitor_command(self) -> str:
        """The `verl monitor` command that finds this run; it names the state dir when `verl` would not look
        there by default (daemon.state_dir set, and not to what $VERL_STATE_DIR says)."""
        command = f"verl monitor --pid {self.pid}"
        if self.state.resolve() != state_dir().resolve():
            command += f" --state-dir {shlex.quote(str(self.state.resolve()))}"
        return command

    async def _shutdown(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._loop.remove_signal_handler(signum)
            if self._first_signal_at is not None:
                # Stopping on a signal: a late repeat of it (`timeout` signalling the group, then the pid; a second
                # Ctrl-C) is the same stop, and must not kill the daemon before its teardown and the run's summary.
                signal.signal(signum, signal.SIG_IGN)
        if self._monitor_thread is not None:
            self._monitor_stop.set()
            await asyncio.to_thread(self._monitor_thread.join, 5.0)
        if self.sampler is not None:
            await asyncio.to_thread(self.sampler.stop)
        self._publish_status()
        if self._api is not None:
            self._api.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._api_task, 5.0)
        if self.ipc is not None:
            await self.ipc.close()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        remove_runtime_file(self.state, self.pid)
        if self.monitor:
            self._report_outcome()

    def _on_signal(self, signum: int) -> None:
        """The first SIGTERM/SIGINT stops the run; one within daemon.force_stop_grace_s of it is the same stop (a
        process-group signal, a double Ctrl-C); a later one kills the trainer without a checkpoint."""
        name, grace = signal.Signals(signum).name, self.config.daemon.force_stop_grace_s
        now = time.monotonic()
        if self._first_signal_at is None:
            self._first_signal_at = now
            log.info("received %s: stopping the run (signal again %g s or more after this to kill the trainer "
                     f"without a checkpoint, {KEYS.daemon.force_stop_grace_s})", name, grace)
            self.supervisor.request_stop()
        elif now - self._first_signal_at >= grace:
            log.warning("received %s again, %.0f s after the first: killing the trainer without a checkpoint",
                        name, now - self._first_signal_at)
            self.supervisor.request_stop(force=True)
        else:
            log.info(f"received %s again within {KEYS.daemon.force_stop_grace_s}=%g s of the first: the same stop, the "
                     "trainer still checkpoints", name, grace)

    # -------------------------------------------------------------------------------------- the API

    async def _start_api(self) -> None:
        telemetry = self.config.telemetry
        listener = _listen(telemetry.host, telemetry.port)
        port = listener.getsockname()[1]
        host = "127.0.0.1" if telemetry.host in ("0.0.0.0", "") else ("::1" if telemetry.host == "::"
                                                                       else telemetry.host)
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        app = create_app(hub=self.hub, registry=self.registry, control=self, token=self.token,
                         public_metrics=telemetry.public_metrics, bind_host=telemetry.host,
                         allowed_origins=telemetry.allowed_origins, exposition=self.metrics.exposition)
        # No per-message compression on the stream: it compressed every event once per client (the
        # daemon's largest cost with 50 followers), for events of a few hundred bytes. No proxy
        # headers: nothing stands between the API and its clients but loopback or the user's network.
        self._api = _ApiServer(uvicorn.Config(app, log_level="warning", lifespan="off", log_config=None,
                                              access_log=False, timeout_graceful_shutdown=2,
                                              ws_per_message_deflate=False, proxy_headers=False))
        self._api_task = asyncio.create_task(self._api.serve(sockets=[listener]))
        while not self._api.started:
            if self._api_task.done():
                raise DaemonStartError(f"the API server on {self.url} did not start: {self._api_task.exception()}")
            await asyncio.sleep(0.01)

    # --------------------------------------------------------------------- RunControl (the API's calls)

    def status(self) -> RunStatus:
        supervisor = self.supervisor
        return RunStatus(
            run=RunInfo(name=self.name, project=self.config.trainer.project_name, run_dir=str(self.run_dir),
                        config_path=str(self.config_path), daemon_pid=self.pid, trainer_pids=self.trainer_pids(),
                        state=supervisor.state, started_at=self.started_at, uptime_s=time.time() - self.started_at,
                        url=self.url, node_rank=self.config.trainer.node_rank, nnodes=self.config.trainer.nnodes,
                        world_size=self.world_size),
            progress=self.progress,
            restarts=Restarts(total=supervisor.restarts, max=self.config.daemon.max_restarts,
                              by_reason={reason: supervisor.restarts_by_reason[reason] for reason in
                                         sorted({*RESTART_REASONS, *supervisor.restarts_by_reason})},
                              last_failure=self.last_failure.shown if self.last_failure is not None else None),
            settings=self.settings_store.state(),
            telemetry=TelemetryHealth(nvml=self.sampler is not None and self.sampler.nvml_up,
                                      dropped_messages=self.dropped_messages),
            offload=OffloadPlacement(summary=self.offload_summary, plans=self.offload_plans),
            ranks=self.ranks.statuses(),
        )

    def settings(self) -> SettingsBody:
        return self.settings_store.describe()

    def _require_control(self, what: str) -> None:
        """Run-wide requests belong to node 0's daemon (it runs rank 0): NotControlNodeError elsewhere."""
        trainer = self.config.trainer
        if trainer.node_rank == 0:
            return
        host = trainer.rdzv_endpoint.rpartition(":")[0] if trainer.rdzv_endpoint else "node 0"
        log.warning("refused %s: node %d does not hold the run's control", what, trainer.node_rank)
        raise NotControlNodeError(f"this daemon serves node {trainer.node_rank} of {trainer.nnodes}; {what} is "
                                  f"run-wide and only node 0's daemon takes it: run the same command on node 0 "
                                  f"({host}), against its daemon's pid; nothing was changed")

    def update_settings(self, change: dict, *, source: str = "api") -> dict[str, Any]:
        self._require_control("a live settings change")
        try:
            update = self.settings_store.update(change, source=source)
        except SettingsRejected as rejected:
            for problem in rejected.problems:
                self.metrics.count_setting_update(problem.setting, "rejected")
            log.warning("settings change rejected: %s", rejected)
            raise SettingsRejectedError(rejected.problems) from None
        if not update.changed:  # every value already in effect: no version, nothing for the trainer
            return {"version": update.version, "old": {}, "new": {}, "values": update.values,
                    "applies_at_step": None, "status": "unchanged"}
        for name, value in update.new.items():
            self.metrics.set_setting(name, value)
            self.metrics.count_setting_update(name, "accepted")
        log.info("settings version %d: %s", update.version,
                 ", ".join(f"{name} {update.old[name]!r} -> {value!r}" for name, value in update.new.items()))
        self._apply_in_daemon(update.new)
        self._keep_live_settings()
        self._send_down(self.settings_store.down_message())
        self.hub.publish("settings", self.settings_store.state())
        return {"version": update.version, "old": update.old, "new": update.new, "values": update.values,
                "applies_at_step": self._next_safe_step(), "status": "pending"}

    def _keep_live_settings(self) -> None:
        """Write the live settings into the run directory, beside the config's values they differ from, so that
        a stop and resume starts from them (`_restore_live_settings`)."""
        path = self.run_dir / LIVE_SETTINGS_FILE
        kept = {"values": self.settings_store.values.public(), "config": initial_live_settings(self.config).public()}
        temporary = path.with_name(f".{path.name}.tmp-{self.pid}")
        try:
            temporary.write_text(json.dumps(kept, indent=2) + "\n", encoding="utf-8")
            os.replace(temporary, path)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            log.warning("could not keep the live settings in %s (%s): they hold for this run, but a stop and resume "
                        "would start from the config's values", path, error.strerror or error)

    def _restore_live_settings(self) -> None:
        """Re-apply the live settings a previous daemon of this run kept, where the config still sets what they
        were changed from (a value the config changes since wins)."""
        path = self.run_dir / LIVE_SETTINGS_FILE
        if self.config.trainer.resume_mode == "disable" or self.config.trainer.node_rank != 0:
            return
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
            # Under canonical names: a file written before the settings were named by their config keys holds
            # the short ones.
            values, configured = canonical_change(dict(kept["values"])), canonical_change(dict(kept["config"]))
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("ignored the kept live settings in %s: %s", path, error)
            return
        now = self.settings_store.values.public()
        live = {name: value for name, value in values.items()
                if name in now and name in configured and value != configured[name]}
        for name in [name for name in live if configured[name] != now[name]]:
            log.info("live setting %s was %r before the stop, but the config changed it from %r to %r since: "
                     "the config's value holds", name, live.pop(name), configured[name], now[name])
        if not live:
            return
        try:
            self.update_settings(live, source="resume")
        except Exception as error:  # a value no longer allowed, an audit log that cannot be written: the run
            # then starts from the config's values rather than not at all
            log.warning("could not re-apply the live settings kept in %s: %s", path, error)
            return
        log.info("re-applied the live settings of this run from before its stop (%s): %s", path,
                 ", ".join(f"{name}={value!r}" for name, value in live.items()))

    def request_checkpoint(self) -> dict[str, Any]:
        self._require_control("checkpoint now")
        reached = self._send_down(CheckpointNowMessage())
        log.info("checkpoint requested%s", "" if reached else " but no trainer is connected")
        return {"status": "requested" if reached else "no_trainer",
                "detail": "the trainer saves a checkpoint at its next safe point" if reached
                else "no trainer is connected right now; ask again once it runs"}

    def request_stop(self, force: bool = False) -> dict[str, Any]:
        """Idempotent: a second request is the same stop. `force` kills the trainer without a checkpoint."""
        self._require_control("a stop")
        first = self.supervisor.request_stop(force=force)
        if force:
            return {"status": "killing", "detail": "the trainer is killed without a checkpoint; then the daemon "
                                                   "exits 0"}
        return {"status": "stopping", "detail": ("the trainer checkpoints at its next safe point and exits; then "
                                                 "the daemon exits 0") if first else
                ("already stopping: the trainer checkpoints at its next safe point and exits; `verl stop --force` "
                 "kills it without a checkpoint")}

    # ------------------------------------------------------------------------------- trainer events

    def _trainer_hello(self, connection: TrainerConnection) -> None:
        hello = connection.hello
        if not self.ranks.admits(connection.rank):
            last = self.ranks.first_rank + self.ranks.ranks_per_node - 1
            log.warning(f"refused trainer pid %s: it says it is rank %d, but this node ({KEYS.trainer.node_rank}=%d) "
                        "runs ranks %d to %d", connection.pid, connection.rank, self.config.trainer.node_rank,
                        self.ranks.first_rank, last)
            connection.close()
            return
        log.info("trainer pid %s connected (rank %d, step %s of %s)", connection.pid, connection.rank,
                 hello.start_step, hello.total_steps)
        self.ranks.connected(connection.rank, local_rank=hello.local_rank, pid=connection.pid, step=hello.start_step)
        self.metrics.set_rank_up(str(connection.rank), True)
        if connection.rank == 0:
            self.progress = self.progress.model_copy(update={"step": hello.start_step,
                                                             "total_steps": hello.total_steps})
            self.metrics.set_total_steps(hello.total_steps)
            # The current values, every time: a change made before a restart holds in the new trainer. Rank 0
            # alone: it passes them on to the other ranks, which all apply them at the same step.
            connection.send(self.settings_store.down_message())
        self.supervisor.trainer_connected(connection.rank)
        self._trainers_changed()

    def _trainer_message(self, connection: TrainerConnection, message: UpMessage) -> None:
        """One decoded message (daemon/ipc.py refused the malformed ones and never passes a hello here)."""
        if not self.ranks.admits(connection.rank):
            return
        if isinstance(message, SIGNS_OF_LIFE):
            self.supervisor.beat(connection.rank)
            self.ranks.heard(connection.rank)
        match message:
            case StepMessage():
                self._on_step(connection, message)
            case PhaseMessage():
                self._on_phase(connection, message)
            case OffloadMessage():
                self._on_offload(connection, message)
            case LogMessage():
                # With the time the trainer wrote the line: its lines wait for the connection (those of its
                # start) or in its queue, so they can arrive after daemon lines written later.
                text = message.message if connection.rank == 0 else f"[rank {connection.rank}] {message.message}"
                self.hub.publish("log", {"level": message.level, "message": text, "source": "trainer",
                                         "time": message.time})
            case SettingsAckMessage():
                self._on_settings_ack(connection, message)
            case CheckpointMessage():
                pass  # a sign of life; the trainer's own "checkpoint saved" log line tells the stream
            case DroppedMessage():
                self.dropped_messages += message.count
                self.metrics.count_dropped("trainer", message.count)
            case HeartbeatMessage():
                pass  # a sign of life, counted above
            case RanksMessage():
                if connection.rank == 0:  # rank 0 gathers them (several nodes): the other nodes' ranks
                    self._on_ranks(message)
            case HelloMessage():
                pass  # only ever the first line, which the IPC server reads itself

    def _on_step(self, connection: TrainerConnection, message: StepMessage) -> None:
        """Rank 0's metrics are the run's; another rank's are its own figures (its memory, its step)."""
        self.ranks.observe_step(connection.rank, message)
        self.metrics.observe_rank_step(str(connection.rank), message.metrics)
        if connection.rank != 0:
            return
        self.progress = self.progress.model_copy(update={"step": message.step})
        step_seconds = message.metrics.get("timing_s/step")
        if step_seconds is not None and step_seconds > 0:
            self._step_seconds.append(step_seconds)
        self.hub.publish("step", message)
        self.metrics.observe_step(message.step, message.metrics)

    def _on_ranks(self, message: RanksMessage) -> None:
        """The other nodes' ranks, as rank 0 gathered them: in /v1/status (and so the monitor and the advisor) and
        their peak memory in /metrics under their rank, as this node's ranks' own."""
        self.ranks.observe_remote(message)
        for report in message.ranks:
            if not self.ranks.admits(report.rank) and report.rank < self.ranks.world_size \
                    and report.gpu_memory_bytes is not None:
                self.metrics.observe_rank_step(str(report.rank), {MEMORY_KEY: report.gpu_memory_bytes / GIB})

    def _on_phase(self, connection: TrainerConnection, message: PhaseMessage) -> None:
        if connection.rank != 0:  # every rank runs the same phases: rank 0's stand for the run
            return
        self.progress = self.progress.model_copy(update={"phase": message.phase, "phase_since": time.time()})
        self._phase_step = message.step
        self.hub.publish("phase", message)
        self.metrics.observe_phase(message.phase)

    def _on_offload(self, connection: TrainerConnection, message: OffloadMessage) -> None:
        """Every rank's copies count under its rank; rank 0's placement and plans are the ones shown."""
        self.ranks.observe_offload(connection.rank, message)
        self.metrics.observe_offload(message, rank=str(connection.rank))
        if connection.rank != 0:
            return
        if message.summary is not None:
            self.offload_summary = message.summary
        if message.plans is not None:
            self.offload_plans = message.plans
        self.hub.publish("offload", message)

    def _on_settings_ack(self, connection: TrainerConnection, message: SettingsAckMessage) -> None:
        if connection.rank != 0:  # rank 0 acknowledges once every rank applied the version
            log.debug("ignored a settings acknowledgement of rank %d: rank 0's stands for the run", connection.rank)
            return
        change = self.settings_store.acknowledge(message.version, message.step)
        if change is not None:
            for name in change.new:
                self.metrics.count_setting_update(name, "applied")
        log.info("trainer pid %s runs settings version %s from step %s", connection.pid, message.version,
                 message.step)
        self.hub.publish("settings", self.settings_store.state())

    def _invalid_message(self, connection: TrainerConnection, problem: str) -> None:
        self.dropped_messages += 1
        self.metrics.count_dropped("ipc", 1)
        log.warning("ignored a message from trainer pid %s: %s", connection.pid, problem)

    def _trainer_disconnected(self, connection: TrainerConnection) -> None:
        if not self.ranks.admits(connection.rank):
            return
        log.info("trainer pid %s disconnected", connection.pid)
        self.supervisor.trainer_disconnected(connection.rank)
        self.ranks.disconnected(connection.rank)
        self.metrics.set_rank_up(str(connection.rank), False)
        if connection.rank == 0:
            self.progress = self.progress.model_copy(update={"phase": None, "phase_since": None})
            self._phase_step = None
        self._trainers_changed()

    # --------------------------------------------------------------------------- supervisor events

    def _trainer_started(self, pid: int) -> None:
        self._log_start, self._hang_marker_end = self._trainer_log_size(), None
        log.info("%s started: pid %d", "trainer" if self.world_size == 1 else "launcher of this node's ranks", pid)
        self._trainers_changed()

    def _trainers_changed(self) -> None:
        """A trainer process started or a rank (dis)connected: the runtime file and the lock list them all."""
        self._write_runtime_file()
        if self.run_lock is not None:
            self.run_lock.record_trainers(self.trainer_pids())
        self._publish_status()

    @property
    def world_size(self) -> int:
        return self.config.trainer.nnodes * self.config.trainer.n_gpus_per_node

    def trainer_pids(self) -> list[int]:
        """The supervised process and every connected rank (a rank's pid finds this daemon: `verl monitor`)."""
        return list(dict.fromkeys([*self.supervisor.pids, *self.ranks.pids()]))

    def _trainer_exited(self, pid: int, returncode: int) -> None:
        self.last_failure = None if returncode == 0 or self.supervisor.stopping else self._failure(returncode)
        cause = self.last_failure.cause if self.last_failure is not None else None
        (log.error if cause else log.info)("trainer pid %d exited with code %d%s", pid, returncode,
                                           f": {cause}" if cause else "")
        self._write_runtime_file()

    def _trainer_log(self) -> Path:
        return self.run_dir / "logs" / "trainer.log"

    def _trainer_log_size(self) -> int:
        try:
            return self._trainer_log().stat().st_size
        except OSError:
            return 0

    def _failure(self, returncode: int) -> Failure:
        """The failed trainer's step and cause: where it hung, what killed it, or the final line of its last
        traceback (or ERROR line) in logs/trainer.log (and logs/trainer.out under --monitor)."""
        step = self.progress.step
        if self.supervisor.hung:
            place = hang_place(read_tail(self._trainer_log(), self._hang_marker_end or self._log_start))
            return Failure(step, f"hung in {place}" if place else None,
                           shown="hung; it wrote no stacks (see logs/trainer.log)" if place is None else None)
        if returncode < 0:
            return Failure(step, None, shown=describe_exit(returncode))
        output = self.supervisor.output
        text = read_tail(self._trainer_log(), self._log_start)
        cause = last_error_line(text) or (last_error_line(read_tail(output, self.supervisor.output_start))
                                          if output is not None else None)
        return Failure(step, cause)

    def _stacks_due(self, pid: int) -> None:
        """After a hung trainer had its time to write its stacks: a plain line when none came (a stopped process
        runs no signal handler, so it cannot write them)."""
        if self._hang_marker_end is None or self._trainer_log_size() > self._hang_marker_end:
            return
        try:
            state = psutil.Process(pid).status()
        except psutil.Error:
            state = "gone"
        why = ("it is stopped (SIGSTOP or SIGTSTP): a stopped process runs no signal handler, so it cannot write them"
               if state == psutil.STATUS_STOPPED else f"it did not answer the signal (process state: {state})")
        with contextlib.suppress(OSError), self._trainer_log().open("a", encoding="utf-8") as file:
            file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR the verl daemon got no Python stacks from trainer "
                       f"pid {pid} within {STACK_DUMP_WAIT_S:.0f} s: {why}; it is killed now\n")

    def hang_timeout_s(self) -> float:
        """daemon.hang_timeout_s, else derived from the median step time so far (derived_hang_timeout)."""
        configured = self.config.daemon.hang_timeout_s
        return configured if configured is not None else derived_hang_timeout(self._step_seconds)

    def _trainer_hangs(self, pid: int, silent_s: float) -> None:
        """Mark the stacks the hung trainer is about to write into its log."""
        log_path = self.run_dir / "logs" / "trainer.log"
        with contextlib.suppress(OSError), log_path.open("a", encoding="utf-8") as file:
            file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR the verl daemon heard nothing from trainer pid "
                       f"{pid} for {silent_s:.0f} s ({KEYS.daemon.hang_timeout_s} {self.hang_timeout_s():.0f} s): its "
                       "Python stacks follow; it is then killed and restarted from its latest checkpoint\n")
        self._hang_marker_end = self._trainer_log_size()

    def _trainer_restarting(self, event: dict[str, Any]) -> None:
        self.metrics.count_restart(event["reason"])
        self.hub.publish("restart", event)

    def _state_changed(self, state: str) -> None:
        self._publish_status()

    # ---------------------------------------------------------------------------------------- helpers

    def _sampled(self, data: dict[str, Any]) -> None:
        """From the sampler thread: hand the sample to the loop."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: the daemon is exiting
            self._loop.call_soon_threadsafe(self._publish_gpu, data)

    def _publish_gpu(self, data: dict[str, Any]) -> None:
        self.hub.publish("gpu", data)
        self.metrics.observe_gpu(data)

    def _publish_status(self) -> None:
        self.hub.publish("status", self.status())

    def _send_down(self, message: DownMessage) -> bool:
        """Send to the rank-0 trainer, which passes it on to the other ranks; safe from any thread. Whether rank 0
        was connected."""
        if self.ipc is None:
            return False
        reached = any(connection.rank == 0 for connection in self.ipc.connections)
        if _on_loop(self._loop):
            self.ipc.send(message, rank=0)
        else:
            self._loop.call_soon_threadsafe(functools.partial(self.ipc.send, message, rank=0))
        return reached

    def _local_gpus(self) -> list[int] | None:
        """The NVML indices of the GPUs this node's ranks compute on (None: every GPU, as for one process)."""
        trainer = self.config.trainer
        if self.world_size == 1 or trainer.device == "cpu":
            return None
        return local_gpu_indices(trainer.n_gpus_per_node, os.environ.get("CUDA_VISIBLE_DEVICES"))

    def _apply_in_daemon(self, changed: dict[str, Any]) -> None:
        """The settings the daemon acts on itself, at once."""
        gpu, pcie, level = NAME_OF["gpu_sample_interval_s"], NAME_OF["pcie_sample_interval_s"], NAME_OF["log_level"]
        if self.sampler is not None and ({gpu, pcie} & changed.keys()):
            self.sampler.set_intervals(gpu_interval_s=changed.get(gpu), pcie_interval_s=changed.get(pcie))
        if level in changed:
            log.setLevel(LOG_LEVELS[changed[level]])

    def _next_safe_step(self) -> int:
        """The first step a change can run in: the next one, or the one after when a step is under way."""
        progress = self.progress
        in_step = progress.phase is not None and self._phase_step == progress.step + 1
        return progress.step + (2 if in_step else 1)

    def _socket_path(self) -> Path:
        path = runtime_dir(self.state) / f"{self.pid}.sock"
        if len(os.fsencode(path)) <= MAX_SOCKET_PATH_BYTES:
            return path
        # A deep state dir would overflow sun_path: use a private temporary folder instead.
        self._socket_dir = Path(tempfile.mkdtemp(prefix="verl-"))
        return self._socket_dir / "ipc.sock"

    def _write_runtime_file(self) -> Path:
        info = RuntimeInfo(pid=self.pid, url=self.url, token=self.token, run_dir=str(self.run_dir),
                           config_path=str(self.config_path), name=self.name,
                           started_at=process_start_time(self.pid) or self.started_at,
                           trainer_pids=self.trainer_pids())
        return write_runtime_file(self.state, info)

    def _setup_logging(self) -> None:
        log_path = self.run_dir / "logs" / "daemon.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        to_file = logging.FileHandler(log_path, encoding="utf-8")
        to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers = [(log, to_file), (logging.getLogger("uvicorn"), to_file), (log, _HubLogHandler(self.hub))]
        if not self.monitor:  # the live view owns the terminal when there is one
            to_terminal = logging.StreamHandler(sys.stderr)
            to_terminal.setFormatter(logging.Formatter("verl daemon: %(message)s"))
            handlers.append((log, to_terminal))
        for logger, handler in handlers:
            logger.addHandler(handler)
            self._log_handlers.append((logger, handler))
        log.setLevel(LOG_LEVELS[self.settings_store.values.log_level])
        log.propagate = False

    def _teardown_logging(self) -> None:
        for logger, handler in self._log_handlers:
            logger.removeHandler(handler)
            # A full disk fails the last flush of daemon.log: the lines are lost either way, the exit code must not be.
            with contextlib.suppress(OSError):
                handler.close()
        self._log_handlers.clear()

    def _start_monitor(self) -> None:
        from api.client import ApiClient
        from api.monitor import run_monitor

        def watch() -> None:
            with ApiClient(self.url, self.token) as client:
                try:
                    run_monitor(client, once=False, as_json=False, stop=self._monitor_stop)
                except Exception as error:  # the view is a convenience: the run goes on without it
                    log.warning("the live view stopped: %s", error)

        self._monitor_thread = threading.Thread(target=watch, name="verl-monitor", daemon=True)
        self._monitor_thread.start()

    def _report_outcome(self) -> None:
        supervisor = self.supervisor
        logs = self.run_dir / "logs"
        if supervisor.state == "finished":
            print(f"run {self.name} {'stopped' if supervisor.stopping else 'finished'} at step "
                  f"{self.progress.step}", file=sys.stderr)
        elif supervisor.last_exit_code == EXIT_USAGE:
            print(f"ERROR: the trainer stopped on a problem with the config, data or models (exit code 2)\n"
                  f"HINT: see its ERROR lines in {logs / 'trainer.out'}", file=sys.stderr)
        elif supervisor.crash_loop and supervisor.last_failure is not None:
            print(f"ERROR: the restarted trainer failed at step {supervisor.last_failure.step} as the previous one did "
                  f"({supervisor.last_failure.cause}): restarting cannot help\n"
                  f"HINT: see {logs / 'trainer.log'} and {logs / 'daemon.log'}", file=sys.stderr)
        elif supervisor.last_exit_code == EXIT_OUT_OF_MEMORY:
            print(f"ERROR: the trainer failed {supervisor.restarts + 1} times, the last one out of memory; gave up "
                  f"after {KEYS.daemon.max_restarts}={self.config.daemon.max_restarts} restarts\n"
                  "HINT: lower the micro batch sizes (*.ppo_micro_batch_size_per_gpu, "
                  f"*.log_prob_micro_batch_size_per_gpu) or offload more ({FSDP_CONFIG.param_offload}=true); "
                  f"see {logs / 'trainer.out'}", file=sys.stderr)
        else:
            print(f"ERROR: the trainer failed {supervisor.restarts + 1} times; gave up after "
                  f"{KEYS.daemon.max_restarts}={self.config.daemon.max_restarts} restarts\n"
                  f"HINT: see {logs / 'trainer.out'} and {logs / 'daemon.log'}", file=sys.stderr)


class _HubLogHandler(logging.Handler):
    """The daemon's own log lines as "log" events, so a monitor shows restarts and stops as they happen."""

    def __init__(self, hub: TelemetryHub):
        super().__init__(logging.INFO)
        self._hub = hub

    def emit(self, record: logging.LogRecord) -> None:
        self._hub.publish("log", {"level": record.levelname.lower(), "message": record.getMessage(),
                                  "source": "daemon", "time": record.created})


def local_gpu_indices(ranks_per_node: int, visible_devices: str | None) -> list[int] | None:
    """The NVML index of each local rank's GPU: local rank i computes on CUDA device i, which is the i-th entry of
    CUDA_VISIBLE_DEVICES where that lists indices. None (sample every GPU) where it lists UUIDs or MIG names."""
    if not visible_devices:
        return list(range(ranks_per_node))
    entries = [entry.strip() for entry in visible_devices.split(",") if entry.strip()]
    if not all(entry.isdigit() for entry in entries):
        return None
    return [int(entry) for entry in entries[:ranks_per_node]]


def _listen(host: str, port: int) -> socket.socket:
    """The API's listening socket, bound here so a port in use is a clear error rather than uvicorn's exit."""
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise DaemonStartError(f"{KEYS.telemetry.host}: cannot resolve {host!r} ({error}); use an address such as "
                               "127.0.0.1") from None
    listener = socket.socket(family, kind, protocol)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as error:
        listener.close()
        raise DaemonStartError(f"{KEYS.telemetry.port}: cannot listen on {host}:{port} ({error.strerror}); choose "
                               f"another port, or {KEYS.telemetry.port}=0 for a free one") from None
    listener.listen(128)
    return listener


def _on_loop(loop: asyncio.AbstractEventLoop | None) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
