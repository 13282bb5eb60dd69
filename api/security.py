"""Who may talk to the API: the run's bearer token, a loopback Host while bound to loopback, and the
Origin of WebSocket handshakes (a browser page on another site must not read the stream).
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
from collections.abc import Sequence
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, HTTPException, status
from fastapi.security import APIKeyQuery, HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

TOKEN_QUERY_PARAMETER = "token"
SUBPROTOCOL_PREFIX = "bearer."
_BEARER = HTTPBearer(auto_error=False, description="The run's token (in its runtime file).")
_QUERY_TOKEN = APIKeyQuery(name=TOKEN_QUERY_PARAMETER, auto_error=False,
                           description="The run's token, for browser URLs.")
TOKEN_HINT = ("send the run's token as 'Authorization: Bearer <token>' or ?token=<token>; it is in the run's "
              "runtime file (`verl status --pid PID` finds it)")


def token_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison, so response timing says nothing about how much of a guess was right."""
    return given is not None and hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


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
    """FastAPI dependency: the run's token in the Authorization header or the ?token= query parameter.

    Declared through FastAPI's security classes so /docs shows an "Authorize" button for it.
    """

    def __init__(self, token: str):
        if not token:
            raise ValueError("the API token must not be empty")
        self.token = token

    async def __call__(
        self,
        bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
        query_token: Annotated[str | None, Depends(_QUERY_TOKEN)],
    ) -> None:
        if token_matches(bearer.credentials if bearer else None, self.token) or token_matches(query_token,
                                                                                             self.token):
            return
        problem = "wrong token" if bearer or query_token else "missing token"
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail=f"{problem}: {TOKEN_HINT}",
                            headers={"WWW-Authenticate": "Bearer"})


def websocket_token(connection: HTTPConnection) -> tuple[str | None, str | None]:
    """(token offered, subprotocol that carried it): header, query parameter, or "bearer.<token>" subprotocol."""
    header = connection.headers.get("authorization", "")
    scheme, _, credentials = header.partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip(), None
    if connection.query_params.get(TOKEN_QUERY_PARAMETER):
        return connection.query_params[TOKEN_QUERY_PARAMETER], None
    for protocol in connection.scope.get("subprotocols") or ():
        if protocol.startswith(SUBPROTOCOL_PREFIX):
            return protocol.removeprefix(SUBPROTOCOL_PREFIX), protocol
    return None, None


def origin_allowed(origin: str, host_header: str, allowed_origins: Sequence[str]) -> bool:
    """A loopback page (any port), the API's own origin, or one of allowed_origins."""
    normalized = origin.strip().rstrip("/").lower()
    if normalized in {allowed.strip().rstrip("/").lower() for allowed in allowed_origins}:
        return True
    parts = urlsplit(normalized)
    if parts.scheme not in ("http", "https") or not parts.hostname:
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
