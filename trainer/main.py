"""The trainer process: ``python -m trainer --config RESOLVED.yaml [key.path=value ...]``.

The ``verl`` command validates the config, writes it into the run directory and starts this
process; it can also be run by hand. Exit codes: 0 done (or stopped on request, after a
checkpoint), 2 a problem with the config, data or models (one ``ERROR:`` line per problem; one
sequence that does not fit on the device with nothing left to free is one too:
trainer/out_of_memory.py), 12 out of device memory that the trainer could not recover from (one
``ERROR:`` line with what to change); any other non-zero code is a crash.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

# One definition for the trainer and the daemon (which counts EXIT_OUT_OF_MEMORY as an "oom" restart).
from trainer.config.exit_codes import EXIT_OK, EXIT_OUT_OF_MEMORY, EXIT_USAGE

EXIT_DAEMON_GONE = 1


def out_of_memory_hint() -> str:
    """What to change after running out of device memory. (A function: this module imports the config only once
    its arguments are parsed.)"""
    from trainer.config import FSDP_CONFIG, KEYS

    return (f"lower the micro batch sizes ({KEYS.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu}, "
            "actor_rollout_ref.{rollout,ref}.log_prob_micro_batch_size_per_gpu, "
            f"{KEYS.critic.ppo_micro_batch_size_per_gpu}) or offload more ({FSDP_CONFIG.param_offload}=true, "
            f"{FSDP_CONFIG.dynamic_offload.enabled}=true)")


ALLOCATOR_DEFAULTS = "expandable_segments:True"
"""The CUDA caching allocator's settings a run starts with unless PYTORCH_CUDA_ALLOC_CONF says otherwise:
segments that grow in place, so that blocks freed by moving layers and by a phase's activations join
up instead of leaving fragments the next phase cannot use (a run near its memory threshold otherwise
keeps failing and retrying allocations)."""


def use_allocator_defaults() -> None:
    """Set ALLOCATOR_DEFAULTS before CUDA starts, where the user has not set the allocator."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_DEFAULTS


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer", description="Run one RL training job.")
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    # Import after argument parsing, so that config errors show before torch loads.
    from trainer.config import ConfigError, load_config
    from trainer.telemetry import die_with_daemon, dump_stacks_on_signal

    if not die_with_daemon():  # an orphan from the start: the daemon died while this process was starting
        print("ERROR: the verl daemon that started this trainer has exited; not training", file=sys.stderr)
        return EXIT_DAEMON_GONE
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as error:
        # Every rank finds the same problems and exits 2; one set of lines is enough.
        return _report_errors([str(problem) for problem in error.problems] if _is_rank_zero() else [])
    dump_stacks_on_signal(config.trainer.run_dir / "logs" / "trainer.log")

    use_allocator_defaults()
    from trainer.distributed.ranks import Ranks
    from trainer.errors import UserError

    try:
        # Joins the process group with several ranks, and builds the (dp, sp) mesh with Ulysses.
        ranks = Ranks.from_environment(config.trainer.device, sequence_parallel_size=config.sequence_parallel_size,
                                       timeout_s=config.actor_rollout_ref.nccl_timeout)
    except UserError as error:
        return _report_user_error(error, None, None, log_path=config.trainer.run_dir / "logs" / "trainer.log",
                                  prints=_is_rank_zero())
    try:
        code = _train(config, ranks)
    finally:
        ranks.close()
    if ranks.distributed:
        _end_rank(code)
    return code


