"""The engine path of every generation: from a typed request (ChatRequest / CompletionRequest) to a Job on the
engine, whose events the protocols read (protocols/openai.py shapes them for chat/completions,
protocols/layer.py for the others).

The asyncio side never calls llama.cpp: tokenizing and chat templating run in worker threads, the
engine runs the request on its own thread and reports events through `on_event`, which hands them
to an asyncio.Queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from fastapi import Request as HTTPRequest

from ..engine.grammar import ActiveGrammar
from ..engine.sampling import StopMatcher
from ..errors import AdapterError, GrammarError
from . import logit_bias
from .errors import APIError, context_length, from_exception
from .pool import Entry
from .schemas import ChatRequest, CompletionRequest, SamplingFields
from .state import ServerState, Ticket
from .structured import request_grammar, response_schema
from .tools import ToolPlan, ToolStream, history
from .versions import note, split_model

log = logging.getLogger("loramux.server")
T = TypeVar("T")


@dataclass
class Job:
    """One generation the server handed to the engine."""

    state: ServerState
    model: str
    chat: bool
    body: SamplingFields
    prompt: list[int]
    entries: list[Entry]
    started: float
    ticket: Ticket | None = None  # its place in the server's bounded queue, released when it finishes
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    request: Any = None  # scheduler.Request once submitted
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    closed: bool = False
    tools: ToolPlan | None = None  # the request's tools (tool_choice not none)
    tool_stream: ToolStream | None = None

    def finish(self, status: int, completion: Any = None, *, record: bool = True) -> None:
        """Release its queue place and record metrics (unless the caller records the failure); idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.request is not None and completion is None:
            self.request.cancelled.set()  # nobody reads it any more: free its sequence
        if self.ticket is not None:
            self.ticket.release()
        if completion is not None:  # per adapter, also for the sequences of a group (recorded as one request)
            for e in self.entries:
                self.state.metrics.adapter_tokens.labels(self.state.metrics.adapter_label(e.name)).inc(
                    len(completion.tokens))
        if record:
            self.state.record(self.model, status, started=self.started,
                              first_token_at=getattr(self.request, "first_token_at", None),
                              prompt_tokens=len(self.prompt),
                              generated_tokens=None if completion is None else len(completion.tokens))


