"""Factor pushes over HTTP (admin plane): replace a live adapter's factors with one request.

    PUT /v1/adapters/{name}/factors     body: a safetensors file          → {"version": N, ...}
    GET /v1/adapters/{name}             rank, alpha, version, every target's factor shapes

The body's tensors are named as in the adapter GGUF (``blk.3.attn_q.weight.lora_a`` / ``.lora_b``) or
as PEFT writes them (``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``); rank and
targets are the loaded adapter's (targets left out keep their factors). The body is parsed once, in a
worker thread, and checked like a load (names, shapes, finite values, the delta bound); then the
factors are written in place (`Engine.push_factors`: no re-parse of the GGUF, no graph rebuild) and the
new version is returned once it is servable. Anything refused writes nothing (400 invalid_factors or
invalid_parameter, naming every problem); a body over --max-upload-bytes is a 413 (guard.py). A pushed
adapter is pinned: its factors are no longer its file's, so an eviction would lose them.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from ..convert import peft_factors
from ..engine.adapters import LoRAAdapter
from ..errors import FactorError
from ..gguf_io import GGUFHeader, read_header
from ..gguf_io.safetensors import parse_safetensors
from .errors import APIError, model_not_found
from .state import ServerState
from .versions import HEADER

GGUF_KINDS = {".lora_a": 0, ".lora_b": 1}


def gguf_pairs(tensors: Mapping[str, np.ndarray]) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], list[str]]:
    """GGUF-named tensors (`<base tensor>.lora_a/.lora_b`) grouped into base name → (A, B), and problems."""
    halves: dict[str, list[np.ndarray | None]] = {}
    problems: list[str] = []
    for key, arr in tensors.items():
        kind = next((k for k in GGUF_KINDS if key.endswith(k)), None)
        if kind is None:
            problems.append(f"{key}: not a factor name (<base tensor>.lora_a / .lora_b, or PEFT's lora_A / lora_B)")
            continue
        halves.setdefault(key[: -len(kind)], [None, None])[GGUF_KINDS[kind]] = arr
    out = {}
    for base, (a, b) in halves.items():
        if a is None or b is None:
            problems.append(f"{base}: {'lora_a' if a is None else 'lora_b'} is missing (factors come in pairs)")
        else:
            out[base] = (a, b)
    return out, problems


@lru_cache(maxsize=4)
def _base_header(path: str) -> GGUFHeader:
    return read_header(path)


def body_factors(adapter: LoRAAdapter, body: bytes) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The push body as factor pairs of `adapter` (base tensor name → (A, B)); every problem raised at once."""
    tensors = parse_safetensors(body)
    if not tensors:
        raise FactorError(adapter.name, "the body holds no tensors", problems=["send at least one factor pair"])
    if all(k.endswith(tuple(GGUF_KINDS)) for k in tensors):
        pairs, problems = gguf_pairs(tensors)
    else:
        pairs, problems = peft_factors(tensors, _base_header(str(adapter.model.path)))
    known = set(adapter.factor_names())
    problems += [f"{n}: the adapter has no factors for this tensor (its targets are fixed at load; "
                 f"e.g. {sorted(known)[:2]})" for n in pairs if n not in known]
    if problems:
        raise FactorError(adapter.name, "factors refused, nothing written", problems=problems[:8])
    return pairs


def add_routes(app: FastAPI, state: ServerState) -> None:
    """PUT /v1/adapters/{name}/factors and GET /v1/adapters/{name} (both on the admin plane)."""

    @app.put("/v1/adapters/{name}/factors")
    async def push(name: str, http: HTTPRequest) -> JSONResponse:
        adapter = _adapter(state, name)
        t0 = time.perf_counter()
        body = await http.body()
        received = time.perf_counter()

        def work() -> tuple[int, float]:
            factors = body_factors(adapter, body)
            version = state.engine.push_factors(name, factors)
            return version, time.perf_counter()
        version, done = await asyncio.to_thread(work)
        state.pool.entries[name].pinned = True  # its factors are not its file's any more
        digest = hashlib.sha256(body).hexdigest()[:16]
        return JSONResponse({"object": "adapter.version", "name": name, "version": version, "sha256": digest,
                             "bytes": len(body), "receive_ms": (received - t0) * 1e3,
                             "servable_ms": (done - received) * 1e3},
                            headers={HEADER: f"{name}={version}"})

    @app.get("/v1/adapters/{name}")
    async def describe(name: str) -> dict[str, Any]:
        a = _adapter(state, name)
        return {"object": "adapter", "name": name, "version": a.version, "rank": a.rank, "alpha": a.alpha,
                "dtype": a.dtype, "factors": {t: {"a": list(f.a_shape), "b": list(f.b_shape)}
                                              for t, f in a.factor_tensors().items()}}


def _adapter(state: ServerState, name: str) -> LoRAAdapter:
    e = state.pool.entries.get(name)
    if e is None:
        raise model_not_found(name, [x.name for x in state.pool.ordered()])
    if not e.resident:
        raise APIError(409, f"adapter {name!r} is not resident (evicted); load it again before pushing factors",
                       code="adapter_not_resident", param="name")
    return state.engine.adapter(name)


__all__ = ["add_routes", "body_factors", "gguf_pairs"]
