"""The response layer every protocol module is written against: one typed request in, one typed result
(or stream of typed events) out, produced by the engine path of server/generation.py.

A protocol module (OpenAI chat/completions, Anthropic Messages, OpenAI Responses, Ollama) translates its
body into the typed internal request, a `ChatRequest` or `CompletionRequest` (schemas.py: prompt or
messages, sampling, constraints, tools, adapters, logprobs, n; every bound and every refusal of those
models applies), and translates `Result` / `Event`s back into its own shapes. Streaming, usage, stop
strings, tool calls and the metrics are therefore done once, here and in generation.py, whatever the
protocol. Requests with logprobs or several sequences (chat completions and completions only) run as a
group of such jobs, shaped by scoring.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from ...engine.scoring import TokenLogprob
from .. import generation
from ..errors import APIError, from_exception, validation_error
from ..generation import Job
from ..schemas import ChatRequest, CompletionRequest
from ..state import ServerState
from ..tool_formats import parse_calls

M = TypeVar("M", bound=BaseModel)
Body = ChatRequest | CompletionRequest


@dataclass(frozen=True)
class Call:
    """One tool call of the model: its id, the function's name, its arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def args(self) -> Any:
        """The arguments as a JSON value (the text itself if it does not parse: never raised)."""
        try:
            return json.loads(self.arguments) if self.arguments else {}
        except ValueError:
            return self.arguments


@dataclass
class Result:
    """A finished generation, whatever the protocol asked for it."""

    model: str
    text: str
    calls: list[Call]
    finish: str  # "stop" (end of turn) | "stop_sequence" | "length" | "tool_calls"
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int
    tokens: list[int] = field(default_factory=list)  # the generated token ids
    started_ns: int = 0  # wall-clock duration of the request (Ollama reports it), nanoseconds
    first_token_ns: int | None = None  # from the start to the first token, nanoseconds
    versions: dict[str, int] = field(default_factory=dict)  # adapter name -> the content version it ran on
    cached_tokens: int = 0  # prompt tokens reused from the KV cache (not decoded again)
    logprobs: list[TokenLogprob] | None = None  # per generated token, when the request asked the engine for them

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TextDelta:
    """Text the model produced that is not part of a tool call."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The end of the generation: its result (with the tool calls, read from the whole output)."""

    result: Result


@dataclass(frozen=True)
class TokenProbs:
    """A generated token's log-probability and top alternatives, for requests that asked the engine for them
    (llama-server's `n_probs`); it comes before the token's text."""

    entry: TokenLogprob


Event = TextDelta | TokenProbs | Finished


@dataclass
class Opened:
    """A request handed to the engine: the job and what the protocol needs to report it."""

    job: Job
    body: Body
    id: str = field(default_factory=lambda: secrets.token_hex(12))


def internal(make: Callable[[], M]) -> M:
    """Build the internal request; a translation that breaks one of its bounds is a 400 naming the field."""
    try:
        return make()
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def renamed(err: APIError, names: Mapping[str, str]) -> APIError:
    """`err` with the internal request's field names (max_tokens, messages) in the protocol's words."""
    if err.param is None or err.param.split(".")[0] not in names:
        return err
    head = err.param.split(".")[0]
    message = re.sub(rf"\b{head}\b", names[head], err.message)
    return APIError(err.status, message, code=err.code, param=names[head] + err.param[len(head):], type=err.type,
                    headers=err.headers, extra=err.extra)


async def open_request(state: ServerState, body: Body, names: Mapping[str, str] | None = None) -> Opened:
    """Admit the request (the bounded queue), resolve its adapters and start it on the engine; a failure
    before it runs is counted in the metrics like one of chat completions, and raised with the fields
    named as the protocol names them (`names`: internal → protocol)."""
    try:
        with generation.counts_failure(state, body.model):
            job = await generation.start(state, body, isinstance(body, ChatRequest))
    except Exception as e:  # noqa: BLE001 - re-raised, renamed
        raise renamed(from_exception(e), names or {}) from None
    return Opened(job, body)


