"""The API as a client meets it: a real uvicorn server on loopback, real httpx and websockets clients.

The daemon's RunControl is replaced by a fake that validates settings with the daemon's own rules
(trainer.config.live), so a 422 here carries the messages a user would read.
"""

from __future__ import annotations

import asyncio
import json
import socket
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
from trainer.config.live import LiveSettings, SettingsRejected
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
PRIVATE_ROUTES = [("GET", "/v1/status"), ("GET", "/v1/metrics/latest"), ("GET", "/v1/metrics/history"),
                  ("GET", "/metrics"), ("GET", "/v1/settings"), ("PATCH", "/v1/settings"),
                  ("POST", "/v1/checkpoint"), ("POST", "/v1/stop"), ("GET", "/docs"), ("GET", "/openapi.json")]


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

    def request_stop(self) -> dict:
        self.requests.append("stop")
        return {"requested": "stop"}


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


# ------------------------------------------------------------------------------------ settings


def test_patch_settings_forwards_to_the_control(served: Served) -> None:
    client = served.client()
    version = client.get("/v1/settings").json()["version"]
    response = client.patch("/v1/settings", json={"gpu_memory_threshold": 0.8, "dynamic_offload.enabled": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["version"] == version + 1 and body["status"] == "pending" and body["applies_at_step"] == 6
    assert body["new"] == {"gpu_memory_threshold": 0.8, "dynamic_offload.enabled": True}
    assert client.get("/v1/settings").json()["values"]["gpu_memory_threshold"] == 0.8


@pytest.mark.parametrize(("change", "named"), [
    ({"gpu_memory_threshold": 1.5}, ["gpu_memory_threshold"]),
    ({"gpu_memory_threshold": -1}, ["gpu_memory_threshold"]),
    ({"gpu_memory_threshold": "abc"}, ["gpu_memory_threshold"]),
    ({"min_transformer_layers_on_gpu": -1}, ["min_transformer_layers_on_gpu"]),
    ({"no_such_setting": 1, "gpu_memory_threshold": 0.5}, ["no_such_setting"]),
    ({"gpu_memory_threshold": 1.5, "min_transformer_layers_on_gpu": "abc", "gpu_sample_interval_s": -1},
     ["gpu_memory_threshold", "min_transformer_layers_on_gpu", "gpu_sample_interval_s"]),
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
    assert response.json()["new"] == {"gpu_memory_threshold": 0.65}
    assert client.get("/v1/settings").json()["values"]["gpu_memory_threshold"] == 0.65
    unlabelled = client.patch("/v1/settings", content=b'{"gpu_memory_threshold": 0.6}', headers={"Content-Type": ""})
    assert unlabelled.status_code == 200 and unlabelled.json()["new"] == {"gpu_memory_threshold": 0.6}


@pytest.mark.parametrize(("body", "content_type", "says"), [
    (b"[0.8]", "application/json", "got a JSON array"),
    (b"0.8", "application/x-www-form-urlencoded", "got a JSON number"),
    (b'"gpu_memory_threshold=0.8"', "text/plain", "got a JSON string"),
    (b"gpu_memory_threshold=0.8", "application/x-www-form-urlencoded", "this is not JSON"),
    (b"", "application/json", "this is not JSON"),
    (b'{"gpu_memory_threshold": 0.5', "application/json", "this is not JSON"),
    (b"\xff\xfe{", "application/json", "this is not JSON"),
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


def test_the_openapi_doc_shows_the_settings_body_as_a_json_object(served: Served) -> None:
    schema = served.client().get("/openapi.json").json()
    body = schema["paths"]["/v1/settings"]["patch"]["requestBody"]
    assert body["required"] is True
    assert body["content"]["application/json"]["schema"]["type"] == "object"
    assert body["content"]["application/json"]["schema"]["examples"] == [{"gpu_memory_threshold": 0.8}]


def test_setting_the_value_in_effect_changes_nothing(served: Served) -> None:
    client = served.client()
    first = client.patch("/v1/settings", json={"gpu_memory_threshold": 0.75}).json()
    forwarded = len(served.control.forwarded)
    again = client.patch("/v1/settings", json={"gpu_memory_threshold": 0.75})
    assert again.status_code == 200, again.text
    body = again.json()
    assert (body["version"], body["old"], body["new"]) == (first["version"], {}, {})
    assert body["values"]["gpu_memory_threshold"] == 0.75 and "applies_at_step" in body
    assert client.get("/v1/settings").json()["version"] == first["version"]
    assert len(served.control.forwarded) == forwarded  # nothing for the trainer
    # Of several settings, only those whose value changes are reported.
    mixed = client.patch("/v1/settings", json={"gpu_memory_threshold": 0.75, "log_level": "debug"}).json()
    assert (mixed["version"], mixed["old"], mixed["new"]) == (first["version"] + 1, {"log_level": "info"},
                                                              {"log_level": "debug"})


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


@pytest.mark.parametrize("since", ["abc", "-1", "1.5", "", "%20"])
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
        for origin in ("http://evil.example.com", "https://127.0.0.1.evil.example.com", "null", "file://"):
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
