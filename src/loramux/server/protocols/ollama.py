"""Ollama's API (/api/*), over the response layer (layer.py).

Models: the base model is listed as `<base>:latest` and each adapter as `<base>:<adapter>` with
`details.parent_model` = the base, so a client that groups tags under a model shows the adapters as
variants of the one model they are (docs/ollama.md). A request may also name the plain base or adapter
name, or `<adapter>:latest`. Streaming is NDJSON and on by default, as in Ollama. Fields are honoured or
refused with Ollama's error shape (`{"error": "..."}`) naming them. Extensions (the `ollama` client does
not send them, raw HTTP can): `lora`, `control_vector`, `tool_choice` (chat completions' values).
Model management (pull, push, create, copy, delete) is refused by name (blobs: 404): adapters are loaded on
loramux's admin plane (POST /v1/load_lora_adapter). There are no embeddings: /api/embed answers 501.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import math
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from ..errors import ERROR_SHAPES, APIError, from_exception
from ..schemas import (
    MAX_CONTENT_CHARS,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_PROMPT_CHARS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    ChatRequest,
    CompletionRequest,
    ControlRef,
    LoraRef,
    NamedToolChoice,
    Tool,
)
from ..state import ServerState
from . import layer
from .layer import Finished, Opened, Result, TextDelta

VERSION = "0.12.0"  # the Ollama API version whose routes and fields are served (clients check a minimum)
RUNNING = "Ollama is running"
MANAGEMENT = ("pull", "push", "create", "copy", "delete")


def error_response(err: APIError) -> Response:
    message = err.message if err.param is None or err.param in err.message else f"{err.param}: {err.message}"
    return JSONResponse({"error": message}, status_code=err.status, headers=err.headers)


ERROR_SHAPES["/api/"] = error_response


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Options(_Body):
    """`options`: the sampling ones are honoured; hardware and runner settings are the server's (unknown here)."""

    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | None = None
    num_predict: int | None = Field(default=None, ge=-2)
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    num_ctx: int | None = Field(default=None, ge=1)  # at most the server's --n-ctx: see _sampling


class ToolCallFunction(_Body):
    name: str = Field(max_length=128)
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None


class ToolCall(_Body):
    function: ToolCallFunction
    id: str | None = Field(default=None, max_length=256)
    type: Literal["function"] | None = None


class Message(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(default="", max_length=MAX_CONTENT_CHARS)
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS)
    tool_name: str | None = Field(default=None, max_length=128)
    thinking: str | None = None


class _Common(_Body):
    model: str = Field(max_length=MAX_NAME_CHARS)
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: str | float | None = None
    think: bool | str | None = None
    lora: list[LoraRef] | None = None
    control_vector: ControlRef | None = None

    def check(self) -> None:
        if self.think not in (None, False):
            raise APIError(400, "this model does not think: send think false or leave it out", param="think",
                           code="invalid_request")
        if self.keep_alive is not None and _seconds(self.keep_alive) == 0:
            raise APIError(400, "keep_alive 0 asks to unload the model, and loramux keeps its base model loaded "
                                "(adapters are unloaded with POST /v1/unload_lora_adapter)", param="keep_alive",
                           code="invalid_request")


class ChatBody(_Common):
    """POST /api/chat."""

    messages: list[Message] = Field(default_factory=list, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


class GenerateBody(_Common):
    """POST /api/generate."""

    prompt: str = Field(default="", max_length=MAX_PROMPT_CHARS)
    system: str | None = Field(default=None, max_length=MAX_CONTENT_CHARS)
    suffix: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] | None = None
    context: list[int] | None = None


class ShowBody(_Body):
    """POST /api/show; older clients name the model `name`."""

    model: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    name: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    verbose: bool | None = None

    def target(self) -> str:
        if (self.model is None) == (self.name is None):
            raise APIError(400, "give the model as model (or, as older clients do, name)", param="model",
                           code="invalid_request")
        return self.model or self.name or ""


