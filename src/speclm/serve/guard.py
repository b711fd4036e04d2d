"""What every request passes before a route sees it: the Host check, the API key, and the
bookkeeping of each answer (its status into the metrics, the replica header).

Why a Host check: a server on 127.0.0.1 without ``--api-key`` is reachable from any web page the
user opens. Simple cross-origin POSTs are refused by the routes (415 unless the body is
``application/json``, which a page can only send after a CORS preflight that this server does
not answer unless ``--cors-allow-origin`` is set), and DNS rebinding (a page's own host name made
to resolve to 127.0.0.1, so the browser treats the replies as same-origin) is refused here: with
no key, only requests naming a loopback host, the bound address or an ``--allowed-host`` are
served. With a key, the key is the protection and any Host is accepted.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets
from collections.abc import Iterable

from fastapi.responses import JSONResponse

from .protocol import APIError

log = logging.getLogger("speclm.serve")
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
DISCONNECTED = "speclm_client_disconnected"  # scope["state"] flag set by a route; counted as 499
REPLICA_ID = f"replica-{secrets.token_hex(4)}"  # names this process without its host or pid


def host_allowed(host_header: str, allowed: Iterable[str]) -> bool:
    """True if a ``Host`` header (``name``, ``name:port``, ``[v6]:port``) names a loopback host
    (``localhost``, ``*.localhost``, 127.0.0.0/8, ::1) or one of ``allowed`` (``*``: any)."""
    allowed = {_host_name(a) for a in allowed}
    if "*" in allowed:
        return True
    host = _host_name(host_header)
    if host in allowed or host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(host: str) -> str:
    """``Name:port``, ``[v6]:port`` or a bare name -> the lower-case name, no trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):  # [v6] or [v6]:port
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


class Guard:
    """ASGI middleware: Host check (when no key is set), bearer-token auth (every route but
    /health), per-route request counts by status (499 for a client that went away), and an
    ``x-speclm-server`` header with an opaque id of this process (which Ray replica answered)
    on every authorized answer."""

    def __init__(self, app, state) -> None:
        self.app, self.state = app, state
        key = state.config.api_key
        self._expected = f"Bearer {key}".encode() if key else None
        self._allowed = [state.config.bind_host, *state.config.allowed_hosts]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else ("/v1/models" if path.startswith("/v1/models/") else "other")
        status = [500]
        server_header = (b"x-speclm-server", REPLICA_ID.encode())

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        async def send_marked(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), server_header]
            await send_counted(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                log.info("%s %s: %d %s", scope["method"], path, refusal.status, refusal.message)
                await JSONResponse(refusal.body(), status_code=refusal.status,
                                   headers=refusal.headers)(scope, receive, send_counted)
                return
            await self.app(scope, receive, send_marked)
        finally:
            if scope.get("state", {}).get(DISCONNECTED):
                status[0] = 499
            self.state.metrics.requests.labels(route, str(status[0])).inc()

    def _refusal(self, scope) -> APIError | None:
        headers = dict(scope.get("headers", []))
        if self._expected is None:
            host = headers.get(b"host")
            if host is not None and not host_allowed(host.decode("latin-1"), self._allowed):
                return APIError(403, f"requests for host {host.decode('latin-1')!r} are refused: "
                                "without --api-key the server answers only loopback names and "
                                "its bound address (allow others with --allowed-host)",
                                type="permission_error", code="host_not_allowed")
            return None
        if scope["path"] == "/health":
            return None
        sent = headers.get(b"authorization")
        if sent is None or not hmac.compare_digest(sent, self._expected):
            return APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return None