def sampling_args(body: SamplingFields, n_prompt: int, n_ctx: int, chat: bool) -> dict[str, Any]:
    """Engine sampling settings for a request, with OpenAI's defaults and our bounds."""
    if n_prompt >= n_ctx:
        raise context_length(f"this model's context holds {n_ctx} tokens per request, and the prompt alone has "
                             f"{n_prompt}: shorten the prompt", n_prompt, n_ctx, "messages" if chat else "prompt")
    completion_limit = getattr(body, "max_completion_tokens", None)  # chat's newer name wins, 0 included
    limit_name = "max_tokens" if completion_limit is None else "max_completion_tokens"
    max_tokens = body.max_tokens if completion_limit is None else completion_limit
    if max_tokens is None:
        max_tokens = n_ctx - n_prompt if chat else 16
    if n_prompt + max_tokens > n_ctx:
        raise context_length(f"this model's context holds {n_ctx} tokens per request; the prompt has {n_prompt} "
                             f"and {limit_name} asks for {max_tokens} more: lower {limit_name} or shorten the "
                             "prompt", n_prompt, n_ctx, limit_name)
    temperature = 1.0 if body.temperature is None else body.temperature
    seed = body.seed if body.seed is not None else secrets.randbits(32)
    seed &= 0xFFFFFFFF
    if seed == 0xFFFFFFFF:  # llama.cpp reads this value as "pick a random seed"
        seed -= 1
    args: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed,
                            "stop": body.stops(), "ignore_eos": body.ignore_eos}
    for name in ("top_p", "top_k", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty"):
        v = getattr(body, name)
        if v is not None:
            args[name] = v
    args.update(body.sampler_args())  # llama-server's other samplers and limits (llama_samplers.py)
    return args


def chat_render_args(state: ServerState, body: ChatRequest
                     ) -> tuple[list[dict[str, Any]], bool, dict[str, Any], ToolPlan | None]:
    """What the chat template is given for `body`: its messages (tools and tool history applied), whether to
    add the generation prompt, the template options, and the tool plan (--tool-format applied)."""
    eng = state.engine
    try:
        messages = body.message_dicts()
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_request", param="messages") from None
    template = eng.chat_template()
    plan = ToolPlan.from_request(body, template, state.settings.tool_format)
    messages = plan.messages(messages, template) if plan is not None else history(messages, template)
    add = body.add_generation_prompt
    options: dict[str, Any] = {"continue_final_message": body.continue_final_message,
                               "kwargs": body.chat_template_kwargs,
                               "tools": plan.template_tools() if plan is not None and template.handles_tools else None}
    return messages, not body.continue_final_message if add is None else add, options, plan


def chat_prompt(state: ServerState, body: ChatRequest) -> tuple[list[int], ToolPlan | None]:
    """The chat's prompt tokens (tools, tool history, template options applied) and its tool plan."""
    messages, add, options, plan = chat_render_args(state, body)
    return state.engine.chat_tokens(messages, add, **options), plan


def constraint(state: ServerState, body: SamplingFields, plan: ToolPlan | None) -> ActiveGrammar | None:
    """The request's compiled output grammar (structured.py, tools.py), or None; runs off the event loop."""
    g = request_grammar(body)
    if plan is not None:
        schema, strict = response_schema(body)
        if g is not None and schema is None:
            raise GrammarError("tools", "tools cannot be combined with this output constraint (only with "
                                        "response_format json_schema); send tool_choice none or drop one")
        g = plan.grammar(schema, strict)
    return g.compile(state.engine.model, state.settings.grammar_limits()) if g is not None else None


async def prompt_tokens(state: ServerState, body: CompletionRequest | ChatRequest) -> list[int]:
    """The request's prompt tokens: the rendered chat (template options applied), or the prompt."""
    eng = state.engine
    if isinstance(body, ChatRequest):
        return (await asyncio.to_thread(chat_prompt, state, body))[0]
    try:
        p = body.single_prompt()
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_request", param="prompt") from None
    if isinstance(p, str):
        if not p:
            raise APIError(400, "the prompt is empty", code="invalid_request", param="prompt")
        return await asyncio.to_thread(eng.tokenize, p)
    n_vocab = state.engine.model.n_vocab
    if any(not 0 <= t < n_vocab for t in p):
        raise APIError(400, f"prompt token ids must be in [0, {n_vocab})", code="invalid_request", param="prompt")
    return list(p)


async def start(state: ServerState, body: CompletionRequest | ChatRequest, chat: bool) -> Job:
    """Check the request, take its place in the bounded queue, resolve its adapters, hand it to the engine."""
    bad = body.unsupported()
    if bad:
        raise APIError(400, "; ".join(f"{p}: {why}" for p, why in bad), code="unsupported_parameter",
                       param=bad[0][0])
    ticket = state.admit()  # 429 when the queue is full
    try:
        job = await submit_job(state, body, chat, ticket)
    except BaseException:
        ticket.release()
        raise
    return job


async def submit_job(state: ServerState, body: CompletionRequest | ChatRequest, chat: bool, ticket: Ticket | None,
                     tokens: list[int] | None = None, extra: dict[str, Any] | None = None,
                     plan: ToolPlan | None = None) -> Job:
    """Resolve a request's adapters and hand it to the engine. `tokens`: its prompt, when the caller
    tokenized it already (with its tool `plan`, from chat_prompt); `extra`: more engine settings
    (scoring's logprobs, a sequence's seed)."""
    started = time.monotonic()
    name, pinned = split_model(body.model, state.pool.entries)  # "adapter@N": that version or a 410
    loras = state.pool.requested_set(name, body.lora)
    control = await state.control_setting(body.control_vector)
    if tokens is None and isinstance(body, ChatRequest):
        tokens, plan = await asyncio.to_thread(chat_prompt, state, body)
    elif tokens is None:
        tokens = await prompt_tokens(state, body)
    sampling = {**sampling_args(body, len(tokens), state.engine.n_ctx, chat), **(extra or {})}
    if body.logit_bias:
        sampling["logit_bias"] = await asyncio.to_thread(logit_bias.resolve, state.engine, body.logit_bias)
    grammar = await asyncio.to_thread(constraint, state, body, plan)
    if sampling["stop"]:
        await asyncio.to_thread(StopMatcher.prepare, sampling["stop"])  # not on the engine thread
    model = body.model or state.base_name
    loop = asyncio.get_running_loop()
    entries = [e for e in map(state.pool.entries.get, loras) if e is not None]  # per-adapter metrics
    job = Job(state, model, chat, body, tokens, entries, started, ticket, tools=plan,
              tool_stream=plan.stream() if plan is not None else None)
    if body.user or body.metadata:  # OpenAI's end-user id and tags: what they are for is the log
        log.info("request %s on %s: user=%r metadata=%r", job.id, model, body.user, body.metadata)

    streaming = bool(getattr(body, "stream", False))

    def on_event(kind: str, value: Any) -> None:  # engine thread
        if kind in ("text", "logprobs", "prompt_logprobs") and not streaming:
            return  # nobody reads them: the completion carries the whole text and every logprob
        try:
            loop.call_soon_threadsafe(job.queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            pass

    eng = state.engine
    kwargs: dict[str, Any] = {"loras": loras, "on_event": on_event, "grammar": grammar, "versions": pinned,
                              **sampling}
    if plan is not None:
        kwargs.update(plan.engine_args(lambda t: eng.tokenize(t, add_bos=False, special=True)))
    if control is not None:
        kwargs["control"] = control
    # The engine loads evicted adapters and queues the request in one step (engine/residency.py); only
    # parsing an evicted adapter's file again is blocking work, done off the event loop.
    if eng.loaded.needs_load(loras):
        task = asyncio.ensure_future(asyncio.to_thread(lambda: eng.submit_async(tokens, **kwargs)))
        try:
            fut = await asyncio.shield(task)
        except asyncio.CancelledError:  # the client left: withdraw the submit once it is made
            task.add_done_callback(lambda t: t.cancelled() or t.exception() is not None or withdraw(t.result()))
            raise
        except AdapterError as e:
            raise cold_load_error(e, loras, body.model) from None
    else:
        fut = eng.submit_async(tokens, **kwargs)
    for name in loras:
        state.metrics.adapter_requests.labels(state.metrics.adapter_label(name)).inc()
    try:
        job.request = await asyncio.shield(asyncio.wrap_future(fut))
        note({k: v for ph in job.request.phases for k, v in ph.adapters.versions.items()})
    except asyncio.CancelledError:  # the client left while the submit was queued (or waited for room)
        withdraw(fut)
        job.finish(499, record=False)  # the route records failures of start()
        raise
    except AdapterError as e:  # a cold adapter's file failed its load on the engine thread
        job.finish(400, record=False)
        raise cold_load_error(e, loras, body.model) from None
    except BaseException:
        job.finish(500, record=False)
        raise
    return job


def cold_load_error(e: AdapterError, loras: Mapping[str, float], model: str | None) -> APIError:
    """A request's adapter could not be loaded from its file (a cold or evicted one): a 400 naming the adapter
    and the file (its name only: the directories are the admin plane's), for this request alone."""
    name = e.name if e.name in loras else next(iter(loras), "?")
    path = Path(e.path)
    text = str(e).replace(str(path), path.name)
    return APIError(400, f"adapter {name!r} cannot be loaded from its file {path.name}: {text}",
                    code=e.code, param="model" if name == model else "lora")


def withdraw(fut: Future[Any]) -> None:
    """Nobody wants this submit any more: cancel it while it waits, or its request once it is queued."""
    fut.cancel()
    fut.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or f.result().cancelled.set())


async def wait_disconnect(request: HTTPRequest) -> None:
    """Return once the client has gone."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def drain(job: Job) -> Any:
    """The job's completion once it is done (its error raised): for a caller that wants no chunks."""
    while True:
        kind, value = await job.queue.get()
        if kind == "done":
            return value
        if kind == "error":
            raise value


@contextmanager
def counts_failure(state: ServerState, model: str | None) -> Iterator[None]:
    """Count a request that fails before it is served, as the error's status (499: the client left)."""
    try:
        yield
    except asyncio.CancelledError:
        state.metrics.requests.labels(state.label(model), "499").inc()
        raise
    except Exception as e:
        state.metrics.requests.labels(state.label(model), str(from_exception(e).status)).inc()
        raise


async def until_client_leaves(work: Awaitable[T], http: HTTPRequest) -> asyncio.Future[T] | None:
    """Run `work` until it ends or the client leaves: its finished future (read its result), or None
    when the client left first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(http))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    return task if task.done() and not task.cancelled() else None


class Finishes(Protocol):
    """What a collected request reports its end to: a Job, or a scoring group of jobs."""

    def finish(self, status: int, completion: Any = None, *, record: bool = True) -> None: ...


async def finished(owner: Finishes, work: Awaitable[T], http: HTTPRequest) -> T | None:
    """`work`'s result, with `owner` finished accordingly: 200, the error's status (raised as an
    APIError), or 499 and None when the client left first (then `work` is cancelled)."""
    fut = await until_client_leaves(work, http)
    if fut is None:
        owner.finish(499)
        return None
    try:
        result = fut.result()
    except BaseException as e:
        err = from_exception(e)
        owner.finish(err.status)
        raise err from None
    owner.finish(200, result)
    return result


__all__ = ["Finishes", "Job", "chat_prompt", "constraint", "counts_failure", "drain", "finished", "prompt_tokens",
           "cold_load_error", "sampling_args", "start", "submit_job", "until_client_leaves", "wait_disconnect", "withdraw"]
