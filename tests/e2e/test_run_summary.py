"""What `verl` says about itself and about a run that has ended: `verl --version`, and the summary a
finished `verl train` closes with (steps, time, the last reward, where the checkpoints are), as plain
lines and, with --monitor, as a panel under the live view."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from tests.e2e.runs import QUICKSTART, SMALL_RUN, VERL

STEPS = 4


def finished_run(folder: Path, *flags: str) -> tuple[str, dict]:
    """`verl train` of the quickstart for STEPS steps (a checkpoint every 2) to its end: its output and
    the last line of its metrics.jsonl."""
    env = {**os.environ, "VERL_STATE_DIR": str(folder / "state")}
    result = subprocess.run([str(VERL), "train", *flags, "--config", QUICKSTART, *SMALL_RUN,
                             f"trainer.total_training_steps={STEPS}", "trainer.save_freq=2"],
                            cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    lines = (folder / "runs" / "quickstart" / "metrics.jsonl").read_text().splitlines()
    return output, json.loads(lines[-1])


def test_verl_version_prints_the_installed_version() -> None:
    from importlib.metadata import version

    result = subprocess.run([str(VERL), "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"verl {version('verl-offload')}"


def test_a_finished_run_ends_with_its_summary(tmp_path: Path) -> None:
    output, last = finished_run(tmp_path)
    reward = format(last["critic/score/mean"], ".4g")
    summary = output[output.index(f"run quickstart finished at step {STEPS}/{STEPS} after "):].splitlines()
    assert re.fullmatch(rf"run quickstart finished at step {STEPS}/{STEPS} after \d+:\d\d", summary[0]), summary
    assert summary[1:3] == [f"  last reward: {reward} (critic/score/mean at step {STEPS})",
                            f"  checkpoints: runs/quickstart/checkpoints (latest: global_step_{STEPS})"]


def test_a_finished_run_under_the_monitor_ends_with_a_summary_panel(tmp_path: Path) -> None:
    output, last = finished_run(tmp_path, "--monitor")
    panel = output[output.rindex("verl quickstart · finished"):]
    assert re.search(rf"│ steps +{STEPS}/{STEPS} in \d+:\d\d +│", panel), panel
    assert re.search(rf"│ reward +{re.escape(format(last['critic/score/mean'], '.4g'))} \(critic/score/mean at step "
                     rf"{STEPS}\) +│", panel), panel
    assert re.search(rf"│ checkpoints +runs/quickstart/checkpoints \(latest: global_step_{STEPS}\) +│", panel), panel
