"""llama-server's native API over the response layer (layer.py), so tools written for it work unchanged:
`/completion` (and `/completions`), `/infill`, `/apply-template`, `/props`, `/slots`,
`/chat/completions/input_tokens`, and the un-prefixed aliases of the OpenAI routes (`/chat/completions`,
`/models`, `/v1/health`). docs/llama-server.md lists every route and field, and each difference.

A native body is a CompletionRequest with llama-server's prompt forms and defaults; its own response fields
(`content`, `tokens`, `stop`, `timings`, `completion_probabilities`, `generation_settings`, ...) are shaped
here from `layer.Result` and the streamed `TextDelta` / `TokenProbs` events. Errors on these routes take
llama-server's shape, `{"error": {"code": <status>, "message", "type"}}`, with loramux's `param` beside.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from .. import generation
from ..errors import ERROR_SHAPES, APIError
from ..schemas import MAX_PROMPT_CHARS, ChatRequest, CompletionRequest
from ..scoring import Pieces
from ..state import ServerState
from ..timings import SYSTEM_FINGERPRINT, generated, timings
from . import infill, layer
from .layer import Finished, Opened, Result, TextDelta, TokenProbs

NATIVE_PATHS = ("/completion", "/infill", "/apply-template", "/props", "/slots")  # also /completions (prefix)
NATIVE_ONLY = ("return_tokens", "response_fields")  # fields the native response has room for
# llama-server's sampling defaults, applied on its native routes when a field is left out (the OpenAI routes
# keep OpenAI's: temperature 1, no top-k, top-p or min-p)
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
RANDOM_SEED = 0xFFFFFFFF  # llama-server's LLAMA_DEFAULT_SEED: a random seed, as reported in generation_settings
# what a chat request may carry here (tools work with any template: tools.py describes them when the template
# does not); llama-server reads these from probing the template
CAPS = {"supports_tools": True, "supports_tool_calls": True, "supports_parallel_tool_calls": True,
        "supports_system_role": True, "supports_string_content": True, "supports_typed_content": True,
        "supports_object_arguments": False, "supports_preserve_reasoning": False, "supports_reasoning_effort": False}
ERROR_TYPES = {501: "not_supported_error", 503: "unavailable_error", 404: "not_found_error",
               401: "authentication_error", 403: "permission_error"}


def error_response(err: APIError) -> Response:
    """llama-server's error object: the status as `code`, its type; loramux's code string as `reason`."""
    body = {"code": err.status, "message": err.message,
            "type": err.type if err.type == "exceed_context_size_error" else ERROR_TYPES.get(err.status, err.type),
            "param": err.param, "reason": err.code, **err.extra}
    return JSONResponse({"error": body}, status_code=err.status, headers=err.headers)


for _path in NATIVE_PATHS:
    ERROR_SHAPES[_path] = error_response


class NativeCompletion(CompletionRequest):
    """POST /completion: llama-server's body. `prompt`: a string, token ids, or both mixed in one list."""

    prompt: str | list[int | str] = Field(default="")
    n_predict: int | None = Field(default=-1, ge=-1)

    def llama_unsupported(self) -> list[tuple[str, str]]:
        """The OpenAI routes' refusals but those this route answers (return_tokens, response_fields, -1), and
        the OpenAI fields whose answer this route's response has no place for."""
        out = [(p, why) for p, why in super().llama_unsupported() if p not in (*NATIVE_ONLY, "n_predict")]
        for name, why in (("n", "one completion per request here: send n to /v1/completions"),
                          ("best_of", "send best_of to /v1/completions"), ("echo", "send echo to /v1/completions"),
                          ("prompt_logprobs", "send prompt_logprobs to /v1/completions"),
                          ("return_token_ids", "this route's name for it is return_tokens")):
            v = getattr(self, name)
            if v is True or (not isinstance(v, bool) and v is not None and v != 1):  # n 1: the one completion
                out.append((name, why))
        if self.stream_options is not None and self.stream_options.include_usage:
            out.append(("stream_options.include_usage", "the last chunk carries the counts here "
                                                        "(tokens_predicted, tokens_evaluated, timings)"))
        return out


class ExtraChunk(BaseModel):
    """One `input_extra` entry of /infill: another file's text, for repository-level context."""

    model_config = ConfigDict(extra="forbid")
    text: str = Field(max_length=MAX_PROMPT_CHARS)
    filename: str = Field(default="tmp", max_length=1024)
    # the editor plugins' bookkeeping (when they took the chunk: llama.vim's reltime() list, llama.vscode's
    # Date.now()): llama-server reads only text and filename, and so does loramux; bounded like any field
    time: Annotated[list[int], Field(max_length=16)] | float | None = None


