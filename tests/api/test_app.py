"""The API as a client meets it: a real uvicorn server on loopback, real httpx and websockets clients.

The daemon's RunControl is replaced by a fake that validates settings with the daemon's own rules
(trainer.config.live), so a 422 here carries the messages a user would read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from api.app import create_app
from api.client import ApiClient, ApiError
from api.hub import TelemetryHub
from api.prometheus import TelemetryMetrics
from api.schemas import SettingsBody, SettingsRejectedError
from daemon.settings import SettingsStore
from tests.support import run_status
from trainer.config.live import SETTING_NAMES, SHORT_NAMES, LiveSettings, SettingsRejected
from trainer.config.messages import (
    CopyCount,
    CopySample,
    OffloadMessage,
    PhaseMessage,
    RunStatus,
    SettingsMessage,
    StepMessage,
)

TOKEN = "s3cret-token_for-tests"
WRONG = "not-the-token"
LIMIT = 64 * 1024  # the largest body the API reads
LARGEST_INTEGER = 2**53 - 1  # the largest whole number it takes
PRIVATE_ROUTES = [("GET", "/v1/status"), ("GET", "/v1/metrics/latest"), ("GET", "/v1/metrics/history"),
                  ("GET", "/metrics"), ("GET", "/v1/settings"), ("PATCH", "/v1/settings"),
                  ("POST", "/v1/checkpoint"), ("POST", "/v1/stop"), ("GET", "/docs"), ("GET", "/openapi.json")]
THRESHOLD, MINIMUM = "dynamic_offload.gpu_memory_threshold", "dynamic_offload.min_transformer_layers_on_gpu"


class FakeControl:
    """What the daemon's RunControl does, minus the daemon and the trainer: live settings kept in the
    daemon's SettingsStore, the changes it would forward, and requests recorded."""

    def __init__(self, audit_path: Path) -> None:
        self.store = SettingsStore(LiveSettings(), audit_path=audit_path)
        self.forwarded: list[SettingsMessage] = []
        self.requests: list[str] = []

    def status(self) -> RunStatus:
        return run_status(name="fake", step=5, total_steps=200)

    def settings(self) -> SettingsBody:
        return self.store.describe()

    def update_settings(self, change: dict) -> dict:
        self.requests.append("update_settings")
        try:
            update = self.store.update(change)
        except SettingsRejected as rejected:
            raise SettingsRejectedError(rejected.problems) from None
        if update.changed:
            self.forwarded.append(self.store.down_message())
        return {"version": update.version, "old": update.old, "new": update.new, "values": update.values,
                "applies_at_step": 6 if update.changed else None,
                "status": "pending" if update.changed else "unchanged"}

    async def request_checkpoint(self) -> dict:  # a coroutine: the app must await it
        self.requests.append("checkpoint")
        return {"requested": "checkpoint"}

    def request_stop(self, force: bool = False) -> dict:
        self.requests.append("force stop" if force else "stop")
        return {"requested": "force stop" if force else "stop"}


@dataclass
class Served:
    url: str
    hub: TelemetryHub
    metrics: TelemetryMetrics
    control: FakeControl

    @property
    def ws_url(self) -> str:
        return "ws" + self.url.removeprefix("http") + "/v1/stream"

    def client(self, token: str | None = TOKEN, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, trust_env=False, timeout=5, **kwargs)


def build(run_dir: Path, **options) -> tuple[TelemetryHub, TelemetryMetrics, FakeControl, object]:
    hub, registry = TelemetryHub(history_seconds=600), CollectorRegistry()
    control = FakeControl(run_dir / "settings_audit.jsonl")
    metrics = TelemetryMetrics(registry, run="fake")
    app = create_app(hub=hub, registry=registry, control=control, token=TOKEN, **options)
    return hub, metrics, control, app


