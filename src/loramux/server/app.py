"""The OpenAI-compatible multi-adapter server: one base model, any number of adapters, each request
choosing its own adapter set, adapters loaded and unloaded while traffic flows.

    from loramux.server import create_app, ServerSettings, serve_in_thread
    app = create_app(engine, ServerSettings(adapter_dirs=("/adapters",)))
    with serve_in_thread(app) as srv:        # uvicorn on 127.0.0.1, a free port
        print(srv.url)                       # http://127.0.0.1:PORT  (OpenAI base_url: srv.url + "/v1")
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ..engine.bank import bank_info
from ..engine.runtime import Engine
from ..sources import CancelToken
from . import background, jobs, playground, protocols, push, tokenize
from .access import Cors
from .config import ServerSettings
from .errors import install_handlers
from .guard import Guard, admin_routes, is_admin, uvicorn_config
from .metrics import CONTENT_TYPE
from .pool import Entry
from .schemas import (
    AdapterScale,
    LoadAdapterRequest,
    UnloadAdapterRequest,
)
from .state import ServerState
from .versions import VersionHeader

log = logging.getLogger("loramux.server")
T = TypeVar("T")


def create_app(engine: Engine, settings: ServerSettings | None = None, *, own_engine: bool = False) -> FastAPI:
    """The FastAPI app serving `engine`. With own_engine, the engine is closed when the app shuts down."""
    settings = (settings or ServerSettings()).validated()
    state = ServerState(engine, settings, _base_name(engine, settings))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        background.install(settings.background_nice)  # request work beside decoding: only spare CPU
        yield
        if own_engine:
            await asyncio.to_thread(engine.close)
            log.info("loramux: engine closed")

    app = FastAPI(title="loramux", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.lm = state
    install_handlers(app)
    _routes(app, state)
    health = ("/health", "/v1/health")  # /v1/health: llama-server's alias (protocols/llama_server.py)
    public = (*health, "/metrics") if settings.public_metrics else health
    app.add_middleware(Guard, api_key=settings.api_key, max_body=settings.max_body_bytes, public=public,
                       admin_api_key=settings.admin_api_key, admin=admin_routes(app.routes),
                       allowed_hosts=settings.host_allowlist(), max_upload=settings.max_upload_bytes,
                       keyless=playground.PUBLIC)
    app.add_middleware(VersionHeader)
    app.add_middleware(Cors, origins=settings.cors_origins)  # outermost: preflights before the keys
    return app


def _base_name(engine: Engine, settings: ServerSettings) -> str:
    """--served-model-name, else the model file's name without .gguf."""
    if settings.served_model_name:
        return settings.served_model_name
    name = engine.model.path.name
    return name[:-5] if name.endswith(".gguf") else name


