"""What stands between the network and the routes: the Host allow-list, the two keys (inference and
admin), JSON-only POST bodies, the body size, and uvicorn's connection limits and timeouts.

    Host not allowed            → 421 host_not_allowed      (DNS rebinding: a web page's own name)
    no or wrong key             → 401 invalid_api_key
    state-changing route, no --admin-api-key configured → 403 admin_disabled
    state-changing route, the inference key             → 403 admin_key_required
    POST without a JSON content type                    → 415 unsupported_media_type (cross-site forms)
    body over --max-body-bytes                          → 413 request_too_large
    (UPLOAD_ROUTES: admin-plane uploads, any content type, bounded by max_upload_bytes instead)

Every route that is not a GET and not one of INFERENCE_ROUTES is a state-changing (admin) route, so
a route added later is on the admin plane unless someone puts it on the inference plane on purpose.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from hmac import compare_digest
from typing import Any

import h11
import uvicorn
from fastapi import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import ServerSettings
from .errors import APIError

INFERENCE_ROUTES = frozenset({("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                              ("POST", "/tokenize"), ("POST", "/detokenize"),
                              # the other protocols' generation and read-only routes (server/protocols/)
                              ("POST", "/v1/responses"), ("POST", "/v1/messages"),
                              ("POST", "/v1/messages/count_tokens"), ("POST", "/api/chat"),
                              ("POST", "/api/generate"), ("POST", "/api/show"), ("POST", "/api/embed"),
                              ("POST", "/api/embeddings"),
                              # Ollama's model management: refused by name whoever asks (no state changes)
                              ("POST", "/api/pull"), ("POST", "/api/push"), ("POST", "/api/create"),
                              ("POST", "/api/copy"), ("DELETE", "/api/delete"),  # read-only, change nothing
                              # llama-server's native routes and aliases (protocols/llama_server.py); its
                              # POST /props and /slots/{id} answer 501 whoever asks
                              ("POST", "/completion"), ("POST", "/completions"), ("POST", "/infill"),
                              ("POST", "/chat/completions"), ("POST", "/apply-template"),
                              ("POST", "/chat/completions/input_tokens"),
                              ("POST", "/v1/chat/completions/input_tokens"), ("POST", "/props"),
                              ("POST", "/slots/{id_slot}")})
# Admin-plane uploads whose bodies are files, not JSON (a factor push's safetensors, a training file):
# a browser form cannot carry the admin key, so the JSON-only rule's reason does not apply to them.
UPLOAD_ROUTES = ((("PUT",), re.compile(r"/v1/adapters/[^/]+/factors")), (("POST",), re.compile(r"/v1/files")))
# Read routes that still belong to the admin plane (training jobs and their files, adapter internals).
ADMIN_PREFIXES = ("/v1/adapters/", "/v1/fine_tuning/", "/v1/files")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
ADMIN_SCOPE_KEY = "loramux.admin"  # set in the ASGI scope: True when the request carries the admin key
MAX_HEADER_BYTES = 16 * 1024  # request line + headers (h11's limit; larger ones get 400)


def admin_routes(routes: Iterable[Any]) -> frozenset[tuple[str, str]]:
    """(method, path) of every route that may change server state: all but GETs and INFERENCE_ROUTES."""
    out = set()
    for r in routes:
        for m in getattr(r, "methods", None) or ():
            if m not in SAFE_METHODS and (m, r.path) not in INFERENCE_ROUTES:
                out.add((m, r.path))
    return frozenset(out)


def is_upload(method: str, path: str) -> bool:
    """Whether (method, path) is one of UPLOAD_ROUTES."""
    return any(method in methods and pattern.fullmatch(path) for methods, pattern in UPLOAD_ROUTES)


def _template(path: str) -> re.Pattern[str]:
    """A route path with {parameters} as a pattern of the concrete paths it serves."""
    return re.compile(re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(path)))


def is_admin(scope: dict[str, Any]) -> bool:
    """Whether the request was authenticated with the admin key (the guard records it in the scope)."""
    return bool(scope.get(ADMIN_SCOPE_KEY, False))


# ---------------------------------------------------------------------------------------- Host check
def split_host(value: str) -> tuple[str, str | None]:
    """'name:port', '[v6]:port', 'name' → (lower-case host without a trailing dot, port or None)."""
    v = value.strip().lower()
    port: str | None = None
    if v.startswith("["):
        end = v.find("]")
        host, rest = (v[1:end], v[end + 1:]) if end > 0 else (v, "")
        port = rest[1:] if rest.startswith(":") else None
    elif v.count(":") == 1:
        host, port = v.split(":")
    else:
        host = v  # a name, an IPv4 address, or an IPv6 address without brackets (allow-list entries)
    return host.rstrip("."), port or None


class HostCheck:
    """Host header allow-list: 'name', 'name:port', '[v6]' or 'v6', '*.domain' (its subdomains), '*'."""

    def __init__(self, allowed: Iterable[str]) -> None:
        self.any = "*" in allowed
        self.entries = [split_host(a) for a in allowed if a != "*"]

    def allows(self, header: str | None) -> bool:
        if self.any:
            return True
        if not header:
            return False
        host, port = split_host(header)
        for name, want_port in self.entries:
            same = host.endswith(name[1:]) if name.startswith("*.") else host == name
            if same and (want_port is None or want_port == port):
                return True
        return False


# --------------------------------------------------------------------------------------------- guard
class Guard:
    """ASGI middleware: Host allow-list, keys, admin plane, JSON content type and body size, checked in
    that order before any body is read."""

    def __init__(self, app: Any, api_key: str | None, max_body: int, public: tuple[str, ...] = ("/health",),
                 *, admin_api_key: str | None = None, admin: frozenset[tuple[str, str]] = frozenset(),
                 allowed_hosts: Iterable[str] = ("*",), max_upload: int | None = None,
                 keyless: tuple[str, ...] = ()) -> None:
        self.app = app
        self.max_upload = max_body if max_upload is None else max_upload
        self.admin_templates = [(m, _template(p)) for m, p in admin if "{" in p]
        self.key = api_key.encode() if api_key else None
        self.admin_key = admin_api_key.encode() if admin_api_key else None
        self.max_body = max_body
        self.public = public
        self.keyless = keyless  # without the key, but only under an allowed Host (the playground's files)
        self.admin = admin
        self.hosts = HostCheck(tuple(allowed_hosts))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        err = self._refusal(scope, headers)
        if err is not None:
            await err.response_for(scope.get("path", ""))(scope, receive, send)
            return
        try:
            declared = int(headers.get(b"content-length", b"0") or 0)
        except ValueError:
            declared = 0
        limit = self.max_upload if is_upload(scope.get("method", ""), scope.get("path", "")) else self.max_body
        if declared > limit:
            await self._too_large(limit).response_for(scope.get("path", ""))(scope, receive, send)
            return
        seen = 0

        async def limited() -> dict[str, Any]:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:  # chunked bodies carry no content-length
                    raise HTTPException(413, self._too_large(limit).message)
            return msg
        await self.app(scope, limited, send)

    def _refusal(self, scope: dict[str, Any], headers: dict[bytes, bytes]) -> APIError | None:
        path, method = scope.get("path", ""), scope.get("method", "GET")
        public = path in self.public
        host = headers.get(b"host", b"").decode("latin-1")
        if not public and not self.hosts.allows(host):
            return APIError(421, f"Host {host!r} is not served here (a DNS-rebinding guard): start the server "
                                 "with --allowed-hosts NAME[,NAME...] to accept it", code="host_not_allowed")
        auth = headers.get(b"authorization", b"")
        # Anthropic's clients send the key as x-api-key
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"").strip()
        # both comparisons always run, each in constant time: no early exit tells which key was close
        inference = self.key is not None and compare_digest(token, self.key)
        admin = self.admin_key is not None and compare_digest(token, self.admin_key)
        scope[ADMIN_SCOPE_KEY] = admin
        if self._admin_route(method, path):
            if self.admin_key is None:
                return APIError(403, f"{method} {path} changes server state and is disabled: start the server "
                                     "with --admin-api-key KEY (or --admin-api-key-file FILE, or "
                                     "$LORAMUX_ADMIN_API_KEY) and send 'Authorization: Bearer <admin key>'",
                                code="admin_disabled")
            if not admin:
                why = f"{method} {path} changes server state: send 'Authorization: Bearer <admin key>'"
                if inference:  # authenticated, but on the inference plane only
                    return APIError(403, why + " (the --admin-api-key, not the --api-key)",
                                    code="admin_key_required")
                return APIError(401, why, code="invalid_api_key")
        elif not public and path not in self.keyless and self.key is not None and not (inference or admin):
            return _unauthorized()
        if method in BODY_METHODS and not is_upload(method, path):
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if ctype != b"application/json":
                return APIError(415, f"{method} bodies must be JSON: send 'Content-Type: application/json' "
                                     f"(got {ctype.decode('latin-1') or 'none'!r})", code="unsupported_media_type")
        return None

    def _admin_route(self, method: str, path: str) -> bool:
        if (method, path) in self.admin or path.startswith(ADMIN_PREFIXES):
            return True
        return any(m == method and t.fullmatch(path) for m, t in self.admin_templates)

    def _too_large(self, limit: int | None = None) -> APIError:
        return APIError(413, f"request body larger than {self.max_body if limit is None else limit} bytes",
                        code="request_too_large")


def _unauthorized() -> APIError:
    return APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


# ----------------------------------------------------------------------------------- uvicorn side
class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the two timeouts it lacks.

    - read: a request (headers and body) must arrive within `read_timeout` of the connection opening
      or of its first byte; otherwise 408 and close (slow-loris). Between requests uvicorn's own
      keep-alive timeout applies.
    - write: when the client stops reading, the transport's buffer fills and writing pauses; paused for
      `write_timeout` the connection is dropped, which the app sees as a disconnect (a streamed
      request is then cancelled and frees its sequence).
    """

    read_timeout = 15.0
    write_timeout = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_read()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._arm_read()  # a new request starts: it must be complete in time
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._cancel("_read_timer")  # read whole

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel("_read_timer")
        self._cancel("_write_timer")
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout, self._write_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel("_write_timer")

    def _arm_read(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout, self._read_expired)

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name, None)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _read_expired(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
            body = b"request not received in time\n"
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()  # mid-body: the app sees a disconnect

    def _write_expired(self) -> None:
        self._write_timer = None
        if self.flow.write_paused:
            self.transport.abort()  # close() would wait to flush to a client that does not read


def protocol_for(settings: ServerSettings) -> type[GuardedH11Protocol]:
    """GuardedH11Protocol with the settings' timeouts."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"read_timeout": float(settings.read_timeout_s), "write_timeout": float(settings.write_timeout_s)})


def uvicorn_config(app: Any, settings: ServerSettings, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's Config for `app` with the settings' limits: connections, header size, keep-alive, read
    and write timeouts, graceful shutdown. kwargs go to uvicorn.Config (host, port, log_level...)."""
    kwargs.setdefault("timeout_graceful_shutdown", settings.graceful_shutdown_s)
    return uvicorn.Config(app, http=protocol_for(settings), limit_concurrency=settings.max_connections,
                          timeout_keep_alive=settings.keep_alive_s, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                          **kwargs)


__all__ = ["ADMIN_SCOPE_KEY", "INFERENCE_ROUTES", "MAX_HEADER_BYTES", "Guard", "GuardedH11Protocol",
           "HostCheck", "admin_routes", "is_admin", "protocol_for", "split_host", "uvicorn_config"]
