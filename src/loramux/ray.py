"""Many loramux replicas behind one endpoint with Ray Serve, requests routed to the replica holding their adapter.

    pip install "loramux[ray]"
    serve run loramux.ray:app                                   # the embedded model, 2 replicas
    serve run loramux.ray:build_app model=base.gguf adapters=a=/m/a.gguf,b=/m/b.gguf num_replicas=4

Each replica is an `Engine` with its own slot bank behind the same OpenAI-compatible app as
`loramux serve` (`server.create_app`). A small ingress deployment (`Router`) reads the request's
`model` (and the names in its `lora` list) and calls the replicas with Ray Serve's model multiplexing:
`multiplexed_model_id` = the adapter's name, so Ray sends it to a replica that already holds that
adapter, and a replica that does not loads it (`Replica.get_adapter`, `@serve.multiplexed`) from the
catalog given to the builder, evicting its least recently used one past `max_adapters`. Requests for the
base model go to any replica. A replica that dies is replaced by Serve's controller; its adapters are
loaded again on whichever replica gets their next request. The ingress checks the request first, as
`loramux serve` does (Host allow-list, API key, body size: the same `Guard` and settings), so a request
without the key never makes a replica load or evict an adapter, and no body past `max_body_bytes` is
buffered. Ray's own dashboard and Jobs API are not loramux's to guard: docs/distributed.md says how to
keep them on loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

try:
    from ray import serve
    from ray.serve import Application
    from ray.serve.handle import DeploymentHandle
except ImportError as e:  # pragma: no cover - install problem
    raise ImportError('loramux.ray needs Ray Serve: pip install "loramux[ray]"') from e
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .config import EXAMPLE_ADAPTER_NAME, embedded_model_in_use, example_adapter_path
from .errors import ParameterError

REPLICA_HEADER = "x-loramux-replica"  # which replica answered (for clients, logs and the tests)
MAX_ADAPTERS = int(os.environ.get("LORAMUX_RAY_MAX_ADAPTERS", "8"))  # per replica; read where Serve imports us


class _Resident:
    """An adapter held by one replica; Serve calls __del__ when it evicts it (LRU past MAX_ADAPTERS)."""

    def __init__(self, replica: Replica, name: str) -> None:
        self.replica, self.name = replica, name

    def __del__(self) -> None:  # Serve runs it in an executor thread; never raise out of it
        try:
            fut = asyncio.run_coroutine_threadsafe(self.replica.state.pool.unload(self.name), self.replica.loop)
            fut.result(timeout=60)
        except Exception:  # noqa: BLE001 - already gone, or the replica is shutting down
            pass


@serve.deployment
class Replica:
    """One Engine (its own bank) and the OpenAI-compatible app, spoken to through `handle`."""

    def __init__(self, model: str | None, settings: Mapping[str, Any], catalog: Mapping[str, str]) -> None:
        from .server.app import create_app
        from .server.config import ServerSettings

        dirs = sorted({str(Path(p).expanduser().resolve().parent) for p in catalog.values()})
        self.settings = ServerSettings.from_dict({**dict(settings), "model": model,
                                                  "adapter_dirs": [*settings.get("adapter_dirs", ()), *dirs]},
                                                 origin="loramux.ray settings")
        self.catalog = dict(catalog)
        self.engine = self.settings.build_engine()
        self.app = create_app(self.engine, self.settings, own_engine=True)
        self.state = self.app.state.lm
        self.loop = asyncio.get_running_loop()
        self.replica_id = serve.get_replica_context().replica_tag

    @serve.multiplexed(max_num_models_per_replica=MAX_ADAPTERS)
    async def get_adapter(self, name: str) -> _Resident:
        """Load catalog adapter `name` here unless it is already loaded (Serve calls this once per
        adapter and replica, and remembers the replica holds it)."""
        if name not in self.state.pool.entries:
            await self.state.pool.load(name, self.catalog[name])
        return _Resident(self, name)

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine is gone (closed, or its RPC workers lost) is
        replaced."""
        if self.engine.closed:
            raise RuntimeError(f"engine closed: {self.engine.lost or 'closed'}")

    def adapters(self) -> list[str]:
        """The adapters this replica holds now (for tests and debugging)."""
        return sorted(e.name for e in self.state.pool.entries.values() if e.resident)

    async def handle(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                     body: bytes, wanted: list[str]) -> AsyncIterator[Any]:
        """Run one HTTP request through the app; yields the response head (a dict), then body chunks."""
        mid = serve.get_multiplexed_model_id()
        for name in dict.fromkeys([mid, *wanted]):
            if name in self.catalog:
                await self.get_adapter(name)
        async for item in _asgi(self.app, method, path, query, headers, body, self.replica_id):
            yield item

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


