"""The protocols the server speaks, each a thin module over the response layer (layer.py) and the engine path
of server/generation.py: OpenAI's chat completions and completions (openai.py; scoring.py shapes their
logprobs and fan-out), Anthropic Messages (anthropic.py), OpenAI Responses (responses.py), Ollama's API
(ollama.py), llama-server's native API and its un-prefixed aliases (llama_server.py; infill.py, timings.py)."""

from __future__ import annotations

from fastapi import FastAPI

from ..state import ServerState
from . import anthropic, llama_server, ollama, openai, responses


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Every protocol's routes; each answers its errors in its own shape (errors.ERROR_SHAPES)."""
    openai.add_routes(app, state)
    anthropic.add_routes(app, state)
    ollama.add_routes(app, state)
    responses.add_routes(app, state)
    llama_server.add_routes(app, state)  # last: it aliases routes added before it


__all__ = ["add_routes"]
