"""The live page in headless Chromium (Debian's package) against a real `verl train` run, driven through the
Chrome DevTools protocol: the URL `verl train` and `verl monitor --web` print opens it, its charts fill
from the stream (the run offloads the actor to the CPU, so the offload charts fill too), the threshold form
changes the run's setting, and without the token it shows nothing.

On this CPU-only machine the GPU charts stay empty (no NVML), and the transformer layers on the GPU do not
move (dynamic offload needs a GPU to measure memory on): the layers chart shows the count the step metrics
report, against the run's min_transformer_layers_on_gpu.

A screenshot is kept as an artifact (its path is printed): $VERL_TEST_ARTIFACTS, else
<tmp>/verl-test-artifacts/live_page.png.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import websockets

from tests.e2e.runs import LiveRun, verl_train

VIEWPORT = {"width": 1400, "height": 1850}
STEP_CHARTS = ("chart-reward", "chart-kl", "chart-loss", "chart-throughput", "chart-phases", "chart-layers")
OFFLOAD_CHARTS = ("chart-offload-latency", "chart-offload-bandwidth")
MIN_LAYERS_ON_GPU = 1
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
                  # Keep timers and frames going in a tab the test is not looking at.
                  "--disable-background-timer-throttling", "--disable-renderer-backgrounding",
                  "--disable-backgrounding-occluded-windows", "--remote-debugging-port=0"]


def artifacts_dir() -> Path:
    return Path(os.environ.get("VERL_TEST_ARTIFACTS") or Path(tempfile.gettempdir()) / "verl-test-artifacts")


# ----------------------------------------------------------------------------------------- Chromium


@contextmanager
def chromium(tmp_path: Path) -> Iterator[str]:
    """A headless Chromium; yields its DevTools HTTP address."""
    binary = shutil.which("chromium")
    if binary is None:
        pytest.skip("chromium is missing: `make test` installs Debian's chromium package where it can")
    profile = tmp_path / "chromium-profile"
    with (tmp_path / "chromium.log").open("w") as log:
        # Its own session, so the browser's helper processes end with it.
        browser = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert browser.poll() is None, (tmp_path / "chromium.log").read_text()
            assert time.monotonic() < deadline, "Chromium did not open its DevTools port"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port_file.read_text().split()[0]}"
    finally:
        os.killpg(browser.pid, signal.SIGTERM)
        try:
            browser.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(browser.pid, signal.SIGKILL)
            browser.wait()


class Tab:
    """One page target over the DevTools protocol: commands and JavaScript evaluation.

    Spoken through the websockets package the project already has: browser-automation libraries
    (Playwright, pyppeteer) fetch browser builds of their own, which this machine cannot download.
    """

    def __init__(self, socket):
        self.socket = socket
        self.last_id = 0

    async def call(self, method: str, **params) -> dict:
        self.last_id += 1
        await self.socket.send(json.dumps({"id": self.last_id, "method": method, "params": params}))
        while True:
            message = json.loads(await asyncio.wait_for(self.socket.recv(), timeout=30))
            if message.get("id") == self.last_id:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                return message["result"]

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_until(self, expression: str, *, what: str, timeout: float = 45):
        """The expression's value once truthy; while the page loads it may throw (no body yet)."""
        guarded = f"(() => {{ try {{ return ({expression}); }} catch (error) {{ return null; }} }})()"
        deadline = time.monotonic() + timeout
        while not (value := await self.evaluate(guarded)):
            if time.monotonic() > deadline:
                state = await self.evaluate("document.body.innerText.slice(0, 2000)")
                raise AssertionError(f"timed out waiting for {what}; the page shows:\n{state}")
            await asyncio.sleep(0.2)
        return value


async def open_tab(devtools: str, url: str, target_id: str | None = None) -> Tab:
    """Attach to a page target (the first one, or `target_id`) and load `url` in it."""
    targets = httpx.get(devtools + "/json/list", timeout=5, trust_env=False).json()
    target = next(target for target in targets if target["type"] == "page" and target_id in (None, target["id"]))
    tab = Tab(await websockets.connect(target["webSocketDebuggerUrl"], max_size=None))
    await tab.call("Emulation.setDeviceMetricsOverride", deviceScaleFactor=1, mobile=False, **VIEWPORT)
    await tab.call("Page.navigate", url=url)
    return tab


