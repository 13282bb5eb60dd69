"""Who may talk to the API: the run's bearer token, a loopback Host while bound to loopback, the
Origin of WebSocket handshakes (a browser page on another site must not read the stream), and how
large a body may be.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
from collections.abc import Sequence
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import APIKeyQuery, HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

TOKEN_QUERY_PARAMETER = "token"
SUBPROTOCOL_PREFIX = "bearer."
_BEARER = HTTPBearer(auto_error=False, description="The run's token (in its runtime file).")
_QUERY_TOKEN = APIKeyQuery(name=TOKEN_QUERY_PARAMETER, auto_error=False,
                           description="The run's token, for browser URLs.")
TOKEN_HINT = ("send the run's token as 'Authorization: Bearer <token>' or ?token=<token>; it is in the run's "
              "runtime file (`verl status --pid PID` finds it)")


def token_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison, so response timing says nothing about how much of a guess was right."""
    # surrogatepass: a token decoded from a hostile request may hold lone surrogates; it must not match, not fail.
    return given is not None and hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                                                     expected.encode("utf-8"))


@functools.lru_cache(maxsize=256)  # every request asks about the same few Host values
def is_loopback_host(host: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1 (a host name or address, without port)."""
    host = host.strip().rstrip(".").lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(authority: str) -> str:
    """The host part of a Host header or URL authority ("[::1]:8000" -> "::1", "localhost:80" -> "localhost")."""
    authority = authority.strip()
    if authority.startswith("["):
        return authority[1:authority.find("]")] if "]" in authority else ""
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


class TokenAuth:
    """FastAPI dependency: the run's token in the Authorization header or the ?token= query parameter
    (the header wins when both come, as on the WebSocket stream: see `offered_token`).

    Declared through FastAPI's security classes so /docs shows an "Authorize" button for it.
    """

    def __init__(self, token: str):
        if not token:
            raise ValueError("the API token must not be empty")
        self.token = token

    async def __call__(
        self,
        request: Request,
        # Not read here (offered_token is), but declaring them is what puts them in the OpenAPI schema.
        _bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
        _query_token: Annotated[str | None, Depends(_QUERY_TOKEN)],
    ) -> None:
        offered, _ = offered_token(request)
        if token_matches(offered, self.token):
            return
        problem = "wrong token" if offered else "missing token"
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail=f"{problem}: {TOKEN_HINT}",
                            headers={"WWW-Authenticate": "Bearer"})


def offered_token(connection: HTTPConnection) -> tuple[str | None, str | None]:
    """(token offered, subprotocol that carried it), from the first place that has one: the Authorization
    header (scheme Bearer), the ?token= query parameter, or a "bearer.<token>" subprotocol.

    Only that first one counts: a wrong header is refused even when the query holds the right token, on
    REST and on the stream alike.
    """
    scheme, credentials = get_authorization_scheme_param(connection.headers.get("authorization"))
    if scheme.lower() == "bearer" and credentials:
        return credentials, None
    if connection.query_params.get(TOKEN_QUERY_PARAMETER):
        return connection.query_params[TOKEN_QUERY_PARAMETER], None
    for protocol in connection.scope.get("subprotocols") or ():
        if protocol.startswith(SUBPROTOCOL_PREFIX):
            return protocol.removeprefix(SUBPROTOCOL_PREFIX), protocol
    return None, None


def origin_allowed(origin: str, host_header: str, allowed_origins: Sequence[str]) -> bool:
    """A loopback page (any port), the API's own origin, or one of allowed_origins.

    Only a bare origin (scheme://host[:port], what browsers send) can pass: one with user info
    ("http://x@127.0.0.1"), a path, a query or a port that is not a port is refused.
    """
    normalized = origin.strip().rstrip("/").lower()
    if normalized in {allowed.strip().rstrip("/").lower() for allowed in allowed_origins}:
        return True
    try:
        parts = urlsplit(normalized)
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError:  # also "http://[::1": a bracket left open
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc:
        return False
    if parts.path or parts.query or parts.fragment:
        return False
    return is_loopback_host(parts.hostname) or parts.netloc == host_header.strip().lower()


class LoopbackHostMiddleware:
    """While the API listens on loopback only, refuse requests whose Host is not a loopback name.

    A web page can point a name it controls at 127.0.0.1 (DNS rebinding); the browser then sends that
    name as Host, which is how such requests are told apart. Written by hand because Starlette's
    TrustedHostMiddleware takes neither the 127.0.0.0/8 range nor a bracketed IPv6 Host with a port.
    """

    def __init__(self, app: ASGIApp, *, enabled: bool):
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.enabled or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = HTTPConnection(scope).headers.get("host", "")
        if is_loopback_host(host_of(host)):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "Host header is not a loopback name"})
            return
        body = json.dumps({"detail": f"Host {host!r} refused: this API serves loopback only (127.0.0.1, ::1, "
                                     "localhost)"}).encode()
        await send({"type": "http.response.start", "status": status.HTTP_403_FORBIDDEN,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def is_loopback_bind(bind_host: str) -> bool:
    return is_loopback_host(bind_host)


class BodyLimitMiddleware:
    """Refuse a request body over `max_bytes` with 413: at once when its Content-Length says so (before any
    route runs: one that reads no body, POST /v1/stop, would act first), else as soon as a chunked body
    streams past the limit.

    Written by hand: FastAPI's own max_body_size needs FastAPI 0.165, and its limiter replaces any answer
    to an oversized request, this one included, with a plain-text one.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int, message: str):
        self.app = app
        self.max_bytes = max_bytes
        self.message = message

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = HTTPConnection(scope).headers.get("content-length", "")
        # The server has already refused a Content-Length that is not a number (400).
        if declared.isascii() and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the route that reads the body: the app's handlers answer it as JSON.
                    raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, detail=self.message,
                                        headers={"Connection": "close"})
            return message

        await self.app(scope, receive_within_limit, send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"detail": self.message}).encode()
        await send({"type": "http.response.start", "status": status.HTTP_413_CONTENT_TOO_LARGE,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
