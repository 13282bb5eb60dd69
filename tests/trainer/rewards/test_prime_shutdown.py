"""prime's worker processes end at once when the pool shuts down, though the process that scores ignores SIGTERM
(trainer/rewards/worker_pool.py): spawned workers inherit an ignored SIGTERM, and Pool.terminate() ended them with
SIGTERM and waited for each, forever."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def run_alone(program: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`program` in a child of its own process group, which is killed whole if it outlasts `timeout`: workers that
    ignore SIGTERM must not outlive a failed test."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(program), *args], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    finally:  # what is left of the group (nothing, once the shutdown works)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


SCORER = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "hang":
        time.sleep(3600)
    return float(solution_str == ground_truth)
"""

PROGRAM = """
import json, signal, sys, time
import psutil
from tests.trainer.rewards.test_reward_managers import TOKENIZER, batch_of
from trainer.rewards.custom import CustomScore
from trainer.rewards.managers import PrimeReward

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as the daemon's in-process shutdown left it; a user's launcher may


def workers():
    return [child.pid for child in psutil.Process().children() if "spawn_main" in " ".join(child.cmdline())]


reward = PrimeReward(TOKENIZER, CustomScore(sys.argv[1], "compute_score"), processes=2, timeout_s=2.0,
                     warn=lambda line: None)
started = time.monotonic()
scores = reward(batch_of(["1", "2"], ["1", "3"])).tolist()
started_workers = workers()
closing = time.monotonic()
reward.close()  # idle workers
close_s = time.monotonic() - closing
left_after_close = workers()

assert reward(batch_of(["3"], ["3"])).tolist() == [1.0]  # new workers, started
late = time.monotonic()
late_scores = reward(batch_of(["1", "2"], ["1", "hang"])).tolist()  # a worker stuck on a late score: stopped
late_s = time.monotonic() - late
print(json.dumps({"scores": scores, "started_workers": len(started_workers), "close_s": close_s,
                  "left_after_close": left_after_close, "late_scores": late_scores, "late_s": late_s,
                  "left_after_late": workers()}))
"""


@pytest.mark.slow  # the child imports torch and transformers: about 40 s on a loaded 2-core host
def test_prime_shuts_its_workers_down_at_once_where_the_process_ignores_sigterm(tmp_path: Path) -> None:
    """It was: close() after a batch waited forever on a worker that ignored SIGTERM (or, with a worker initializer
    that reset SIGTERM, on one that was still starting when the pool signalled it), and a batch with a late score,
    which stops its stuck worker, never returned."""
    scorer = tmp_path / "scorer.py"
    scorer.write_text(SCORER)
    done = run_alone(PROGRAM, str(scorer), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["scores"] == [1.0, 0.0] and result["started_workers"] == 2
    assert result["close_s"] < 1.0, result
    assert result["left_after_close"] == [], result
    # The late score counts 0 after prime's 2 s; stopping the worker stuck on it adds well under a second.
    assert result["late_scores"] == [1.0, 0.0], result
    assert 2.0 <= result["late_s"] < 2.0 + 1.0, result
    assert result["left_after_late"] == [], result


POOL_PROGRAM = """
import json, signal, time
from trainer.rewards.worker_pool import WorkerPool

signal.signal(signal.SIGTERM, signal.SIG_IGN)
pool = WorkerPool(2)
stuck = pool.apply_async(time.sleep, (3600,))  # one worker busy for good, the other idle (or still starting)
time.sleep(0.5)
started = time.monotonic()
pool.terminate()
pool.join()
print(json.dumps({"shutdown_s": time.monotonic() - started}))
"""


def test_the_worker_pool_ends_busy_idle_and_starting_workers_where_sigterm_is_ignored() -> None:
    """The pool alone (no torch in the child: seconds): with SIGTERM ignored, Pool.terminate() waited forever."""
    done = run_alone(POOL_PROGRAM, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["shutdown_s"] < 1.0
