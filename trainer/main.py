"""The trainer process: ``python -m trainer --config RESOLVED.yaml [key.path=value ...]``.

The ``verl`` command validates the config, writes it into the run directory and starts this
process; it can also be run by hand. Exit codes: 0 done (or stopped on request, after a
checkpoint), 2 a problem with the config, data or models (one ``ERROR:`` line per problem).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

EXIT_OK = 0
EXIT_USAGE = 2


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer", description="Run one RL training job.")
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    # Import after argument parsing so --help is instant, and config errors show before torch loads.
    from trainer.config import ConfigError, inactive_settings, load_config

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as error:
        return _report_errors([str(problem) for problem in error.problems])

    from trainer.errors import USER_ERRORS
    from trainer.loop import Trainer
    from trainer.reporting import ConsoleReporter

    run_dir = config.trainer.run_dir
    reporter = None
    try:
        trainer = Trainer(config, log=print)
        reporter = ConsoleReporter(total_steps=trainer.total_steps, log_path=run_dir / "logs" / "trainer.log")
        trainer.log, trainer.warn = reporter.info, reporter.warning
        trainer.observers.append(reporter)
        for note in inactive_settings(config):
            reporter.warning(note)
        reporter.info(f"run directory {run_dir}; device {trainer.device}; {trainer.total_steps} steps")
        trainer.install_signal_handlers()
        trainer.resume()
        reporter.start(trainer.step)
        trainer.fit()
    except USER_ERRORS as error:
        return _report_errors([str(error)])
    finally:
        if reporter is not None:
            reporter.close()
    return EXIT_OK


def _report_errors(messages: Sequence[str]) -> int:
    for message in messages:
        print(f"ERROR: {message}", file=sys.stderr)
    return EXIT_USAGE
