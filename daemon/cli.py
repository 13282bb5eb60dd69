"""The ``verl`` command.

    verl train [--config run.yaml] [--monitor] [key.path=value ...] start a run (no --config: the defaults)
    verl train --check [--config run.yaml] [key.path=value ...]     validate all, print the resolved config
    verl monitor --pid PID [--once] [--json] [--web]                watch a running run
    verl set NAME=VALUE [NAME=VALUE ...] --pid PID                  change live settings
    verl status --pid PID [--json]                                  one summary
    verl stop --pid PID [--wait] [--force]                          checkpoint, then exit
    verl --version                                                  the installed version

PID is the daemon's (printed by `verl train`) or any of its trainers'. Known user errors become
``ERROR:`` lines (and a ``HINT:``) with exit code 2, never a traceback. Torch stays out of this
module: it validates the config and starts the run, both in a fraction of a second.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import yaml

from api.client import ApiClient, ApiError, DaemonUnreachable, IncompatibleDaemon, Unauthorized, page_url
from api.monitor import RunSummary, describe_status, format_value, run_monitor
from daemon.runtime import RunDirInUse, RunLock, RunNotFound, RuntimeInfo, find_run, runtime_file, state_dir
from trainer.config import KEYS, ConfigError, RunConfig, dump_config, load_config_with_notes, note_line
from trainer.config.exit_codes import EXIT_USAGE
from trainer.config.live import ALLOWED_NAMES, named_twice
from trainer.config.ranks import missing_endpoint

EXIT_INTERRUPTED = 130
ACK_POLL_S = 0.2


class UsageError(Exception):
    """A mistake of the user's (or a run that cannot be reached): ERROR lines, a HINT, exit code 2."""

    def __init__(self, errors: str | Sequence[str], hint: str | None = None):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        self.hint = hint
        super().__init__("; ".join(self.errors))


