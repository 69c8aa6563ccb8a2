"""The playground: a page served by `loramux serve` at /playground to chat with an adapter stack, compare
adapter sets side by side on one prompt (fan-out), see what the server holds and its live metrics.

The page is three static files in this package (index.html, app.js, app.css: vanilla JavaScript, no build
step, nothing fetched from elsewhere). They need no key (an allowed Host still, as on every route), so a
browser can open the page before it has one; everything the page then asks for goes through the API with
the key the user types, sent as a header and kept in the tab's memory only. Every asset is sent with a
Content-Security-Policy that allows scripts and styles from this origin alone (no inline script, no other
origin, no framing), and the page shows model text with `textContent` only: markup in an answer is shown,
never run.

`GET /playground/api/adapters` (API key) lists each adapter with what the page's Adapters view shows:
source, rank, targets, size, sha256, residency tier, pinned, requests and tokens served.
"""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from ..guard import is_admin
from ..state import ServerState

ROUTE = "/playground"
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}
ASSETS = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "app.css": "text/css; charset=utf-8"}
#: The page's paths, answered without the API key under an allowed Host (static files: the page asks for
#: the key itself).
PUBLIC = (ROUTE, ROUTE + "/", *(f"{ROUTE}/{name}" for name in ASSETS if name != "index.html"))


def _asset(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


def _residency(state: ServerState, name: str) -> str:
    """The adapter's tier (engine/residency.py): `slot` (in the bank), `warm`, `loaded` or `cold` (evicted)."""
    bank = state.engine.bank
    e = state.pool.entries.get(name)
    if e is None or not e.resident:
        return "cold"
    if bank is not None and name in bank.in_slots():
        return "slot"
    if bank is not None and name in bank.warm.names():
        return "warm"
    return "loaded"


def _served(state: ServerState, metric: str) -> dict[str, int]:
    """adapter label -> the counter's value, read in one walk of the registry (not one per adapter)."""
    out: dict[str, int] = {}
    for family in state.metrics.registry.collect():
        for s in family.samples:
            if s.name == metric and "adapter" in s.labels:
                out[s.labels["adapter"]] = int(s.value)
    return out


def adapters(state: ServerState, admin: bool) -> tuple[list[dict[str, Any]], list[Any]]:
    """Every adapter the server knows, with its facts (None for an evicted one: not loaded now), and the
    loaded adapter of each row (or None) whose sha256 the caller fills in off the event loop. Call on the
    event loop: the adapter table is the loop's alone."""
    rows, loaded = [], []
    requests = _served(state, "loramux_adapter_requests_total")
    tokens = _served(state, "loramux_adapter_generation_tokens_total")
    for e in state.pool.ordered():
        a = state.engine.adapters.get(e.name)
        rows.append({
            "id": e.id, "name": e.name, "source": e.display_source(admin), "scale": e.scale,
            "global_scale": e.global_scale, "pinned": e.pinned, "residency": _residency(state, e.name),
            "rank": None if a is None else a.rank, "alpha": None if a is None else a.alpha,
            "targets": None if a is None else sorted(a.targets), "size": None if a is None else a.size,
            "sha256": None, "requests": requests.get(e.name, 0), "tokens": tokens.get(e.name, 0)})
        loaded.append(a)
    return rows, loaded


def _hashes(loaded: list[Any]) -> list[str | None]:
    return [None if a is None else a.sha256 for a in loaded]  # read once per adapter, cached by it


def add_routes(app: FastAPI, state: ServerState) -> None:
    """GET /playground (and its assets) and GET /playground/api/adapters."""
    files = {name: _asset(name) for name in ASSETS}  # read once: a few tens of KB

    def page(name: str) -> Response:
        return Response(files[name], media_type=ASSETS[name], headers=HEADERS)

    @app.get(ROUTE)
    async def index() -> Response:
        return page("index.html")

    @app.get(ROUTE + "/")
    async def index_slash() -> Response:  # its own name: one OpenAPI operation id per route
        return page("index.html")

    @app.get(ROUTE + "/app.js")
    async def script() -> Response:
        return page("app.js")

    @app.get(ROUTE + "/app.css")
    async def style() -> Response:
        return page("app.css")

    @app.get(ROUTE + "/api/adapters")
    async def adapter_info(http: HTTPRequest) -> list[dict[str, Any]]:
        rows, loaded = adapters(state, is_admin(http.scope))
        for row, digest in zip(rows, await asyncio.to_thread(_hashes, loaded)):  # the first reads the file
            row["sha256"] = digest
        return rows


__all__ = ["ASSETS", "CSP", "PUBLIC", "ROUTE", "adapters", "add_routes"]
