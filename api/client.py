"""A client for a running daemon's API: what `verl monitor/set/status/stop` speak.

REST over httpx, the live stream over websockets; the token goes in the Authorization header
(never in a URL, where it would end up in logs). Every failure is an ApiError whose message can
be shown to a user as is; DaemonUnreachable and Unauthorized tell the two common causes apart,
and IncompatibleDaemon a body this client cannot read (a daemon of another verl version).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedError, InvalidHandshake, InvalidStatus

from api.schemas import LatestBody
from trainer.config.messages import RunStatus

# Close code the server uses when it refuses a WebSocket after the handshake (token or Origin).
_POLICY_VIOLATION = 1008
_BAD_REQUEST = 4422  # api/app.py WS_CLOSE_BAD_REQUEST: a bad query parameter (since)

Body = TypeVar("Body", bound=BaseModel)


class ApiError(Exception):
    """A request the daemon refused or could not answer; str() is fit to show a user.

    `problems` holds (setting, message) pairs from a 422 answer, one per rejected field.
    """

    def __init__(self, message: str, *, status: int | None = None, problems: Iterable[tuple[str, str]] = ()):
        self.status = status
        self.problems = list(problems)
        super().__init__(message)

    def lines(self) -> list[str]:
        """One line per rejected field for a 422, else the message."""
        if self.problems:
            return [f"{setting}: {message}" for setting, message in self.problems]
        return [str(self)]


class DaemonUnreachable(ApiError):
    """Nothing answers at the URL (the run ended, or the daemon is stuck)."""


class Unauthorized(ApiError):
    """The daemon refused the token (401, or a WebSocket closed for policy)."""


class IncompatibleDaemon(ApiError):
    """The daemon answered with a body that does not fit this client's model of it (another verl version)."""


