"""Where a trainer stuck in a user's reward call hangs, as the daemon reads it from the real stacks faulthandler
writes (daemon/failures.py's hang_place): the user's frame, not the time limit's own waits (the main thread waiting
for the call, an idle worker of the pool waiting for the next one)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from daemon.failures import hang_place

REPO = Path(__file__).resolve().parents[3]

SCRIPT = """
import faulthandler, os, signal, sys, threading, time
sys.path.insert(0, {repo!r})
from trainer.rewards.time_limit import call_with_time_limit
sys.path.insert(0, {folder!r})
import stuck_reward

faulthandler.register(signal.SIGUSR1, file=open({stacks!r}, "w"), all_threads=True)
# Two calls at once leave two workers in the pool: one idle while the main thread's call is stuck.
callers = [threading.Thread(target=call_with_time_limit, args=(time.sleep, (0.3,), {{}}),
                            kwargs=dict(limit_s=5, what=lambda: "f")) for _ in range(2)]
for caller in callers:
    caller.start()
for caller in callers:
    caller.join()
# The test sends the signal from outside, as the daemon does, once the call below is under way: a thread of this
# process sending it (threading.Timer) may take the signal itself while it exits, and faulthandler walking the
# threads then reads the exiting one's freed state and crashes (CPython 3.11, about 1 run in 20 under load).
open({ready!r}, "w").close()
try:
    call_with_time_limit(stuck_reward.compute_score, ("gsm8k", "1", "1", None), {{}}, limit_s=2, what=lambda: "f")
except Exception as error:
    print(type(error).__name__)
"""

STUCK = """import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(30)
"""


def test_a_hang_in_a_reward_call_on_the_pool_is_placed_in_the_users_function(tmp_path):
    (tmp_path / "stuck_reward.py").write_text(STUCK)
    stacks = tmp_path / "stacks.txt"
    ready = tmp_path / "ready"
    script = SCRIPT.format(repo=str(REPO), folder=str(tmp_path), stacks=str(stacks), ready=str(ready))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # well inside the call's 2 s limit
        child.send_signal(signal.SIGUSR1)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert (child.returncode, out.strip()) == (0, "RewardTimeoutError"), err
    text = stacks.read_text()
    assert "in _work" in text, text  # the idle worker is in the dump
    assert hang_place(text) == f"{tmp_path / 'stuck_reward.py'}:5 in compute_score", text
