"""OpenAI's Responses API: POST /v1/responses (JSON, or the Responses SSE event sequence), stateless.

The body is translated into a ChatRequest (layer.py): `instructions` and system/developer items → system
messages, user/assistant message items → turns, `function_call` / `function_call_output` items → the
assistant's tool calls and the tool results, flat function tools (and those inside a `namespace` tool,
flattened under their own names) → chat tools, a `custom` tool → a function of one string (its regex
grammar, if any, enforced), `text.format` → `response_format`, `max_output_tokens` →
`max_tokens`. Hosted tools loramux cannot run (web search, file search, code interpreter, computer use, ...)
are not offered to the model and the response lists them in `tools_not_offered`; a `tool_choice` that forces
one is a 400 naming it. Nothing is stored: `store: true`, `previous_response_id` and `conversation` are
refused by name. This model does not reason: `reasoning` is accepted, the response's `reasoning` is null and
its reasoning tokens 0. `prompt_cache_key` is accepted: the engine reuses a shared prefix's KV whatever the
key (docs/responses.md). Extensions: `lora` (a per-request adapter stack) and `control_vector`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from ..errors import APIError, from_exception
from ..schemas import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_PROMPT_CHARS,
    MAX_TOOLS,
    MAX_USER_CHARS,
    ChatRequest,
    ControlRef,
    JsonSchemaFormat,
    LoraRef,
)
from ..state import ServerState
from . import layer
from .layer import Finished, Opened, Result, TextDelta

# tools OpenAI runs on its side; loramux has none of them
HOSTED = frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
                    "code_interpreter", "computer", "computer_use", "computer_use_preview", "image_generation",
                    "mcp", "local_shell", "shell", "apply_patch", "tool_search"})
INCLUDABLE = frozenset({"reasoning.encrypted_content"})  # there is no reasoning: nothing to include, visibly
MAX_INCLUDE = 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


Text = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


class Part(_Body):
    type: Literal["input_text", "output_text", "text", "refusal", "input_image", "input_file", "input_audio"]
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    image_url: str | None = None
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None
    detail: str | None = None
    input_audio: dict[str, Any] | None = None


class Item(_Body):
    """One input item; which fields it may carry depends on its type (checked in `_messages`)."""

    type: Literal["message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
                  "reasoning", "item_reference"] | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: Text | Annotated[list[Part], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    id: str | None = Field(default=None, max_length=256)
    status: str | None = None
    call_id: str | None = Field(default=None, max_length=256)
    name: str | None = Field(default=None, max_length=128)
    namespace: str | None = Field(default=None, max_length=128)
    arguments: str | None = None
    input: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)  # a custom tool call's text
    output: Text | Annotated[list[Part], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    summary: list[Any] | None = None
    encrypted_content: str | None = None


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class CustomFormat(_Body):
    type: Literal["text", "grammar"]
    syntax: Literal["regex", "lark"] | None = None
    definition: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)


class CustomTool(_Body):
    """A freeform tool: its input is text, free or matching a grammar (a regex converts; Lark does not)."""

    type: Literal["custom"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    format: CustomFormat | None = None

    def parameters(self, where: str) -> dict[str, Any]:
        """The call as a function of one string, `input`, constrained to the regex when there is one."""
        text: dict[str, Any] = {"type": "string"}
        f = self.format
        if f is not None and f.type == "grammar":
            if f.syntax != "regex" or not f.definition:
                raise APIError(400, "only a regex grammar converts to llama.cpp's grammars (Lark does not): send a "
                                    "regex or a text format", param=f"{where}.format", code="unsupported_parameter")
            body = f.definition.removeprefix("^").removesuffix("$")
            text["pattern"] = f"^(?:{body})$"  # the whole input matches (a schema pattern alone is a search)
        return {"type": "object", "properties": {"input": text}, "required": ["input"],
                "additionalProperties": False}


class NamespaceTool(_Body):
    type: Literal["namespace"]
    name: str = Field(max_length=128)
    description: str | None = None
    tools: list[FunctionTool] = Field(max_length=MAX_TOOLS)


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only length this model has: any other is a 400


class Reasoning(_Body):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Body):
    """POST /v1/responses."""

    model: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    input: Text | Annotated[list[Item], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    reasoning: Reasoning | None = None
    include: list[str] | None = Field(default=None, max_length=MAX_INCLUDE)
    metadata: dict[str, str] | None = None
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    safety_identifier: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    client_metadata: dict[str, Any] | None = None  # Codex's ids: only logged
    truncation: Literal["disabled"] | None = None  # "auto" would drop input: refused by the Literal
    service_tier: Literal["auto", "default"] | None = None
    background: Literal[False] | None = None
    top_logprobs: Literal[0] | None = None
    lora: list[LoraRef] | None = None
    control_vector: ControlRef | None = None

    def refusals(self) -> None:
        if self.store:
            raise APIError(400, "loramux stores no responses: send store false (the conversation goes in input)",
                           param="store", code="unsupported_parameter")
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name):
                raise APIError(400, f"{name} needs stored responses, and loramux stores none: send the whole "
                                    "conversation in input", param=name, code="unsupported_parameter")
        bad = [x for x in self.include or () if x not in INCLUDABLE]
        if bad:
            raise APIError(400, f"include {bad[0]!r} is not supported (only {', '.join(sorted(INCLUDABLE))})",
                           param="include", code="unsupported_parameter")


# ------------------------------------------------------------------------------ into the layer
def _tools(body: ResponsesRequest) -> tuple[list[dict[str, Any]], list[str], set[str]]:
    """(chat tools, hosted tool types not offered, custom tools' names); function tools inside a namespace are
    flattened; a custom tool is a function of one string."""
    out, skipped, custom = [], [], set()
    for i, raw in enumerate(body.tools or ()):
        kind = raw.get("type")
        if kind in HOSTED:
            skipped.append(str(kind))
            continue
        if kind == "custom":
            ct = layer.internal(lambda r=raw: CustomTool.model_validate(r))
            custom.add(ct.name)
            out.append({"type": "function", "function": {"name": ct.name, "description": ct.description,
                                                          "parameters": ct.parameters(f"tools.{i}")}})
            continue
        if kind == "namespace":
            ns = layer.internal(lambda r=raw: NamespaceTool.model_validate(r))
            fns = ns.tools
        elif kind == "function":
            fns = [layer.internal(lambda r=raw: FunctionTool.model_validate(r))]
        else:
            raise APIError(400, f"tool type {kind!r} is not supported (function, custom and namespace tools are; hosted "
                                f"tools ({', '.join(sorted(HOSTED))}) are not offered)", param=f"tools.{i}.type",
                           code="unsupported_parameter")
        out += [{"type": "function", "function": {"name": f.name, "description": f.description,
                                                   "parameters": f.parameters, "strict": f.strict}} for f in fns]
    return out, skipped, custom


def _tool_choice(tc: str | dict[str, Any] | None, skipped: list[str]) -> Any:
    if tc is None or isinstance(tc, str):
        if tc not in (None, "auto", "none", "required"):
            raise APIError(400, f"tool_choice {tc!r} is not one of auto, none, required", param="tool_choice",
                           code="invalid_request")
        return tc
    kind = tc.get("type")
    if kind in ("function", "custom") and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    if kind in HOSTED:
        raise APIError(400, f"tool_choice forces the hosted tool {kind!r}, which loramux cannot run",
                       param="tool_choice", code="unsupported_parameter")
    raise APIError(400, f"tool_choice of type {kind!r} is not supported (auto, none, required, or a function by "
                        "name)", param="tool_choice", code="unsupported_parameter")


def _text(content: str | list[Part] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for j, p in enumerate(content):
        if p.type in ("input_image", "input_file", "input_audio"):
            raise APIError(400, f"{p.type} is not supported: this server runs a text-only model",
                           param=f"{where}.{j}.type", code="unsupported_parameter")
        out.append(p.text or p.refusal or "")
    return "".join(out)


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []

    def system(text: str) -> None:
        if msgs and msgs[-1]["role"] == "system":  # one system turn: templates take a single one
            msgs[-1]["content"] += "\n\n" + text
        else:
            msgs.append({"role": "system", "content": text})
    if body.instructions:
        system(body.instructions)
    items = [Item(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    names: dict[str, str] = {}
    for i, it in enumerate(items):
        kind = it.type or "message"
        if kind == "message" and it.role is not None:
            text = _text(it.content, f"input.{i}.content")
            if it.role in ("system", "developer"):
                system(text)
            else:
                msgs.append({"role": it.role, "content": text})
        elif kind == "function_call" and it.call_id and it.name:
            names[it.call_id] = it.name
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": it.arguments or "{}"}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "custom_tool_call" and it.call_id and it.name:
            names[it.call_id] = it.name
            call = {"id": it.call_id, "type": "function",
                    "function": {"name": it.name, "arguments": json.dumps({"input": it.input or ""})}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output") and it.call_id:
            msgs.append({"role": "tool", "tool_call_id": it.call_id, "name": names.get(it.call_id),
                         "content": _text(it.output, f"input.{i}.output")})
        elif kind == "reasoning":
            continue  # a reasoning model's earlier thinking: this model takes none
        elif kind == "item_reference":
            raise APIError(400, "item_reference needs stored items, and loramux stores none",
                           param=f"input.{i}", code="unsupported_parameter")
        else:
            raise APIError(400, f"a {kind} item needs its fields (role; call_id and name; call_id)",
                           param=f"input.{i}", code="invalid_request")
    return [{k: v for k, v in m.items() if v is not None} for m in msgs]


def _format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    js = JsonSchemaFormat(name=fmt.name or "response", description=fmt.description, schema=fmt.schema_,
                          strict=fmt.strict)
    return {"type": "json_schema", "json_schema": js.model_dump(by_alias=True, exclude_none=True)}


def to_chat(body: ResponsesRequest) -> tuple[ChatRequest, list[str], set[str]]:
    """The internal request, the hosted tools left out, the custom tools' names."""
    body.refusals()
    tools, skipped, custom = _tools(body)
    fields: dict[str, Any] = {
        "model": body.model, "messages": _messages(body), "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream, "lora": body.lora,
        "control_vector": body.control_vector, "metadata": body.metadata, "user": body.user or body.safety_identifier,
        "response_format": _format(body), "parallel_tool_calls": body.parallel_tool_calls if tools else None}
    choice = _tool_choice(body.tool_choice, skipped)
    if tools:
        fields.update(tools=tools, tool_choice=choice)
    elif choice not in (None, "auto", "none"):
        raise APIError(400, "tool_choice needs function tools", param="tool_choice", code="invalid_request")
    fields = {k: v for k, v in fields.items() if v is not None}
    return layer.internal(lambda: ChatRequest.model_validate(fields)), skipped, custom


# --------------------------------------------------------------------------------- out of it
class Shape:
    """The response object of one request, built up as it runs (the stream and the final JSON share it)."""

    def __init__(self, op: Opened, body: ResponsesRequest, skipped: list[str], custom: set[str]) -> None:
        self.op, self.body, self.skipped, self.custom = op, body, skipped, custom
        self.id = "resp_" + op.id
        self.created = int(time.time())
        self.msg_id = layer.new_id("msg_")

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" \
            else []
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

    def call(self, c: layer.Call, status: str = "completed") -> dict[str, Any]:
        if c.name in self.custom:
            args = c.args()
            text = args.get("input", "") if isinstance(args, dict) else ""
            return {"type": "custom_tool_call", "id": "ctc_" + c.id.removeprefix("call_"), "call_id": c.id,
                    "name": c.name, "input": text if status == "completed" else "", "status": status}
        return {"type": "function_call", "id": "fc_" + c.id.removeprefix("call_"), "call_id": c.id, "name": c.name,
                "arguments": c.arguments if status == "completed" else "", "status": status}

    def output(self, r: Result) -> list[dict[str, Any]]:
        out = [self.message(r.text, "completed")] if r.text or not r.calls else []
        return out + [self.call(c) for c in r.calls]

    def response(self, r: Result | None) -> dict[str, Any]:
        b, job = self.body, self.op.job
        status = "in_progress" if r is None else "incomplete" if r.finish == "length" else "completed"
        chat = job.body
        fmt = _format(b)
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": job.model,
            "output": [] if r is None else self.output(r),
            "parallel_tool_calls": b.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": chat.temperature if chat.temperature is not None else 1.0,
            "text": {"format": {"type": "text"} if fmt is None else {
                "type": fmt["type"], **({k: v for k, v in fmt["json_schema"].items()} if "json_schema" in fmt else {})}},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": [t for t in b.tools or () if t.get("type") not in HOSTED],
            "tools_not_offered": self.skipped, "top_p": chat.top_p if chat.top_p is not None else 1.0,
            "truncation": "disabled", "user": b.user, "metadata": b.metadata or {},
            "usage": None if r is None else {
                "input_tokens": r.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": r.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": r.total_tokens},
            **({} if r is None else {"adapter_versions": r.versions})}


