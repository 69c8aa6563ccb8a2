"""Cross-origin access (CORS) for browser pages on another origin, opt-in with `--cors-origins`.

    no origins configured            → no CORS headers; a browser on another origin is refused by the browser
    preflight (OPTIONS + Access-Control-Request-Method) from an allowed origin
                                     → 204 with the allowed methods and headers, answered before the key
                                       check (browsers never send credentials on a preflight), as
                                       llama-server does
    preflight from another origin    → 403 cors_origin_not_allowed
    any other request from an allowed origin → the route's answer with Access-Control-Allow-Origin

The keys still guard every real request (guard.py runs inside this middleware): CORS only lets the browser
show the page the answer. Credentials (cookies) are never allowed: the API authenticates with headers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .errors import APIError

ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type, X-Api-Key, Anthropic-Version, Accept"
MAX_AGE_S = 600  # how long a browser may keep a preflight's answer


class Cors:
    """ASGI middleware answering CORS preflights and marking the answers to allowed origins."""

    def __init__(self, app: Any, origins: Iterable[str]) -> None:
        self.app = app
        self.origins = frozenset(o.rstrip("/").lower() for o in origins)
        self.any = "*" in self.origins

    def allows(self, origin: str) -> bool:
        """Whether a page served from `origin` (an Origin header's value) may read the answers."""
        return bool(origin) and (self.any or origin.rstrip("/").lower() in self.origins)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.origins:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        origin = headers.get(b"origin", b"").decode("latin-1")
        if scope.get("method") == "OPTIONS" and b"access-control-request-method" in headers:
            await self._preflight(scope, receive, send, origin, headers)
            return
        if not self.allows(origin):
            await self.app(scope, receive, send)
            return
        extra = self._allow(origin)

        async def marked(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)
        await self.app(scope, receive, marked)

    def _allow(self, origin: str) -> list[tuple[bytes, bytes]]:
        value = b"*" if self.any else origin.encode("latin-1")
        return [(b"access-control-allow-origin", value), (b"vary", b"Origin")]

    async def _preflight(self, scope: dict[str, Any], receive: Any, send: Any, origin: str,
                         headers: dict[bytes, bytes]) -> None:
        if not self.allows(origin):
            err = APIError(403, f"cross-origin requests from {origin or 'a page without an Origin'!r} are not "
                                "allowed: start the server with --cors-origins ORIGIN (or cors_origins in the "
                                "settings file) to allow them", code="cors_origin_not_allowed")
            await err.response_for(scope.get("path", ""))(scope, receive, send)
            return
        asked = headers.get(b"access-control-request-headers", b"").decode("latin-1")
        out = [*self._allow(origin), (b"access-control-allow-methods", ALLOW_METHODS.encode()),
               (b"access-control-allow-headers", (asked or ALLOW_HEADERS).encode("latin-1")),
               (b"access-control-max-age", str(MAX_AGE_S).encode()), (b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 204, "headers": out})
        await send({"type": "http.response.body", "body": b""})


__all__ = ["ALLOW_HEADERS", "ALLOW_METHODS", "Cors"]
