"""The rank group of one node: ``python -m trainer.distributed.launch --config RESOLVED.yaml [-- ARGS]``.

The daemon never imports torch, so with trainer.nnodes * trainer.n_gpus_per_node > 1 the child it
supervises is this process. It runs trainer.n_gpus_per_node ranks of ``python -m trainer --config
RESOLVED.yaml`` under torch.distributed's elastic launcher, used as a library (what torchrun runs):

- one node: c10d rendezvous on a free local port (torchrun --standalone);
- several nodes: the rendezvous at trainer.rdzv_endpoint (node 0's host:port), with this node's
  trainer.node_rank fixing its ranks (torchrun --node-rank, the "static" rendezvous), so that global
  rank 0, which reports the run-wide metrics and acts on live settings, is always on node 0, whose
  daemon holds the run's control. c10d's dynamic rendezvous orders nodes by host name and pid instead.

``max_restarts=0``: the elastic agent never restarts ranks itself. A failed group ends this process
with the trainer's exit code of the first rank that failed (trainer/config/exit_codes.py: 2 a config problem,
12 out of memory, other codes a crash; a rank killed by a signal ends this process by the same signal), so the
daemon's restart policy, back-off and exit-code rules (daemon/supervisor.py) apply to the whole group:
it restarts all ranks, which resume from the latest checkpoint.

Signals: SIGTERM and SIGINT reach every rank through the elastic agent, which waits up to
daemon.stop_timeout_s for them to checkpoint and exit before it kills them; STACK_DUMP_SIGNAL is passed
on to the ranks so that a hung group writes its stacks.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from trainer.config.exit_codes import EXIT_OK, EXIT_USAGE
from trainer.distributed.failed_rank import log_sizes, report_failed_rank

if TYPE_CHECKING:
    from trainer.config.schema import DaemonConfig, TrainerConfig

EXIT_CRASH = 1
STANDALONE_ENDPOINT = "localhost:0"
"""One node: c10d's rendezvous store on a free local port, as torchrun --standalone does."""
RANKS_LOG_DIR = "ranks"
"""Under <run dir>/logs: the elastic agent's per-attempt folders (error files of failed ranks)."""


class Failure(Protocol):
    """What this module reads of torch.distributed.elastic's ProcessFailure."""

    exitcode: int
    timestamp: int


@dataclass(frozen=True)
class GroupPlan:
    """How this node's ranks are launched, from the run config."""

    nnodes: int
    nproc_per_node: int
    node_rank: int
    rdzv_backend: str
    rdzv_endpoint: str
    rdzv_configs: dict[str, object]
    run_id: str
    shutdown_timeout_s: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def plan_group(*, nnodes: int, n_gpus_per_node: int, node_rank: int, rdzv_endpoint: str | None,
               run_name: str, stop_timeout_s: float) -> GroupPlan:
    """The launch of one node's ranks (see the module docstring for the choice of rendezvous)."""
    if nnodes == 1:
        return GroupPlan(nnodes=1, nproc_per_node=n_gpus_per_node, node_rank=0, rdzv_backend="c10d",
                         rdzv_endpoint=rdzv_endpoint or STANDALONE_ENDPOINT, rdzv_configs={"is_host": True},
                         run_id=f"{run_name}-{uuid.uuid4().hex[:8]}", shutdown_timeout_s=_seconds(stop_timeout_s))
    if rdzv_endpoint is None:
        from trainer.config import KEYS  # here: planning a group loads nothing it does not need

        raise ValueError(f"{KEYS.trainer.rdzv_endpoint} is required when {KEYS.trainer.nnodes} > 1")
    return GroupPlan(nnodes=nnodes, nproc_per_node=n_gpus_per_node, node_rank=node_rank, rdzv_backend="static",
                     rdzv_endpoint=rdzv_endpoint, rdzv_configs={"rank": node_rank}, run_id=run_name,
                     shutdown_timeout_s=_seconds(stop_timeout_s))


def _seconds(value: float) -> int:
    return max(1, int(value + 0.999))


def group_exit_code(failures: Mapping[int, Failure]) -> int:
    """The exit code a failed group passes to the daemon: that of its first failed rank (first_failed_rank): 2,
    12, any crash code, or minus the signal that killed it. The ranks stopped after it only followed it."""
    if not failures:
        return EXIT_CRASH
    return failures[first_failed_rank(failures)].exitcode


def first_failed_rank(failures: Mapping[int, Failure]) -> int:
    """The global rank that failed first: the earliest failure, and among those of the same second (timestamps
    are whole seconds) the one the elastic agent saw first; `failures` keeps the order the agent found them in,
    the ranks it stopped because of the first one after it."""
    return min(failures, key=lambda global_rank: failures[global_rank].timestamp)


def exit_like(code: int) -> int:
    """End this process as the failed rank ended: by the same signal when one killed it (so the daemon counts a
    "signal" restart, as for a single trainer), else returns the code to exit with."""
    if code >= 0:
        return code
    signum = -code
    if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    with contextlib.suppress(ValueError, OSError):
        os.kill(os.getpid(), signum)
    return 128 + signum  # a signal this process cannot die of (its default action is not to end it)


def forward_to_ranks(signum: int) -> int:
    """Send `signum` to this process's children (the ranks); how many it reached."""
    import psutil

    reached = 0
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            child.send_signal(signum)
            reached += 1
    return reached


