"""A full disk while `verl train` saves (issue 41's remaining faults, item 2), through the trainer's fault hook
(VERL_FAULT_FULL_DISK: no tmpfs to mount, so no root): a save that fails warns in one line and the run trains on; a
final save that fails is one ERROR line and exit code 2, which the daemon does not restart; the next start resumes
from the last good checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.e2e.runs import QUICKSTART, VERL
from trainer.checkpoint_manifest import verify_checkpoint

SMALL = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.device=cpu", "trainer.save_freq=1"]
ADVICE = ("free some space, keep fewer checkpoints (trainer.max_ckpt_to_keep) or write the checkpoints elsewhere "
          "(trainer.default_local_dir)")


def train(tmp_path: Path, steps: int, full_disk: str | None) -> subprocess.CompletedProcess:
    marker = tmp_path / "full_disk"
    if full_disk is None:
        marker.unlink(missing_ok=True)
    else:
        marker.write_text(full_disk)
    return subprocess.run([str(VERL), "train", "--config", QUICKSTART, *SMALL, f"trainer.total_training_steps={steps}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "VERL_FAULT_FULL_DISK": str(marker)})


def test_a_full_disk_at_the_final_save_stops_in_one_line_and_the_next_start_resumes_from_the_last_good(tmp_path):
    """(A save before the final one warns and the run trains on: tests/trainer/test_checkpoint_full_disk.py.)"""
    run = tmp_path / "runs" / "quickstart"
    checkpoints = run / "checkpoints"
    result = train(tmp_path, 2, "write@2")
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "restart 1 of" not in output, output
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR: ")]
    assert len(errors) == 1 and errors[0].startswith("ERROR: the final checkpoint of step 2 was not saved: could not "
                                                     "write the checkpoint of step 2 to "), output
    assert errors[0].endswith("the latest complete checkpoint: step 1"), output
    log = (run / "logs" / "trainer.log").read_text()
    assert "([Errno 28] No space left on device (injected: VERL_FAULT_FULL_DISK at manifest.json)) after " in log
    assert f" was free then; {ADVICE}; " in log
    assert sorted(path.name for path in checkpoints.iterdir() if path.name.startswith(("global_step", "."))) == [
        "global_step_1"], "no partial checkpoint left"
    assert verify_checkpoint(checkpoints / "global_step_1").ok

    result = train(tmp_path, 2, None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed from runs/quickstart/checkpoints/global_step_1 at step 1" in (run / "logs" / "trainer.log"
                                                                                  ).read_text()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