def _routes(app: FastAPI, state: ServerState) -> None:
    pool = state.pool

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = state.healthy()
        return JSONResponse({"status": "ok" if ok else "error"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        snapshot = state.snapshot()  # on the loop: the adapter table is the loop's alone
        body = await asyncio.to_thread(state.metrics.render, snapshot)  # rendering is the slow part
        # llama-server's header: dashboards and exporters read the process start from it
        return Response(body, media_type=CONTENT_TYPE, headers={"Process-Start-Time-Unix": str(state.started)})

    @app.get("/v1/models")
    async def models(http: HTTPRequest) -> dict[str, Any]:
        n_ctx, admin = state.engine.n_ctx, is_admin(http.scope)
        model = state.engine.model.path
        data = [{"id": state.base_name, "object": "model", "created": state.started, "owned_by": "loramux",
                 "root": str(model) if admin else model.name, "parent": None, "max_model_len": n_ctx}]
        adapters = state.engine.adapters
        for e in pool.ordered():
            data.append({"id": e.name, "object": "model", "created": e.created, "owned_by": "loramux",
                         "root": _source(e, admin), "parent": state.base_name, "max_model_len": n_ctx,
                         "lora_id": e.id, "scale": e.scale, "resident": e.resident, "pinned": e.pinned,
                         **bank_info(state.engine.bank, adapters.get(e.name))})
        return {"object": "list", "data": data}

    protocols.add_routes(app, state)  # chat/completions and the other protocols
    tokenize.add_routes(app, state)
    playground.add_routes(app, state)  # GET /playground: the page (server/playground/)
    _adapter_routes(app, state)
    push.add_routes(app, state)  # factor pushes (admin plane)
    app.state.jobs = jobs.install(app, state)  # training files and fine-tuning jobs (admin plane)


def _adapter_routes(app: FastAPI, state: ServerState) -> None:
    pool = state.pool

    @app.post("/v1/load_lora_adapter")
    async def load_adapter(body: LoadAdapterRequest, http: HTTPRequest) -> Response:
        cancel = CancelToken()  # a client that leaves cancels its download
        e = await _unless_client_leaves(http, cancel, pool.load(
            body.lora_name, body.lora_path, scale=body.scale, replace=body.replace, pinned=body.pinned,
            cancel=cancel))
        if e is None:
            return Response(status_code=499)
        return JSONResponse({"message": f"Success: LoRA adapter '{e.name}' added successfully.", "id": e.id,
                             "name": e.name})

    @app.post("/v1/unload_lora_adapter")
    async def unload_adapter(body: UnloadAdapterRequest) -> dict[str, Any]:
        e = await pool.unload(body.lora_name, body.lora_int_id)
        state.metrics.forget(e.name)  # a name that is gone leaves the label sets
        return {"message": f"Success: LoRA adapter '{e.name}' removed successfully.", "id": e.id, "name": e.name}

    @app.get("/lora-adapters")
    async def list_adapters(http: HTTPRequest) -> list[dict[str, Any]]:
        admin = is_admin(http.scope)
        return [{"id": e.id, "name": e.name, "path": e.display_path(admin),
                 "scale": e.global_scale, "default_scale": e.scale, "resident": e.resident, "pinned": e.pinned}
                for e in pool.ordered()]

    @app.post("/lora-adapters")
    async def set_adapters(body: list[AdapterScale]) -> dict[str, Any]:
        pool.set_global_scales([(x.id, x.scale) for x in body])
        return {"success": True}


def _source(e: Entry, admin: bool) -> str:
    """An adapter's source as a caller may see it: never URL credentials or query strings; a local file's
    directories only for the admin plane."""
    return e.display_source(admin)


async def _unless_client_leaves(http: HTTPRequest, cancel: CancelToken, work: Awaitable[T]) -> T | None:
    """Await `work`; if the client disconnects first, set `cancel` (a download stops at its next chunk) and
    return None once `work` settled: it is never abandoned half-way (an engine load that began finishes)."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if nobody awaits it
    watch = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        cancel.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    cancel.cancel()
    try:
        await task
    except Exception:  # noqa: BLE001 - cancelled, or failed: the client is gone and cannot be told
        pass
    return None


async def _disconnected(http: HTTPRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


class ServerThread:
    """uvicorn serving an app from a background thread (tests, notebooks, benchmarks).

    The socket is bound before the thread starts, so `port` is known at once (port 0 = a free one).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 graceful_shutdown_s: float = 5.0) -> None:
        self.host = host
        self.sock = socket.create_server((host, port))
        self.port = int(self.sock.getsockname()[1])
        lm = getattr(getattr(app, "state", None), "lm", None)  # an app of create_app: its limits and timeouts
        settings = lm.settings if isinstance(lm, ServerState) else ServerSettings()
        config = uvicorn_config(app, settings, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=graceful_shutdown_s)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"loramux-server-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self if self.thread.is_alive() else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> ServerThread:
    """Start uvicorn for `app` in a daemon thread and return once it accepts connections."""
    return ServerThread(app, host, port, **kwargs).start()


__all__ = ["ServerThread", "create_app", "serve_in_thread"]
