"""Tokenization routes: vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info` (llama-server's `content`,
`add_special` and `with_pieces` too), so that clients such as lm-evaluation-harness (`tokenizer_backend=remote`)
need no Hugging Face tokenizer: they get the GGUF's own vocabulary, the one the engine scores with.

llama.cpp is called from worker threads only, never on the event loop. /tokenize and /detokenize take a
place in the same bounded queue as the generation routes (`ServerState.admit`: 429 past --parallel +
--max-queue), so a flood of them cannot pile up threads; /tokenizer_info reads the model's metadata only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI

from .errors import APIError
from .schemas import DetokenizeRequest, TokenizeRequest
from .state import ServerState

T = TypeVar("T")


def _piece(raw: bytes) -> str | list[int]:
    """llama-server's piece: the text, or the bytes when they are not whole UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _tokenize(state: ServerState, body: TokenizeRequest) -> dict[str, Any]:
    eng = state.engine
    special = body.add_special_tokens if body.add_special_tokens is not None else body.add_special
    if body.messages is not None:
        try:
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in body.messages]
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_request", param="messages") from None
        text = eng.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        tokens = eng.tokenize(text, add_bos=bool(special))  # the template already wrote BOS
    else:
        text = body.prompt if body.prompt is not None else body.content or ""
        # vLLM adds BOS unless told not to; llama-server's `content` does not unless `add_special`
        default = body.prompt is not None
        tokens = eng.tokenize(text, add_bos=default if special is None else special)
    h = eng.model.handle
    out: dict[str, Any] = {"count": len(tokens), "max_model_len": eng.n_ctx, "tokens": tokens, "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = [h.token_bytes(t, special=True).decode("utf-8", errors="replace") for t in tokens]
    if body.with_pieces:
        out["tokens"] = [{"id": t, "piece": _piece(h.token_bytes(t, special=True))} for t in tokens]
    return out


def _tokenizer_info(state: ServerState) -> dict[str, Any]:
    m = state.engine.model
    h = m.handle
    return {"tokenizer_class": "llama.cpp", "model": state.base_name,
            "bos_token": m.token_text(h.bos) if h.bos >= 0 else None,
            "eos_token": m.token_text(h.eos) if h.eos >= 0 else None, "pad_token": None,
            "add_bos_token": bool(h.add_bos), "chat_template": m.chat_template,
            "model_max_length": state.engine.n_ctx, "max_model_len": state.engine.n_ctx, "vocab_size": m.n_vocab}


async def _queued(state: ServerState, fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` in a worker thread holding one place of the bounded queue (429 when it is full).

    The place is held until the thread returns, even when the client left: the thread cannot be
    stopped, and what the bound counts is work that is really running."""
    ticket = state.admit()
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    task.add_done_callback(lambda _: ticket.release())
    return await asyncio.shield(task)


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Register /tokenize, /detokenize and /tokenizer_info on `app`."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        state.pool.requested_set(body.model, None)  # an unknown model is a 404, as for completions
        return await _queued(state, _tokenize, state, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        state.pool.requested_set(body.model, None)
        n_vocab = state.engine.model.n_vocab
        bad = [t for t in body.tokens if not 0 <= t < n_vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {n_vocab}), got {bad[0]}", code="invalid_request",
                           param="tokens")
        text = await _queued(state, state.engine.detokenize, body.tokens)
        return {"prompt": text, "content": text}  # vLLM's key and llama-server's

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return await asyncio.to_thread(_tokenizer_info, state)


__all__ = ["add_routes"]
