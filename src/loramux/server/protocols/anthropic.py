"""Anthropic's Messages API: POST /v1/messages (JSON or Anthropic's SSE events) and /v1/messages/count_tokens.

The body is translated into a ChatRequest (layer.py): `system` → a system message, `text` blocks → text,
`tool_use` blocks → the assistant's tool calls, `tool_result` blocks → tool messages, `tools` /
`tool_choice` (auto, any, tool, none) → the same tool machinery as chat completions (a forced call is
grammar-constrained). Every field is honoured or refused with Anthropic's error shape naming it;
`thinking` is accepted and answered visibly: this model does not think, so no thinking block comes back
(docs/anthropic.md). Extensions: `lora` (a per-request adapter stack) and `control_vector`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from ..errors import ERROR_SHAPES, APIError, from_exception
from ..schemas import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_PROMPT_CHARS,
    MAX_TOOLS,
    ChatRequest,
    ControlRef,
    LoraRef,
)
from ..state import ServerState
from . import layer
from .layer import Finished, Opened, Result, TextDelta

PREFIX = "/v1/messages"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(err: APIError) -> dict[str, Any]:
    """Anthropic's error object; the parameter is named in the message (Anthropic's shape has no field for it)."""
    message = err.message if err.param is None or err.param in err.message else f"{err.param}: {err.message}"
    return {"type": "error", "error": {"type": error_type(err.status), "message": message}}


def error_response(err: APIError) -> Response:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


ERROR_SHAPES[PREFIX] = error_response


Text = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Block(_Body):
    """One content block; which fields it may carry depends on `type` (checked in `_blocks`)."""

    type: Literal["text", "tool_use", "tool_result", "image", "document", "thinking", "redacted_thinking"]
    text: str | None = None
    id: str | None = Field(default=None, max_length=256)
    name: str | None = Field(default=None, max_length=128)
    input: dict[str, Any] | None = None
    tool_use_id: str | None = Field(default=None, max_length=256)
    content: Text | Annotated[list[Block], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: the prefix KV is reused anyway
    citations: list[Any] | None = None
    source: dict[str, Any] | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class Message(_Body):
    role: Literal["user", "assistant", "system"]  # system: a system turn within the conversation (Claude Code)
    content: Text | Annotated[list[Block], Field(max_length=MAX_CONTENT_PARTS)]


class ToolDef(_Body):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, max_length=128)
    disable_parallel_tool_use: bool | None = None


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    """`output_config`: `format` (structured output, grammar-enforced); `effort` only tunes a model's reasoning
    and this one does not reason (docs/anthropic.md)."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Metadata(_Body):
    user_id: str | None = Field(default=None, max_length=256)


class CountRequest(_Body):
    """POST /v1/messages/count_tokens."""

    model: str = Field(max_length=MAX_NAME_CHARS)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Text | Annotated[list[Block], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    lora: list[LoraRef] | None = None


class MessagesRequest(CountRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: both mean it
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the beta's name for output_config.format
    cache_control: dict[str, Any] | None = None  # automatic prompt caching: the prefix KV is reused anyway
    # server-side context editing (Claude Code sends it): the conversation is run as sent, and the response
    # says so with no applied edits
    context_management: dict[str, Any] | None = None
    control_vector: ControlRef | None = None


def _text(content: str | list[Block] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, b in enumerate(content):
        if b.type != "text":
            raise APIError(400, f"only text blocks can be a tool result here, got {b.type!r}",
                           code="invalid_request", param=f"{where}.{i}")
        parts.append(b.text or "")
    return "".join(parts)


def _refuse_block(b: Block, where: str) -> None:
    if b.type in ("image", "document"):
        raise APIError(400, f"{b.type} blocks are not supported: this server runs a text-only model",
                       code="invalid_request", param=f"{where}.type")


def _messages(body: CountRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages (the internal request's shape)."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        out.append({"role": "system", "content": _text(body.system, "system")})
    for i, m in enumerate(body.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str) or m.role == "system":
            out.append({"role": m.role, "content": _text(m.content, where)})
            continue
        texts, calls, results = [], [], []
        for j, b in enumerate(m.content):
            _refuse_block(b, f"{where}.{j}")
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.id or not b.name:
                    raise APIError(400, "a tool_use block needs its id and name", code="invalid_request",
                                   param=f"{where}.{j}")
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name or "", "arguments": json.dumps(b.input or {})}})
            elif b.type == "tool_result" and m.role == "user":
                text = _text(b.content, f"{where}.{j}.content")
                results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": ("Error: " + text) if b.is_error else text})
            elif b.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # a thinking model's earlier reasoning: this model takes none
            else:
                raise APIError(400, f"a {b.type} block cannot be in a {m.role} message", code="invalid_request",
                               param=f"{where}.{j}.type")
        out += results
        if texts or calls or not results:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tool_fields(body: CountRequest) -> dict[str, Any]:
    if not body.tools:
        if body.tool_choice is not None and body.tool_choice.type != "none":
            raise APIError(400, f"tool_choice {body.tool_choice.type} needs tools", code="invalid_request",
                           param="tool_choice")
        return {}
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                "parameters": t.input_schema}} for t in body.tools]
    out: dict[str, Any] = {"tools": tools}
    tc = body.tool_choice
    if tc is not None:
        if tc.type == "tool" and not tc.name:
            raise APIError(400, "tool_choice type tool needs a name", code="invalid_request", param="tool_choice.name")
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or \
            {"type": "function", "function": {"name": tc.name}}
        if tc.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    return out