class InfillRequest(NativeCompletion):
    """POST /infill: the code before and after the cursor (and other files), completed in the middle."""

    input_prefix: str = Field(max_length=MAX_PROMPT_CHARS)
    input_suffix: str = Field(max_length=MAX_PROMPT_CHARS)
    input_extra: list[ExtraChunk] = Field(default_factory=list, max_length=infill.MAX_EXTRA)
    prompt: str = Field(default="", max_length=MAX_PROMPT_CHARS)  # text after the middle token


def add_routes(app: FastAPI, state: ServerState) -> None:
    """llama-server's native routes and the un-prefixed aliases (after the OpenAI routes are added)."""
    _aliases(app)

    @app.post("/completion")
    @app.post("/completions")
    async def completion(body: NativeCompletion, http: HTTPRequest) -> Response:
        return await _respond(state, http, body, await _prompt(state, body))

    @app.post("/infill")
    async def infill_route(body: InfillRequest, http: HTTPRequest) -> Response:
        tokens = await asyncio.to_thread(infill.prompt_tokens, state.engine, body.input_prefix, body.input_suffix,
                                         [(c.filename, c.text) for c in body.input_extra], body.prompt)
        return await _respond(state, http, body, tokens)

    @app.post("/apply-template")
    async def apply_template(body: ChatRequest) -> dict[str, Any]:
        return {"prompt": await asyncio.to_thread(_template_text, state, body)}

    @app.post("/chat/completions/input_tokens")
    @app.post("/v1/chat/completions/input_tokens")
    async def input_tokens(body: ChatRequest) -> dict[str, Any]:
        return {"input_tokens": await layer.prompt_size(state, body), "object": "response.input_tokens"}

    @app.get("/props")
    async def props() -> dict[str, Any]:
        return await asyncio.to_thread(_props, state)

    @app.post("/props")
    async def set_props() -> Response:
        raise APIError(501, "loramux has no global properties to change: send settings per request, or change "
                            "adapters through the admin routes", code="not_supported")

    @app.get("/slots")
    async def slots() -> list[dict[str, Any]]:
        return _slots(state)

    @app.post("/slots/{id_slot}")
    async def slot_action(id_slot: str) -> Response:
        raise APIError(501, "slot save, restore and erase are not supported: loramux reuses cached prefixes per "
                            "adapter set by itself", code="not_supported")


def _aliases(app: FastAPI) -> None:
    """llama-server serves each OpenAI route under a second path with one handler: so does this server."""
    pairs = {("POST", "/v1/chat/completions"): "/chat/completions", ("GET", "/v1/models"): "/models",
             ("GET", "/health"): "/v1/health"}
    for route in list(app.routes):
        for method in getattr(route, "methods", None) or ():
            alias = pairs.get((method, getattr(route, "path", "")))
            if alias is not None:
                app.add_api_route(alias, route.endpoint, methods=[method])  # type: ignore[attr-defined]


def _template_text(state: ServerState, body: ChatRequest) -> str:
    """The chat as the template writes it, tools and options applied as generation.chat_prompt does; the
    text that chat_prompt tokenizes (worker thread)."""
    messages, add, options, _ = generation.chat_render_args(state, body)
    return state.engine.apply_chat_template(messages, add, **options)


async def _prompt(state: ServerState, body: NativeCompletion) -> list[int]:
    """The prompt's tokens: a string (with BOS, special tokens parsed, as llama-server does), token ids, or a
    list mixing both."""
    parts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not parts or parts == [""]:
        raise APIError(400, "the prompt is empty", code="invalid_request", param="prompt")
    n_vocab = state.engine.model.n_vocab
    if any(isinstance(p, int) and not 0 <= p < n_vocab for p in parts):
        raise APIError(400, f"prompt token ids must be in [0, {n_vocab})", code="invalid_request", param="prompt")

    def run() -> list[int]:
        out: list[int] = []
        for i, p in enumerate(parts):
            out += [p] if isinstance(p, int) else state.engine.tokenize(p, add_bos=i == 0)
        return out
    return await asyncio.to_thread(run)


