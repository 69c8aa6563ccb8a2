"""Requests that score or fan out: logprobs, echo, prompt_logprobs, several prompts, n and best_of.

One HTTP request becomes a `Group` of engine requests (one per prompt and sequence), submitted back to
back so they share decode steps (through the slot bank, whatever their adapters). The engine computes
every log-probability on its own thread (engine/scoring.py); this module only shapes them:
OpenAI's legacy completions `logprobs` object (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`), chat's `logprobs.content[]` with `bytes`, and vLLM's `prompt_logprobs`. A fan-out request
(`adapter_sets`, server/fanout.py) is such a group too: one sub-request per adapter set, each choice
labelled with its set (`adapter_set`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse

from ..engine.sampling import Completion
from ..engine.scoring import TokenLogprob
from . import generation
from .errors import APIError, from_exception
from .generation import Job
from .schemas import ChatRequest, CompletionRequest
from .state import ServerState, Ticket
from .timings import SYSTEM_FINGERPRINT
from .tool_formats import parse_calls

#: A fan-out: the sub-request of each adapter set, and the set's label.
Fan = tuple[Sequence[CompletionRequest | ChatRequest], Sequence[str]]
YIELD_EVERY = 64  # entries rendered between two hand-overs of the GIL (each has up to 21 alternatives)


def handles(body: CompletionRequest | ChatRequest) -> bool:
    """Does this request need scoring or several sequences (else the plain generation path serves it)?"""
    if isinstance(body, CompletionRequest):
        return bool(body.echo or body.logprobs is not None or body.prompt_logprobs is not None
                    or len(body.prompt_list()) != 1 or body.n > 1 or (body.best_of or 1) > 1)
    return bool(body.logprobs) or body.n > 1


class Pieces:
    """Token text for responses, cached per request; llama.cpp is called from worker threads only."""

    def __init__(self, state: ServerState) -> None:
        self.handle = state.engine.model.handle
        self._cache: dict[tuple[int, bool], bytes] = {}

    def raw(self, token: int, special: bool = True) -> bytes:
        key = (token, special)
        b = self._cache.get(key)
        if b is None:
            b = self._cache[key] = self.handle.token_bytes(token, special=special)
        return b

    def text(self, token: int) -> str:
        """The token as OpenAI shows it: its text, or `bytes:\\xNN…` when it is not whole UTF-8."""
        b = self.raw(token)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

    def width(self, token: int) -> int:
        """Characters the token adds to the text (special tokens add none), for text_offset."""
        return len(self.raw(token, special=False).decode("utf-8", errors="replace"))


@dataclass
class Group:
    """The engine requests of one HTTP request, in choice order (prompt-major)."""

    state: ServerState
    body: CompletionRequest | ChatRequest
    chat: bool
    model: str
    ticket: Ticket
    started: float
    per_prompt: int  # sequences run per prompt (best_of, else n)
    prompts: list[list[int]] = field(default_factory=list)
    prompt_texts: list[str] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    extra_tickets: list[Ticket] = field(default_factory=list)  # its sequences' weight in the queue bound
    sets: list[str] | None = None  # fan-out: the adapter set of each sub-request, named in its choices
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    closed: bool = False

    @property
    def prefix(self) -> str:
        return "chatcmpl-" if self.chat else "cmpl-"

    @property
    def obj(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def finish(self, status: int, completions: list[Completion] | None = None, *, record: bool = True) -> None:
        """Release every job and the ticket, and record the request once (unless the caller records the
        failure); idempotent."""
        if self.closed:
            return
        self.closed = True
        for j, c in zip(self.jobs, completions or [None] * len(self.jobs)):
            j.finish(status, c, record=False)
        self.ticket.release()
        for t in self.extra_tickets:
            t.release()
        if not record:
            return
        first = [j.request.first_token_at for j in self.jobs if j.request is not None and j.request.first_token_at]
        self.state.record(self.model, status, started=self.started, first_token_at=min(first) if first else None,
                          prompt_tokens=sum(len(p) for p in self.prompts),
                          generated_tokens=None if completions is None else sum(len(c.tokens) for c in completions))


def _wanted(body: CompletionRequest | ChatRequest) -> tuple[int | None, int | None]:
    """(prompt top-N, generated top-N) the engine computes; None where not needed."""
    if isinstance(body, ChatRequest):
        return None, (body.top_logprobs or 0) if body.logprobs else None
    prompt = body.logprobs if body.echo and body.logprobs is not None else None
    if body.prompt_logprobs is not None:
        prompt = max(prompt or 0, body.prompt_logprobs)
    gen = body.logprobs
    if gen is None and (body.best_of or 1) > body.n:
        gen = 0  # ranking the sequences needs their cumulative logprob
    return prompt, gen


async def _start(state: ServerState, body: CompletionRequest | ChatRequest, chat: bool,
                 fan: Fan | None = None) -> Group:
    bad = body.unsupported()
    if bad:
        raise APIError(400, "; ".join(f"{p}: {why}" for p, why in bad), code="unsupported_parameter",
                       param=bad[0][0])
    ticket = state.admit()
    per = body.n if chat else max(body.n, body.best_of or 1)
    group = Group(state, body, chat, body.model or state.base_name, ticket, time.monotonic(), per,
                  sets=None if fan is None else list(fan[1]))
    try:
        if fan is not None:
            subs: list[Any] = list(fan[0])
        else:
            subs = [body] if chat else [body.model_copy(update={"prompt": p}) for p in body.prompt_list()]
        plan = None
        _weigh(group, len(subs) * per)
        for sub in subs:
            if isinstance(sub, ChatRequest):  # the tool plan too: each sequence reads its own calls
                toks, plan = await asyncio.to_thread(generation.chat_prompt, state, sub)
                group.prompts.append(toks)
            else:
                group.prompts.append(await generation.prompt_tokens(state, sub))
            p = getattr(sub, "prompt", "")
            group.prompt_texts.append(p if isinstance(p, str) else await asyncio.to_thread(
                state.engine.detokenize, group.prompts[-1]))
        k_prompt, k_gen = _wanted(body)
        _check_scored(group, k_prompt, k_gen)
        await _submit(group, subs, plan, k_prompt, k_gen)
    except BaseException:
        group.finish(499, record=False)  # respond() records the failure
        raise
    return group


async def _submit(group: Group, subs: Sequence[CompletionRequest | ChatRequest], plan: Any,
                  k_prompt: int | None, k_gen: int | None) -> None:
    """Hand every sequence to the engine, into `group.jobs` in choice order (prompt-major). The first
    sequence of every prompt (or adapter set) is submitted at once, concurrently, so that the engine admits
    them between the same two decode steps and decodes them together from the first step (one at a time,
    each submit would wait for a step of the ones before it); the other sequences of a prompt then share
    its KV (the engine decodes the prompt once)."""
    body, per = group.body, group.per_prompt
    grid: list[list[Job | None]] = [[None] * per for _ in subs]

    def extra(j: int) -> dict[str, Any]:
        # party: the engine gives the request's sequences a fair share together (engine/fairness.py)
        out: dict[str, Any] = {"logprobs": k_gen, "prompt_logprobs": k_prompt, "party": group}
        if body.seed is not None:
            seed = (body.seed + j) & 0xFFFFFFFF  # each sequence its own, reproducible, seed
            out["seed"] = seed - (seed == 0xFFFFFFFF)  # llama.cpp reads that one as "random"
        return out

    async def one(i: int, j: int) -> None:
        x = extra(j)
        if j:
            x["share"] = grid[i][0].request  # type: ignore[union-attr]  # submitted in the first round
        grid[i][j] = await generation.submit_job(group.state, subs[i], group.chat, None, tokens=group.prompts[i],
                                                 extra=x, plan=plan)
    try:
        for j in range(per):
            results = await asyncio.gather(*(one(i, j) for i in range(len(subs))), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise failed[0]
    finally:  # every job submitted is the group's, to be finished with it, also when another failed
        group.jobs.extend(job for row in grid for job in row if job is not None)


def _weigh(group: Group, sequences: int) -> None:
    """Take a queue ticket per sequence beyond the first (a 429 when the queue cannot hold them), up to
    half the queue bound: one request of 128 sequences is not one request's work."""
    state = group.state
    weight = min(sequences, max(1, state.settings.queue_limit(state.engine.n_parallel) // 2))
    for _ in range(weight - 1):
        group.extra_tickets.append(state.admit())


def _check_scored(group: Group, k_prompt: int | None, k_gen: int | None) -> None:
    """Refuse (400) a request whose scored tokens, each a pass over the vocabulary on the engine thread
    and an entry of the response, would pass `max_scored_tokens`: prompt tokens when prompt logprobs
    are wanted, up to max_tokens generated tokens when their logprobs are, per sequence."""
    n_ctx, per = group.state.engine.n_ctx, group.per_prompt
    scored = 0
    for toks in group.prompts:
        if k_prompt is not None:
            scored += per * len(toks)
        if k_gen is not None:
            room = max(0, n_ctx - len(toks))
            asked = group.body.max_tokens
            scored += per * (room if asked is None else min(asked, room))
    limit = group.state.settings.max_scored_tokens
    if scored > limit:
        param = "prompt_logprobs" if k_prompt is not None else "logprobs"
        raise APIError(400, f"this request would score {scored} tokens (prompt and generated tokens with "
                            f"logprobs, over all its prompts and sequences): at most {limit} "
                            "(max_scored_tokens); split it, or send a smaller max_tokens, n or best_of",
                       code="scoring_budget_exceeded", param=param)


async def respond(state: ServerState, http: HTTPRequest, body: CompletionRequest | ChatRequest,
                  chat: bool, fan: Fan | None = None) -> Response:
    """Serve one scoring or several-sequence request, as JSON or as SSE. `fan`: the sub-requests of a
    fan-out over adapter sets and each one's label (server/fanout.py), run in place of the body's prompts."""
    with generation.counts_failure(state, body.model):
        group = await _start(state, body, chat, fan)
    if body.stream:
        return _GroupStream(group)
    result = await _collect(group, http)
    return Response(result, media_type="application/json") if result is not None else Response(status_code=499)


async def _collect(group: Group, http: HTTPRequest) -> bytes | None:
    """The whole response body, built and rendered off the event loop (it can hold max_scored_tokens
    entries with 20 alternatives each: megabytes of JSON)."""
    completions = await generation.finished(group, asyncio.gather(*(generation.drain(j) for j in group.jobs)), http)
    if completions is None:
        return None
    return await asyncio.to_thread(_render, group, completions)


def _render(group: Group, completions: list[Completion]) -> bytes:
    body = _full_body(group, completions, Pieces(group.state))
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _choices(group: Group, completions: list[Completion]) -> list[tuple[int, int, Completion]]:
    """(prompt index, job index, completion) of the returned choices: per prompt, all n sequences, or the
    n of best_of with the highest cumulative logprob."""
    n, per = group.body.n, group.per_prompt
    out = []
    for i in range(len(group.prompts)):
        idx = list(range(i * per, (i + 1) * per))
        if per > n:
            idx = sorted(idx, key=lambda k: -sum(e.logprob or 0.0 for e in completions[k].logprobs or ()))[:n]
        out.extend((i, k, completions[k]) for k in idx)
    return out


def _full_body(group: Group, completions: list[Completion], pieces: Pieces) -> dict[str, Any]:
    body = group.body
    choices = []
    for index, (i, k, c) in enumerate(_choices(group, completions)):
        reason = "length" if c.finish_reason == "length" else "stop"
        if group.chat:
            message, calls = tool_message(group.jobs[k], c.text)
            if calls and reason == "stop":
                reason = "tool_calls"
            choice: dict[str, Any] = {"index": index, "message": message,
                                      "logprobs": _chat_logprobs(c.logprobs, pieces, body.top_logprobs or 0)
                                      if body.logprobs else None, "finish_reason": reason}
        else:
            assert isinstance(body, CompletionRequest)
            echo = group.prompt_texts[i] if body.echo else ""
            choice = {"index": index, "text": echo + c.text, "finish_reason": reason,
                      "logprobs": _legacy_logprobs(c, pieces, body, len(group.prompt_texts[i]))}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(c.prompt_logprobs or [], pieces,
                                                                  body.prompt_logprobs)
        if body.return_token_ids:
            choice["token_ids"] = list(c.tokens)
            choice["prompt_token_ids"] = list(group.prompts[i])
        if group.sets is not None:
            choice["adapter_set"] = group.sets[i]
            choice["adapter_versions"] = c.versions
        choices.append(choice)
    return {"id": group.prefix + group.id, "object": group.obj, "created": group.created, "model": group.model,
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices, "usage": _usage(group, completions),
            "adapter_versions": _versions(completions)}


def _versions(completions: Sequence[Completion]) -> dict[str, int]:
    """The adapter versions the sequences ran on, all together (as the x-loramux-adapter-versions header)."""
    return {name: v for c in completions for name, v in c.versions.items()}


def _usage(group: Group, completions: Sequence[Completion]) -> dict[str, Any]:
    """The group's usage: each prompt's tokens once (as OpenAI counts `n`), every sequence's output, and the
    prompt tokens reused from the KV cache, counted on the first sequence of each prompt (the others share its
    prompt, which usage does not count again)."""
    n_prompt = sum(len(p) for p in group.prompts)
    n_gen = sum(len(c.tokens) for c in completions)
    firsts = group.jobs[::max(1, group.per_prompt)]
    cached = sum(int(getattr(j.request, "cached", 0) or 0) for j in firsts if j.request is not None)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": cached}}


def tool_message(job: Job, text: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A chat choice's message: its content, or the tool calls read from it when the request has tools."""
    if job.tools is None:
        return {"role": "assistant", "content": text}, []
    content, calls = parse_calls(text, [t.function.name for t in job.tools.tools])
    if not calls:
        return {"role": "assistant", "content": text}, []
    return {"role": "assistant", "content": content or None, "tool_calls": calls}, calls


def _legacy_logprobs(c: Completion, pieces: Pieces, body: CompletionRequest, prompt_chars: int
                     ) -> dict[str, Any] | None:
    if body.logprobs is None:
        return None
    entries = list(c.prompt_logprobs or []) if body.echo else []
    entries += list(c.logprobs or [])
    return legacy_entries(entries, pieces, body.logprobs, 0 if body.echo else prompt_chars)


def legacy_entries(entries: list[TokenLogprob], pieces: Pieces, top_n: int, offset: int) -> dict[str, Any]:
    """OpenAI's legacy `logprobs` object; each top_logprobs dict holds the top N and the chosen token."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, e in enumerate(entries):
        if i and not i % YIELD_EVERY:
            time.sleep(0)  # hand the GIL to the engine thread now and then (a worker thread renders this)
        out["tokens"].append(pieces.text(e.token))
        out["token_logprobs"].append(e.logprob)
        out["text_offset"].append(offset)
        offset += pieces.width(e.token)
        if e.logprob is None:
            out["top_logprobs"].append(None)
            continue
        top: dict[str, float] = {}
        for t, lp in e.top[:top_n]:
            top.setdefault(pieces.text(t), lp)
        top.setdefault(pieces.text(e.token), e.logprob)
        out["top_logprobs"].append(top)
    return out


def _chat_entry(token: int, lp: float, pieces: Pieces) -> dict[str, Any]:
    return {"token": pieces.text(token), "logprob": lp, "bytes": list(pieces.raw(token))}


def _chat_logprobs(entries: list[TokenLogprob] | None, pieces: Pieces, top_n: int) -> dict[str, Any]:
    """Chat's `logprobs`: one `content[]` entry per generated token (not the end-of-turn token)."""
    content = []
    for e in entries or []:
        if pieces.handle.is_eog(e.token):
            continue
        d = _chat_entry(e.token, e.logprob or 0.0, pieces)
        d["top_logprobs"] = [_chat_entry(t, lp, pieces) for t, lp in e.top[:top_n]]
        content.append(d)
    return {"content": content, "refusal": None}


def _vllm_prompt_logprobs(entries: list[TokenLogprob], pieces: Pieces, top_n: int) -> list[Any]:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank, decoded_token}}
    with the prompt's own token and the top N."""
    out: list[Any] = []
    for i, e in enumerate(entries):
        if i and not i % YIELD_EVERY:
            time.sleep(0)
        if e.logprob is None:
            out.append(None)
            continue
        d = {str(e.token): {"logprob": e.logprob, "rank": e.rank, "decoded_token": pieces.text(e.token)}}
        for r, (t, lp) in enumerate(e.top[:top_n], 1):
            d.setdefault(str(t), {"logprob": lp, "rank": r, "decoded_token": pieces.text(t)})
        out.append(d)
    return out


# ----------------------------------------------------------------------------------------------
# Streaming
# ----------------------------------------------------------------------------------------------

def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class _Choice:
    """What one streamed choice has sent so far."""

    pending: list[TokenLogprob] = field(default_factory=list)  # logprobs not yet sent with a text chunk
    offset: int = 0  # text_offset of the next token


def _chunk(group: Group, index: int, text: str | None, entries: list[TokenLogprob] | None, pieces: Pieces,
           st: _Choice, reason: str | None = None, role: bool = False,
           tool_calls: list[dict[str, Any]] | None = None, versions: dict[str, int] | None = None) -> str:
    body = group.body
    if group.chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls is not None:
            delta["tool_calls"] = tool_calls
        lp = _chat_logprobs(entries, pieces, body.top_logprobs or 0) if body.logprobs and entries else None
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        assert isinstance(body, CompletionRequest)
        lp = None
        if body.logprobs is not None and entries:
            lp = legacy_entries(entries, pieces, body.logprobs, st.offset)
            st.offset += sum(pieces.width(e.token) for e in entries)
        choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": reason}
        obj = "text_completion"
    if group.sets is not None:
        choice["adapter_set"] = group.sets[index // group.per_prompt]
    out = {"id": group.prefix + group.id, "object": obj, "created": group.created, "model": group.model,
           "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [choice]}
    if versions is not None:  # a choice's last chunk: the adapter versions it ran on
        out["adapter_versions"] = versions
    return _sse(out)


async def _merged(group: Group) -> AsyncIterator[tuple[int, str, Any]]:
    """Every job's events, tagged with the job's index, as they come."""
    q: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()

    async def pump(k: int, job: Job) -> None:
        while True:
            kind, value = await job.queue.get()
            q.put_nowait((k, kind, value))
            if kind in ("done", "error"):
                return
    tasks = [asyncio.ensure_future(pump(k, j)) for k, j in enumerate(group.jobs)]
    try:
        left = len(tasks)
        while left:
            item = await q.get()
            left -= item[1] in ("done", "error")
            yield item
    finally:
        for t in tasks:
            t.cancel()


async def _events(group: Group, pieces: Pieces, states: list[_Choice]
                  ) -> AsyncIterator[str | tuple[int, Completion]]:
    """The SSE chunks of the sequences as they generate; each finished Completion once, in between."""
    body = group.body
    echo = isinstance(body, CompletionRequest) and body.echo
    for k, st in enumerate(states):
        if group.chat:
            yield _chunk(group, k, "", None, pieces, st, role=True)
        else:
            st.offset = 0 if echo else len(group.prompt_texts[k // group.per_prompt])
    async for k, kind, value in _merged(group):
        st = states[k]
        if kind == "logprobs":
            st.pending.append(value)
        elif kind == "prompt_logprobs" and echo:
            yield await asyncio.to_thread(_chunk, group, k, group.prompt_texts[k // group.per_prompt], value,
                                          pieces, st)
        elif kind == "text":
            tools = group.jobs[k].tool_stream
            if tools is not None:
                value = tools.feed(value)  # what may be a tool call is held back (its logprobs wait with it)
                if not value:
                    continue
            entries, st.pending = st.pending, []
            if entries:  # token texts from llama.cpp: off the event loop
                yield await asyncio.to_thread(_chunk, group, k, value, entries, pieces, st)
            else:  # text alone (fan-out without logprobs): no thread hop per chunk, as a single stream
                yield _chunk(group, k, value, entries, pieces, st)
            await asyncio.sleep(0)  # see protocols/openai.stream: lets a disconnect be seen between chunks
        elif kind == "error":
            raise value
        elif kind == "done":
            async for chunk in _tail(group, k, value, pieces, st):
                yield chunk
            yield (k, value)


async def _tail(group: Group, k: int, c: Completion, pieces: Pieces, st: _Choice) -> AsyncIterator[str]:
    """The end of choice k: text held back, its tool calls (OpenAI's shape: id and name, then the arguments),
    the finish reason."""
    tools, calls = group.jobs[k].tool_stream, []
    entries, st.pending = st.pending, []
    if tools is not None:
        tail, calls = tools.finish()
        if tail:
            yield await asyncio.to_thread(_chunk, group, k, tail, entries, pieces, st)
            entries = []
        for i, call in enumerate(calls):
            head = {"index": i, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}}
            yield _chunk(group, k, None, None, pieces, st, tool_calls=[head])
            yield _chunk(group, k, None, None, pieces, st,
                         tool_calls=[{"index": i, "function": {"arguments": call["function"]["arguments"]}}])
    reason = "length" if c.finish_reason == "length" else "tool_calls" if calls else "stop"
    yield await asyncio.to_thread(_chunk, group, k, None if group.chat else "", entries, pieces, st, reason,
                                  versions=c.versions)


async def _stream(group: Group) -> AsyncIterator[str]:
    pieces = Pieces(group.state)
    states = [_Choice() for _ in group.jobs]
    done: dict[int, Completion] = {}
    try:
        async for item in _events(group, pieces, states):
            if isinstance(item, str):
                yield item
            else:
                done[item[0]] = item[1]
    except Exception as e:  # noqa: BLE001 - one failed sequence fails the request; the server goes on
        err = from_exception(e)
        group.finish(err.status)
        yield _sse(err.body())
        yield "data: [DONE]\n\n"
        return
    finally:
        if len(done) < len(group.jobs):
            group.finish(499)
    completions = [done[k] for k in range(len(group.jobs))]
    group.finish(200, completions)
    opts = group.body.stream_options
    if opts is not None and opts.include_usage:
        yield _sse({"id": group.prefix + group.id, "object": "chat.completion.chunk" if group.chat
                    else "text_completion", "created": group.created, "model": group.model,
                    "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [], "usage": _usage(group, completions)})
    yield "data: [DONE]\n\n"


class _GroupStream(StreamingResponse):
    """SSE response that always settles its group, even when the client leaves before the body starts."""

    def __init__(self, group: Group) -> None:
        super().__init__(_stream(group), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.group = group

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.finish(499)


__all__ = ["Fan", "Group", "Pieces", "handles", "legacy_entries", "respond"]
