"""The PromQL of the Grafana dashboards as Grafana sends it to Prometheus: every panel target, annotation
and variable query, with Grafana's variables replaced by values Prometheus accepts.

Shared by tests/dashboards (promtool parses every expression) and tests/e2e/test_prometheus.py (a real
Prometheus runs every expression against a real run; every metric name exists in that run's /metrics).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = REPO / "dashboards" / "grafana"
SCRAPE_CONFIG = REPO / "dashboards" / "prometheus.yml"

# Metrics the dashboards show before the code that exports them has landed, each with the issue that adds
# it. A name here that /metrics already exports fails a test: then it belongs off this list.
LATER_METRICS = {
}

# Grafana's built-in interval variables, as Grafana would fill them in for a 5 s scrape interval.
INTERVALS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
# Template variables ($instance, ${gpu}, ...) become "everything": they may only stand in regex matchers.
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.+),\s*(?P<label>\w+)\s*\)\s*$", re.DOTALL)
QUERY_RESULT = re.compile(r"^\s*query_result\((?P<expr>.+)\)\s*$", re.DOTALL)
METRIC = re.compile(r"\bverl_[A-Za-z0-9_:]*")
QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
RANGE = re.compile(r"\[([^\[\]]+)\]")
DURATION_PART = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


@dataclass(frozen=True)
class Query:
    where: str
    """Which dashboard, panel and target it comes from, for failure messages."""
    expr: str
    """As written in the dashboard."""

    @property
    def promql(self) -> str:
        return expand(self.expr)

    @property
    def metrics(self) -> set[str]:
        return metric_names(self.promql)


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARD_DIR.glob("*.json"))


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def all_queries() -> list[Query]:
    return [query for path in dashboard_files() for query in queries(load(path), path.name)]


def queries(dashboard: dict, name: str = "dashboard") -> list[Query]:
    """Every PromQL expression of a dashboard: targets, annotation queries, variable queries."""
    found = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            if target.get("expr"):
                found.append(Query(f"{name}: panel {panel.get('title')!r} target {target.get('refId')}",
                                   target["expr"]))
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if annotation.get("expr"):
            found.append(Query(f"{name}: annotation {annotation.get('name')!r}", annotation["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            found.append(Query(f"{name}: variable ${variable['name']}", variable_promql(variable)))
    return found


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, those inside collapsed rows too."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def variable_promql(variable: dict) -> str:
    """The PromQL inside a variable's query: label_values(SELECTOR, label) and query_result(EXPR)."""
    query = variable.get("query")
    text = query.get("query", "") if isinstance(query, dict) else str(query)
    if match := LABEL_VALUES.match(text):
        return match["selector"]
    if match := QUERY_RESULT.match(text):
        return match["expr"]
    return text


def expand(expr: str) -> str:
    """The expression with Grafana's variables filled in as Grafana would (All selected)."""
    for name, value in INTERVALS.items():
        expr = expr.replace(name, value)
    return VARIABLE.sub(".*", expr)


def seconds(duration: str) -> float:
    """A Prometheus duration ("15s", "1m", "1h30m") in seconds."""
    parts = DURATION_PART.findall(duration)
    if not parts or "".join(number + unit for number, unit in parts) != duration:
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    return sum(float(number) * DURATION_UNITS[unit] for number, unit in parts)


def range_windows(promql: str) -> list[str]:
    """The windows of an expression's range selectors ("5m" of rate(x[5m])), subqueries left out."""
    return [window for window in RANGE.findall(QUOTED.sub('""', promql)) if ":" not in window]


def metric_names(promql: str) -> set[str]:
    """The verl_* metric names an expression reads (names inside quoted strings do not count)."""
    return set(METRIC.findall(QUOTED.sub('""', promql)))


def exported_names(exposition: str) -> set[str]:
    """Every series name a /metrics text can carry, also for metric families without samples yet
    (a labelled gauge before its first value shows only its HELP and TYPE lines)."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("_sum", "_count", "_created"), "info": ("_info",), "gaugehistogram": ("_bucket",
                                                                                                      "_gsum",
                                                                                                      "_gcount")}
    names = set()
    for family in text_string_to_metric_families(exposition):
        names.add(family.name)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def unknown_metrics(queries_: Iterable[Query], exported: set[str]) -> list[str]:
    """'where: name' for each metric a query reads that is neither exported nor on LATER_METRICS."""
    return [f"{query.where}: {name}" for query in queries_ for name in sorted(query.metrics)
            if name not in exported and name not in LATER_METRICS]