def _internal(state: ServerState, body: NativeCompletion, tokens: list[int]) -> CompletionRequest:
    """The engine's request: the tokens as its prompt, the limit -1 as "up to the context", llama-server's
    sampling defaults for what the body leaves out, n_probs read here (not as OpenAI's logprobs)."""
    update: dict[str, Any] = {"prompt": tokens, "logprobs": None}  # n_probs (logprobs: its alias) read apart
    if body.n_predict is None or body.n_predict < 0:
        update["max_tokens"] = max(0, state.engine.n_ctx - len(tokens))
    for name, value in DEFAULTS.items():
        if name not in body.model_fields_set:
            update[name] = value
    if body.seed is not None and body.seed < 0:  # llama-server's -1: a random seed
        update["seed"] = None
    return body.model_copy(update=update)


async def _open(state: ServerState, body: CompletionRequest, n_probs: int) -> Opened:
    """Admit and start the request as generation.start does, asking the engine for the tokens' top-N."""
    with generation.counts_failure(state, body.model):
        bad = body.unsupported()
        if bad:
            raise APIError(400, "; ".join(f"{p}: {why}" for p, why in bad), code="unsupported_parameter",
                           param=bad[0][0])
        if n_probs and (body.max_tokens or 0) > state.settings.max_scored_tokens:
            raise APIError(400, f"n_probs scores every generated token: n_predict may be at most "
                                f"{state.settings.max_scored_tokens} with it (got {body.max_tokens})",
                           code="too_many_scored_tokens", param="n_probs")
        ticket = state.admit()
        try:
            job = await generation.submit_job(state, body, False, ticket, tokens=list(body.prompt),  # type: ignore[arg-type]
                                              extra={"logprobs": n_probs} if n_probs else None)
        except BaseException:
            ticket.release()
            raise
    return Opened(job, body)


async def _respond(state: ServerState, http: HTTPRequest, body: NativeCompletion, tokens: list[int]) -> Response:
    internal = _internal(state, body, tokens)
    op = await _open(state, internal, n_probs(body))
    pieces = Pieces(state)
    if body.stream:
        return layer.EventStream(op, _stream(op, body, pieces), "text/event-stream")
    r = await layer.result(op, http)
    if r is None:
        return Response(status_code=499)
    out = await asyncio.to_thread(_final, state, op, body, r, pieces, False)
    return JSONResponse(_fields(out, body.response_fields))


def n_probs(body: NativeCompletion) -> int:
    """The top-N wanted per generated token: n_probs, else `logprobs` (llama-server reads it as an alias)."""
    return int(body.n_probs if body.n_probs is not None else body.logprobs or 0)


def _fields(out: dict[str, Any], wanted: list[str] | None) -> dict[str, Any]:
    """`response_fields`: only those (a/b: b of a, under the key "a/b"); the missing ones left out."""
    if not wanted:
        return out
    picked: dict[str, Any] = {}
    for path in wanted:
        cur: Any = out
        for key in path.split("/"):
            if not isinstance(cur, dict) or key not in cur:
                break
            cur = cur[key]
        else:
            picked[path] = cur
    return picked


