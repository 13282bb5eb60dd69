"""The Grafana dashboards and the Prometheus scrape config, checked without a running Grafana: file
provisioning rules, the panels an overview of a run needs, every PromQL expression parsed by promtool,
and every metric name it reads exported by the daemon's collectors.

tests/e2e/test_prometheus.py runs the same expressions in a real Prometheus scraping a real run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from api.prometheus import TelemetryMetrics
from tests.dashboards import queries as q

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
REQUIRED_VARIABLES = ("instance", "gpu", "run")


@pytest.fixture(scope="module")
def dashboards() -> list[tuple[str, dict]]:
    files = q.dashboard_files()
    assert files, f"no dashboard JSON in {q.DASHBOARD_DIR}"
    return [(path.name, q.load(path)) for path in files]


@pytest.fixture(scope="module")
def overview(dashboards) -> dict:
    found = [dashboard for _, dashboard in dashboards if dashboard["uid"] == "verl-run-overview"]
    assert found, "the run overview dashboard (uid verl-run-overview) is missing"
    return found[0]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is missing: `make test` installs Debian's prometheus package where it can")
    return path


# --------------------------------------------------------------------------------------- provisioning


def test_dashboards_are_provisionable_by_file(dashboards) -> None:
    uids = [dashboard.get("uid") for _, dashboard in dashboards]
    assert len(set(uids)) == len(uids), f"dashboard uids must be unique: {uids}"
    for name, dashboard in dashboards:
        # A fixed uid keeps links and the home dashboard stable across provisioning runs; Grafana caps it at 40.
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard.get("uid") or ""), name
        assert dashboard.get("id") is None, f"{name}: a provisioned dashboard carries no database id"
        assert "__inputs" not in dashboard, f"{name}: exported 'for sharing' (with __inputs): provisioning " \
                                            "does not fill those in"
        text = (q.DASHBOARD_DIR / name).read_text(encoding="utf-8")
        assert "${DS_" not in text, f"{name}: a ${{DS_...}} placeholder stays unresolved when provisioned"


def test_every_query_goes_through_the_datasource_variable(dashboards) -> None:
    for name, dashboard in dashboards:
        variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
        assert variables.get("datasource", {}).get("type") == "datasource", name
        assert variables["datasource"]["query"] == "prometheus", name
        for panel in q.panels(dashboard):
            if panel["type"] == "row":
                continue
            assert panel.get("datasource") == DATASOURCE, f"{name}: panel {panel['title']!r}"
            for target in panel.get("targets", []):
                assert target.get("datasource") == DATASOURCE, f"{name}: panel {panel['title']!r}"
        for annotation in dashboard["annotations"]["list"]:
            if not annotation.get("builtIn"):
                assert annotation["datasource"] == DATASOURCE, f"{name}: annotation {annotation['name']!r}"
        for variable in variables.values():
            if variable["type"] == "query":
                assert variable["datasource"] == DATASOURCE, f"{name}: variable {variable['name']}"


def test_the_overview_has_instance_gpu_and_run_variables(overview) -> None:
    variables = {variable["name"]: variable for variable in overview["templating"]["list"]}
    for name in REQUIRED_VARIABLES:
        assert variables.get(name, {}).get("type") == "query", f"variable ${name} is missing"
        assert variables[name]["includeAll"] and variables[name]["multi"]
    # Narrowing: a run picks its daemons (instances), an instance its GPUs.
    assert "$run" in q.variable_promql(variables["instance"])
    assert "$instance" in q.variable_promql(variables["gpu"])
    gpu_panels = [query for query in q.queries(overview) if "verl_gpu_" in query.expr]
    assert gpu_panels and all('gpu=~"$gpu"' in query.expr for query in gpu_panels if "variable" not in query.where)
    for query in q.queries(overview):
        if "variable" not in query.where:
            assert 'instance=~"$instance"' in query.expr, f"{query.where} ignores the instance variable"


def test_panels_fit_the_grid_without_overlapping(dashboards) -> None:
    for name, dashboard in dashboards:
        taken: dict[tuple[int, int], str] = {}
        ids = [panel["id"] for panel in q.panels(dashboard)]
        assert len(ids) == len(set(ids)), f"{name}: panel ids repeat"
        for panel in q.panels(dashboard):
            box = panel["gridPos"]
            assert box["x"] >= 0 and box["w"] > 0 and box["x"] + box["w"] <= 24, f"{name}: {panel['title']!r}"
            for x in range(box["x"], box["x"] + box["w"]):
                for y in range(box["y"], box["y"] + box["h"]):
                    assert (x, y) not in taken, f"{name}: {panel['title']!r} overlaps {taken[(x, y)]!r}"
                    taken[(x, y)] = panel["title"]


# --------------------------------------------------------------------------------------- what it shows


def _panel_metrics(dashboard: dict) -> dict[str, set[str]]:
    """Panel title -> the metrics its targets read."""
    return {panel["title"]: set().union(*(q.metric_names(target["expr"]) for target in panel.get("targets", [])))
            for panel in q.panels(dashboard) if panel["type"] != "row"}


@pytest.mark.parametrize(("title", "metrics"), [
    ("GPU utilization", {"verl_gpu_utilization_ratio"}),
    ("GPU memory used vs threshold", {"verl_gpu_memory_used_bytes", "verl_gpu_memory_total_bytes",
                                      "verl_setting_gpu_memory_threshold_ratio"}),
    ("GPU power", {"verl_gpu_power_watts"}),
    ("PCIe throughput", {"verl_gpu_pcie_throughput_bytes_per_second"}),
    ("Offload copy latency p50 / p99", {"verl_offload_copy_duration_seconds_bucket"}),
    ("Offload copy latency", {"verl_offload_copy_duration_seconds_bucket"}),
    ("Offload bandwidth", {"verl_offload_copied_bytes_total"}),
    ("Transformer layers on GPU", {"verl_offload_model_transformer_layers_on_gpu"}),
    ("Tokens per second", {"verl_trainer_throughput_tokens_per_second", "verl_trainer_tokens_total"}),
    ("Step phase durations", {"verl_trainer_step_phase_duration_seconds_sum",
                              "verl_trainer_step_phase_duration_seconds_count"}),
    ("Reward", {"verl_trainer_score_mean"}),
    ("KL", {"verl_trainer_ppo_kl"}),
    ("Losses and entropy", {"verl_trainer_policy_loss", "verl_trainer_value_loss"}),
    ("Restarts and OOMs", {"verl_trainer_restarts_total"}),
])
def test_the_overview_shows(overview, title: str, metrics: set[str]) -> None:
    shown = _panel_metrics(overview)
    assert title in shown, f"no panel {title!r}; panels: {sorted(shown)}"
    assert metrics <= shown[title]


def test_copy_latency_is_shown_as_p50_p99_and_as_a_heatmap(overview) -> None:
    by_title = {panel["title"]: panel for panel in q.panels(overview)}
    quantiles = " ".join(target["expr"] for target in by_title["Offload copy latency p50 / p99"]["targets"])
    assert "histogram_quantile(0.5," in quantiles and "histogram_quantile(0.99," in quantiles
    heatmap = by_title["Offload copy latency"]
    assert heatmap["type"] == "heatmap" and heatmap["targets"][0]["format"] == "heatmap"
    assert "by (le)" in heatmap["targets"][0]["expr"]


def test_the_memory_threshold_is_drawn_in_bytes_against_memory_in_use(overview) -> None:
    panel = next(panel for panel in q.panels(overview) if panel["title"] == "GPU memory used vs threshold")
    threshold = [target["expr"] for target in panel["targets"] if "threshold_ratio" in target["expr"]]
    assert threshold and "verl_gpu_memory_total_bytes" in threshold[0] and "*" in threshold[0]
    assert panel["fieldConfig"]["defaults"]["unit"] == "bytes"


def test_live_setting_changes_are_annotations(overview) -> None:
    annotations = [annotation for annotation in overview["annotations"]["list"]
                   if "verl_setting_updates_total" in annotation.get("expr", "")]
    assert annotations, "no annotation marks live setting changes"
    expr = annotations[0]["expr"]
    assert re.search(r"\b(changes|increase)\(verl_setting_updates_total", expr)
    assert annotations[0]["enable"] and "{{setting}}" in annotations[0]["titleFormat"]


def test_annotation_windows_overlap_from_one_step_to_the_next(dashboards) -> None:
    """Grafana evaluates an annotation every `step` (a longer one over a wide time range). With a window of one step
    ($__interval), a change that lands between the last scrape of one window and the first of the next is
    in neither (the audit saw 2 annotations for 4 changes). $__rate_interval grows with the step and is at
    least the step plus a scrape interval; tests/e2e/test_prometheus.py checks it on a real Prometheus."""
    scrape = q.seconds(yaml.safe_load(q.SCRAPE_CONFIG.read_text(encoding="utf-8"))["global"]["scrape_interval"])
    for name, dashboard in dashboards:
        for annotation in dashboard["annotations"]["list"]:
            if not annotation.get("expr"):
                continue
            where = f"{name}: annotation {annotation['name']!r}"
            windows = q.range_windows(annotation["expr"])
            assert windows, f"{where} reads no window of samples: it cannot mark a change"
            for window in windows:
                assert window in ("$__rate_interval", "${__rate_interval}"), f"{where}: [{window}] does not grow " \
                                                                             "with the step: use $__rate_interval"
                assert q.seconds(q.expand(window)) >= q.seconds(annotation["step"]) + scrape, where


# ------------------------------------------------------------------------------------------ PromQL


def test_every_expression_parses(tmp_path: Path) -> None:
    """promtool parses each expression as the expression of a recording rule."""
    queries = q.all_queries()
    assert len(queries) >= 20
    rules = {"groups": [{"name": "dashboards", "rules": [
        {"record": f"dashboard:query_{index:04d}", "expr": query.promql} for index, query in enumerate(queries)]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False), encoding="utf-8")
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        # Name the dashboard query behind each failing rule.
        report = result.stdout + result.stderr
        for index, query in enumerate(queries):
            report = report.replace(f"dashboard:query_{index:04d}", f"{query.where} ({query.expr})")
        pytest.fail(report)


def test_a_bad_expression_fails_the_parse_check(tmp_path: Path) -> None:
    """The check above can fail: promtool refuses a broken expression (and a variable outside a matcher)."""
    for broken in ("sum by (le (rate(verl_trainer_steps_total[1m]))", "rate(verl_trainer_steps_total[$gpu])"):
        path = tmp_path / "broken.yml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
            {"record": "r", "expr": q.expand(broken)}]}]}), encoding="utf-8")
        result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, timeout=60)
        assert result.returncode != 0, broken


def test_every_metric_exists_in_the_daemons_collectors() -> None:
    """The daemon's registry as it starts; tests/e2e/test_prometheus.py checks a real run's /metrics too."""
    exported = q.exported_names(generate_latest(_registry()).decode())
    assert q.unknown_metrics(q.all_queries(), exported) == []


def test_the_later_metrics_list_holds_only_what_is_used_and_not_yet_exported() -> None:
    used = set().union(*(query.metrics for query in q.all_queries()))
    exported = q.exported_names(generate_latest(_registry()).decode())
    assert set(q.LATER_METRICS) <= used, "drop names no dashboard reads from LATER_METRICS"
    landed = sorted(set(q.LATER_METRICS) & exported)
    assert landed == [], f"{landed} are exported now: remove them from LATER_METRICS in tests/dashboards/queries.py"


def test_an_unknown_metric_is_reported() -> None:
    exported = q.exported_names(generate_latest(_registry()).decode())
    typo = q.Query("panel 'x'", 'rate(verl_trainer_step_total{instance=~"$instance"}[$__rate_interval])')
    assert q.unknown_metrics([typo], exported) == ["panel 'x': verl_trainer_step_total"]


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    TelemetryMetrics(registry, run="test")
    return registry


# ------------------------------------------------------------------------------ Prometheus, provisioning


def test_the_scrape_config_passes_promtool() -> None:
    result = subprocess.run([promtool(), "check", "config", str(q.SCRAPE_CONFIG)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_scrape_config_scrapes_the_daemons_metrics_route() -> None:
    config = yaml.safe_load(q.SCRAPE_CONFIG.read_text(encoding="utf-8"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["verl"]["metrics_path"] == "/metrics"
    assert jobs["verl"]["static_configs"][0]["targets"]


def test_the_provisioning_files_point_at_prometheus_and_the_dashboards() -> None:
    root = q.REPO / "dashboards" / "provisioning"
    datasources = yaml.safe_load((root / "datasources" / "prometheus.yml").read_text(encoding="utf-8"))
    assert datasources["apiVersion"] == 1
    assert [source["type"] for source in datasources["datasources"]] == ["prometheus"]
    providers = yaml.safe_load((root / "dashboards" / "verl.yml").read_text(encoding="utf-8"))
    assert providers["apiVersion"] == 1
    assert [provider["type"] for provider in providers["providers"]] == ["file"]



RANK_SERIES = ("verl_offload_copy_duration_seconds", "verl_offload_copied_bytes_total", "verl_offload_group_bytes",
               "verl_trainer_gpu_memory_max_allocated_bytes")


def test_the_per_rank_series_follow_the_rank_variable(overview) -> None:
    variables = {variable["name"]: variable for variable in overview["templating"]["list"]}
    assert variables["rank"]["includeAll"] and "$instance" in q.variable_promql(variables["rank"])
    per_rank = [query for query in q.queries(overview) if any(name in query.expr for name in RANK_SERIES)]
    assert per_rank and all('rank=~"$rank"' in query.expr for query in per_rank)
