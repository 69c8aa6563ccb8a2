"""OpenAI's chat completions and completions: the routes, and the responses they shape (JSON or SSE chunks)
from the engine path of server/generation.py. Scoring and fan-out requests (logprobs, echo, several prompts,
n, best_of) are shaped by server/scoring.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import generation, scoring
from ..errors import from_exception
from ..generation import Job
from ..schemas import ChatRequest, CompletionRequest
from ..state import ServerState
from ..tools import parse_calls


def add_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/completions and /v1/chat/completions."""

    async def generate(http: HTTPRequest, body: CompletionRequest | ChatRequest, chat: bool) -> Response:
        if scoring.handles(body):  # logprobs, echo, several prompts or sequences: server/scoring.py
            return await scoring.respond(state, http, body, chat)
        with generation.counts_failure(state, body.model):
            job = await generation.start(state, body, chat)
        if body.stream:
            return _JobStream(job)
        result = await collect(job, http)
        return JSONResponse(result) if result is not None else Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest) -> Response:
        return await generate(http, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HTTPRequest) -> Response:
        return await generate(http, body, chat=True)


async def collect(job: Job, http: HTTPRequest) -> dict[str, Any] | None:
    """Wait for the whole completion and build the body; None (request cancelled) if the client left."""
    completion = await generation.finished(job, generation.drain(job), http)
    return None if completion is None else _full_body(job, completion)


def _usage(job: Job, completion: Any) -> dict[str, int]:
    n = len(completion.tokens)
    return {"prompt_tokens": len(job.prompt), "completion_tokens": n, "total_tokens": len(job.prompt) + n}


def _finish_reason(completion: Any, calls: list[Any] | None = None) -> str:
    if completion.finish_reason == "length":
        return "length"
    return "tool_calls" if calls else "stop"


def _full_body(job: Job, completion: Any) -> dict[str, Any]:
    reason = _finish_reason(completion)
    if job.chat:
        message: dict[str, Any] = {"role": "assistant", "content": completion.text}
        if job.tools is not None:
            content, calls = parse_calls(completion.text, [t.function.name for t in job.tools.tools])
            if calls:
                message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                reason = _finish_reason(completion, calls)
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        obj, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": completion.text, "logprobs": None, "finish_reason": reason}
        obj, prefix = "text_completion", "cmpl-"
    if job.body.return_token_ids:
        choice["token_ids"] = list(completion.tokens)
        choice["prompt_token_ids"] = list(job.prompt)
    return {"id": prefix + job.id, "object": obj, "created": job.created, "model": job.model,
            "choices": [choice], "usage": _usage(job, completion)}


def _chunk(job: Job, text: str | None, reason: str | None = None, role: bool = False,
           tool_calls: list[dict[str, Any]] | None = None) -> str:
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
    body = {"id": prefix + job.id, "object": obj, "created": job.created, "model": job.model, "choices": [choice]}
    return _sse(body)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def stream(job: Job) -> AsyncIterator[str]:
    """SSE in OpenAI's chunk format, ending with `data: [DONE]`. Leaving early cancels the request."""
    try:
        if job.chat:
            yield _chunk(job, "", role=True)
        while True:
            kind, value = await job.queue.get()
            if kind == "text":
                if job.tool_stream is not None:
                    value = job.tool_stream.feed(value)
                    if not value:
                        continue
                yield _chunk(job, value)
                # to a client that is gone (left, or dropped by the write timeout) a send returns at once:
                # without this the rest of the queue would go out in one go and count as a 200 before the
                # disconnect could be seen
                await asyncio.sleep(0)
                continue
            if kind == "error":
                err = from_exception(value)
                job.finish(err.status)
                yield _sse(err.body())
                yield "data: [DONE]\n\n"
                return
            break
        completion = value
        job.finish(200, completion)
        calls: list[dict[str, Any]] = []
        if job.tool_stream is not None:
            tail, calls = job.tool_stream.finish()
            if tail:
                yield _chunk(job, tail)
            for i, c in enumerate(calls):  # OpenAI's shape: id, type and name first, then the arguments
                yield _chunk(job, None, tool_calls=[{"index": i, "id": c["id"], "type": "function",
                                                     "function": {"name": c["function"]["name"], "arguments": ""}}])
                yield _chunk(job, None, tool_calls=[{"index": i, "function": {"arguments": c["function"]["arguments"]}}])
        last = _chunk(job, None if job.chat else "", reason=_finish_reason(completion, calls))
        if job.body.return_token_ids:
            data = json.loads(last[6:])
            data["choices"][0]["token_ids"] = list(completion.tokens)
            data["choices"][0]["prompt_token_ids"] = list(job.prompt)
            last = _sse(data)
        yield last
        if job.body.stream_options is not None and job.body.stream_options.include_usage:
            prefix = "chatcmpl-" if job.chat else "cmpl-"
            yield _sse({"id": prefix + job.id, "object": "chat.completion.chunk" if job.chat else "text_completion",
                        "created": job.created, "model": job.model, "choices": [],
                        "usage": _usage(job, completion)})
        yield "data: [DONE]\n\n"
    finally:
        job.finish(499)  # no-op when it finished above; otherwise the client went away


class _JobStream(StreamingResponse):
    """SSE response that always settles its job: a client can leave before the body generator ever
    starts (its `finally` would then never run), and the request must still be cancelled."""

    def __init__(self, job: Job) -> None:
        super().__init__(stream(job), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.finish(499)  # no-op if the stream finished it


__all__ = ["add_routes", "collect", "stream"]
