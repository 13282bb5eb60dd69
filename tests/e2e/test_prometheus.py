"""A real Prometheus (Debian's package) scrapes a real `verl train` run on loopback with the shipped scrape
config, and every query of the Grafana dashboards runs against what it scraped.

Every metric a dashboard reads must be in the run's /metrics, or on the list of metrics a later issue
adds (LATER_METRICS in tests/dashboards/queries.py).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from tests.dashboards import queries as q

SCRAPE_INTERVAL = "1s"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape_config_for(run, token_file: Path) -> dict:
    """The shipped scrape config, pointed at this run and sending its token from a file (the way the
    config's comments describe for a run outside Docker)."""
    config = yaml.safe_load(q.SCRAPE_CONFIG.read_text(encoding="utf-8"))
    config["global"]["scrape_interval"] = SCRAPE_INTERVAL
    [job] = [job for job in config["scrape_configs"] if job["job_name"] == "verl"]
    job["static_configs"] = [{"targets": [urlsplit(run.url).netloc]}]
    job["authorization"] = {"type": "Bearer", "credentials_file": str(token_file)}
    return config


@contextmanager
def prometheus(tmp_path: Path, config: dict) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is missing: `make test` installs Debian's prometheus package where it can")
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    address = f"127.0.0.1:{free_port()}"
    with (tmp_path / "prometheus.log").open("w") as log:
        server = subprocess.Popen([binary, f"--config.file={config_file}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address={address}", "--log.level=warn"],
                                  stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{address}"
    try:
        wait_for(lambda: _ready(url) or server.poll() is not None, what="Prometheus to be ready")
        assert server.poll() is None, (tmp_path / "prometheus.log").read_text()
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/-/ready", timeout=2, trust_env=False).status_code == 200
    except httpx.TransportError:
        return False


def wait_for(condition: Callable[[], object], *, what: str, timeout: float = 30) -> object:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return value


def query(url: str, promql: str) -> dict:
    """Prometheus's HTTP API answer to an instant query (status "success" or "error")."""
    return httpx.get(url + "/api/v1/query", params={"query": promql}, timeout=10, trust_env=False).json()


def values(url: str, promql: str) -> list[float]:
    answer = query(url, promql)
    assert answer["status"] == "success", answer
    return [float(sample["value"][1]) for sample in answer["data"]["result"]]


def test_every_dashboard_metric_is_in_a_real_runs_metrics(live_run) -> None:
    live_run.wait(lambda: live_run.step() >= 1, what="the first step")
    exported = q.exported_names(live_run.get("/metrics").text)
    assert q.unknown_metrics(q.all_queries(), exported) == []
    landed = sorted(set(q.LATER_METRICS) & exported)
    assert landed == [], f"{landed} are exported now: remove them from LATER_METRICS in tests/dashboards/queries.py"


def test_prometheus_scrapes_a_real_run_and_runs_every_dashboard_query(live_run, tmp_path: Path) -> None:
    token_file = tmp_path / "verl-token"
    token_file.write_text(live_run.token, encoding="utf-8")
    with prometheus(tmp_path, scrape_config_for(live_run, token_file)) as url:
        started = time.time()
        # The first scrapes may come before step 1 (a counter at 0): wait for a step, not for a scrape.
        steps = live_run.wait(lambda: (found := values(url, "verl_trainer_steps_total")) and found[0] >= 1 and found,
                              what="a scraped step counter of at least 1")
        assert len(steps) == 1
        assert steps[0] <= live_run.step()  # the run's own counter, read after the scrape
        assert values(url, 'up{job="verl"}') == [1.0]
        run_info = query(url, "verl_run_info")["data"]["result"]
        assert [series["metric"]["run"] for series in run_info] == ["quickstart"]

        # Rates need two scrapes with steps between them.
        live_run.wait(lambda: values(url, "rate(verl_trainer_steps_total[1m])") and
                      values(url, "rate(verl_trainer_steps_total[1m])")[0] > 0, what="a step rate")
        failures = [f"{each.where}: {answer.get('error')}" for each in q.all_queries()
                    if (answer := query(url, each.promql))["status"] != "success"]
        assert failures == []
        by_title = {panel["title"]: panel for path in q.dashboard_files() for panel in q.panels(q.load(path))}
        for title in ("Reward", "Step phase durations", "Tokens per second", "Host CPU and memory"):
            promql = q.expand(by_title[title]["targets"][0]["expr"])
            # Rates and quantiles fill once a few scrapes have landed: on a loaded machine that takes a while.
            live_run.wait(lambda promql=promql: values(url, promql), timeout=90,
                          what=f"panel {title!r} to show data for a running run: {promql}")
        _annotations_mark_a_setting_change_and_a_restart(live_run, url, since=started)


def _annotations_mark_a_setting_change_and_a_restart(run, url: str, *, since: float) -> None:
    """`verl set` and a killed trainer each show as an annotation, even where Grafana's steps fall worst.

    Grafana runs an annotation's expression as a range query over the dashboard's time span, one point per
    `step`, starting at a multiple of the step. A change lands anywhere between two steps; the worst place
    is between the last scrape of one step's window and the first of the next. The steps here are placed
    so that one ends there: a window of one step misses the change (the audit's 2 annotations for 4 changes).
    """
    changed = run.verl("set", "gpu_memory_threshold=0.8", "--pid", str(run.process.pid))
    assert changed.returncode == 0, changed.stderr
    os.kill(run.runtime()["trainer_pids"][0], signal.SIGKILL)
    annotations = {annotation["name"]: annotation for path in q.dashboard_files()
                   for annotation in q.load(path)["annotations"]["list"]}
    # Labelled by the canonical name, though `verl set` was given the short one.
    setting = "dynamic_offload.gpu_memory_threshold"
    marked = {"Live setting changes": (f'verl_setting_updates_total{{setting="{setting}", result="accepted"}}',
                                       {"setting": setting, "result": "accepted"}),
              "Trainer restarts": ('verl_trainer_restarts_total{reason="signal"}', {"reason": "signal"})}
    for name, (series, labels) in marked.items():
        run.wait(lambda series=series: values(url, series) == [1.0], what=f"Prometheus to scrape {series} at 1")
        before, after = _scrapes_around_the_change(url, series, since=since)
        annotation = annotations[name]
        window = q.seconds(q.INTERVALS["$__rate_interval"])
        points = _annotation_points(url, annotation, labels, boundary=(before + after) / 2, since=since)
        assert any(before < point <= after + window for point in points), \
            f"annotation {name!r} misses {series} going to 1 between {before} and {after}: points at {points}"
        # The steps sit where they should: the one-step window the dashboard had sees nothing there.
        one_step = {**annotation, "expr": annotation["expr"].replace("$__rate_interval", "$__interval")}
        assert _annotation_points(url, one_step, labels, boundary=(before + after) / 2, since=since) == []


def _scrapes_around_the_change(url: str, series: str, *, since: float) -> tuple[float, float]:
    """The times of the last scrape of `series` at 0 and of the first at 1."""
    span = math.ceil(time.time() - since) + 5
    [found] = query(url, f"{series}[{span}s]")["data"]["result"]
    samples = [(float(when), float(value)) for when, value in found["values"]]
    first = next(index for index, (_, value) in enumerate(samples) if value >= 1)
    assert first > 0, f"{series} was never scraped at 0: the change is not an increase ({samples[:3]})"
    return samples[first - 1][0], samples[first][0]


def _annotation_points(url: str, annotation: dict, labels: dict, *, boundary: float, since: float) -> list[float]:
    """The times at which Grafana would mark `annotation` for the series with `labels` (values above 0):
    its expression as a range query from `since` on, at the annotation's step, one step ending at `boundary`."""
    step = q.seconds(annotation["step"])
    start = boundary - step * math.ceil((boundary - since) / step)
    answer = httpx.get(url + "/api/v1/query_range", timeout=10, trust_env=False,
                       params={"query": q.expand(annotation["expr"]), "start": start, "end": boundary + 4 * step,
                               "step": step}).json()
    assert answer["status"] == "success", answer
    return [float(when) for found in answer["data"]["result"] if labels.items() <= found["metric"].items()
            for when, value in found["values"] if float(value) > 0]


def test_without_the_token_prometheus_scrapes_nothing(live_run, tmp_path: Path) -> None:
    """The token is what lets Prometheus in (unless the run sets telemetry.public_metrics)."""
    config = scrape_config_for(live_run, tmp_path / "verl-token")
    del config["scrape_configs"][0]["authorization"]
    with prometheus(tmp_path, config) as url:
        live_run.wait(lambda: values(url, 'up{job="verl"}'), what="a first scrape")
        assert values(url, 'up{job="verl"}') == [0.0]
        assert values(url, "verl_trainer_steps_total") == []
