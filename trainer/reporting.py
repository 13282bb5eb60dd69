"""What a person watching the trainer sees: a progress bar and one line of metrics per step,
mirrored into the run's log file."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

# (metric, label, format) in the order they are printed.
STEP_LINE = (
    ("critic/score/mean", "score", "{:.3f}"),
    ("actor/pg_loss", "pg_loss", "{:+.4f}"),
    ("critic/vf_loss", "vf_loss", "{:.4f}"),
    ("actor/ppo_kl", "ppo_kl", "{:+.5f}"),
    ("actor/kl_loss", "kl_loss", "{:.5f}"),
    ("actor/reward_kl_penalty", "kl_penalty", "{:.5f}"),
    ("actor/entropy", "entropy", "{:.3f}"),
    ("response_length/mean", "resp_len", "{:.1f}"),
    ("timing_s/step", "step_s", "{:.2f}"),
    ("perf/throughput", "tok/s", "{:.0f}"),
)


class StepObserver(Protocol):
    """Anything that wants each step's metrics: the console, and later the telemetry client."""

    def on_step(self, step: int, metrics: Mapping[str, float]) -> None: ...


def format_step_line(step: int, total_steps: int, metrics: Mapping[str, float]) -> str:
    parts = [f"step {step}/{total_steps}"]
    for key, label, pattern in STEP_LINE:
        value = metrics.get(key)
        if value is not None:
            parts.append(f"{label} {pattern.format(value)}")
    return "  ".join(parts)


class ConsoleReporter:
    """Progress bar on a terminal (plain lines elsewhere), and the log file `log_path`. `print_steps`: each
    step's line on the console too (trainer.logger's console), not only in the log file."""

    def __init__(self, *, total_steps: int, log_path: Path, console: Console | None = None,
                 forward: Callable[[str, str], None] | None = None, print_steps: bool = True):
        self.total_steps = total_steps
        self.print_steps = print_steps
        self._forward = forward
        self.console = console or Console(stderr=True, highlight=False)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.logger = logging.getLogger(f"verl.trainer.{log_path}")
        self.logger.propagate = False
        self.logger.setLevel(logging.INFO)
        handler = logging.FileHandler(log_path, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.logger.addHandler(handler)
        self._progress: Progress | None = None
        self._task = None

    def info(self, message: str) -> None:
        self.logger.info(message)
        if self.logger.isEnabledFor(logging.INFO):
            self._print(message, markup=False)
        if self._forward is not None:
            self._forward("info", message)

    def warning(self, message: str) -> None:
        self.logger.warning(message)
        self._print(f"[yellow]WARNING:[/yellow] {escape(message)}")
        if self._forward is not None:
            self._forward("warning", message)

    def set_level(self, level: str) -> None:
        """The live log_level: debug, info, warning or error."""
        self.logger.setLevel(level.upper())

    def start(self, step: int) -> None:
        if self.console.is_terminal:
            self._progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                                      TimeRemainingColumn(), console=self.console)
            self._task = self._progress.add_task("steps", total=self.total_steps, completed=step)
            self._progress.start()

    def on_step(self, step: int, metrics: Mapping[str, float]) -> None:
        line = format_step_line(step, self.total_steps, metrics)
        self.logger.info(line)
        if self.print_steps and self.logger.isEnabledFor(logging.INFO):
            self._print(line, markup=False)
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        for handler in list(self.logger.handlers):
            handler.close()
            self.logger.removeHandler(handler)

    def _print(self, message: str, markup: bool = True) -> None:
        console = self._progress.console if self._progress is not None else self.console
        console.print(message, markup=markup, soft_wrap=True)