def _probs(entries: list[Any], pieces: Pieces) -> list[dict[str, Any]]:
    """llama-server's completion_probabilities: each token with its logprob, bytes and top alternatives."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        raw = pieces.raw(token)
        return {"id": token, "token": raw.decode("utf-8", errors="ignore"), "bytes": list(raw),
                "logprob": float(logprob)}
    return [{**one(e.token, e.logprob if e.logprob is not None else 0.0),
             "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


def _settings(state: ServerState, op: Opened, body: NativeCompletion) -> dict[str, Any]:
    b = op.body
    return {"n_predict": body.n_predict if body.n_predict is not None else -1, "max_tokens": b.max_tokens,
            "seed": b.seed if b.seed is not None else RANDOM_SEED,
            "temperature": b.temperature, "top_k": b.top_k, "top_p": b.top_p, "min_p": b.min_p,
            "repeat_penalty": b.repeat_penalty if b.repeat_penalty is not None else 1.0,
            "presence_penalty": b.presence_penalty or 0.0, "frequency_penalty": b.frequency_penalty or 0.0,
            "stop": list(b.stops()), "stream": b.stream, "n_probs": n_probs(body), "ignore_eos": b.ignore_eos,
            "timings_per_token": b.timings_per_token, "post_sampling_probs": False,
            "grammar": b.grammar or "", "lora": [{"id": e.id, "scale": e.scale} for e in op.job.entries],
            "n_ctx": state.engine.n_ctx, **b.sampler_settings()}


def _final(state: ServerState, op: Opened, body: NativeCompletion, r: Result, pieces: Pieces,
           streamed: bool) -> dict[str, Any]:
    """The last object of a native response (worker thread: it detokenizes the prompt)."""
    job = op.job
    stop_type = "limit" if r.finish == "length" else "word" if r.stop_sequence is not None else "eos"
    out: dict[str, Any] = {
        "index": 0, "content": "" if streamed else r.text,
        "tokens": list(r.tokens) if body.return_tokens and not streamed else [],
        "id_slot": -1, "stop": True, "model": job.model, "tokens_predicted": r.completion_tokens,
        "tokens_evaluated": r.prompt_tokens, "generation_settings": _settings(state, op, body),
        "prompt": state.engine.model.detokenize(job.prompt, special=True), "has_new_line": "\n" in r.text,
        "truncated": False, "stop_type": stop_type, "stopping_word": r.stop_sequence or "",
        "tokens_cached": r.prompt_tokens + max(0, r.completion_tokens - 1),  # the last token is not decoded
        "timings": timings(job, r.completion_tokens, r.cached_tokens)}
    if n_probs(body) and not streamed:
        out["completion_probabilities"] = _probs((r.logprobs or [])[: r.completion_tokens], pieces)
    return out


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(op: Opened, body: NativeCompletion, pieces: Pieces) -> AsyncIterator[str]:
    """llama-server's native stream: a chunk per piece of text (its tokens' probabilities with it), then the
    final object with `stop: true`. No `[DONE]` line, as llama-server sends none on these routes."""
    job, probs, sent = op.job, [], 0
    try:
        async for ev in layer.events(op):
            if isinstance(ev, TokenProbs):
                probs.append(ev.entry)
            elif isinstance(ev, TextDelta):
                chunk: dict[str, Any] = {"index": 0, "content": ev.text, "tokens": [], "stop": False, "id_slot": -1,
                                         "tokens_predicted": generated(job), "tokens_evaluated": len(job.prompt)}
                if body.return_tokens:  # the tokens generated since the last chunk
                    now = list(getattr(job.request, "generated", ()))
                    chunk["tokens"], sent = now[sent:], len(now)
                if n_probs(body):
                    chunk["completion_probabilities"], probs = _probs(probs, pieces), []
                if body.timings_per_token:
                    chunk["timings"] = timings(job, generated(job))
                yield _sse(chunk)
            elif isinstance(ev, Finished):
                state = job.state
                yield _sse(_fields(await asyncio.to_thread(_final, state, op, body, ev.result, pieces, True),
                                   body.response_fields))
    except APIError as err:
        yield _sse(json.loads(bytes(error_response(err).body)))


def _props(state: ServerState) -> dict[str, Any]:
    eng = state.engine
    h = eng.model.handle
    bos, eos = eng.model.token_text(h.bos), eng.model.token_text(h.eos)
    params = {"n_predict": -1, "max_tokens": -1, "seed": RANDOM_SEED, **DEFAULTS, "repeat_penalty": 1.0, "presence_penalty": 0.0,
              "frequency_penalty": 0.0, "stream": False, "n_probs": 0, "ignore_eos": False,
              "timings_per_token": False, "post_sampling_probs": False, "lora": []}
    return {"default_generation_settings": {"params": params, "n_ctx": eng.n_ctx},
            "total_slots": eng.n_parallel, "model_alias": state.base_name, "model_path": eng.model.path.name,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True, "ui": False,
            "chat_template": eng.chat_template().source, "chat_template_caps": CAPS,
            "bos_token": bos, "eos_token": eos, "build_info": SYSTEM_FINGERPRINT, "is_sleeping": False}


def _slots(state: ServerState) -> list[dict[str, Any]]:
    """One entry per sequence slot (--parallel): llama-server's metrics-only form. The prompts and outputs
    llama-server shows there are other tenants' data: never listed."""
    eng = state.engine
    running = state.snapshot().engine.running
    per = eng.n_ctx  # each request may use the whole context (sampling_args)
    return [{"id": i, "n_ctx": per, "speculative": False, "is_processing": i < running}
            for i in range(eng.n_parallel)]


__all__ = ["ERROR_TYPES", "ExtraChunk", "InfillRequest", "NativeCompletion", "add_routes", "error_response"]
