"""The daemon's HTTP API: REST under /v1, Prometheus text at /metrics, the live stream at /v1/stream,
and the live page at / (static files from api/static, which fetch everything else with the token).

Everything it serves comes in through `create_app`'s arguments (the hub, the registry, the daemon's
RunControl, the token), so a test builds a fresh app the way the daemon does.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn
from urllib.parse import quote

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response, WebSocket, status
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.websockets import WebSocketDisconnect

from api.advisor import SUSTAINED_WINDOW_S, Snapshot, advise
from api.hub import Subscription, TelemetryHub
from api.schemas import (
    EVENT_KINDS,
    KINDS_PATTERN,
    LARGEST_INTEGER,
    ErrorBody,
    Health,
    HintsBody,
    HistoryBody,
    LatestBody,
    NotControlNodeError,
    OffloadSummary,
    RunControl,
    SettingsBody,
    SettingsNotSavedError,
    SettingsRejectedError,
    SettingsUpdateBody,
    StepSnapshot,
    ValidationErrorBody,
    settings_change_schema,
)
from api.security import (
    BodyLimitMiddleware,
    LoopbackHostMiddleware,
    TokenAuth,
    is_loopback_host,
    offered_token,
    origin_allowed,
    token_matches,
)
from trainer.config.messages import RunStatus, StepMessage

# The server's own log (daemon.log): the daemon sends uvicorn's loggers there.
log = logging.getLogger("uvicorn.error")
UNAUTHORIZED = {401: {"model": ErrorBody, "description": "Missing or wrong token."}}
# The largest body read: a settings change takes a few dozen bytes, and a rejected one is copied into the log
# and the audit log, so a few MiB sent in a loop would fill both.
MAX_BODY_BYTES = 64 * 1024
BODY_TOO_LARGE = (f"the request body is over {MAX_BODY_BYTES // 1024} KiB, the most this API reads (a settings "
                  "change takes a few dozen bytes)")
MAX_KEYS_CHARS = 4096
MAX_KINDS_CHARS = 256
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE")
STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
# The page loads only its own files and talks only to this API ('self' covers the same-origin
# WebSocket); no frames (the settings form must not be clickjacked), no Referer (the first URL
# carries the token).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
SETTINGS_BODY_HINT = ('the body must be a JSON object of setting -> value, e.g. '
                      '{"dynamic_offload.gpu_memory_threshold": 0.8}')
SETTINGS_CHANGE_DOC = {"required": True, "content": {"application/json": {"schema": settings_change_schema()}}}
SETTINGS_CHANGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    413: {"model": ErrorBody, "description": f"A body over {MAX_BODY_BYTES // 1024} KiB; nothing changed."},
    422: {"model": ValidationErrorBody, "description": "A bad value; nothing changed."},
    503: {"model": ErrorBody, "description": "The change could not be saved (a full disk); nothing changed."},
}
# A stream refused for a bad query parameter closes with this code (private range 4000-4999, after
# HTTP 422); 1008 stays for refusals of the token or the origin, which clients read as "unauthorized".
WS_CLOSE_BAD_REQUEST = 4422
MAX_CLOSE_REASON_BYTES = 123


def create_app(*, hub: TelemetryHub, registry: CollectorRegistry, control: RunControl, token: str,
               public_metrics: bool = False, bind_host: str = "127.0.0.1",
               allowed_origins: Sequence[str] = (), exposition: Callable[[], bytes] | None = None) -> FastAPI:
    """The API of one run. `public_metrics` serves /metrics without the token (for a Prometheus that
    cannot send one); `bind_host` on loopback turns on the Host check; `allowed_origins` are the browser
    origins, beyond loopback pages and the API's own, that may open the WebSocket stream; `exposition`
    renders /metrics (default: the whole registry at every request; the daemon passes
    TelemetryMetrics.exposition, which renders only after a change).
    """
    # /docs and /openapi.json are declared below, behind the token like everything else.
    app = FastAPI(title="verl run API", summary="Status, metrics, live stream and live settings of one run.",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimitMiddleware, max_bytes=MAX_BODY_BYTES, message=BODY_TOO_LARGE)
    app.add_middleware(LoopbackHostMiddleware, enabled=is_loopback_host(bind_host))
    app.add_exception_handler(SettingsRejectedError, _settings_rejected)
    app.add_exception_handler(SettingsNotSavedError, _settings_not_saved)
    app.add_exception_handler(NotControlNodeError, _not_control_node)
    app.add_exception_handler(status.HTTP_405_METHOD_NOT_ALLOWED, _method_not_allowed)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    public = APIRouter()
    private = APIRouter(dependencies=[Depends(TokenAuth(token))], responses=UNAUTHORIZED)

    @public.get("/healthz", response_model=Health, tags=["health"])
    async def healthz() -> dict:
        """Liveness, without the token."""
        return {"status": "ok"}

    _add_metrics_routes(public if public_metrics else private, exposition or (lambda: generate_latest(registry)))
    _add_telemetry_routes(private, hub)
    _add_control_routes(private, control)
    _add_hints_route(private, hub, control)
    _add_page_routes(public)
    _add_docs_routes(private, app)
    app.include_router(public)
    app.include_router(private)
    _add_stream(app, hub, token, allowed_origins)
    return app


def _add_metrics_routes(router: APIRouter, exposition: Callable[[], bytes]) -> None:
    @router.get("/metrics", response_class=Response, tags=["metrics"],
                responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def metrics() -> Response:
        """Prometheus text exposition of every verl_* metric."""
        return Response(exposition(), media_type=CONTENT_TYPE_LATEST)


def _add_telemetry_routes(router: APIRouter, hub: TelemetryHub) -> None:
    @router.get("/v1/metrics/latest", response_model=LatestBody, tags=["metrics"])
    def latest() -> LatestBody:
        """The newest step metrics and GPU sample, and offload copies of the last minute."""
        return _latest_body(hub)

    # A plain `def`: FastAPI runs it in a worker thread, so serializing a long history does not stall the loop.
    @router.get("/v1/metrics/history", response_class=Response, tags=["metrics"],
                responses={200: {"model": HistoryBody}, 422: {"model": ValidationErrorBody}})
    def history(
        since: Annotated[int, Query(ge=0, le=LARGEST_INTEGER, description="Only events with a larger seq.")] = 0,
        keys: Annotated[str | None, Query(max_length=MAX_KEYS_CHARS, description="Comma-separated step metrics "
                                          "to keep, e.g. actor/pg_loss,timing_s/step.")] = None,
        # The pattern is documented, not enforced by FastAPI: _history_kinds checks the same rule and names
        # the unknown kinds, which a "should match pattern" message would not.
        kinds: Annotated[str | None, Query(max_length=MAX_KINDS_CHARS, json_schema_extra={"pattern": KINDS_PATTERN},
                                           description="Comma-separated kinds: " + ",".join(EVENT_KINDS))] = None,
    ) -> Response:
        """Events kept by the daemon (the last telemetry.history_seconds), oldest first."""
        wanted_kinds = _history_kinds(kinds)
        last_seq = hub.last_seq
        events = hub.since(since, kinds=wanted_kinds, keys=_comma_list(keys))
        # Resuming from last_seq must miss nothing, also when events arrived while this one was read.
        last_seq = max([last_seq, *(event.seq for event in events[-1:])])
        body = '{"events":[' + ",".join(event.to_json() for event in events) + f'],"last_seq":{last_seq}}}'
        return Response(body, media_type="application/json")


def _history_kinds(kinds: str | None) -> list[str] | None:
    """The `kinds` filter, or a 422 naming the unknown ones (the rule KINDS_PATTERN documents)."""
    wanted = _comma_list(kinds)
    unknown = [kind for kind in dict.fromkeys(wanted or ()) if kind not in EVENT_KINDS]
    if unknown:
        shown = ", ".join(repr(kind[:40]) for kind in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=[{
            "loc": ["query", "kinds"], "type": "value_error",
            "msg": f"unknown kind(s) {shown}; allowed: {', '.join(EVENT_KINDS)}, separated by commas"}])
    return wanted


def _latest_body(hub: TelemetryHub) -> LatestBody:
    """The newest step and GPU sample (NaN and infinities go out as null: the response's serializer)."""
    step, gpu = hub.latest("step"), hub.latest("gpu")
    snapshot = None
    if step is not None and isinstance(step.data, StepMessage):
        snapshot = StepSnapshot(step=step.data.step, time=step.time, metrics=step.data.metrics)
    return LatestBody(seq=hub.last_seq, step=snapshot,
                      gpu=gpu.data if gpu is not None and isinstance(gpu.data, dict) else None,
                      offload=OffloadSummary.model_validate(hub.offload.summary()))


def _add_control_routes(router: APIRouter, control: RunControl) -> None:
    @router.get("/v1/status", response_model=RunStatus, tags=["run"])
    async def run_status() -> RunStatus:
        """The run: state, pids, progress, restarts, live settings, telemetry health, offload placement."""
        return await _call(control.status)

    @router.get("/v1/settings", response_model=SettingsBody, tags=["settings"])
    async def get_settings() -> SettingsBody:
        """Every live setting: value, who applies it, what it does; version and acknowledged version."""
        return await _call(control.settings)

    # The body is read by hand, not declared as a parameter: FastAPI parses it as JSON only when the request
    # says application/json, and `curl -d` (the way most people try this) says form-urlencoded.
    @router.patch("/v1/settings", response_model=SettingsUpdateBody, tags=["settings"],
                  openapi_extra={"requestBody": SETTINGS_CHANGE_DOC}, responses=SETTINGS_CHANGE_RESPONSES)
    async def patch_settings(request: Request) -> dict:
        """Change live settings, all or nothing; the trainer applies them at its next safe point. The body is
        read as JSON whatever its Content-Type."""
        return await _call(control.update_settings, _settings_change(await request.body()))

    @router.post("/v1/checkpoint", status_code=status.HTTP_202_ACCEPTED, tags=["run"])
    async def checkpoint() -> dict:
        """Save a checkpoint at the trainer's next safe point."""
        return await _call(control.request_checkpoint)

    @router.post("/v1/stop", status_code=status.HTTP_202_ACCEPTED, tags=["run"])
    async def stop(force: Annotated[bool, Query(description="Kill the trainer now, without a checkpoint.")] = False
                   ) -> dict:
        """Checkpoint at the next safe point, then stop the run (the daemon exits 0); asking again while it stops
        is the same stop. With force=true the trainer is killed at once, without a checkpoint."""
        return await (_call(control.request_stop, True) if force else _call(control.request_stop))


def _add_hints_route(router: APIRouter, hub: TelemetryHub, control: RunControl) -> None:
    @router.get("/v1/hints", response_model=HintsBody, tags=["run"])
    async def hints() -> dict:
        """The advisor's hints for the run as it is now (the monitor's HINT lines), most urgent first."""
        now = hub.clock()
        recent_gpu = [event.as_dict() for event in hub.since(0, kinds=("gpu",))
                      if event.time >= now - SUSTAINED_WINDOW_S]
        # The advisor reads what the monitor fetches over HTTP: the same models, the same events.
        status: RunStatus = await _call(control.status)
        snapshot = Snapshot(time=now, status=status, latest=_latest_body(hub), history=recent_gpu)
        return {"time": now, "hints": advise(snapshot)}


def _add_page_routes(router: APIRouter) -> None:
    """The live page: a static shell, public because it holds no data. Its script takes the token from
    the ?token= of the URL `verl train` prints, keeps it in the tab's sessionStorage and sends it with
    every call, so without the token the page can show nothing but that the token is missing."""
    files = {path.name: path for path in sorted(STATIC_DIR.iterdir()) if path.suffix in STATIC_MEDIA_TYPES}

    @router.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(files["index.html"], media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    # Only the files shipped in api/static, by name: nothing else on the disk can be asked for.
    @router.get("/static/{name}", include_in_schema=False)
    async def static_file(name: str) -> FileResponse:
        if name not in files:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no file {name!r} in the live page")
        path = files[name]
        return FileResponse(path, media_type=STATIC_MEDIA_TYPES[path.suffix] + "; charset=utf-8",
                            headers=PAGE_HEADERS)


def _add_docs_routes(router: APIRouter, app: FastAPI) -> None:
    @router.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @router.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        # A browser opens /docs?token=...; the page then fetches the schema with the same token.
        token = request.query_params.get("token")
        schema_url = "/openapi.json" + (f"?token={quote(token, safe='')}" if token else "")
        return get_swagger_ui_html(openapi_url=schema_url, title=f"{app.title} - docs")


def _add_stream(app: FastAPI, hub: TelemetryHub, token: str, allowed_origins: Sequence[str]) -> None:
    # `since` is read from the query by hand: declared as a parameter, a bad value would make FastAPI
    # refuse the handshake, which a client sees as a bare 403 with no word of what was wrong.
    @app.websocket("/v1/stream")
    async def stream(websocket: WebSocket) -> None:
        """Replays the events after `?since=SEQ` (none without it), then sends each new one, one JSON per frame."""
        offered, subprotocol = offered_token(websocket)
        origin = websocket.headers.get("origin")
        if origin is not None and not origin_allowed(origin, websocket.headers.get("host", ""), allowed_origins):
            await _refuse(websocket, f"Origin {origin!r} may not open the stream")
            return
        if not token_matches(offered, token):
            await _refuse(websocket, f"{'wrong' if offered else 'missing'} token")
            return
        # A browser that offered the token as a subprotocol fails the handshake unless one is chosen.
        await websocket.accept(subprotocol=subprotocol)
        try:
            since = _stream_since(websocket.query_params.get("since"))
        except ValueError as error:
            # Refused after accepting, so the client can read the reason in the close frame.
            await websocket.close(code=WS_CLOSE_BAD_REQUEST, reason=_close_reason(str(error)))
            return
        async with hub.subscribe(since) as events:
            await _pump(websocket, events)


async def _refuse(websocket: WebSocket, reason: str) -> None:
    """Refuse a handshake: closing before accepting makes the server answer HTTP 403 (no upgrade).

    Not an HTTP denial response with a JSON body: uvicorn then logs a spurious "ASGI callable returned
    without completing handshake" error for every refused client.
    """
    await websocket.close(code=status.WS_1008_POLICY_VIOLATION, reason=_close_reason(reason))


def _close_reason(reason: str) -> str:
    """A close frame's reason holds at most 123 bytes of UTF-8."""
    return reason.encode()[:MAX_CLOSE_REASON_BYTES].decode(errors="ignore")


async def _pump(websocket: WebSocket, events: Subscription) -> None:
    """Send events until the client goes away; listening for the close notices it even when none come."""

    async def send_events() -> None:
        async for event in events:
            await websocket.send_text(event.to_json())

    async def until_closed() -> None:
        while (await websocket.receive())["type"] != "websocket.disconnect":
            pass  # clients have nothing to say; their messages are ignored

    tasks = [asyncio.create_task(send_events()), asyncio.create_task(until_closed())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect, OSError, RuntimeError):
                await task


def _settings_change(body: bytes) -> dict[str, Any]:
    """The PATCH /v1/settings body as a dict, or a 422 naming the body (nothing reaches the run)."""
    try:
        change = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as error:  # not JSON, not Unicode text, or nested too deep
        _refuse_body("json_invalid", f"{SETTINGS_BODY_HINT}; this is not JSON ({error})")
    if not isinstance(change, dict):
        _refuse_body("dict_type", f"{SETTINGS_BODY_HINT}; got a JSON {_json_type_name(change)}")
    return change


def _refuse_constant(name: str) -> NoReturn:
    """NaN and Infinity: Python's json reads them, JSON has no such numbers."""
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or exponent; 1e999 would otherwise be read as infinity."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:24]} is beyond the range of a number")
    return value


def _refuse_body(error_type: str, message: str) -> NoReturn:
    raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                        detail=[{"loc": ["body"], "type": error_type, "msg": message}])


