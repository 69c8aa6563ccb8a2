"""loramux's OpenAI-compatible multi-adapter server (FastAPI + uvicorn).

    from loramux.server import ServerSettings, create_app, serve_in_thread
    app = create_app(engine, ServerSettings(adapter_dirs=("/adapters",)))
    with serve_in_thread(app) as srv:
        ...  # OpenAI(base_url=srv.url + "/v1", api_key="-")

`loramux serve` is the command-line front end (see `loramux serve --help` and docs/server.md).
"""

from __future__ import annotations

from .app import ServerThread, create_app, serve_in_thread
from .config import ControlEntry, LoraEntry, ServerSettings
from .errors import APIError

__all__ = ["APIError", "ControlEntry", "LoraEntry", "ServerSettings", "ServerThread", "create_app",
           "serve_in_thread"]