async def _asgi(app: Any, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                replica_id: str) -> AsyncIterator[Any]:
    """An in-process ASGI call whose response streams out as it is produced (SSE included)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()  # the caller stopped reading: tell the app the client left
        return {"type": "http.disconnect"}

    task = asyncio.create_task(app(scope, receive, out.put))
    try:
        while True:
            msg = await out.get()
            if msg["type"] == "http.response.start":
                hdrs = {k.decode("latin-1"): v.decode("latin-1") for k, v in msg.get("headers", [])}
                hdrs[REPLICA_HEADER] = replica_id
                yield {"status": msg["status"], "headers": hdrs}
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield bytes(msg["body"])
                if not msg.get("more_body"):
                    break
        await task
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait([task], timeout=30)


#: ServerSettings fields the ingress reads: what it needs to refuse a request before any replica sees it.
GATE_SETTINGS = ("api_key", "api_key_env", "api_key_file", "admin_api_key", "admin_api_key_env",
                 "admin_api_key_file", "allowed_hosts", "host", "max_body_bytes", "public_metrics")


class _Refused(Exception):
    """The gate answered the request itself (its response messages are in `messages`)."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        super().__init__("refused")
        self.messages = messages


@serve.deployment
class Router:
    """The ingress: checks the request (Host, key, body size) as `loramux serve` does, then picks the
    adapter it is for and calls a replica multiplexed on it.

    The checks come first so that a request without the key never makes a replica load (and evict)
    an adapter, and the body is read only up to `max_body_bytes` (413 past it, chunked bodies too).
    """

    def __init__(self, replica: DeploymentHandle, catalog: Mapping[str, str],
                 settings: Mapping[str, Any] | None = None) -> None:
        from .server.config import ServerSettings
        from .server.guard import Guard

        gate = ServerSettings.from_dict({k: v for k, v in dict(settings or {}).items() if k in GATE_SETTINGS},
                                        origin="loramux.ray settings")
        self.replica = replica
        self.catalog = dict(catalog)
        self.max_body = gate.max_body_bytes
        public = ("/health", "/metrics") if gate.public_metrics else ("/health",)
        # admin routes are the replicas' to refuse (they know the app's routes); here both keys pass
        self.guard = Guard(self._read, api_key=gate.api_key, max_body=gate.max_body_bytes, public=public,
                           admin_api_key=gate.admin_api_key, allowed_hosts=gate.host_allowlist())

    @staticmethod
    async def _read(scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The gate's inner app: collect the body (through the gate's size-limited receive)."""
        chunks = scope.setdefault("loramux.body", [])
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                raise _Refused([])  # the client left
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                return

    async def _checked_body(self, request: Request) -> bytes:
        """The request's body once the gate let it through; _Refused with the gate's answer otherwise."""
        from starlette.exceptions import HTTPException

        from .server.errors import APIError

        sent: list[dict[str, Any]] = []

        async def send(msg: dict[str, Any]) -> None:
            sent.append(msg)
        scope = request.scope
        try:
            await self.guard(scope, request.receive, send)
        except HTTPException:  # a chunked body past the limit
            raise _Refused(_messages(APIError(413, f"request body larger than {self.max_body} bytes",
                                              code="request_too_large"))) from None
        if sent:
            raise _Refused(sent)
        return b"".join(scope.get("loramux.body", []))

    def _adapters_of(self, method: str, path: str, body: bytes) -> list[str]:
        """Catalog adapters an inference request names: its `model`, then its `lora` list's names, in
        order (at most MAX_ADAPTERS). Other routes name none: they never make a replica load one."""
        from .server.guard import INFERENCE_ROUTES

        if (method, path) not in INFERENCE_ROUTES:
            return []
        try:
            data = json.loads(body) if body else None
        except ValueError:
            return []  # the app answers the 400
        if not isinstance(data, dict):
            return []
        names = [data.get("model")]
        lora = data.get("lora")
        names += [x.get("name") for x in lora if isinstance(x, dict)] if isinstance(lora, list) else []
        return [n for n in dict.fromkeys(names) if isinstance(n, str) and n in self.catalog][:MAX_ADAPTERS]

    async def __call__(self, request: Request) -> Response:
        try:
            body = await self._checked_body(request)
        except _Refused as r:
            return _response(r.messages)
        names = self._adapters_of(request.method, request.url.path, body)
        handle = self.replica.options(stream=True, multiplexed_model_id=names[0] if names else "")
        gen = handle.handle.remote(request.method, request.url.path, request.url.query.encode(),
                                   list(request.headers.raw), body, names[1:])
        head = await gen.__anext__()

        async def rest() -> AsyncIterator[bytes]:
            async for chunk in gen:
                yield chunk
        head["headers"].pop("content-length", None)  # re-framed by the proxy
        return StreamingResponse(rest(), status_code=head["status"], headers=head["headers"])


def _messages(err: Any) -> list[dict[str, Any]]:
    """An APIError as the ASGI messages its response would send."""
    resp = err.response()
    return [{"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers},
            {"type": "http.response.body", "body": resp.body}]


def _response(messages: list[dict[str, Any]]) -> Response:
    """The gate's own answer (a 401, 413, 421 ...) as a Response; 499 when the client left."""
    start = next((m for m in messages if m["type"] == "http.response.start"), None)
    if start is None:
        return Response(status_code=499)
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.get("headers", [])
               if k.lower() != b"content-length"}
    return Response(body, status_code=start["status"], headers=headers)


