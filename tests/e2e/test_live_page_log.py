"""A real run's live page, opened after the run has outlived its history: its log panel has missed
nothing, shows each checkpoint once, newest line first; its offload summary names the device that
holds each group (the CPU, on this machine) apart from offload_policy's placement, and so does
`verl status --json`. Stopped, the run ends with its summary.

Headless Chromium drives the page (tests/e2e/test_live_page.py has the helpers); without it the test skips.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.client import page_url
from tests.e2e.runs import LiveRun, verl_train
from tests.e2e.test_live_page import chromium, open_tab

HISTORY_SECONDS = 10
SAVE_FREQ = 2


@pytest.fixture
def live_run(tmp_path: Path) -> Iterator[LiveRun]:
    """The e2e quickstart with a short history, frequent checkpoints and the actor offloaded to the host."""
    with verl_train(tmp_path, "trainer.total_training_steps=2000", f"trainer.save_freq={SAVE_FREQ}",
                    f"telemetry.history_seconds={HISTORY_SECONDS}",
                    "actor_rollout_ref.actor.fsdp_config.param_offload=true") as run:
        yield run


async def _page(devtools: str, run: LiveRun) -> dict:
    """The page's log lines (written time, text) and offload table once it has caught up with the run."""
    tab = await open_tab(devtools, page_url(run.url, run.token))
    try:
        await tab.wait_until("document.body.dataset.state === 'ready'", what="the page to load")
        last_seq = run.json("/v1/metrics/history", since=0, kinds="status")["last_seq"]
        await tab.wait_until(f"+document.body.dataset.lastSeq >= {last_seq}", what="the page to catch up")
        await tab.wait_until("document.querySelectorAll('#offload tbody tr').length > 0", what="the offload summary")
        return await tab.evaluate(
            "({log: [...document.querySelectorAll('#log li')].map(li => [+li.dataset.time, li.textContent]),"
            " offload: [...document.querySelectorAll('#offload tbody tr')].map(row => [...row.cells].map("
            "cell => cell.textContent)), note: document.getElementById('offload-note').textContent})")
    finally:
        await tab.socket.close()


def test_a_page_opened_late_shows_each_checkpoint_once_in_order_and_the_groups_on_the_cpu(live_run, tmp_path):
    run = live_run
    # Outlive the history, so that the page's first load (since=0) finds its start pruned.
    run.wait(lambda: run.json("/v1/status")["run"]["uptime_s"] > HISTORY_SECONDS + 2 and run.step() >= 3 * SAVE_FREQ,
             timeout=180, what="the run to outlive its history")
    assert run.json("/v1/metrics/history", since=0)["events"][0]["seq"] > 1

    with chromium(tmp_path) as devtools:
        page = asyncio.run(_page(devtools, run))
    lines = [text for _, text in page["log"]]
    assert not [line for line in lines if "missed" in line], lines
    saved = [match.group(1) for line in lines for match in [re.search(r"checkpoint saved.*(global_step_\d+)", line)]
             if match]
    assert saved and len(saved) == len(set(saved)), lines
    times = [written for written, _ in page["log"]]
    assert times == sorted(times, reverse=True), page["log"]

    # Every group is held by the CPU, the compute device here; the actor's are the offloaded ones.
    rows = {(model, group): (device, offloaded) for model, group, device, offloaded, _ in page["offload"]}
    assert {device for device, _ in rows.values()} == {"cpu"}, rows
    assert {model for (model, _), (_, offloaded) in rows.items() if offloaded == "yes"} == {"actor"}, rows
    assert "the run computes on the CPU" in page["note"]
    status = run.verl("status", "--pid", str(run.process.pid), "--json")
    assert status.returncode == 0, status.stderr
    summary = json.loads(status.stdout)["offload"]["summary"]
    assert {row["device"] for row in summary} == {"cpu"}, summary
    assert {(row["role"], row["placement"]) for row in summary} >= {("actor", "cpu"), ("critic", "gpu")}, summary

    run.process.send_signal(signal.SIGTERM)
    assert run.process.wait(timeout=120) == 0
    time.sleep(0.2)
    stopped = re.search(r"^run quickstart stopped at step (\d+)/2000 after \d+:\d\d$", run.output(), re.MULTILINE)
    assert stopped, run.output()[-3000:]
    assert f"checkpoints: runs/quickstart/checkpoints (latest: global_step_{stopped.group(1)})" in run.output()
