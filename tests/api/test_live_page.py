"""The live page as the API serves it: a static shell at / that shows nothing without the token, its
files from api/static (shipped in the wheel), nothing loaded from the network, every call it makes
behind the token, and /v1/hints, the advisor's hints it shows.

tests/e2e/test_live_page.py drives the page in a real browser against a real run.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from api.app import STATIC_DIR, create_app
from api.client import page_url
from api.hub import TelemetryHub
from api.schemas import SettingsBody
from tests.e2e.runs import wait_for
from tests.e2e.test_live_page import chromium, open_tab
from tests.support import run_status
from trainer.config.live import LiveSettings
from trainer.config.messages import CopyCount, CopySample, OffloadMessage, OffloadSummaryRow, RunStatus

REPO = Path(__file__).resolve().parents[2]
TOKEN = "page-token_for-tests"
RUN_NAME = "secret-run-name"


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class FakeControl:
    def __init__(self) -> None:
        self.offload_summary: list[OffloadSummaryRow] = []

    def status(self) -> RunStatus:
        return run_status(name=RUN_NAME, step=5, total_steps=200, summary=self.offload_summary)

    def settings(self) -> SettingsBody:
        return SettingsBody(values=LiveSettings(), version=0, acknowledged_version=0, applied_at_step=None,
                            settings=[])

    def update_settings(self, change: dict) -> dict:
        raise AssertionError("the page tests change no settings")

    def request_checkpoint(self) -> dict:
        return {}

    def request_stop(self) -> dict:
        return {}


@dataclass
class Served:
    url: str
    hub: TelemetryHub
    clock: Clock
    control: FakeControl

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, trust_env=False, timeout=5)


@pytest.fixture
def served(serve) -> Iterator[Served]:
    with serving(serve) as running:
        yield running


@contextmanager
def serving(serve, **hub_options) -> Iterator[Served]:
    clock = Clock()
    hub, control = TelemetryHub(history_seconds=600, clock=clock, **hub_options), FakeControl()
    app = create_app(hub=hub, registry=CollectorRegistry(), control=control, token=TOKEN)
    with serve(app) as url:
        yield Served(url, hub, clock, control)


def static_files() -> list[Path]:
    return sorted(path for path in STATIC_DIR.iterdir() if path.is_file())


# ---------------------------------------------------------------------------------------- the page


@pytest.mark.parametrize("query", ["", f"?token={TOKEN}", "?token=wrong"])
def test_the_page_is_a_shell_that_holds_nothing_of_the_run(served: Served, query: str) -> None:
    """Whatever the token, / is the same static file: the run's data come only through token-checked calls."""
    response = served.client(token=None).get("/" + query)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert response.content == (STATIC_DIR / "index.html").read_bytes()
    assert RUN_NAME not in response.text and TOKEN not in response.text


def test_the_page_can_load_nothing_from_elsewhere_nor_be_framed(served: Served) -> None:
    headers = served.client(token=None).get("/").headers
    policy = dict(part.strip().split(" ", 1) for part in headers["content-security-policy"].split(";"))
    assert policy["default-src"] == "'none'" and policy["script-src"] == "'self'"
    assert policy["connect-src"] == "'self'" and policy["frame-ancestors"] == "'none'"
    # The first address holds the token: no Referer may carry it anywhere.
    assert headers["referrer-policy"] == "no-referrer"


def test_every_file_the_page_references_is_served_from_the_package(served: Served) -> None:
    html = (STATIC_DIR / "index.html").read_text(encoding="utf-8")
    referenced = re.findall(r'(?:src|href)="([^"]+)"', html)
    local = [ref for ref in referenced if not ref.startswith("data:")]
    assert "/static/app.js" in local and "/static/style.css" in local
    imports = re.findall(r'from "\./([^"]+)"', (STATIC_DIR / "app.js").read_text(encoding="utf-8"))
    assert imports == ["charts.js"]
    client = served.client(token=None)
    for path in [*local, *(f"/static/{name}" for name in imports)]:
        response = client.get(path)
        assert response.status_code == 200, path
        assert response.content == (STATIC_DIR / path.removeprefix("/static/")).read_bytes()
    assert client.get("/static/app.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/static/style.css").headers["content-type"].startswith("text/css")