@pytest.fixture(scope="module")
def served(serve, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    hub, metrics, control, app = build(tmp_path_factory.mktemp("run"))
    with serve(app) as url:
        yield Served(url, hub, metrics, control)


@pytest.fixture(scope="module")
def open_metrics(serve, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Bound beyond loopback (no Host check), /metrics public, one extra browser origin allowed."""
    hub, metrics, control, app = build(tmp_path_factory.mktemp("run"), public_metrics=True, bind_host="0.0.0.0",
                                       allowed_origins=["https://grafana.example.com"])
    with serve(app) as url:
        yield Served(url, hub, metrics, control)


# ------------------------------------------------------------------------------------------ tokens


def test_healthz_needs_no_token(served: Served) -> None:
    response = served.client(token=None).get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


@pytest.mark.parametrize(("method", "path"), PRIVATE_ROUTES)
def test_every_other_route_needs_the_token(served: Served, method: str, path: str) -> None:
    before = list(served.control.requests)
    for token in (None, WRONG):
        response = served.client(token=token).request(method, path, json={"gpu_memory_threshold": 0.5})
        assert response.status_code == 401, (token, response.text)
        assert "token" in response.json()["detail"] and response.headers["www-authenticate"] == "Bearer"
    wrong_query = served.client(token=None).request(method, path, params={"token": WRONG})
    assert wrong_query.status_code == 401
    assert served.control.requests == before  # nothing reached the run


def test_the_token_works_in_the_header_and_in_the_query(served: Served) -> None:
    assert served.client().get("/v1/status").json()["run"]["name"] == "fake"
    assert served.client(token=None).get("/v1/status", params={"token": TOKEN}).status_code == 200
    assert served.client(token=None).get("/metrics", params={"token": TOKEN}).status_code == 200


def test_a_wrong_header_wins_over_the_right_query_token_on_rest_and_stream_alike(served: Served) -> None:
    before = list(served.control.requests)
    rest = served.client(token=WRONG).post("/v1/checkpoint", params={"token": TOKEN})
    assert rest.status_code == 401 and rest.json()["detail"].startswith("wrong token")
    assert served.control.requests == before
    assert asyncio.run(refused_status(f"{served.ws_url}?token={TOKEN}",
                                      additional_headers={"Authorization": f"Bearer {WRONG}"})) == 403
    # The right header with a wrong query token passes on both.
    assert served.client().get("/v1/status", params={"token": WRONG}).status_code == 200

    async def right_header() -> None:
        async with connect(f"{served.ws_url}?token={WRONG}", additional_headers={"Authorization": f"Bearer {TOKEN}"},
                           proxy=None):
            pass

    asyncio.run(right_header())


def test_docs_and_openapi_behind_the_token(served: Served) -> None:
    page = served.client(token=None).get("/docs", params={"token": TOKEN})
    assert page.status_code == 200 and f"/openapi.json?token={TOKEN}" in page.text
    schema = served.client().get("/openapi.json").json()
    assert {"/v1/status", "/v1/settings", "/v1/metrics/history", "/metrics"} <= set(schema["paths"])
    assert {"HTTPBearer", "APIKeyQuery"} <= set(schema["components"]["securitySchemes"])


def test_public_metrics_opens_only_metrics(open_metrics: Served) -> None:
    anonymous = open_metrics.client(token=None)
    assert anonymous.get("/metrics").status_code == 200
    assert anonymous.get("/v1/status").status_code == 401
    assert anonymous.get("/docs").status_code == 401


# ------------------------------------------------------------------------------------ Host check


@pytest.mark.parametrize("host", ["evil.example.com", "evil.example.com:8000", "10.0.0.5", "127.0.0.1.nip.io"])
def test_a_foreign_host_header_is_refused_on_loopback(served: Served, host: str) -> None:
    response = served.client().get("/v1/status", headers={"Host": host})
    assert response.status_code == 403 and "loopback" in response.json()["detail"]
    assert served.client().get("/healthz", headers={"Host": host}).status_code == 403


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:9", "127.0.0.1:1234", "127.3.2.1", "[::1]:8080"])
def test_loopback_host_headers_pass(served: Served, host: str) -> None:
    assert served.client().get("/v1/status", headers={"Host": host}).status_code == 200


def test_no_host_check_when_bound_beyond_loopback(open_metrics: Served) -> None:
    assert open_metrics.client().get("/v1/status", headers={"Host": "trainer-node-3:8000"}).status_code == 200


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("DELETE", "/v1/settings", "GET, PATCH"),
    ("OPTIONS", "/v1/settings", "GET, PATCH"),
    ("PUT", "/v1/status", "GET"),
    ("GET", "/v1/stop", "POST"),
])
def test_405_lists_every_method_of_the_path_in_allow(served: Served, method: str, path: str, allowed: str) -> None:
    response = served.client().request(method, path)
    assert response.status_code == 405 and response.headers["allow"] == allowed
    assert response.json()["detail"].endswith(f"allowed: {allowed}")


# -------------------------------------------------------------------------------------- /metrics


def test_metrics_is_a_plain_route_with_prometheus_text(served: Served) -> None:
    served.metrics.observe_step(7, {"timing_s/step": 1.2, "perf/total_num_tokens": 1000})
    response = served.client(follow_redirects=False).get("/metrics")
    assert response.status_code == 200, response.headers  # not a 307 to /metrics/
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    assert "verl_trainer_step 7.0" in response.text and "# HELP verl_trainer_steps_total" in response.text


# ------------------------------------------------------------------------------ latest and history


def test_latest_is_empty_then_follows_the_newest_events(serve, tmp_path: Path) -> None:
    hub, _, _, app = build(tmp_path)
    with serve(app) as url:
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, trust_env=False)
        assert client.get("/v1/metrics/latest").json() == {
            "seq": 0, "step": None, "gpu": None,
            "offload": {"copy_latency_p50_s": None, "copy_latency_p99_s": None, "bandwidth_bytes_per_second": None,
                        "copies": 0}}
        hub.publish("step", StepMessage(step=1, metrics={"actor/pg_loss": 0.5}))
        hub.publish("step", StepMessage(step=2, metrics={"actor/pg_loss": 0.25, "critic/score/mean": float("nan")}))
        hub.publish("gpu", {"nvml": False, "gpus": [], "host": {"cpu_ratio": 0.5}})
        hub.publish("offload", OffloadMessage(
            copies=[CopySample(direction="h2d", group="transformer", bytes=8, seconds=0.004)],
            counts=[CopyCount(direction="h2d", group="transformer", copies=1, bytes=8)]))
        latest = client.get("/v1/metrics/latest").json()
    assert latest["seq"] == 4
    assert latest["step"]["step"] == 2
    assert latest["step"]["metrics"] == {"actor/pg_loss": 0.25, "critic/score/mean": None}
    assert latest["gpu"]["host"] == {"cpu_ratio": 0.5}
    assert latest["offload"]["copies"] == 1 and latest["offload"]["copy_latency_p50_s"] == pytest.approx(0.004)


def test_history_filters_by_since_keys_and_kinds(served: Served) -> None:
    start = served.hub.last_seq
    served.hub.publish("step", StepMessage(step=1, metrics={"actor/pg_loss": 0.5, "timing_s/step": 2.0, "x/y": 1}))
    served.hub.publish("gpu", {"nvml": False, "gpus": []})
    served.hub.publish("phase", PhaseMessage(step=2, phase="gen"))
    client = served.client()

    body = client.get("/v1/metrics/history", params={"since": start}).json()
    assert [event["kind"] for event in body["events"]] == ["step", "gpu", "phase"]
    assert [event["seq"] for event in body["events"]] == [start + 1, start + 2, start + 3]
    assert body["last_seq"] == start + 3 and set(body["events"][0]) == {"seq", "time", "kind", "data"}

    body = client.get("/v1/metrics/history", params={"since": start + 1}).json()
    assert [event["kind"] for event in body["events"]] == ["gpu", "phase"]

    body = client.get("/v1/metrics/history", params={"since": start, "kinds": "step,phase",
                                                      "keys": "actor/pg_loss,timing_s/step"}).json()
    assert [event["kind"] for event in body["events"]] == ["step", "phase"]
    assert body["events"][0]["data"] == {"step": 1, "metrics": {"actor/pg_loss": 0.5, "timing_s/step": 2.0}}
    assert body["last_seq"] == start + 3

    bad_kind = client.get("/v1/metrics/history", params={"kinds": "step,bogus"})
    assert bad_kind.status_code == 422 and "bogus" in json.dumps(bad_kind.json())
    assert client.get("/v1/metrics/history", params={"since": -1}).status_code == 422


@pytest.mark.parametrize(("params", "named"), [
    ({"since": 2**63}, "since"),  # once a 500: more than a C long for the history's slice
    ({"since": LARGEST_INTEGER + 1}, "since"),
    ({"since": "1" * 5000}, "since"),
    ({"keys": "k" * 5000}, "keys"),
    ({"kinds": "step," * 100}, "kinds"),
])
def test_history_refuses_query_parameters_out_of_bounds_naming_them(served: Served, params: dict, named: str) -> None:
    served.hub.publish("gpu", {"nvml": False, "gpus": []})  # a history that is not empty
    response = served.client().get("/v1/metrics/history", params=params)
    assert response.status_code == 422, response.text
    [problem] = response.json()["detail"]
    assert problem["loc"] == ["query", named] and problem["msg"]


def test_history_takes_the_largest_since(served: Served) -> None:
    served.hub.publish("gpu", {"nvml": False, "gpus": []})
    response = served.client().get("/v1/metrics/history", params={"since": LARGEST_INTEGER})
    assert response.status_code == 200 and response.json()["events"] == []


KINDS_SAMPLES = ["step", "step,gpu", " step , gpu ,", ",,", "", "log\n", "\tlog,\u00a0gpu", "stepgpu", "step gpu",
                 "bogus", "step,bogus", "STEP", "log;gpu", "\ufeffstep", "step,,phase, ,offload"]


def test_the_documented_kinds_pattern_is_the_rule_the_server_applies(served: Served) -> None:
    client = served.client()
    [parameter] = [parameter for parameter in client.get("/openapi.json").json()["paths"]["/v1/metrics/history"]
                   ["get"]["parameters"] if parameter["name"] == "kinds"]
    pattern = parameter["schema"]["pattern"]
    for kinds in KINDS_SAMPLES:
        answer = client.get("/v1/metrics/history", params={"kinds": kinds})
        # JSON Schema's "pattern" is a search, as re.search is.
        assert (answer.status_code == 200) == (re.search(pattern, kinds) is not None), (kinds, answer.text)
        assert answer.status_code in (200, 422)


# ------------------------------------------------------------------------------------ settings


def test_patch_settings_forwards_to_the_control(served: Served) -> None:
    client = served.client()
    version = client.get("/v1/settings").json()["version"]
    response = client.patch("/v1/settings", json={THRESHOLD: 0.8, "dynamic_offload.enabled": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["version"] == version + 1 and body["status"] == "pending" and body["applies_at_step"] == 6
    assert body["new"] == {THRESHOLD: 0.8, "dynamic_offload.enabled": True}
    assert client.get("/v1/settings").json()["values"][THRESHOLD] == 0.8


def test_patch_settings_takes_the_short_names_and_answers_with_the_canonical_ones(served: Served) -> None:
    client = served.client()
    client.patch("/v1/settings", json={THRESHOLD: 0.85, "daemon.log_level": "info"})
    response = client.patch("/v1/settings", json={"gpu_memory_threshold": 0.7, "log_level": "debug"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["old"], body["new"]) == ({THRESHOLD: 0.85, "daemon.log_level": "info"},
                                          {THRESHOLD: 0.7, "daemon.log_level": "debug"})
    assert list(body["values"]) == list(SETTING_NAMES)
    assert served.control.forwarded[-1].values.gpu_memory_threshold == 0.7
    described = client.get("/v1/settings").json()
    assert [(entry["name"], entry["short_name"]) for entry in described["settings"]] == [
        (THRESHOLD, "gpu_memory_threshold"), (MINIMUM, "min_transformer_layers_on_gpu"),
        ("dynamic_offload.enabled", None), ("telemetry.gpu_sample_interval_s", "gpu_sample_interval_s"),
        ("telemetry.pcie_sample_interval_s", "pcie_sample_interval_s"), ("daemon.log_level", "log_level")]
    client.patch("/v1/settings", json={"log_level": "info"})  # as the other tests of this served app expect it


@pytest.mark.parametrize("values", [(0.7, 0.6), (0.7, 0.7)], ids=["different", "the same"])
def test_a_setting_named_by_both_its_names_is_one_422_naming_both(served: Served, values: tuple) -> None:
    client = served.client()
    before, forwarded = client.get("/v1/settings").json(), len(served.control.forwarded)
    response = client.patch("/v1/settings", json={"gpu_memory_threshold": values[0], THRESHOLD: values[1],
                                                  "log_level": "debug"})
    assert response.status_code == 422, response.text
    [problem] = response.json()["detail"]
    assert problem["loc"] == ["body", THRESHOLD]
    assert f"gpu_memory_threshold={values[0]!r}" in problem["msg"] and f"{THRESHOLD}={values[1]!r}" in problem["msg"]
    assert client.get("/v1/settings").json() == before and len(served.control.forwarded) == forwarded


@pytest.mark.parametrize(("change", "named"), [
    ({THRESHOLD: 1.5}, [THRESHOLD]),
    ({THRESHOLD: -1}, [THRESHOLD]),
    ({"gpu_memory_threshold": "abc"}, [THRESHOLD]),  # a short name's problem names the setting canonically
    ({MINIMUM: -1}, [MINIMUM]),
    ({"no_such_setting": 1, THRESHOLD: 0.5}, ["no_such_setting"]),
    ({"no_such_setting": 1, THRESHOLD: 1.5}, ["no_such_setting", THRESHOLD]),
    ({MINIMUM: LARGEST_INTEGER + 1}, [MINIMUM]),
    ({THRESHOLD: 1.5, "min_transformer_layers_on_gpu": "abc", "telemetry.gpu_sample_interval_s": -1},
     [THRESHOLD, MINIMUM, "telemetry.gpu_sample_interval_s"]),
])
def test_bad_settings_get_422_naming_every_field_and_change_nothing(served: Served, change: dict,
                                                                    named: list[str]) -> None:
    client = served.client()
    before = client.get("/v1/settings").json()
    response = client.patch("/v1/settings", json=change)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert sorted(item["loc"][1] for item in detail) == sorted(named)
    assert all(item["loc"][0] == "body" and item["type"] == "value_error" and item["msg"] for item in detail)
    assert client.get("/v1/settings").json() == before


def test_a_json_body_sent_as_curl_d_sends_it_is_read_as_json(served: Served) -> None:
    """`curl -X PATCH -d '{...}'` labels the body application/x-www-form-urlencoded."""
    client = served.client()
    response = client.patch("/v1/settings", content=b'{"gpu_memory_threshold": 0.65}',
                            headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200, response.text
    assert response.json()["new"] == {THRESHOLD: 0.65}
    assert client.get("/v1/settings").json()["values"][THRESHOLD] == 0.65
    unlabelled = client.patch("/v1/settings", content=b'{"gpu_memory_threshold": 0.6}', headers={"Content-Type": ""})
    assert unlabelled.status_code == 200 and unlabelled.json()["new"] == {THRESHOLD: 0.6}


@pytest.mark.parametrize(("body", "content_type", "says"), [
    (b"[0.8]", "application/json", "got a JSON array"),
    (b"0.8", "application/x-www-form-urlencoded", "got a JSON number"),
    (b'"gpu_memory_threshold=0.8"', "text/plain", "got a JSON string"),
    (b"gpu_memory_threshold=0.8", "application/x-www-form-urlencoded", "this is not JSON"),
    (b"", "application/json", "this is not JSON"),
    (b'{"gpu_memory_threshold": 0.5', "application/json", "this is not JSON"),
    (b"\xff\xfe{", "application/json", "this is not JSON"),
    (b'{"gpu_memory_threshold": NaN}', "application/json", "NaN is not a JSON number"),
    (b'{"gpu_sample_interval_s": Infinity}', "application/json", "Infinity is not a JSON number"),
    (b'{"gpu_sample_interval_s": 1e999}', "application/json", "1e999 is beyond the range of a number"),
])
def test_a_settings_body_that_is_not_a_json_object_is_refused_naming_the_body(
        served: Served, body: bytes, content_type: str, says: str) -> None:
    client = served.client()
    before, requests = client.get("/v1/settings").json(), list(served.control.requests)
    response = client.patch("/v1/settings", content=body, headers={"Content-Type": content_type})
    assert response.status_code == 422, response.text
    [problem] = response.json()["detail"]
    assert problem["loc"] == ["body"] and "must be a JSON object" in problem["msg"] and says in problem["msg"]
    assert client.get("/v1/settings").json() == before
    assert served.control.requests == requests  # refused before it reached the run


def test_the_openapi_doc_shows_the_settings_body_as_strict_as_the_validation(served: Served) -> None:
    schema = served.client().get("/openapi.json").json()
    patch = schema["paths"]["/v1/settings"]["patch"]
    body = patch["requestBody"]
    assert body["required"] is True
    change = body["content"]["application/json"]["schema"]
    assert change["type"] == "object" and change["examples"] == [{THRESHOLD: 0.8}]
    # {} and unknown names are refused (422), and so the schema says.
    assert change["minProperties"] == 1 and change["additionalProperties"] is False
    # The canonical names, then the short ones; a setting by both of its names is refused, and so the schema says.
    assert list(change["properties"]) == [*SETTING_NAMES, *SHORT_NAMES]
    assert {tuple(rule["not"]["required"]) for rule in change["allOf"]} == {
        (name, short) for short, name in SHORT_NAMES.items()}
    assert change["properties"][MINIMUM] == {
        "type": "integer", "minimum": 0, "maximum": LARGEST_INTEGER, "description": LiveSettings.model_fields[
            "min_transformer_layers_on_gpu"].description}
    assert change["properties"]["min_transformer_layers_on_gpu"] == {
        **change["properties"][MINIMUM], "description": f"The short name of {MINIMUM}."}
    assert change["properties"]["daemon.log_level"]["enum"] == ["debug", "info", "warning", "error"]
    assert change["properties"]["log_level"]["enum"] == ["debug", "info", "warning", "error"]
    assert {"200", "401", "413", "422", "503"} <= set(patch["responses"])


def test_a_huge_whole_number_is_refused_before_anything_changes(served: Served) -> None:
    """A 400-digit integer once answered 500 with the setting changed: float() of it overflowed after the store
    had taken it."""
    client = served.client()
    before, forwarded = client.get("/v1/settings").json(), len(served.control.forwarded)
    response = client.patch("/v1/settings", content=b'{"min_transformer_layers_on_gpu": 1' + b"0" * 400 + b"}")
    assert response.status_code == 422, response.text
    [problem] = response.json()["detail"]
    assert problem["loc"] == ["body", MINIMUM]
    assert f"<= {LARGEST_INTEGER}" in problem["msg"] and "(401 characters)" in problem["msg"]
    assert len(problem["msg"]) < 300
    assert client.get("/v1/settings").json() == before and len(served.control.forwarded) == forwarded


def test_a_change_that_cannot_be_saved_answers_503_and_changes_nothing(serve, tmp_path: Path) -> None:
    """The audit log on a full disk (/dev/full answers every write with ENOSPC)."""
    if not Path("/dev/full").exists():
        pytest.skip("needs Linux's /dev/full")
    hub, registry = TelemetryHub(history_seconds=600), CollectorRegistry()
    control = FakeControl(Path("/dev/full"))
    app = create_app(hub=hub, registry=registry, control=control, token=TOKEN)
    with serve(app) as url:
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, trust_env=False, timeout=5)
        before = client.get("/v1/settings").json()
        response = client.patch("/v1/settings", json={"gpu_memory_threshold": 0.7})
        assert response.status_code == 503, response.text
        assert "audit log" in response.json()["detail"] and "not made" in response.json()["detail"]
        assert client.get("/v1/settings").json() == before and control.forwarded == []
        # A bad change is still told what is wrong with it, though its audit line is lost too.
        refused = client.patch("/v1/settings", json={THRESHOLD: 2})
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", THRESHOLD]
        # Once the disk has room again, the same change goes through.
        control.store.audit_path = tmp_path / "settings_audit.jsonl"
        assert client.patch("/v1/settings", json={"gpu_memory_threshold": 0.7}).json()["version"] == 1


def test_a_rejected_value_is_kept_as_an_excerpt_in_the_answer_and_the_audit_log(served: Served) -> None:
    client = served.client()
    audit_path = served.control.store.audit_path
    size = audit_path.stat().st_size if audit_path.exists() else 0
    response = client.patch("/v1/settings", json={"log_level": "x" * 60_000, "n" * 1000: 1})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert sorted(len(problem["loc"][1]) < 200 for problem in detail) == [True, True]
    assert all(len(problem["msg"]) < 400 and "characters)" in problem["msg"] + problem["loc"][1]
               for problem in detail)
    assert 0 < audit_path.stat().st_size - size < 2000


def test_a_setting_name_that_is_not_unicode_text_is_refused_not_a_500(served: Served) -> None:
    response = served.client().patch("/v1/settings", content=b'{"\\ud800": 1}')
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "\\ud800"]


# -------------------------------------------------------------------------------- request bodies


def patch_raw(served: Served, content, **headers: str) -> httpx.Response:
    return served.client().patch("/v1/settings", content=content, headers=headers)


def padded_change(size: int) -> bytes:
    """A valid change of exactly `size` bytes (JSON allows any amount of blank space)."""
    change = b'{"gpu_memory_threshold": 0.55}'
    return change[:-1] + b" " * (size - len(change)) + b"}"


def test_a_body_over_the_limit_is_refused_with_413_and_changes_nothing(served: Served) -> None:
    client = served.client()
    client.patch("/v1/settings", json={"log_level": "bogus"})  # an audit log to watch
    before, audit_size = client.get("/v1/settings").json(), served.control.store.audit_path.stat().st_size
    declared = patch_raw(served, padded_change(LIMIT + 1))
    assert declared.status_code == 413, declared.text
    assert "64 KiB" in declared.json()["detail"]
    # Chunked, with no Content-Length: counted as it streams.
    streamed = patch_raw(served, iter([padded_change(LIMIT + 1)[:40_000], padded_change(LIMIT + 1)[40_000:]]))
    assert streamed.status_code == 413 and "64 KiB" in streamed.json()["detail"]
    assert client.get("/v1/settings").json() == before
    assert served.control.store.audit_path.stat().st_size == audit_size
    assert patch_raw(served, padded_change(LIMIT)).status_code == 200  # the limit itself passes


def test_a_declared_body_over_the_limit_is_refused_before_the_route_acts(served: Served) -> None:
    before = list(served.control.requests)
    response = served.client().post("/v1/stop", content=b"x" * (LIMIT + 1))
    assert response.status_code == 413 and served.control.requests == before


def test_a_client_that_hangs_up_in_the_middle_of_a_body_is_no_error(served: Served) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    server_log = logging.getLogger("uvicorn.error")
    server_log.addHandler(handler)
    try:
        port = int(served.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as connection:
            connection.sendall(f"PATCH /v1/settings HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                               "Content-Length: 1000\r\n\r\n{\"gpu_memory".encode())
            time.sleep(0.2)
        time.sleep(0.3)
        assert served.client().get("/healthz").status_code == 200
    finally:
        server_log.removeHandler(handler)
    assert [record.getMessage() for record in records if record.levelno >= logging.ERROR] == []


def test_setting_the_value_in_effect_changes_nothing(served: Served) -> None:
    client = served.client()
    first = client.patch("/v1/settings", json={THRESHOLD: 0.75}).json()
    forwarded = len(served.control.forwarded)
    again = client.patch("/v1/settings", json={"gpu_memory_threshold": 0.75})  # the same setting, by its short name
    assert again.status_code == 200, again.text
    body = again.json()
    assert (body["version"], body["old"], body["new"]) == (first["version"], {}, {})
    assert body["values"][THRESHOLD] == 0.75 and "applies_at_step" in body
    assert client.get("/v1/settings").json()["version"] == first["version"]
    assert len(served.control.forwarded) == forwarded  # nothing for the trainer
    # Of several settings, only those whose value changes are reported.
    mixed = client.patch("/v1/settings", json={THRESHOLD: 0.75, "daemon.log_level": "debug"}).json()
    assert (mixed["version"], mixed["old"], mixed["new"]) == (first["version"] + 1, {"daemon.log_level": "info"},
                                                              {"daemon.log_level": "debug"})


def test_checkpoint_and_stop_reach_the_control(served: Served) -> None:
    client = served.client()
    assert client.post("/v1/checkpoint").status_code == 202
    response = client.post("/v1/stop")
    assert response.status_code == 202 and response.json() == {"requested": "stop"}
    assert served.control.requests[-2:] == ["checkpoint", "stop"]


# ----------------------------------------------------------------------------------- WebSocket


async def frames(websocket, count: int) -> list[dict]:
    return [json.loads(await asyncio.wait_for(websocket.recv(), 5)) for _ in range(count)]


def test_stream_replays_then_sends_live_events_and_resumes_from_a_seq(served: Served) -> None:
    hub = served.hub
    start = hub.last_seq
    for step in (1, 2, 3):
        hub.publish("step", StepMessage(step=step, metrics={"actor/pg_loss": 0.1}))

    async def scenario() -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with connect(f"{served.ws_url}?since={start}", additional_headers=headers, proxy=None) as websocket:
            replayed = await frames(websocket, 3)
            assert [frame["seq"] for frame in replayed] == [start + 1, start + 2, start + 3]
            assert replayed[0]["kind"] == "step" and replayed[0]["data"]["step"] == 1
            # Published from this (non-server) thread, as the GPU sampler does.
            hub.publish("gpu", {"nvml": False, "gpus": []})
            live = await frames(websocket, 1)
            assert (live[0]["seq"], live[0]["kind"]) == (start + 4, "gpu")
        async with connect(f"{served.ws_url}?since={start + 2}&token={TOKEN}", proxy=None) as websocket:
            assert [frame["seq"] for frame in await frames(websocket, 2)] == [start + 3, start + 4]
        # Browsers cannot set headers: the token may come as the subprotocol "bearer.<token>".
        async with connect(f"{served.ws_url}?since={start + 3}", subprotocols=[f"bearer.{TOKEN}"],
                           origin="http://localhost:3000", proxy=None) as websocket:
            assert websocket.subprotocol == f"bearer.{TOKEN}"
            assert [frame["seq"] for frame in await frames(websocket, 1)] == [start + 4]

    asyncio.run(scenario())


async def refused_status(url: str, **options) -> int:
    with pytest.raises(InvalidStatus) as refused:
        async with connect(url, proxy=None, **options):
            pass
    return refused.value.response.status_code


def test_stream_refuses_a_missing_or_wrong_token(served: Served) -> None:
    async def scenario() -> None:
        # Closing before the upgrade: the server answers 403 and the connection never opens.
        assert await refused_status(served.ws_url) == 403
        assert await refused_status(served.ws_url, additional_headers={"Authorization": f"Bearer {WRONG}"}) == 403
        assert await refused_status(f"{served.ws_url}?token={WRONG}") == 403
        assert await refused_status(served.ws_url, subprotocols=[f"bearer.{WRONG}"]) == 403

    asyncio.run(scenario())


@pytest.mark.parametrize("since", ["abc", "-1", "1.5", "", "%20", str(LARGEST_INTEGER + 1), "9" * 30])
def test_stream_refuses_a_bad_since_saying_what_is_allowed(served: Served, since: str) -> None:
    async def scenario() -> ConnectionClosed:
        async with connect(f"{served.ws_url}?since={since}", additional_headers={"Authorization": f"Bearer {TOKEN}"},
                           proxy=None) as websocket:
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(websocket.recv(), 5)
        return closed.value

    closed = asyncio.run(scenario())
    assert closed.rcvd is not None and closed.rcvd.code == 4422
    assert "since must be a whole number >= 0" in closed.rcvd.reason
    assert not served.hub._subscriptions


def test_the_monitors_client_reports_a_refused_since_as_a_422(served: Served) -> None:
    async def first() -> dict:
        async for event in ApiClient(served.url, TOKEN).stream(since=-1):
            return event

    with pytest.raises(ApiError, match="refused the stream: since must be a whole number >= 0") as refused:
        asyncio.run(first())
    assert refused.value.status == 422


def test_stream_checks_the_token_before_since(served: Served) -> None:
    assert asyncio.run(refused_status(f"{served.ws_url}?since=abc")) == 403


def test_stream_refuses_foreign_origins_and_hosts(served: Served, open_metrics: Served) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async def scenario() -> None:
        for origin in ("http://evil.example.com", "https://127.0.0.1.evil.example.com", "null", "file://",
                       # user info, a path, a port out of range, a bracket left open (once a 500)
                       "http://x@127.0.0.1", "http://x:y@localhost:3000", "http://127.0.0.1/page",
                       "http://127.0.0.1:99999", "http://[::1"):
            assert await refused_status(served.ws_url, additional_headers=headers, origin=origin) == 403, origin
        # A page on a rebound name: the URL's host is what the client sends as Host.
        port = int(served.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as rebound:
            assert await refused_status(f"ws://evil.example.com:{port}/v1/stream", additional_headers=headers,
                                        sock=rebound) == 403
        # An origin the user allowed, on a server bound beyond loopback.
        async with connect(open_metrics.ws_url, additional_headers=headers, origin="https://grafana.example.com",
                           proxy=None):
            pass
        assert await refused_status(open_metrics.ws_url, additional_headers=headers,
                                    origin="https://evil.example.com") == 403

    asyncio.run(scenario())


def test_a_closed_stream_releases_its_subscription(served: Served) -> None:
    async def scenario() -> None:
        async with connect(served.ws_url, additional_headers={"Authorization": f"Bearer {TOKEN}"}, proxy=None):
            await asyncio.sleep(0.1)
            assert len(served.hub._subscriptions) == 1
        for _ in range(50):
            if not served.hub._subscriptions:
                break
            await asyncio.sleep(0.02)
        assert len(served.hub._subscriptions) == 0

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------- the schema


@pytest.mark.slow
def test_schemathesis_finds_nothing_against_the_openapi_schema(serve, tmp_path: Path) -> None:
    """Every check schemathesis has (no 5xx, documented codes and bodies, valid data accepted, invalid refused,
    405 with Allow, auth enforced) on requests generated from the schema the API serves."""
    schemathesis = Path(sys.executable).with_name("schemathesis")
    if not schemathesis.exists():
        pytest.skip("schemathesis is not installed (pip install schemathesis)")
    _, _, _, app = build(tmp_path)
    with serve(app) as url:
        run = subprocess.run(
            [str(schemathesis), "run", f"{url}/openapi.json?token={TOKEN}", "-H", f"Authorization: Bearer {TOKEN}",
             "--checks", "all", "--max-examples", "40", "--workers", "1", "--no-color", "--continue-on-failure",
             "--generation-database", "none"],
            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
