"""Which adapter versions produced a response: `model: "name@N"` requests, and the version header.

Every generation response, on every protocol, streamed or not, carries the header

    x-loramux-adapter-versions: style=3, domain=1

naming each adapter the request ran on with its content version (empty for the base model alone).
The version of a request is fixed when it is submitted (engine/versions.py), so the header can go
out before a stream's first token. The middleware here sets it once for every route; generation.py
notes each submitted request's versions. A request may ask for one: `model: "style@3"` runs on
version 3 of `style`, or gets 410 adapter_version_gone when that is not the version served.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Mapping
from typing import Any

HEADER = "x-loramux-adapter-versions"
_VERSIONED = re.compile(r"(?P<name>.+)@(?P<version>[0-9]{1,18})")
_noted: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar("loramux_versions", default=None)


def split_model(model: str | None, known: Mapping[str, Any]) -> tuple[str | None, dict[str, int]]:
    """`model` without a version suffix, and {name: version} asked for (`name@N` of a known adapter)."""
    if model is None or model in known:
        return model, {}
    m = _VERSIONED.fullmatch(model)
    if m is None or m["name"] not in known:
        return model, {}
    return m["name"], {m["name"]: int(m["version"])}


def note(versions: Mapping[str, int]) -> None:
    """Record the versions a request of the current HTTP request runs on (several: merged)."""
    held = _noted.get()
    if held is not None:
        held.update(versions)
        held.setdefault("", 0)  # marks "a generation ran", so the header is sent even for the base alone


def header_value(versions: Mapping[str, int]) -> str:
    return ", ".join(f"{n}={v}" for n, v in versions.items() if n)


class VersionHeader:
    """ASGI middleware: adds the version header to every response of a request that generated."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: dict[str, int] = {}
        token = _noted.set(held)

        async def send_with_versions(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.start" and held:
                msg = {**msg, "headers": [*msg.get("headers", []),
                                          (HEADER.encode(), header_value(held).encode())]}
            await send(msg)
        try:
            await self.app(scope, receive, send_with_versions)
        finally:
            _noted.reset(token)


__all__ = ["HEADER", "VersionHeader", "header_value", "note", "split_model"]