class _Events:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.n, **data}
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


async def stream(shape: Shape) -> AsyncIterator[str]:
    """The Responses event sequence: created, in_progress, the message item with its text deltas, each function
    call item with its arguments, then completed (or incomplete at max_output_tokens; error on a failure)."""
    ev = _Events()
    yield ev("response.created", response=shape.response(None))
    yield ev("response.in_progress", response=shape.response(None))
    text: list[str] = []
    mid = shape.msg_id
    try:
        async for e in layer.events(shape.op):
            if isinstance(e, TextDelta):
                if not text:
                    yield ev("response.output_item.added", output_index=0, item=shape.message("", "in_progress"))
                    yield ev("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                text.append(e.text)
                yield ev("response.output_text.delta", item_id=mid, output_index=0, content_index=0, delta=e.text,
                         logprobs=[])
            elif isinstance(e, Finished):
                r = e.result
                if text:
                    whole = "".join(text)
                    part = {"type": "output_text", "text": whole, "annotations": [], "logprobs": []}
                    yield ev("response.output_text.done", item_id=mid, output_index=0, content_index=0, text=whole,
                             logprobs=[])
                    yield ev("response.content_part.done", item_id=mid, output_index=0, content_index=0, part=part)
                    yield ev("response.output_item.done", output_index=0, item=shape.message(whole, "completed"))
                elif not r.calls:  # an empty answer is still one message item
                    yield ev("response.output_item.added", output_index=0, item=shape.message("", "in_progress"))
                    yield ev("response.output_item.done", output_index=0, item=shape.message("", "completed"))
                r.text = "".join(text)
                base = 1 if (text or not r.calls) else 0
                for k, c in enumerate(r.calls):
                    item, idx = shape.call(c), base + k
                    yield ev("response.output_item.added", output_index=idx, item=shape.call(c, "in_progress"))
                    if item["type"] == "custom_tool_call":
                        yield ev("response.custom_tool_call_input.delta", item_id=item["id"], output_index=idx,
                                 delta=item["input"])
                        yield ev("response.custom_tool_call_input.done", item_id=item["id"], output_index=idx,
                                 input=item["input"])
                    else:
                        yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                                 delta=c.arguments)
                        yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                 name=c.name, arguments=c.arguments)
                    yield ev("response.output_item.done", output_index=idx, item=item)
                final = shape.response(r)
                yield ev("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                         response=final)
    except APIError as err:
        yield ev("error", code=err.code, message=err.message, param=err.param)
        failed = {**shape.response(None), "status": "failed", "error": {"code": err.code, "message": err.message}}
        yield ev("response.failed", response=failed)


RENAMED = {"max_tokens": "max_output_tokens", "messages": "input"}


async def _serve(state: ServerState, body: ResponsesRequest, http: HTTPRequest) -> Response:
    chat, skipped, custom = to_chat(body)
    op = await layer.open_request(state, chat, RENAMED)
    shape = Shape(op, body, skipped, custom)
    if body.stream:
        return layer.EventStream(op, stream(shape), "text/event-stream")
    r = await layer.result(op, http)
    return JSONResponse(shape.response(r)) if r is not None else Response(status_code=499)


def add_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/responses (errors in OpenAI's shape, as the Responses API answers them)."""

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, http: HTTPRequest) -> Response:
        try:
            return await _serve(state, body, http)
        except Exception as e:  # noqa: BLE001 - every failure is an OpenAI-shaped error
            return layer.renamed(from_exception(e), RENAMED).response()


__all__ = ["HOSTED", "ResponsesRequest", "Shape", "add_routes", "stream", "to_chat"]