@pytest.mark.parametrize("path", ["/static/nothing.js", "/static/..%2Fapp.py", "/static/%2E%2E%2Fsecurity.py",
                                  "/static/../app.py"])
def test_nothing_but_the_shipped_files_is_served(served: Served, path: str) -> None:
    response = served.client(token=None).get(path)
    assert response.status_code == 404
    assert "def create_app" not in response.text


def test_no_file_of_the_page_names_another_host() -> None:
    """No CDN, fonts or analytics: the page works on a machine without network."""
    for path in static_files():
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.IGNORECASE), path.name
        assert "@import" not in text and "url(" not in text, path.name


def test_every_call_of_the_page_needs_the_token(served: Served) -> None:
    script = (STATIC_DIR / "app.js").read_text(encoding="utf-8")
    calls = set(re.findall(r'api\("(/v1/[a-z/]+)"', script))
    assert {"/v1/status", "/v1/settings", "/v1/hints"} <= calls
    for path in sorted(calls):
        assert served.client(token=None).get(path).status_code == 401, path
        assert served.client(token="wrong").get(path).status_code == 401, path
        assert served.client().get(path).status_code == 200, path
    # The stream gets the token as a subprotocol, not in its URL (where logs would keep it).
    [opening] = re.findall(r"new WebSocket\(([^;]+)\);", script)
    assert "bearer.${page.token}" in opening and "token=" not in opening


def test_a_foreign_host_gets_no_page_on_loopback(served: Served) -> None:
    response = served.client(token=None).get("/", headers={"Host": "rebound.example.com"})
    assert response.status_code == 403


def test_the_page_url_carries_the_token_escaped() -> None:
    assert page_url("http://127.0.0.1:8000", "a b/c") == "http://127.0.0.1:8000/?token=a%20b%2Fc"
    assert page_url("http://[::1]:8000/", TOKEN) == f"http://[::1]:8000/?token={TOKEN}"


# ------------------------------------------------------------------------------------------- hints


def test_hints_are_empty_when_nothing_looks_wrong(served: Served) -> None:
    body = served.client().get("/v1/hints").json()
    assert body == {"time": served.clock.now, "hints": []}


def test_slow_offload_copies_give_a_hint(served: Served) -> None:
    served.hub.publish("offload", OffloadMessage(
        copies=[CopySample(direction="h2d", group="transformer", bytes=1 << 26, seconds=0.120)] * 20,
        counts=[CopyCount(direction="h2d", group="transformer", copies=20, bytes=20 << 26)]))
    hints = served.client().get("/v1/hints").json()["hints"]
    assert len(hints) == 1 and "p99 120 ms" in hints[0]


def test_a_minute_of_an_idle_gpu_with_offload_says_over_offloaded(served: Served) -> None:
    served.control.offload_summary = [OffloadSummaryRow(role="actor", group="transformer", placement="cpu",
                                                        device="cpu", bytes=1 << 30)]
    for _ in range(40):
        served.hub.publish("gpu", {"nvml": True, "gpus": [{"index": 0, "utilization_ratio": 0.3,
                                                           "memory_used_bytes": 10, "memory_total_bytes": 100}]})
        served.clock.now += 1.0
    hints = served.client().get("/v1/hints").json()["hints"]
    assert len(hints) == 1 and hints[0].startswith("GPU 0 averaged 30% utilization")
    # Samples older than the advisor's window no longer count.
    served.clock.now += 120
    assert served.client().get("/v1/hints").json()["hints"] == []


# ------------------------------------------------------------------------------- in a browser: the log