# -------------------------------------------------------------------------------------------- tests


@pytest.fixture
def live_run(tmp_path: Path) -> Iterator[LiveRun]:
    """The e2e quickstart run with the actor's parameters on the CPU: its copies feed the offload charts
    (on the CPU the engine times them with the host clock), and a minimum of layers for the layers chart."""
    with verl_train(tmp_path, "trainer.total_training_steps=2000",
                    "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                    "actor_rollout_ref.actor.fsdp_config.dynamic_offload.enabled=true",
                    f"dynamic_offload.min_transformer_layers_on_gpu={MIN_LAYERS_ON_GPU}") as run:
        yield run


def test_the_printed_urls_open_the_live_page(live_run, tmp_path: Path, capsys) -> None:
    printed = re.search(r"^  page:\s+(\S+)$", live_run.output(), re.MULTILINE)
    assert printed, f"`verl train` printed no page URL:\n{live_run.output()}"
    url = printed[1]
    assert url == f"{live_run.url}/?token={live_run.token}"
    web = live_run.verl("monitor", "--pid", str(live_run.process.pid), "--web")
    assert web.returncode == 0, web.stderr
    assert web.stdout.strip() == url and "token" in web.stderr
    mixed = live_run.verl("monitor", "--pid", str(live_run.process.pid), "--web", "--once")
    assert mixed.returncode == 2 and mixed.stderr.startswith("ERROR:") and url not in mixed.stdout

    with chromium(tmp_path) as devtools:
        screenshot = asyncio.run(_drive_the_page(devtools, url, live_run))
    (tmp_path / "live_page.png").write_bytes(screenshot)
    kept = artifacts_dir() / "live_page.png"
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_bytes(screenshot)
    with capsys.disabled():
        print(f"\nlive page screenshot: {kept}")


async def _drive_the_page(devtools: str, url: str, run) -> bytes:
    tab = await open_tab(devtools, url)
    try:
        await tab.wait_until("document.body.dataset.state === 'ready'", what="the page to load")
        # The token left the address bar for the tab's storage.
        assert "token" not in await tab.evaluate("location.href")
        assert await tab.evaluate("sessionStorage.getItem('verl-token')") == run.token
        assert "quickstart" in await tab.evaluate("document.getElementById('run-name').textContent")

        await _charts_receive_data(tab)
        await _offload_charts_receive_data(tab, run)
        await _the_form_changes_the_threshold(tab, run)
        await asyncio.sleep(1.0)  # a few more points and a settled frame for the picture
        await tab.call("Page.bringToFront")
        shot = await tab.call("Page.captureScreenshot", format="png")
        await _without_the_token_it_shows_nothing(devtools, run)
        return base64.b64decode(shot["data"])
    finally:
        await tab.socket.close()


async def _charts_receive_data(tab: Tab) -> None:
    points = "Object.fromEntries([...document.querySelectorAll('canvas')].map(c => [c.id, +(c.dataset.points||0)]))"
    first = await tab.wait_until(f"(p => {json.dumps(STEP_CHARTS)}.every(id => p[id] >= 2) && p)({points})",
                                 what="the step charts to fill")
    assert first["chart-host"] > 0, first
    # Live, not only the replay: more points arrive while the page is open.
    await tab.wait_until(f"({points})['chart-reward'] > {first['chart-reward']}", what="a live step")
    assert await tab.evaluate("document.getElementById('stream').dataset.state") == "live"
    assert int(await tab.evaluate("document.body.dataset.points")) >= sum(first.values())


