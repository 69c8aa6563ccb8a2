"""OpenAI's chat completions and completions: the routes, and their JSON bodies and SSE chunks shaped from the
response layer (layer.py), as every protocol's are. Scoring and several-sequence requests (logprobs, echo,
several prompts, n, best_of) are shaped by server/scoring.py, fan-out over adapter sets (`adapter_sets`) by
server/fanout.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from .. import fanout, scoring
from ..errors import APIError
from ..generation import Job
from ..schemas import ChatRequest, CompletionRequest
from ..state import ServerState
from ..timings import SYSTEM_FINGERPRINT, generated, timings
from . import layer
from .layer import Call, Finished, Opened, Result, TextDelta


def add_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/completions and /v1/chat/completions."""

    async def generate(http: HTTPRequest, body: CompletionRequest | ChatRequest, chat: bool) -> Response:
        if fanout.handles(body):  # several adapter sets, one result each: server/fanout.py
            return await fanout.respond(state, http, body, chat)
        if scoring.handles(body):  # logprobs, echo, several prompts or sequences: server/scoring.py
            return await scoring.respond(state, http, body, chat)
        op = await layer.open_request(state, body)
        if body.stream:
            return layer.EventStream(op, stream(op), "text/event-stream")
        r = await layer.result(op, http)
        return JSONResponse(_full_body(op.job, r)) if r is not None else Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest) -> Response:
        return await generate(http, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HTTPRequest) -> Response:
        _check_order(body)
        return await generate(http, body, chat=True)


def _check_order(body: ChatRequest) -> None:
    """The message rules of OpenAI's chat (and llama-server's, which also serves it as /chat/completions):
    every message but an assistant's has content, an assistant's has content or tool calls, and at most one
    assistant message ends the list (the one continued)."""
    for i, m in enumerate(body.messages):
        if m.content is None and (m.role != "assistant" or not m.tool_calls):
            raise APIError(400, f"messages.{i}: a {m.role} message needs content"
                                + (" or tool_calls" if m.role == "assistant" else ""),
                           code="invalid_request", param=f"messages.{i}.content")
    if len(body.messages) >= 2 and body.messages[-1].role == body.messages[-2].role == "assistant":
        raise APIError(400, "messages: at most one assistant message at the end (the one continued)",
                       code="invalid_request", param="messages")


def _usage(r: Result) -> dict[str, Any]:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens, "total_tokens": r.total_tokens,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}


def _finish_reason(r: Result) -> str:
    return "length" if r.finish == "length" else "tool_calls" if r.calls else "stop"


def _call(c: Call) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _token_ids(job: Job, r: Result, choice: dict[str, Any]) -> None:
    if job.body.return_token_ids:
        choice["token_ids"] = list(r.tokens)
        choice["prompt_token_ids"] = list(job.prompt)


def _full_body(job: Job, r: Result) -> dict[str, Any]:
    reason = _finish_reason(r)
    if job.chat:
        message: dict[str, Any] = {"role": "assistant", "content": r.text}
        if r.calls:
            message = {"role": "assistant", "content": r.text or None, "tool_calls": [_call(c) for c in r.calls]}
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        obj, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": r.text, "logprobs": None, "finish_reason": reason}
        obj, prefix = "text_completion", "cmpl-"
    _token_ids(job, r, choice)
    return {"id": prefix + job.id, "object": obj, "created": job.created, "model": job.model,
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [choice], "usage": _usage(r),
            "timings": timings(job, r.completion_tokens, r.cached_tokens), "adapter_versions": r.versions}


def _chunk(job: Job, text: str | None, reason: str | None = None, role: bool = False,
           tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    if job.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls is not None:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        obj, prefix = "chat.completion.chunk", "chatcmpl-"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        obj, prefix = "text_completion", "cmpl-"
    return {"id": prefix + job.id, "object": obj, "created": job.created, "model": job.model,
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [choice]}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _ending(job: Job, r: Result) -> Iterator[str]:
    """The tool calls (OpenAI's shape: id, type and name first, then the arguments), the finish reason, usage."""
    for i, c in enumerate(r.calls):
        yield _sse(_chunk(job, None, tool_calls=[{"index": i, "id": c.id, "type": "function",
                                                  "function": {"name": c.name, "arguments": ""}}]))
        yield _sse(_chunk(job, None, tool_calls=[{"index": i, "function": {"arguments": c.arguments}}]))
    last = _chunk(job, None if job.chat else "", reason=_finish_reason(r))
    _token_ids(job, r, last["choices"][0])
    last["adapter_versions"] = r.versions
    usage = None
    if job.body.stream_options is not None and job.body.stream_options.include_usage:
        prefix = "chatcmpl-" if job.chat else "cmpl-"
        usage = {"id": prefix + job.id, "object": "chat.completion.chunk" if job.chat else "text_completion",
                 "created": job.created, "model": job.model, "system_fingerprint": SYSTEM_FINGERPRINT,
                 "choices": [], "usage": _usage(r)}
    (usage or last)["timings"] = timings(job, r.completion_tokens, r.cached_tokens)  # llama-server: the last one
    yield _sse(last)
    if usage is not None:
        yield _sse(usage)


async def stream(op: Opened) -> AsyncIterator[str]:
    """SSE in OpenAI's chunk format, ending with `data: [DONE]`. Leaving early cancels the request."""
    job = op.job
    if job.chat:  # the role first, content null (as OpenAI and llama-server send it)
        first = _chunk(job, None, role=True)
        first["choices"][0]["delta"]["content"] = None
        yield _sse(first)
    try:
        async for ev in layer.events(op):
            if isinstance(ev, TextDelta):
                chunk = _chunk(job, ev.text)
                if job.body.timings_per_token:
                    chunk["timings"] = timings(job, generated(job))
                yield _sse(chunk)
            elif isinstance(ev, Finished):
                for line in _ending(job, ev.result):
                    yield line
    except APIError as err:
        yield _sse(err.body())
    yield "data: [DONE]\n\n"


__all__ = ["add_routes", "stream"]