def _json_type_name(value: Any) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _stream_since(value: str | None) -> int | None:
    """The stream's `since` query parameter: None when absent, else a seq (a whole number >= 0, as on
    GET /v1/metrics/history)."""
    if value is None:
        return None
    # At most 19 digits before int(): LARGEST_INTEGER has 16, and int() of thousands of digits is slow or refused.
    if re.fullmatch("[0-9]{1,19}", value) and int(value) <= LARGEST_INTEGER:
        return int(value)
    raise ValueError(f"since must be a whole number >= 0 and <= {LARGEST_INTEGER} (the last seq received), "
                     f"got {value[:24]!r}")


def _comma_list(value: str | None) -> list[str] | None:
    """"a,b" -> ["a", "b"]; None (the parameter absent) -> None, meaning no filter."""
    if value is None:
        return None
    return [item.strip() for item in value.split(",") if item.strip()]


async def _call(method: Callable[..., Any], *args: Any) -> Any:
    """Call a RunControl method, awaiting it when the daemon implemented it as a coroutine."""
    result = method(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


async def _settings_rejected(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, SettingsRejectedError)
    # "body": a problem with the body as a whole (an empty change), not with a setting of that name.
    detail = [{"loc": ["body"] if setting == "body" else ["body", setting], "msg": message, "type": "value_error"}
              for setting, message in error.problems]
    return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


async def _not_control_node(request: Request, error: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(error)}, status_code=status.HTTP_409_CONFLICT)


async def _settings_not_saved(request: Request, error: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(error)}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE)


async def _method_not_allowed(request: Request, error: Exception) -> JSONResponse:
    """405 whose Allow lists every method of the path: Starlette's names those of one route, and
    /v1/settings is two (GET and PATCH)."""
    router = request.app.router
    # Asked of the router itself, one method at a time: FastAPI keeps included routers nested, so there is
    # no flat list of routes to read the methods from.
    allowed = ", ".join(method for method in HTTP_METHODS
                        if any(route.matches({**request.scope, "method": method})[0] == Match.FULL
                               for route in router.routes))
    return JSONResponse({"detail": f"method {request.method} is not allowed here; allowed: {allowed}"},
                        status_code=status.HTTP_405_METHOD_NOT_ALLOWED, headers={"Allow": allowed})


async def _client_gone(request: Request, error: Exception) -> Response:
    """The client hung up in the middle of its body: nothing was done and nobody is left to answer, so one
    line, not an ERROR traceback."""
    log.info("%s %s: the client went away before its body was complete; nothing was done", request.method,
             request.url.path)
    return Response(status_code=status.HTTP_400_BAD_REQUEST)