JOIN_DELAY_S = 5.0
"""Seconds a node other than node 0 waits before it joins the rendezvous. After a rank of another node dies, node 0's
group fails only at its next collective and its launcher, which holds the rendezvous store at trainer.rdzv_endpoint,
ends a moment later: a node restarted sooner joined that dying store and waited on it for good (seen on the 2-core
machine, tests/e2e/test_ranks.py: node 1 restarted 1 s before node 0's old launcher ended, then hung 5 minutes).
Node 0 itself hosts the store and never waits."""


def run_group(plan: GroupPlan, trainer_args: Sequence[str], *, log_dir: Path) -> int:
    """Run the ranks until they end; the exit code for the daemon (negative: the signal to end by)."""
    if plan.nnodes > 1 and plan.node_rank > 0:
        time.sleep(JOIN_DELAY_S)
    os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(plan.shutdown_timeout_s)  # torch before LaunchConfig's field
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    options: dict[str, object] = {}
    if "shutdown_timeout" in LaunchConfig.__dataclass_fields__:
        options["shutdown_timeout"] = plan.shutdown_timeout_s
    log_dir.mkdir(parents=True, exist_ok=True)
    logs_before = log_sizes(log_dir.parent)  # a failed rank's record is what it writes from now on
    config = LaunchConfig(min_nodes=plan.nnodes, max_nodes=plan.nnodes, nproc_per_node=plan.nproc_per_node,
                          run_id=plan.run_id, rdzv_backend=plan.rdzv_backend, rdzv_endpoint=plan.rdzv_endpoint,
                          rdzv_configs=dict(plan.rdzv_configs), max_restarts=0, start_method="spawn",
                          logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)), **options)  # type: ignore[arg-type]
    try:
        elastic_launch(config, sys.executable)(*trainer_args)
    except ChildFailedError as error:
        rank = first_failed_rank(error.failures)
        code = group_exit_code(error.failures)
        print(f"verl launcher: rank {rank} failed ({_describe(code)}); the group ends with it", file=sys.stderr,
              flush=True)
        report_failed_rank(log_dir.parent, rank, _describe(code), since=logs_before,  # its error in trainer.log
                           user_error=code == EXIT_USAGE)
        return code
    except SignalException as error:  # the ranks were asked to stop (the agent passed the signal on)
        return -int(error.sigval)
    return EXIT_OK


def read_launch_sections(path: Path) -> tuple[TrainerConfig, DaemonConfig]:
    """The trainer and daemon sections of the resolved config, all the launcher reads of it. The whole config was
    checked by `verl train` when it wrote the file, and every rank checks it again (and exits 2 on a problem,
    which ends the group with 2); the launcher does not pay for loading models and data files to check it too."""
    from pydantic import ValidationError

    from trainer.config.errors import ConfigError
    from trainer.config.loading import read_yaml
    from trainer.config.schema import DaemonConfig, TrainerConfig

    try:
        raw = read_yaml(path)
        return (TrainerConfig.model_validate(raw.get("trainer") or {}),
                DaemonConfig.model_validate(raw.get("daemon") or {}))
    except ConfigError as error:
        raise ValueError("; ".join(str(problem) for problem in error.problems)) from None
    except ValidationError as error:
        raise ValueError(f"{path}: not a resolved run config ({error.errors()[0]['msg']})") from None


def gpu_shortage(device_name: str, n_gpus_per_node: int) -> str | None:
    """The line for a GPU run whose node has too few GPUs for its ranks (or none, with trainer.device=cuda); None
    when they fit or the ranks run on the CPU."""
    import torch

    from trainer.distributed.ranks import gpus_per_node_problem, resolve_device
    from trainer.errors import RunSetupError

    try:
        device = resolve_device(device_name)
    except RunSetupError as error:
        return str(error)
    if device.type != "cuda":
        return None
    return gpus_per_node_problem(n_gpus_per_node, torch.cuda.device_count())


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.distributed.launch",
                                     description="Run this node's ranks of one training job.")
    parser.add_argument("--config", required=True, help="the resolved YAML run config")
    parser.add_argument("program", nargs="*", metavar="-- ARGS",
                        help="what each rank runs instead of the trainer: `python ARGS` (default: python -m trainer "
                             "--config CONFIG)")
    args = parser.parse_args(argv)
    from trainer.config.ipc import STACK_DUMP_SIGNAL
    from trainer.telemetry import die_with_daemon

    if not die_with_daemon():
        print("ERROR: the verl daemon that started this launcher has exited; not training", file=sys.stderr)
        return EXIT_CRASH
    try:
        trainer, daemon = read_launch_sections(Path(args.config))
    except ValueError as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return EXIT_USAGE
    problem = gpu_shortage(trainer.device, trainer.n_gpus_per_node)
    if problem is not None:  # one line here, before any rank starts (each rank would also find it)
        print(f"ERROR: {problem}", file=sys.stderr)
        return EXIT_USAGE
    plan = plan_group(nnodes=trainer.nnodes, n_gpus_per_node=trainer.n_gpus_per_node, node_rank=trainer.node_rank,
                      rdzv_endpoint=trainer.rdzv_endpoint, run_name=trainer.experiment_name,
                      stop_timeout_s=daemon.stop_timeout_s)
    signal.signal(STACK_DUMP_SIGNAL, lambda signum, frame: forward_to_ranks(signum))
    program = args.program or ["-m", "trainer", "--config", str(Path(args.config).resolve())]
    code = run_group(plan, program, log_dir=Path(trainer.run_dir) / "logs" / RANKS_LOG_DIR)
    return exit_like(code)


if __name__ == "__main__":
    sys.exit(main())