def to_chat(body: CountRequest) -> ChatRequest:
    """The internal request for a Messages body."""
    fields: dict[str, Any] = {"model": body.model, "messages": _messages(body), "lora": body.lora, **_tool_fields(body)}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, stream=body.stream, control_vector=body.control_vector,
                      user=body.metadata.user_id if body.metadata else None)
        fmt = body.output_format or (body.output_config.format if body.output_config else None)
        if fmt is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    fields = {k: v for k, v in fields.items() if v is not None}
    return layer.internal(lambda: ChatRequest.model_validate(fields))


_STOP = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use"}


def _usage(r: Result) -> dict[str, int]:
    return {"input_tokens": r.prompt_tokens, "output_tokens": r.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def _tool_use(c: layer.Call) -> dict[str, Any]:
    args = c.args()
    return {"type": "tool_use", "id": "toolu_" + c.id.removeprefix("call_"), "name": c.name,
            "input": args if isinstance(args, dict) else {}}


def message_body(op: Opened, r: Result, managed: bool = False) -> dict[str, Any]:
    """The Message; `managed`: the request asked for context editing, and none was applied."""
    content: list[dict[str, Any]] = [{"type": "text", "text": r.text}] if r.text or not r.calls else []
    content += [_tool_use(c) for c in r.calls]
    out = {"id": "msg_" + op.id, "type": "message", "role": "assistant", "model": r.model, "content": content,
           "stop_reason": _STOP[r.finish], "stop_sequence": r.stop_sequence, "usage": _usage(r),
           "adapter_versions": r.versions}  # loramux's: the adapter versions it ran on (server/versions.py)
    if managed:
        out["context_management"] = {"applied_edits": []}
    return out


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps({'type': event, **data}, ensure_ascii=False)}\n\n"


async def stream(op: Opened, managed: bool = False) -> AsyncIterator[str]:
    """Anthropic's event sequence: message_start, the content blocks (text deltas, then tool_use blocks with
    their input as JSON deltas), message_delta with the stop reason, usage and loramux's adapter_versions,
    message_stop."""
    job = op.job
    yield _sse("message_start", {"message": {
        "id": "msg_" + op.id, "type": "message", "role": "assistant", "model": job.model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(job.prompt), "output_tokens": 0, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0}}})
    yield _sse("ping", {})
    index, text_open = 0, False
    try:
        async for ev in layer.events(op):
            if isinstance(ev, TextDelta):
                if not text_open:
                    yield _sse("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                    text_open = True
                yield _sse("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": ev.text}})
            elif isinstance(ev, Finished):
                r = ev.result
                if text_open:
                    yield _sse("content_block_stop", {"index": index})
                    index += 1
                for c in r.calls:
                    block = _tool_use(c)
                    yield _sse("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
                    yield _sse("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
                    yield _sse("content_block_stop", {"index": index})
                    index += 1
                delta = {"delta": {"stop_reason": _STOP[r.finish], "stop_sequence": r.stop_sequence},
                         "usage": {"output_tokens": r.completion_tokens}, "adapter_versions": r.versions}
                if managed:
                    delta["context_management"] = {"applied_edits": []}
                yield _sse("message_delta", delta)
                yield _sse("message_stop", {})
    except APIError as e:
        yield _sse("error", {"error": error_body(e)["error"]})


async def _serve(state: ServerState, body: MessagesRequest, http: HTTPRequest) -> Response:
    if body.thinking is not None and body.thinking.type == "enabled" and body.thinking.budget_tokens is not None \
            and body.thinking.budget_tokens >= body.max_tokens:
        raise APIError(400, "thinking.budget_tokens must be less than max_tokens", code="invalid_request",
                       param="thinking.budget_tokens")
    op = await layer.open_request(state, to_chat(body))
    if body.stream:
        return layer.EventStream(op, stream(op, body.context_management is not None), "text/event-stream")
    r = await layer.result(op, http)
    if r is None:
        return Response(status_code=499)
    return JSONResponse(message_body(op, r, body.context_management is not None))


def add_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/messages and /v1/messages/count_tokens (a query string, as Claude Code's `?beta=true`, is fine)."""

    @app.post(PREFIX)
    async def messages(body: MessagesRequest, http: HTTPRequest) -> Response:
        try:
            return await _serve(state, body, http)
        except Exception as e:  # noqa: BLE001 - every failure answers in Anthropic's shape
            return error_response(from_exception(e))

    @app.post(PREFIX + "/count_tokens")
    async def count_tokens(body: CountRequest) -> Response:
        try:
            chat = to_chat(body)
            state.pool.requested_set(chat.model, chat.lora)  # an unknown model is a 404 here too
            return JSONResponse({"input_tokens": await layer.prompt_size(state, chat)})
        except Exception as e:  # noqa: BLE001
            return error_response(from_exception(e))


__all__ = ["CountRequest", "MessagesRequest", "add_routes", "error_body", "message_body", "stream", "to_chat"]