class _Parser(argparse.ArgumentParser):
    """argparse reporting its errors in the ERROR/HINT form of every other message."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"ERROR: {message}\nHINT: `{self.prog} --help` shows the usage\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="verl", description="PPO and GRPO for LLMs on GPUs too small for the model.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    train = commands.add_parser("train", help="start a training run",
                                description="Validate the config, write it into runs/<name>/ and train.")
    train.add_argument("--config", metavar="FILE", help="YAML run config (see examples/); without it the "
                       "built-in defaults, changed by the overrides")
    train.add_argument("--monitor", action="store_true", help="show the live view in the foreground")
    train.add_argument("--check", action="store_true",
                       help="validate the config, its files, models and prompt lengths without training; print "
                            "the resolved config (exit code 0, or 2 with every problem)")
    # verl's launch scripts name its Hydra config (`python3 -m verl.trainer.main_ppo --config-path=config
    # --config-name=ppo_trainer ...`): the same lines run `verl train`.
    train.add_argument("--config-name", metavar="NAME", help="verl's Hydra config name: ppo_trainer (the default) "
                       "is accepted; ppo_megatron_trainer is refused (Megatron is not an engine here)")
    train.add_argument("--config-path", metavar="DIR", help="verl's Hydra config directory: accepted, unused")
    train.add_argument("overrides", nargs="*", metavar="key.path=value",
                       help="override config keys in Hydra's grammar: key=value, +key=value, ++key=value, ~key, "
                            f"lists [a,b], ${{oc.env:VAR}}; e.g. {KEYS.data.train_batch_size}=64")
    train.set_defaults(handler=train_command)

    monitor = _run_command(commands, "monitor", "attach a live view to a running run", monitor_command)
    monitor.add_argument("--once", action="store_true", help="print one view and exit")
    monitor.add_argument("--json", action="store_true", help="print one JSON snapshot and exit (implies --once)")
    monitor.add_argument("--refresh", type=_positive_seconds, default=1.0, metavar="SECONDS",
                         help="seconds between updates (default 1)")
    monitor.add_argument("--web", action="store_true",
                         help="print the URL of the run's live page (with its token) and exit")

    settings = _run_command(commands, "set", "change live settings without a restart", set_command)
    settings.add_argument("assignments", nargs="+", metavar="NAME=VALUE",
                          help="a live setting and its value (YAML: 0.8, 4, true); one of " + ALLOWED_NAMES)
    settings.add_argument("--wait", type=float, default=5.0, metavar="SECONDS",
                          help="how long to wait for the trainer to acknowledge (default 5; 0: don't wait)")

    status = _run_command(commands, "status", "summarize a running run", status_command)
    status.add_argument("--json", action="store_true", help="print the API's status body as JSON")

    stop = _run_command(commands, "stop", "ask a run to checkpoint and exit", stop_command)
    stop.add_argument("--wait", action="store_true", help="wait until the daemon has exited")
    stop.add_argument("--force", action="store_true",
                      help="kill the trainer now, without a checkpoint (the steps since the last one are lost)")
    return parser


def _run_command(commands, name: str, summary: str, handler) -> argparse.ArgumentParser:
    """A subcommand that talks to a running run, found by --pid."""
    command = commands.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")
    command.add_argument("--pid", required=True, type=_pid, metavar="PID",
                         help="the daemon's pid (printed by `verl train`) or one of its trainers' pids")
    command.add_argument("--state-dir", metavar="DIR",
                         help=f"where the run keeps its runtime files: its {KEYS.daemon.state_dir} (default: "
                              "$VERL_STATE_DIR, else $XDG_STATE_HOME/verl, else ~/.local/state/verl; a run "
                              f"started with {KEYS.daemon.state_dir}=DIR needs --state-dir DIR)")
    command.set_defaults(handler=handler)
    return command


def _pid(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a process id (a positive integer), got {text!r}")
    return int(text)


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_request:  # --help, or a usage error argparse has already reported
        return int(exit_request.code or 0)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except UsageError as error:
        for line in error.errors:
            print(f"ERROR: {line}", file=sys.stderr)
        if error.hint:
            print(f"HINT: {error.hint}", file=sys.stderr)
        return EXIT_USAGE


# ----------------------------------------------------------------------------------------- train


def train_command(args: argparse.Namespace) -> int:
    if args.check and args.monitor:
        raise UsageError("--check validates without training; it does not go with --monitor",
                         "run `verl train --check ...` first, then `verl train --monitor ...`")
    config = load_run_config(args.config, args.overrides, args.config_name)
    if args.check:
        return check_command(config)
    if (missing := missing_endpoint(config)) is not None:  # --check passes it with a WARNING line (ranks.py)
        raise UsageError(str(missing))
    try:  # before anything is written there: another daemon's trainer reads that config when it restarts
        run_lock = RunLock.acquire(config.trainer.run_dir)
    except RunDirInUse as error:
        raise UsageError(str(error)) from None
    try:
        config_path = write_run_config(config)
        return start_run(config, config_path, monitor=args.monitor, run_lock=run_lock)
    finally:
        run_lock.release()


def load_run_config(config_file: str | None, overrides: Sequence[str], config_name: str | None = None) -> RunConfig:
    """The validated config, or a UsageError with every problem of the file and the overrides. verl's keys read
    otherwise than verl reads them (with no effect, most of them: the noted entries of the alias table,
    trainer/config/aliases.py) are named in one NOTE line, and each setting that runs as in verl but likely not as
    meant in a WARNING line."""
    try:
        config, notes, warnings = load_config_with_notes(config_file, overrides, config_name)
    except ConfigError as error:
        hint = None
        if any(problem.path != "--config" for problem in error.problems):
            where = f"in {config_file} or " if config_file else ""
            hint = f"fix these {where}on the command line as key.path=value (Hydra's override grammar)"
        raise UsageError([str(problem) for problem in error.problems], hint) from None
    if notes:
        print(note_line(notes), file=sys.stderr, flush=True)
    for warning in warnings:
        print(f"WARNING: {warning}", file=sys.stderr, flush=True)
    return config


def check_command(config: RunConfig) -> int:
    """--check: the checks that need the trainer's libraries (tokenizers, data files, prompt lengths) run in
    a `python -m trainer.check` process, since this one must not import torch; then the resolved config."""
    resolved = dump_config(config)
    with tempfile.TemporaryDirectory(prefix="verl-check-") as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(resolved, encoding="utf-8")
        checked = subprocess.run([sys.executable, "-m", "trainer.check", "--config", str(path)], check=False)
    if checked.returncode == EXIT_USAGE:
        return EXIT_USAGE  # its ERROR lines are on stderr already
    if checked.returncode != 0:
        raise UsageError(f"the data and model checks failed (`python -m trainer.check` exited "
                         f"{checked.returncode})", "its output above says why")
    print(resolved, end="", flush=True)
    print("config OK: schema, cross-field rules, files, models and prompt lengths checked; nothing was trained",
          file=sys.stderr)
    return 0


def write_run_config(config: RunConfig) -> Path:
    """The resolved config, every default explicit, in the run directory: what the trainer reads."""
    run_dir = config.trainer.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    path.write_text(dump_config(config), encoding="utf-8")
    return path


def start_run(config: RunConfig, config_path: Path, monitor: bool, run_lock: RunLock | None = None) -> int:
    """Run the training under this process, the daemon; `monitor` shows the live view in the foreground.
    A run that ends, well or not, closes with its summary; one that stops on a user's error (exit code 2)
    with the ERROR lines that say what to fix."""
    from daemon.service import run_daemon

    started = time.monotonic()
    code = run_daemon(config, config_path, monitor=monitor, run_lock=run_lock)
    if code != EXIT_USAGE:
        print_summary(RunSummary.from_run_dir(config.trainer.run_dir, name=config.trainer.experiment_name,
                                              total_steps=config.trainer.total_training_steps,
                                              elapsed_s=time.monotonic() - started, failed=code != 0,
                                              checkpoints=config.trainer.checkpoint_dir),
                      monitor=monitor)
    return code


def print_summary(summary: RunSummary, *, monitor: bool) -> None:
    """Under the live view's last frame as a panel (--monitor), else as plain lines."""
    if monitor:
        from rich.console import Console

        Console().print(summary.render())
    else:
        print("\n".join(summary.lines()), flush=True)