def _calls(job: Job, text: str) -> tuple[str, list[Call]]:
    if job.tools is None:
        return text, []
    content, calls = parse_calls(text, [t.function.name for t in job.tools.tools])
    return content, [Call(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _stop_sequence(job: Job, completion: Any) -> str | None:
    """The stop string that ended the output, or None (end of turn, length, or a tool call)."""
    stops = job.body.stops()
    assembler = getattr(job.request, "text", None)
    if completion.finish_reason != "stop" or not stops or not getattr(assembler, "stopped", False):
        return None
    if len(stops) == 1:
        return stops[0]
    full = job.state.engine.detokenize(completion.tokens)  # worker thread: see result()
    tail = full[len(completion.text):] if full.startswith(completion.text) else full
    return min(stops, key=lambda s: (tail.find(s) if s in tail else len(tail) + 1))


def _result(job: Job, completion: Any, text: str, calls: list[Call]) -> Result:
    stop = _stop_sequence(job, completion)
    if completion.finish_reason == "length":
        finish = "length"
    elif calls:
        finish = "tool_calls"
    else:
        finish = "stop_sequence" if stop is not None else "stop"
    first = getattr(job.request, "first_token_at", None)
    now = time.monotonic()
    return Result(job.model, text, calls, finish, stop, len(job.prompt), len(completion.tokens),
                  tokens=list(completion.tokens), started_ns=int((now - job.started) * 1e9),
                  first_token_ns=None if first is None else int(max(0.0, first - job.started) * 1e9),
                  cached_tokens=int(getattr(job.request, "cached", 0) or 0), logprobs=completion.logprobs,
                  versions=dict(getattr(completion, "versions", {})))


async def result(opened: Opened, http: HTTPRequest) -> Result | None:
    """The whole result once the engine is done; None when the client left first (then it is cancelled)."""
    job = opened.job
    completion = await generation.finished(job, generation.drain(job), http)
    if completion is None:
        return None
    text, calls = _calls(job, completion.text)
    return await asyncio.to_thread(_result, job, completion, text, calls)


async def events(opened: Opened) -> AsyncIterator[Event]:
    """The generation as it runs: text deltas (what may be a tool call held back), then Finished.
    An engine error is raised as an APIError once the job is settled; leaving early cancels the request."""
    job = opened.job
    try:
        while True:
            kind, value = await job.queue.get()
            if kind == "text":
                if job.tool_stream is not None:
                    value = job.tool_stream.feed(value)
                if value:
                    yield TextDelta(value)
                    await asyncio.sleep(0)  # see protocols/openai.stream: lets a disconnect be seen between chunks
            elif kind == "logprobs":
                yield TokenProbs(value)
            elif kind == "error":
                err = from_exception(value)
                job.finish(err.status)
                raise err
            elif kind == "done":
                break
        job.finish(200, value)
        tail, calls = "", []
        if job.tool_stream is not None:
            tail, raw = job.tool_stream.finish()
            calls = [Call(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in raw]
        if tail:
            yield TextDelta(tail)
        shown = "".join(job.tool_stream.sent) + tail if job.tool_stream is not None else value.text
        yield Finished(await asyncio.to_thread(_result, job, value, shown, calls))
    finally:
        job.finish(499)  # no-op when it finished above; otherwise the client went away


class EventStream(StreamingResponse):
    """A streamed response that always settles its job, even when the client leaves before the body starts."""

    def __init__(self, opened: Opened, body: AsyncIterator[str], media_type: str) -> None:
        super().__init__(body, media_type=media_type, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = opened.job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.finish(499)  # no-op if the stream finished it


async def prompt_size(state: ServerState, body: ChatRequest) -> int:
    """Tokens the rendered chat takes (tools and template applied), without running it."""
    return len((await asyncio.to_thread(generation.chat_prompt, state, body))[0])


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


__all__ = ["Body", "Call", "Event", "EventStream", "Finished", "Opened", "Result", "TextDelta", "TokenProbs", "events", "internal",
           "new_id", "open_request", "prompt_size", "renamed", "result"]