class ApiClient:
    """Calls of one daemon's REST API and stream; use as a context manager or call close()."""

    def __init__(self, url: str, token: str, timeout: float = 5):
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        # trust_env=False: the daemon listens on this machine; a proxy from the environment would
        # receive the token and could not reach 127.0.0.1 anyway.
        self._http = httpx.Client(base_url=self.url, headers=self._headers, timeout=timeout, trust_env=False)

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------------------------- REST

    def status(self) -> RunStatus:
        return self._parse(RunStatus, "GET", "/v1/status")

    def latest(self) -> LatestBody:
        return self._parse(LatestBody, "GET", "/v1/metrics/latest")

    def history(self, since: int = 0, keys: Iterable[str] | None = None,
                kinds: Iterable[str] | None = None) -> dict[str, Any]:
        """Buffered events after sequence number `since`: {"events": [...], "last_seq": N}."""
        params: dict[str, Any] = {"since": since}
        if keys is not None:
            params["keys"] = ",".join(keys)
        if kinds is not None:
            params["kinds"] = ",".join(kinds)
        return self._request("GET", "/v1/metrics/history", params=params)

    def settings(self) -> dict[str, Any]:
        return self._request("GET", "/v1/settings")

    def update_settings(self, change: Mapping[str, Any]) -> dict[str, Any]:
        """PATCH the live settings (all or nothing); a rejection raises ApiError with its `problems`."""
        return self._request("PATCH", "/v1/settings", json=dict(change))

    def checkpoint(self) -> dict[str, Any]:
        return self._request("POST", "/v1/checkpoint")

    def stop(self, *, force: bool = False) -> dict[str, Any]:
        """Ask the run to checkpoint and exit; `force`: kill the trainer now, without a checkpoint."""
        return self._request("POST", "/v1/stop", params={"force": "true"} if force else None)

    def _parse(self, model: type[Body], method: str, path: str) -> Body:
        """The answer to a request as `model`; one that does not fit is an IncompatibleDaemon naming the
        first field that does not (a user needs the line, not pydantic's report)."""
        try:
            return model.model_validate(self._request(method, path))
        except ValidationError as error:
            problems = error.errors()
            field = ".".join(str(part) for part in problems[0]["loc"]) or "body"
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise IncompatibleDaemon(f"the daemon at {self.url} answered {method} {path} with a body this verl "
                                     f"cannot read: {field}: {problems[0]['msg'].lower()}{more}") from None

    def _request(self, method: str, path: str, **kwargs) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as error:
            raise DaemonUnreachable(f"the daemon does not answer at {self.url} ({_describe(error)})") from None
        if response.status_code == 401:
            raise Unauthorized(f"the daemon at {self.url} refused the token (401: {_detail(response)})",
                               status=401)
        if response.status_code == 422:
            problems = _problems(response)
            raise ApiError("; ".join(f"{setting}: {message}" for setting, message in problems),
                           status=422, problems=problems)
        if response.status_code == 409:  # a run-wide request to a daemon that does not hold the run's control
            raise ApiError(_detail(response), status=409)
        if response.status_code >= 400:
            raise ApiError(f"{method} {path} failed with HTTP {response.status_code}: {_detail(response)}",
                           status=response.status_code)
        try:
            return response.json()
        except json.JSONDecodeError:
            raise ApiError(f"{method} {path} answered something that is not JSON: {response.text[:200]!r}",
                           status=response.status_code) from None

    # ----------------------------------------------------------------------------------- stream

    async def stream(self, since: int | None = None) -> AsyncIterator[dict[str, Any]]:
        """Events as they are published ({"seq", "time", "kind", "data"}), after replaying those
        buffered after `since`. Ends when the daemon closes the stream; to resume after a drop,
        call again with the last `seq` received."""
        url = "ws" + self.url.removeprefix("http") + "/v1/stream"
        if since is not None:
            url += f"?since={since}"
        try:
            # proxy=None for the same reason as trust_env=False above.
            async with connect(url, additional_headers=self._headers, proxy=None) as socket:
                async for frame in socket:
                    yield json.loads(frame)
        except InvalidStatus as error:
            status = error.response.status_code
            error_type = Unauthorized if status in (401, 403) else ApiError
            raise error_type(f"the daemon at {self.url} refused the stream (HTTP {status})", status=status) from None
        except ConnectionClosedError as error:
            if error.rcvd is not None and error.rcvd.code == _POLICY_VIOLATION:
                raise Unauthorized(f"the daemon at {self.url} closed the stream: {error.rcvd.reason or 'policy'}",
                                   status=401) from None
            if error.rcvd is not None and error.rcvd.code == _BAD_REQUEST:
                raise ApiError(f"the daemon at {self.url} refused the stream: {error.rcvd.reason}",
                               status=422) from None
            raise DaemonUnreachable(f"the stream from {self.url} broke off ({error})") from None
        except (OSError, InvalidHandshake, TimeoutError) as error:
            raise DaemonUnreachable(f"the daemon does not answer at {self.url} ({_describe(error)})") from None


def page_url(api_url: str, token: str) -> str:
    """The live page's address with the token in it, as Jupyter prints its URL.

    The one place a token goes into a URL on purpose: a browser can be handed nothing else. The page
    moves the token into the tab's storage and strips it from the address bar at once.
    """
    return f"{api_url.rstrip('/')}/?token={quote(token, safe='')}"


def _describe(error: Exception) -> str:
    return str(error) or type(error).__name__


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except (json.JSONDecodeError, AttributeError):
        return response.text[:200] or response.reason_phrase
    return detail if isinstance(detail, str) else json.dumps(detail)


def _problems(response: httpx.Response) -> list[tuple[str, str]]:
    """FastAPI's 422 body {"detail": [{"loc": [..., FIELD], "msg": ...}]} as (field, message) pairs."""
    try:
        detail = response.json().get("detail")
    except (json.JSONDecodeError, AttributeError):
        return [("body", response.text[:200])]
    if not isinstance(detail, list):
        return [("body", str(detail))]
    problems = []
    for item in detail:
        location = [str(part) for part in item.get("loc", []) if part != "body"] if isinstance(item, dict) else []
        message = item.get("msg", str(item)) if isinstance(item, dict) else str(item)
        problems.append((".".join(location) or "body", message))
    return problems
