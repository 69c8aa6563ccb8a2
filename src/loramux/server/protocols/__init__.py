"""The protocols the server speaks, each a thin module over the response layer (layer.py) and the engine path
of server/generation.py: OpenAI's chat completions and completions (openai.py; scoring.py shapes their
logprobs and fan-out), Anthropic Messages (anthropic.py), OpenAI Responses (responses.py), Ollama's API
(ollama.py)."""

from __future__ import annotations

from fastapi import FastAPI

from ..state import ServerState
from . import anthropic, ollama, openai, responses


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Every protocol's routes; each answers its errors in its own shape (errors.ERROR_SHAPES)."""
    openai.add_routes(app, state)
    anthropic.add_routes(app, state)
    ollama.add_routes(app, state)
    responses.add_routes(app, state)


__all__ = ["add_routes"]
