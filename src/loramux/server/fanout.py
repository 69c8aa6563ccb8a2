"""Fan-out: one request over several adapter sets, one result per set.

`adapter_sets: [{"name": "pirate", "lora": [{"name": "pirate", "scale": 0.8}]}, {"lora": []}, ...]` on
/v1/chat/completions or /v1/completions runs the same prompt and sampling once per set (`lora: []` is the
base alone). The sets' sequences are submitted together as one group of jobs (server/scoring.py), so the
scheduler decodes them in the same steps through the slot bank, whatever their adapters: N sets cost about
one decode step per token, not N. Each choice, and each streamed chunk, names its set in `adapter_set`;
choices come in the order of the sets (set-major when `n` > 1).

Each set's sub-request is exactly the request made alone with `lora` set to that stack, so it is bounded
and refused as that request would be; on top, a fan-out is bounded like `n` (MAX_ADAPTER_SETS sets, and
sets × n within MAX_CHOICES) and holds one queue ticket per sequence like several-sequence requests.
"""

from __future__ import annotations

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from . import generation, scoring
from .errors import APIError
from .schemas import MAX_CHOICES, AdapterSet, ChatRequest, CompletionRequest
from .state import ServerState

Body = CompletionRequest | ChatRequest


def handles(body: Body) -> bool:
    """Does this request fan out over adapter sets?"""
    return body.adapter_sets is not None


def _refusals(state: ServerState, body: Body) -> None:
    """400s naming the field for what cannot be combined with `adapter_sets`."""
    def refuse(param: str, why: str) -> APIError:
        return APIError(400, f"{param}: {why}", code="unsupported_parameter", param=param)

    if body.model is not None and body.model != state.base_name:
        raise refuse("model", f"with adapter_sets, model must be the base model ({state.base_name!r}) or left "
                              "out: each set names its own adapters (put this adapter in the sets' lora lists)")
    if body.lora is not None:
        raise refuse("lora", "with adapter_sets, each set carries its own lora list: drop the top-level lora")
    sets = body.adapter_sets or []
    per = body.n if isinstance(body, ChatRequest) else max(body.n, body.best_of or 1)
    if len(sets) * per > MAX_CHOICES:
        raise refuse("adapter_sets", f"sets × max(n, best_of) may be at most {MAX_CHOICES}, got "
                                     f"{len(sets)} × {per}")
    if isinstance(body, CompletionRequest) and len(body.prompt_list()) != 1:
        raise refuse("prompt", "a fan-out runs one prompt over its adapter sets: send one prompt")


def _label(state: ServerState, k: int, s: AdapterSet) -> str:
    """The set's name, or its resolved stack written as `a:0.5+b:1` (the base model's name for none)."""
    try:
        stack = state.pool.requested_set(None, s.lora)
    except APIError as e:  # the set's own 404 / 400, named as the request names it
        param = f"adapter_sets[{k}].{e.param}" if e.param else f"adapter_sets[{k}]"
        raise APIError(e.status, f"adapter_sets[{k}].{e.message}", code=e.code, param=param,
                       headers=e.headers) from None
    if s.name is not None:
        return s.name
    return "+".join(f"{n}:{v:g}" for n, v in stack.items()) or state.base_name


def plan(state: ServerState, body: Body) -> scoring.Fan:
    """The sub-request of each adapter set and the set's label; raises a 400/404 naming the field."""
    _refusals(state, body)
    sets = body.adapter_sets or []
    labels = [_label(state, k, s) for k, s in enumerate(sets)]
    seen: dict[str, int] = {}
    for k, name in enumerate(labels):
        if name in seen:
            raise APIError(400, f"adapter_sets[{k}] is labelled {name!r} like adapter_sets[{seen[name]}]: give "
                                "each set a distinct name", code="invalid_request", param=f"adapter_sets[{k}].name")
        seen[name] = k
    subs = [body.model_copy(update={"model": None, "lora": list(s.lora), "adapter_sets": None}) for s in sets]
    return subs, labels


async def respond(state: ServerState, http: HTTPRequest, body: Body, chat: bool) -> Response:
    """Serve a fan-out request (JSON or SSE) as one group of jobs, one sub-request per set."""
    with generation.counts_failure(state, body.model):  # a refused fan-out is counted like any request
        fan = plan(state, body)
    return await scoring.respond(state, http, body, chat, fan=fan)


__all__ = ["handles", "plan", "respond"]