def parse_catalog(value: str | Mapping[str, str] | None) -> dict[str, str]:
    """Adapters replicas may load: {name: path} or "name=path,name=path"."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    out: dict[str, str] = {}
    for item in filter(None, (v.strip() for v in value.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ParameterError("adapters", f"expected NAME=PATH, got {item!r}")
        out[name] = path
    return out


def build_app(args: Mapping[str, Any] | None = None) -> Application:
    """The Serve application (`serve run loramux.ray:build_app key=value ...`, or `serve.run(build_app({...}))`).

    args: model (a GGUF path; default the embedded model), adapters (the catalog: {name: path} or
    "name=path,..."; default, on the embedded model, the example 'pirate' adapter), num_replicas
    (default 2), replica_cpus (Ray CPUs per replica, default 1; also its llama.cpp threads), settings
    (`ServerSettings` fields as a dict, e.g. {"parallel": 4, "slots": 4, "api_key": ...}).
    """
    args = dict(args or {})
    model = args.pop("model", None)
    catalog = parse_catalog(args.pop("adapters", None))
    if model is None and not catalog and embedded_model_in_use():
        catalog = {EXAMPLE_ADAPTER_NAME: str(example_adapter_path())}
    missing = [f"{name}={path}" for name, path in catalog.items() if not Path(path).expanduser().is_file()]
    if missing:  # a replica would answer 404 for them later: say so now, while the app is built
        raise ParameterError("adapters", f"no such file: {', '.join(missing)}",
                             hint="give existing GGUF paths as NAME=PATH,NAME=PATH")
    replicas = int(args.pop("num_replicas", 2))
    cpus = float(args.pop("replica_cpus", 1))
    settings = dict(args.pop("settings", None) or {})
    settings.setdefault("threads", max(1, int(cpus)))
    if args:
        raise ParameterError(sorted(args)[0], "is not a loramux.ray argument (model, adapters, num_replicas, "
                                              "replica_cpus, settings)")
    replica = Replica.options(num_replicas=replicas, ray_actor_options={"num_cpus": cpus}).bind(model, settings, catalog)
    return Router.options(ray_actor_options={"num_cpus": 0}).bind(replica, catalog, settings)


app = build_app()

__all__ = ["REPLICA_HEADER", "Replica", "Router", "app", "build_app", "parse_catalog"]
