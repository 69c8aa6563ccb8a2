"""The protocols beside OpenAI's chat/completions, each a thin module over the response layer (layer.py):
Anthropic Messages (anthropic.py), OpenAI Responses (responses.py), Ollama's API (ollama.py)."""

from __future__ import annotations

from fastapi import FastAPI

from ..state import ServerState
from . import anthropic, ollama, responses


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Every protocol's routes; each answers its errors in its own shape (errors.ERROR_SHAPES)."""
    anthropic.add_routes(app, state)
    ollama.add_routes(app, state)
    responses.add_routes(app, state)


__all__ = ["add_routes"]