LOG_LINES = "[...document.querySelectorAll('#log li')].map(li => [+li.dataset.time, li.textContent])"


def log_event(hub: TelemetryHub, message: str, *, source: str, written: float | None = None) -> None:
    data = {"level": "info", "message": message, "source": source}
    if written is not None:
        data["time"] = written
    hub.publish("log", data)


async def _page_log(devtools: str, url: str, *, settled: str = "true") -> list[list]:
    """The log panel of the page at `url` once it has loaded, received the last event and `settled`."""
    tab = await open_tab(devtools, url)
    try:
        await tab.wait_until("document.body.dataset.state === 'ready'", what="the page to load")
        await tab.wait_until(settled, what="the page to settle")
        return await tab.evaluate(LOG_LINES)
    finally:
        await tab.socket.close()


def test_the_log_panel_orders_lines_by_when_they_were_written_and_misses_nothing_on_a_load(
        serve, tmp_path: Path) -> None:
    """A run older than its history: the page's first load (since=0) has missed nothing; a trainer's line
    that reached the daemon after a later daemon line goes below it; newest first throughout."""
    with serving(serve) as running, chromium(tmp_path) as devtools:
        hub, clock = running.hub, running.clock
        for number in range(300):
            log_event(hub, f"old line {number}", source="daemon")
        clock.now += 601  # all of those age out of the 600 s history
        log_event(hub, "trainer pid 7 connected", source="daemon")
        clock.now += 1
        # Written before the daemon's line above (the trainer's start waits for its connection).
        log_event(hub, "Embedding: OFFLOADED to CPU", source="trainer", written=clock.now - 2)
        clock.now += 1
        log_event(hub, "checkpoint saved: global_step_10", source="trainer", written=clock.now)
        url = page_url(running.url, TOKEN)
        lines = asyncio.run(_page_log(devtools, url, settled=f"+document.body.dataset.lastSeq === {hub.last_seq}"))
    texts = [text.split(" ", 1)[1] for _, text in lines]
    assert texts == ["trainer checkpoint saved: global_step_10", "daemon trainer pid 7 connected",
                     "trainer Embedding: OFFLOADED to CPU"]
    times = [written for written, _ in lines]
    assert times == sorted(times, reverse=True)


def test_a_page_that_falls_behind_during_its_replay_gets_every_event_and_no_missed_line(
        serve, tmp_path: Path) -> None:
    """The stream resumes from the history when the page reads slower than the run publishes (a gap with
    nothing lost): every event arrives, and the page says nothing was missed."""
    with serving(serve, subscriber_queue_size=2) as running, chromium(tmp_path) as devtools:
        hub = running.hub
        for number in range(3000):
            hub.publish("gpu", {"nvml": False, "gpus": [], "n": number})

        def publish_while_the_page_replays() -> None:
            wait_for(lambda: len(hub._subscriptions) > 0, timeout=30, interval=0.005, what="the page's stream")
            for number in range(20):
                log_event(hub, f"live line {number}", source="daemon")

        publisher = threading.Thread(target=publish_while_the_page_replays)
        publisher.start()
        try:
            lines = asyncio.run(_page_log(devtools, page_url(running.url, TOKEN),
                                          settled="+document.body.dataset.lastSeq === 3020"))
        finally:
            publisher.join()
    texts = [text for _, text in lines]
    assert not [text for text in texts if "missed" in text], texts
    assert [text.split(" ", 1)[1] for text in texts] == [f"daemon live line {number}" for number in range(19, -1, -1)]


# ---------------------------------------------------------------------------------------- packaging


def test_a_built_wheel_ships_the_page(tmp_path: Path) -> None:
    """What a pip-installed verl serves at /: every file of api/static is in the wheel."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("api", "daemon", "trainer"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                             "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    [wheel] = (tmp_path / "wheel").glob("*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    assert {f"api/static/{path.name}" for path in static_files()} <= shipped
