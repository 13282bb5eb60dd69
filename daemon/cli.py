"""The ``verl`` command.

    verl train --config run.yaml [key.path=value ...]

Known user errors become ``ERROR:`` lines (and a ``HINT:``) with exit code 2, never a traceback.
This module must not import torch: it validates the config and starts the trainer process.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from trainer.config import ConfigError, RunConfig, dump_config, load_config

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl", description="PPO and GRPO for LLMs on GPUs too small for the model.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    train = commands.add_parser("train", help="start a training run",
                                description="Validate the config, write it into runs/<name>/ and train.")
    train.add_argument("--config", required=True, metavar="FILE", help="YAML run config (see examples/)")
    train.add_argument("overrides", nargs="*", metavar="key.path=value",
                       help="override config keys, e.g. data.train_batch_size=64")
    train.set_defaults(handler=train_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


def train_command(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as error:
        for problem in error.problems:
            print(f"ERROR: {problem}", file=sys.stderr)
        if any(problem.path != "--config" for problem in error.problems):
            print(f"HINT: fix these in {args.config} or override them on the command line as key.path=value",
                  file=sys.stderr)
        return EXIT_USAGE
    config_path = write_run_config(config)
    return run_trainer(config_path)


def write_run_config(config: RunConfig) -> Path:
    """The resolved config, every default explicit, in the run directory: what the trainer reads."""
    run_dir = config.trainer.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    path.write_text(dump_config(config), encoding="utf-8")
    return path


def run_trainer(config_path: Path) -> int:
    """Run the trainer as a child process; the first Ctrl-C or SIGTERM asks it to checkpoint and stop,
    a second one ends it at once."""
    child = subprocess.Popen([sys.executable, "-m", "trainer", "--config", str(config_path)])
    signals_seen = 0

    def forward(signum, _frame):
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            print("stopping: the trainer checkpoints at the end of this step (again to abort)", file=sys.stderr)
            child.send_signal(signal.SIGTERM)
        else:
            child.kill()

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