def monitor_command(args: argparse.Namespace) -> int:
    if args.web and (args.once or args.json):
        raise UsageError("--web prints the live page's URL; it does not go with --once or --json",
                         f"run `verl monitor {_run_flags(args)} --web` alone")
    with connect(args.pid, args.state_dir) as (info, client):
        if args.web:
            client.status()  # the daemon answers and takes this token: the URL will work
            print(f"live page of run {info.name} (daemon pid {info.pid}); the URL holds the run's token, "
                  "so share it only with whoever may steer the run:", file=sys.stderr)
            print(page_url(info.url, info.token), flush=True)
            return 0
        return run_monitor(client, once=args.once or args.json, as_json=args.json, refresh_s=args.refresh)


def status_command(args: argparse.Namespace) -> int:
    with connect(args.pid, args.state_dir) as (_, client):
        status = client.status()
    print(json.dumps(status.model_dump(mode="json", by_alias=True), indent=2) if args.json
          else "\n".join(describe_status(status)))
    return 0


def set_command(args: argparse.Namespace) -> int:
    change = parse_assignments(args.assignments)
    with connect(args.pid, args.state_dir) as (info, client):
        try:
            answer = client.update_settings(change)
        except ApiError as error:
            if error.status != 422:
                raise
            raise UsageError(error.lines(), f"nothing was changed; `verl status {_run_flags(args)}` shows the "
                             "current values") from None
        version = answer["version"]
        for name, new in answer["new"].items():
            print(f"{name}: {format_value(answer['old'].get(name))} -> {format_value(new)}")
        if not answer["new"]:
            print(f"nothing to change: the settings already have these values (settings version {version})")
            return 0
        print(f"settings version {version}; the trainer applies it at step {answer['applies_at_step']}")
        if answer["status"] != "pending" or args.wait <= 0:
            return 0
        acknowledged = _wait_for_acknowledgement(client, version, args.wait)
    if acknowledged is None:
        print(f"the trainer has not acknowledged version {version} within {args.wait:g} s; it applies it at "
              f"its next safe point (`verl status {_run_flags(args)}` shows when)")
    else:
        print(f"acknowledged by the trainer: in effect from step {acknowledged['applied_at_step']}")
    return 0


def stop_command(args: argparse.Namespace) -> int:
    with connect(args.pid, args.state_dir) as (info, client):
        client.stop(force=args.force)
        print(f"killed the trainer of run {info.name} (daemon pid {info.pid}) without a checkpoint; the daemon exits"
              if args.force else
              f"asked run {info.name} (daemon pid {info.pid}) to checkpoint at its next safe point and exit")
        if not args.wait:
            return 0
        try:
            last_step = _wait_for_exit(info.pid, client)
        except KeyboardInterrupt:
            print("stopped waiting; the run still stops", file=sys.stderr)
            return EXIT_INTERRUPTED
    print(f"run {info.name} has stopped" + (f" (last seen at step {last_step})" if last_step is not None else ""))
    return 0