def _seconds(v: str | float) -> float:
    """Ollama's keep_alive: a number of seconds or a Go duration ('5m', '1h30m', '-1')."""
    if isinstance(v, (int, float)):
        return float(v)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3}
    s, total, num = v.strip(), 0.0, ""
    i = 0
    while i < len(s):
        c = s[i]
        if c.isdigit() or c in ".-+":
            num += c
            i += 1
            continue
        unit = "ms" if s[i:i + 2] == "ms" else c
        if unit not in units or not num:
            raise APIError(400, f"keep_alive {v!r} is not a duration (e.g. '5m', '1h', -1)", param="keep_alive",
                           code="invalid_request")
        total += float(num) * units[unit]
        num, i = "", i + len(unit)
    try:
        return total + (float(num) if num else 0.0)
    except ValueError:
        raise APIError(400, f"keep_alive {v!r} is not a duration", param="keep_alive", code="invalid_request") from None


# ---------------------------------------------------------------------------------------- models
def _names(state: ServerState) -> list[tuple[str, str, str | None]]:
    """(Ollama name, loramux model name, parent) of every served model, the base first."""
    base = state.base_name
    return [(f"{base}:latest", base, None), *((f"{base}:{e.name}", e.name, base) for e in state.pool.ordered())]


def resolve(state: ServerState, name: str) -> str:
    """The loramux model a request's Ollama name means; 404 in Ollama's words when none."""
    base, pool = state.base_name, state.pool.entries
    if name == base or name in pool:
        return name
    left, _, tag = name.rpartition(":")
    if left == base and (tag == "latest" or tag in pool):
        return base if tag == "latest" else tag
    if tag == "latest" and (left in pool or left == base):
        return left
    raise APIError(404, f"model {name!r} not found (GET /api/tags lists the served ones)", code="model_not_found")


def _digest(state: ServerState, name: str) -> str:
    """A stable id for a served model (the file's name, size and time, and the adapter's source), not its content."""
    p = state.engine.model.path
    st = p.stat()
    e = state.pool.entries.get(name)
    key = f"{p.name}|{st.st_size}|{st.st_mtime_ns}|{name}|{e.source if e else ''}"
    return hashlib.sha256(key.encode()).hexdigest()


def _params(state: ServerState) -> int:
    return sum(math.prod(s) for s in state.engine.model.tensor_shapes.values())


def _details(state: ServerState, parent: str | None) -> dict[str, Any]:
    m = state.engine.model
    n = _params(state)
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else str(n)
    return {"parent_model": parent or "", "format": "gguf", "family": m.architecture, "families": [m.architecture],
            "parameter_size": size, "quantization_level": _FILE_TYPES.get(m.header.metadata.get("general.file_type"), "unknown")}


# llama.cpp's general.file_type values (llama_ftype) as Ollama names them
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
               12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
               32: "BF16"}


def _modified(state: ServerState) -> str:
    return datetime.fromtimestamp(state.started, UTC).isoformat().replace("+00:00", "Z")


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def tags(state: ServerState) -> dict[str, Any]:
    size = state.engine.model.path.stat().st_size
    return {"models": [{"name": n, "model": n, "modified_at": _modified(state), "size": size,
                        "digest": _digest(state, internal), "details": _details(state, parent)}
                       for n, internal, parent in _names(state)]}


def show(state: ServerState, name: str) -> dict[str, Any]:
    internal = resolve(state, name)
    m, base = state.engine.model, state.base_name
    parent = None if internal == base else base
    arch = m.architecture
    e = state.pool.entries.get(internal)
    modelfile = f"FROM {m.path.name}\n" + (f"ADAPTER {e.display_source(False)}\n" if e else "")
    return {"modelfile": modelfile, "parameters": "", "template": m.chat_template or "",
            "details": _details(state, parent), "modified_at": _modified(state),
            "model_info": {"general.architecture": arch, "general.parameter_count": _params(state),
                           f"{arch}.context_length": state.engine.n_ctx, f"{arch}.embedding_length": m.n_embd,
                           f"{arch}.block_count": m.n_layer},
            "capabilities": ["completion", "tools"]}


def ps(state: ServerState) -> dict[str, Any]:
    size = state.engine.model.path.stat().st_size
    far = "2318-08-22T00:00:00Z"  # loaded until the server stops: Ollama's keep_alive -1 shows such a date
    return {"models": [{"name": n, "model": n, "size": size, "digest": _digest(state, internal),
                        "details": _details(state, parent), "expires_at": far,
                        "size_vram": 0 if state.engine.model.n_gpu_layers == 0 else size,
                        "context_length": state.engine.n_ctx}
                       for n, internal, parent in _names(state)
                       if internal == state.base_name or state.pool.entries[internal].resident]}