async def _offload_charts_receive_data(tab: Tab, run) -> None:
    """The actor's copies fill the latency and bandwidth charts; the layers chart shows the actor's step
    metric against min_transformer_layers_on_gpu; the summary lists the actor's groups as offloaded."""
    points = "(id => +(document.getElementById(id).dataset.points || 0))"
    for chart in OFFLOAD_CHARTS:
        await tab.wait_until(f"{points}('{chart}') >= 2", what=f"{chart} to fill with the run's copies")
    legend = await tab.evaluate("document.getElementById('legend-offload-latency').textContent")
    assert "p50" in legend and "p99" in legend, legend

    # On the CPU the layers stay where they were placed: the count is the same at every step. One
    # series per offloaded model: here the actor's.
    on_gpu = run.json("/v1/metrics/latest")["step"]["metrics"]["offload/actor/transformer_layers_on_gpu"]
    shown = await tab.evaluate("document.querySelector('#legend-layers b').textContent")
    assert float(shown) == on_gpu
    assert "actor" in await tab.evaluate("document.getElementById('legend-layers').textContent")
    lines = json.loads(await tab.evaluate("document.getElementById('chart-layers').dataset.lines"))
    assert lines == {"dynamic_offload.min_transformer_layers_on_gpu": MIN_LAYERS_ON_GPU}

    offloaded = await tab.evaluate("[...document.querySelectorAll('#offload tbody tr')]"
                                   ".filter(row => row.cells[3].textContent === 'yes')"
                                   ".map(row => row.cells[0].textContent)")
    assert offloaded and set(offloaded) == {"actor"}, offloaded


async def _the_form_changes_the_threshold(tab: Tab, run) -> None:
    submit = ("(value => { const input = document.getElementById('threshold-input'); input.value = value;"
              " document.getElementById('threshold-form').requestSubmit(); })")
    await tab.evaluate(f"{submit}('1.5')")
    rejected = await tab.wait_until("(o => o.dataset.kind === 'error' && o.textContent)"
                                    "(document.getElementById('threshold-result'))", what="the rejection")
    assert "dynamic_offload.gpu_memory_threshold" in rejected
    assert run.json("/v1/settings")["values"]["dynamic_offload.gpu_memory_threshold"] == 0.85

    await tab.evaluate(f"{submit}('0.7')")
    accepted = await tab.wait_until("(o => o.dataset.kind === 'ok' && o.textContent)"
                                    "(document.getElementById('threshold-result'))", what="the change")
    assert "0.85 → 0.7" in accepted
    assert run.json("/v1/settings")["values"]["dynamic_offload.gpu_memory_threshold"] == 0.7
    # The trainer's acknowledgement comes back over the stream.
    await tab.wait_until("document.getElementById('settings-version').textContent.includes('in effect from step')",
                         what="the trainer's acknowledgement on the page")
    row = await tab.evaluate("document.querySelector('tr[data-setting=\"dynamic_offload.gpu_memory_threshold\"]')"
                             ".cells[1].textContent")
    assert row == "0.7"
    lines = json.loads(await tab.evaluate("document.getElementById('chart-gpu-memory').dataset.lines"))
    assert lines == {"threshold": 0.7}
    # The long canonical names wrap within the settings panel rather than push the page sideways.
    overflow = await tab.evaluate("(s => [s.scrollWidth, s.clientWidth, document.documentElement.scrollWidth,"
                                  " document.documentElement.clientWidth])(document.querySelector('aside section'))")
    assert overflow[0] <= overflow[1] and overflow[2] <= overflow[3], overflow


async def _without_the_token_it_shows_nothing(devtools: str, run) -> None:
    """A new tab (its own sessionStorage) opened on the bare address."""
    created = httpx.put(f"{devtools}/json/new?about:blank", timeout=5, trust_env=False).json()
    tab = await open_tab(devtools, run.url + "/", created["id"])
    try:
        await tab.wait_until("document.body.dataset.state === 'locked'", what="the page to lock")
        text = await tab.evaluate("document.body.innerText")
        assert "needs the run's token" in text and "quickstart" not in text
        assert await tab.evaluate("document.getElementById('dashboard').children.length") == 0
    finally:
        await tab.socket.close()