@contextmanager
def connect(pid: int, configured_state_dir: str | None = None) -> Iterator[tuple[RuntimeInfo, ApiClient]]:
    """The run that `pid` belongs to and a client of its API; turns the ways this fails into UsageError."""
    state = state_dir(configured_state_dir)
    try:
        info = find_run(pid, state)
    except RunNotFound as error:
        raise UsageError(str(error), error.hint or "pass the pid that `verl train` printed (the daemon's) or one of "
                         "its trainers' pids (a run that has ended has none)") from None
    with ApiClient(info.url, info.token) as client:
        try:
            yield info, client
        except DaemonUnreachable as error:
            raise UsageError(f"run {info.name} (daemon pid {info.pid}): {error}",
                             f"the daemon may still be starting or be stuck; see {info.run_dir}/logs/daemon.log"
                             ) from None
        except Unauthorized as error:
            raise UsageError(f"run {info.name} (daemon pid {info.pid}): {error}",
                             f"the token in {runtime_file(state, info.pid)} is not this daemon's: the file is "
                             "left from an older run; delete it, then use the pid the running `verl train` "
                             "printed") from None
        except IncompatibleDaemon as error:
            raise UsageError(f"run {info.name} (daemon pid {info.pid}): {error}",
                             "the daemon likely runs another verl version than this command: use the `verl` of "
                             "the environment that started the run") from None
        except ApiError as error:
            raise UsageError(error.lines(), f"see {info.run_dir}/logs/daemon.log") from None


# ------------------------------------------------------------------------------------------ helpers


def version() -> str:
    """The installed verl's version (the verl-offload distribution)."""
    try:
        return importlib.metadata.version("verl-offload")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run from a source tree)"


def _run_flags(args: argparse.Namespace) -> str:
    """--pid (and --state-dir, when given) as the user typed them, for the commands a message suggests."""
    return f"--pid {args.pid}" + (f" --state-dir {shlex.quote(args.state_dir)}" if args.state_dir else "")


class _ScalarLoader(yaml.SafeLoader):
    """YAML as the config's overrides read it: 1e-3 is a number (PyYAML's YAML 1.1 wants 1.0e-3)."""


_ScalarLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789"))


def parse_assignments(texts: Sequence[str]) -> dict[str, Any]:
    """NAME=VALUE arguments as a settings change, each value read as a YAML scalar (0.8, 4, true, debug)."""
    hint = "write NAME=VALUE, e.g. `verl set gpu_memory_threshold=0.8 --pid PID`; settings: " + ALLOWED_NAMES
    change: dict[str, Any] = {}
    for text in texts:
        name, equals, raw = text.partition("=")
        name = name.strip()
        if not equals or not name or not raw.strip():
            raise UsageError(f"expected NAME=VALUE, got {text!r}", hint)
        if name in change:
            raise UsageError(f"{name} is given twice", hint)
        try:
            value = yaml.load(raw, Loader=_ScalarLoader)  # noqa: S506 (a safe loader)
        except yaml.YAMLError:
            value = raw  # a plain string after all; the daemon says whether the setting takes one
        if isinstance(value, dict | list):
            raise UsageError(f"{name}: expected a single value, got {raw!r}", hint)
        change[name] = value
    twice = named_twice(change)
    if twice:
        raise UsageError([str(problem) for problem in twice], hint)
    return change


def _wait_for_acknowledgement(client: ApiClient, version: int, timeout_s: float) -> dict | None:
    """The settings once the trainer has acknowledged `version`, or None after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        settings = client.settings()
        if (settings.get("acknowledged_version") or 0) >= version:
            return settings
        if time.monotonic() >= deadline:
            return None
        time.sleep(min(ACK_POLL_S, max(0.0, deadline - time.monotonic())))


def _wait_for_exit(pid: int, client: ApiClient) -> int | None:
    """Block until the daemon has exited; the last step its API reported on the way."""
    last_step = None
    while True:
        try:
            last_step = client.status().progress.step
        except ApiError:
            pass  # it is shutting down its API: keep waiting for the process
        try:
            psutil.Process(pid).wait(timeout=0.5)
            return last_step
        except psutil.TimeoutExpired:
            continue
        except psutil.NoSuchProcess:
            return last_step