def _end_rank(code: int) -> NoReturn:
    """End a rank of several with `code`, its files flushed, without the interpreter's finalization.

    A rank that trained to the end, destroyed its process group and returned was seen to abort at exit
    ("terminate called without an active exception", SIGABRT; torchrun then reports the whole run failed). torch
    keeps references to a destroyed gloo group that Python cannot see, so the group's C++ threads meet the
    interpreter's teardown (pytorch#179291 describes the crash; its atexit fix was abandoned). Every file this
    trainer writes is closed by now, so skipping the teardown loses nothing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _train(config, ranks) -> int:
    import torch
    from rich.console import Console

    from trainer.errors import UserError
    from trainer.loop import Trainer
    from trainer.reporting import ConsoleReporter
    from trainer.telemetry import TelemetryClient
    from trainer.tracking import start_tracking

    run_dir = config.trainer.run_dir
    # Rank 0 writes the run's log and console; another rank keeps its own log file and prints nothing.
    log_path = run_dir / "logs" / ("trainer.log" if ranks.is_main else f"trainer-rank{ranks.rank}.log")
    # Present when the verl daemon started this process; None when run by hand.
    telemetry = TelemetryClient.from_env(run_dir=str(run_dir), rank=ranks.rank)
    reporter = tracking = restore_signal_handlers = None
    finished = False  # the trackers' runs are marked failed unless training returns
    try:
        # Before the trainer: what building the models says (a warning about a checkpoint's dtype, the placement)
        # goes to the run's log and the daemon too, not only to the terminal.
        reporter = ConsoleReporter(total_steps=0, log_path=log_path,
                                   console=None if ranks.is_main else Console(quiet=True),
                                   forward=_log_forwarder(telemetry), print_steps="console" in config.trainer.logger)
        trainer = Trainer(config, log=reporter.info, warn=reporter.warning, telemetry=telemetry, ranks=ranks)
        reporter.total_steps = trainer.total_steps
        trainer.observers.append(reporter)
        trainer.settings.subscribe(lambda settings: reporter.set_level(settings.log_level))
        for line in trainer.memory.summary_lines():
            reporter.info(line)
        where = f"; rank {ranks.rank} of {ranks.world_size}" if ranks.distributed else ""
        reporter.info(f"run directory {run_dir}; device {trainer.device}{where}; {trainer.total_steps} steps")
        restore_signal_handlers = trainer.control.install_signal_handlers()
        trainer.resume()
        if telemetry is not None:
            telemetry.hello(start_step=trainer.step, total_steps=trainer.total_steps)
        if not trainer.control.receive_initial_settings():
            reporter.warning("the daemon sent no live settings within 5 s; starting with the config's")
        if ranks.is_main:  # the trackers get the run-wide metrics, once
            # After resuming: a tracker drops what it had logged past the checkpoint's step.
            tracking = start_tracking(config, start_step=trainer.step, warn=reporter.warning, log=reporter.info)
            trainer.observers.append(tracking)
        reporter.start(trainer.step)
        trainer.fit()
        finished = True
    except UserError as error:  # with several ranks rank 0 prints, and a rank that met its error alone
        return _report_user_error(error, reporter, telemetry, log_path=log_path,
                                  prints=ranks.is_main or error.rank_local, rank=None if ranks.is_main else ranks.rank)
    except torch.OutOfMemoryError as error:  # the trainer's own recovery (offload more, split) did not suffice
        return _report_out_of_memory(error, reporter, telemetry)
    except Exception as error:  # a crash: its traceback into the run's log, where the user and the daemon look
        _log_crash(error, reporter, telemetry)
        raise
    finally:
        if restore_signal_handlers is not None:  # the interpreter's last reference to the trainer
            restore_signal_handlers()
        if tracking is not None:
            tracking.close(failed=not finished)
        if reporter is not None:
            reporter.close()
        if telemetry is not None:
            telemetry.close()
    return EXIT_OK


def _is_rank_zero() -> bool:
    """Rank 0 of a torchrun launch, or a process torchrun did not start (before torch is imported)."""
    return os.environ.get("RANK", "0") == "0"


def _log_forwarder(telemetry):
    if telemetry is None:
        return None
    from trainer.config.messages import LogMessage

    return lambda level, message: telemetry.send(LogMessage(level=level, message=message))


def _log_crash(error: BaseException, reporter, telemetry) -> None:
    """A crash's traceback in the run's log (the terminal gets it from the interpreter as the exception goes on up),
    and its final line in the daemon's stream: the daemon puts it in its "exited with code N" line and /v1/status."""
    import traceback

    final = traceback.format_exception_only(type(error), error)[-1].strip()
    if reporter is not None:
        reporter.logger.error("the trainer crashed: %s\n%s", final, "".join(traceback.format_exception(error)).rstrip())
    if telemetry is not None:
        from trainer.config.messages import LogMessage

        telemetry.send(LogMessage(level="error", message=f"the trainer crashed: {final}"))


def _report_out_of_memory(error: BaseException, reporter, telemetry) -> int:
    """One ERROR line that says what to change, in the terminal, the run's log and the daemon's stream."""
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    message = f"out of memory, not recovered ({detail[:200]}): {out_of_memory_hint()}"
    if reporter is not None:
        reporter.logger.error(message)
        reporter.close()  # the progress bar off the terminal before the line goes there
    print(f"ERROR: {message}", file=sys.stderr, flush=True)
    if telemetry is not None:
        from trainer.config.messages import LogMessage

        telemetry.send(LogMessage(level="error", message=message))
    return EXIT_OUT_OF_MEMORY


def _report_user_error(error: BaseException, reporter, telemetry, *, log_path: Path, prints: bool = True,
                       rank: int | None = None) -> int:
    """One ERROR line for a problem the user can fix, in the terminal, the run's log and the daemon's stream;
    the log also gets the traceback when the user's own code raised (a custom reward function). A `rank` other
    than 0 that prints names itself in the terminal's line."""
    from trainer.rewards import RewardFunctionError

    message = " ".join(str(error).split())
    if reporter is not None:
        details = ""
        if isinstance(error, RewardFunctionError):
            details = f"\n{error.traceback_text.rstrip()}"
            message += f" (its traceback is in {log_path})"
        reporter.logger.error(message + details)
        reporter.close()  # the progress bar off the terminal before the line goes there
    if prints:  # with several ranks, rank 0's line stands for all of them (each one's log has its own)
        print(f"ERROR: {'' if rank is None else f'rank {rank}: '}{message}", file=sys.stderr, flush=True)
    elif not _is_rank_zero():
        time.sleep(RANK_ZERO_FIRST_S)  # rank 0's line first (_report_errors)
    if telemetry is not None:
        from trainer.config.messages import LogMessage

        telemetry.send(LogMessage(level="error", message=message))
    return EXIT_USAGE


RANK_ZERO_FIRST_S = 3.0
"""How long a rank other than 0 waits before it exits on an error that rank 0 reports: torchrun stops the group at
the first rank's exit, and under load a silent rank could exit (and rank 0 be stopped) before rank 0's line is out."""


def _report_errors(messages: Sequence[str]) -> int:
    for message in messages:
        print(f"ERROR: {message}", file=sys.stderr, flush=True)
    if not messages and not _is_rank_zero():
        time.sleep(RANK_ZERO_FIRST_S)
    return EXIT_USAGE