# ------------------------------------------------------------------------------ into the layer
def _sampling(state: ServerState, body: _Common) -> dict[str, Any]:
    o = body.options or Options()
    if o.num_ctx is not None and o.num_ctx > state.engine.n_ctx:
        raise APIError(400, f"options.num_ctx {o.num_ctx} is more than this server's context ({state.engine.n_ctx} "
                            "tokens per request, --n-ctx)", param="options.num_ctx", code="invalid_request")
    out: dict[str, Any] = {k: getattr(o, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                                        "repeat_penalty", "presence_penalty", "frequency_penalty")}
    if o.num_predict is not None and o.num_predict >= 0:
        out["max_tokens"] = o.num_predict  # -1 (until the end) and -2 (fill the context): the default
    if isinstance(body.format, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": body.format}}
    elif body.format == "json":
        out["response_format"] = {"type": "json_object"}
    out.update(lora=body.lora, control_vector=body.control_vector, model=resolve(state, body.model),
               stream=body.stream)
    return {k: v for k, v in out.items() if v is not None}


def _chat_messages(body: ChatBody) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(body.messages):
        if m.images:
            raise APIError(400, "images are not supported: this server runs a text-only model",
                           param=f"messages.{i}.images", code="invalid_request")
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.dumps(c.function.arguments, ensure_ascii=False)}}
                for c in m.tool_calls]
        if m.role == "tool" and m.tool_name:
            d["name"] = m.tool_name
        out.append(d)
    return out


def chat_request(state: ServerState, body: ChatBody) -> ChatRequest:
    body.check()
    fields = {**_sampling(state, body), "messages": _chat_messages(body)}
    if body.tools:
        fields.update(tools=body.tools, tool_choice=body.tool_choice)
    elif body.tool_choice is not None:
        fields["tool_choice"] = body.tool_choice
    return layer.internal(lambda: ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None}))


async def generate_request(state: ServerState, body: GenerateBody) -> ChatRequest | CompletionRequest:
    body.check()
    for name in ("suffix", "template", "images", "context"):
        if getattr(body, name):
            raise APIError(400, f"{name} is not supported by loramux's /api/generate", param=name,
                           code="invalid_request")
    fields = _sampling(state, body)
    if not body.raw:  # Ollama applies the model's template: the prompt is a user turn
        msgs = ([{"role": "system", "content": body.system}] if body.system else []) + \
            [{"role": "user", "content": body.prompt}]
        return layer.internal(lambda: ChatRequest.model_validate({**fields, "messages": msgs}))
    if body.system:
        raise APIError(400, "system has no place in a raw prompt: put it in the prompt", param="system",
                       code="invalid_request")
    tokens = await asyncio.to_thread(state.engine.tokenize, body.prompt)
    fields.setdefault("max_tokens", max(0, state.engine.n_ctx - len(tokens)))  # Ollama: until the end
    return layer.internal(lambda: CompletionRequest.model_validate({**fields, "prompt": tokens}))


# --------------------------------------------------------------------------------- out of it
def _timing(r: Result, reason: str) -> dict[str, Any]:
    first = r.first_token_ns or 0
    return {"done": True, "done_reason": reason, "total_duration": r.started_ns, "load_duration": 0,
            "prompt_eval_count": r.prompt_tokens, "prompt_eval_duration": first, "eval_count": r.completion_tokens,
            "eval_duration": max(0, r.started_ns - first), "adapter_versions": r.versions}


def _reason(r: Result) -> str:
    return "length" if r.finish == "length" else "stop"


def _calls(r: Result) -> list[dict[str, Any]]:
    out = []
    for i, c in enumerate(r.calls):
        args = c.args()
        out.append({"id": c.id, "function": {"index": i, "name": c.name,
                                              "arguments": args if isinstance(args, dict) else {}}})
    return out


def chat_body(name: str, r: Result) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": r.text}
    if r.calls:
        msg["tool_calls"] = _calls(r)
    return {"model": name, "created_at": _now(), "message": msg, **_timing(r, _reason(r))}


def generate_body(name: str, r: Result) -> dict[str, Any]:
    return {"model": name, "created_at": _now(), "response": r.text, **_timing(r, _reason(r))}


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


async def stream(op: Opened, name: str, chat: bool) -> AsyncIterator[str]:
    """NDJSON: one line per text delta, a line with the tool calls, then the final line with the counts."""
    try:
        async for ev in layer.events(op):
            if isinstance(ev, TextDelta):
                part = {"message": {"role": "assistant", "content": ev.text}} if chat else {"response": ev.text}
                yield _line({"model": name, "created_at": _now(), **part, "done": False})
            elif isinstance(ev, Finished):
                r = ev.result
                if r.calls and chat:
                    yield _line({"model": name, "created_at": _now(),
                                 "message": {"role": "assistant", "content": "", "tool_calls": _calls(r)},
                                 "done": False})
                part = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
                yield _line({"model": name, "created_at": _now(), **part, **_timing(r, _reason(r))})
    except APIError as e:
        yield _line({"error": e.message})


async def _generation(state: ServerState, body: ChatBody | GenerateBody, http: HTTPRequest) -> Response:
    chat = isinstance(body, ChatBody)
    if not (body.messages if isinstance(body, ChatBody) else body.prompt):  # Ollama's "load the model" call
        body.check()
        resolve(state, body.model)
        return JSONResponse({"model": body.model, "created_at": _now(), "done": True, "done_reason": "load",
                             **({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})})
    name, streaming = body.model, body.stream
    req = chat_request(state, body) if isinstance(body, ChatBody) else await generate_request(state, body)
    op = await layer.open_request(state, req, {"max_tokens": "options.num_predict"})
    if streaming:
        return layer.EventStream(op, stream(op, name, chat), "application/x-ndjson")
    r = await layer.result(op, http)
    if r is None:
        return Response(status_code=499)
    return JSONResponse(chat_body(name, r) if chat else generate_body(name, r))


def _guarded(fn: Any) -> Any:
    """The route answering every failure in Ollama's shape (never a 500 page)."""
    @functools.wraps(fn)
    async def run(*args: Any, **kwargs: Any) -> Response:
        try:
            return await fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            return error_response(from_exception(e))
    return run


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Ollama's routes, and its probe at the root (for clients, not browsers: see `root`)."""

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root(http: HTTPRequest) -> Response:
        # Ollama's clients probe GET / for this text. A browser (Accept: text/html) is not such a client:
        # the root stays free for a page the server may serve there later.
        if "text/html" in http.headers.get("accept", ""):
            raise APIError(404, "Not Found")
        return PlainTextResponse(RUNNING)

    @app.get("/api/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.api_route("/api/tags", methods=["GET", "HEAD"])
    async def list_tags() -> dict[str, Any]:
        return tags(state)

    @app.get("/api/ps")
    async def running() -> dict[str, Any]:
        return ps(state)

    @app.post("/api/show")
    @_guarded
    async def show_model(body: ShowBody) -> Response:
        return JSONResponse(show(state, body.target()))

    @app.post("/api/chat")
    @_guarded
    async def chat(body: ChatBody, http: HTTPRequest) -> Response:
        return await _generation(state, body, http)

    @app.post("/api/generate")
    @_guarded
    async def generate(body: GenerateBody, http: HTTPRequest) -> Response:
        return await _generation(state, body, http)

    async def no_embeddings() -> Response:
        return error_response(APIError(501, "embeddings are not served: loramux runs generation models only",
                                       code="not_implemented"))
    for path in ("/api/embed", "/api/embeddings"):
        app.add_api_route(path, no_embeddings, methods=["POST"])

    def refuse(what: str) -> Any:
        async def refused() -> Response:
            return error_response(APIError(400, f"/api/{what} is not supported: loramux serves one base model; "
                                                "adapters are loaded and unloaded on its admin plane (POST "
                                                "/v1/load_lora_adapter, /v1/unload_lora_adapter)",
                                           code="unsupported"))
        return refused
    for what in MANAGEMENT:
        app.add_api_route(f"/api/{what}", refuse(what), methods=["DELETE" if what == "delete" else "POST"])


__all__ = ["VERSION", "ChatBody", "GenerateBody", "add_routes", "chat_request", "generate_request", "resolve", "show",
           "tags"]
