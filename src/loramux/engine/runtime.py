"""The Engine: one base model, many adapters, one engine thread that owns every llama_context.

All decodes, adapter-set changes and in-place factor writes run on the engine thread, one after
another, so no write can land while a decode is in flight. Callers on other threads hand it work
through a command queue (`Engine.call`) or submit generation requests that it batches.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .. import _native as N
from .. import config
from ..errors import ContextLengthError, EngineClosedError, ParameterError
from ..sources import resolve
from . import rpc
from .adapters import LoRAAdapter
from .bank import SlotBank
from .chat import ChatTemplate, special_texts, tokenize_chat, user_strings
from .commands import CommandQueue, pass_failure
from .control import ControlSetting, ControlSource
from .evaluation import Evaluator
from .grammar import ActiveGrammar, Grammar
from .kv_guard import KvGuard
from .loads import Loads, build_adapter
from .model import Context, ContextOptions, Model, default_threads
from .options import EngineOptions, check_deterministic
from .phases import alora_phases
from .registry import LoraArg, Registry, check_scale, requested_names
from .request import Request, RequestInput
from .residency import LoadedTier
from .sampling import Completion, SamplingParams
from .scheduler import Scheduler
from .scoring import Scoring, TokenLogprob, score_many
from .specs import ControlArg, Inherit, LoraSpec, adapter_name
from .stats import EngineStats
from .streams import TextStream
from .versions import PushGate, check_factors, check_versions, must_check

T = TypeVar("T")
log = logging.getLogger("loramux")


class Engine:
    """A base GGUF loaded once, with adapters that come and go while it serves. Thread-safe."""

    def __init__(self, model: Model, options: EngineOptions | None = None, **keywords: Any) -> None:
        """An engine around an open `Model`; `options` (or the same names as keywords) fix its contexts.

        Most callers want `Engine.load`, which also opens the model and loads adapters.
        """
        opts = EngineOptions.from_keywords(options, **keywords)
        self.options = opts
        self.model = model
        self.n_parallel = opts.n_parallel
        self.registry = Registry()
        # The slot bank's per-token masks need the batch's token order in every node: a unified KV
        # cache and one ubatch per decode (see bank.py).
        self.bank = (SlotBank(model, opts.slots, opts.slot_rank, dtype=opts.bank_dtype,
                              node_access=opts.bank_node_access, background_writes=opts.slot_writes == "background",
                              cache_bytes=opts.adapter_cache_bytes, run=self.call) if opts.slots else None)
        self.deterministic = opts.deterministic
        if opts.deterministic:
            check_deterministic(model, opts.flash_attn, opts.kv_unified)
        # Deterministic serving keeps one KV stream per sequence; the bank then plans its masks from
        # llama.cpp's per-sequence ubatch split (bank_masks.plan_ubatches).
        unified = opts.kv_unified or (self.bank is not None and not opts.deterministic)
        n_ctx, n_batch, n_parallel = opts.n_ctx, opts.n_batch, opts.n_parallel
        self._ctx_opts = ContextOptions(n_ctx=n_ctx * n_parallel if unified or n_parallel > 1 else n_ctx,
                                        n_batch=n_batch, n_ubatch=n_batch if self.bank else min(n_batch, 512),
                                        n_seq_max=n_parallel, n_threads=opts.n_threads, kv_unified=unified,
                                        flash_attn=opts.flash_attn, kv_type=opts.kv_type)
        self._eval_opts = ContextOptions(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_batch, 512),
                                         n_seq_max=1, n_threads=opts.n_threads, flash_attn=opts.flash_attn,
                                         kv_type=opts.kv_type)
        self.n_ctx = n_ctx
        self.ctx = Context(model, self._ctx_opts, callback=self.bank.callback if self.bank else None)
        self._retired: list[LoRAAdapter] = []  # out of the registry (or never in it), freed once unused
        self._loads = Loads()  # adapter loads running on other threads; close() waits for them
        guard = KvGuard(model, self.bank.callback if self.bank else None, opts.kv_type)
        self.scheduler = Scheduler(model, self.ctx, n_parallel, self.bank, opts.deterministic, guard,
                                   score_rows=opts.score_rows, score_rows_shared=opts.score_rows_shared,
                                   request_slots=opts.request_slots, request_step_seqs=opts.request_step_seqs,
                                   request_step_every=opts.request_step_every,
                                   prefill_step_tokens=opts.prefill_step_tokens,
                                   prefill_chunk_tokens=opts.prefill_chunk_tokens)
        # the loaded tier: which adapters llama.cpp holds, at most max_loaded (residency.py)
        self.loaded = LoadedTier(model, self.registry, opts.max_loaded, users=self.scheduler.users,
                                 build=lambda cold: self._build(cold.path, cold.name, cold.source),
                                 register=self._publish, unload=self._retire, discard=self._retired.append,
                                 decoding=lambda: any(self.scheduler.slots))
        self.evaluator = Evaluator(model, self._eval_opts, self.registry, self.loaded.use_now,
                                   self.scheduler.guard)  # logits and losses apart from serving
        self.control: ControlSetting | None = None  # default control-vector setting (see control.py)
        self.pushes = PushGate()  # factor pushes waiting for their adapters' earlier requests (versions.py)
        self.commands = CommandQueue()  # how other threads reach the engine thread (commands.py)
        self._thread = threading.Thread(target=self._loop, name="loramux-engine", daemon=True)
        self.commands.thread = self._thread
        self._thread.start()

    # ------------------------------------------------------------------ construction
    @classmethod
    def load(cls, model: str | os.PathLike[str] | None = None, *, loras: Sequence[LoraSpec | str] = (),
             options: EngineOptions | None = None, **keywords: Any) -> Engine:
        """Load a base model (default: the embedded Gemma 3 270M) and apply `loras` in list order.

        Keywords are `EngineOptions` fields (n_ctx, n_parallel, n_threads, slots, deterministic, ...;
        they override `options`) or adapter-source options for `loras` (token, cache_dir, ...; see
        `loramux.sources.SourceOptions`). With `slots=K`, a slot bank of K adapters of rank ≤
        `slot_rank` lets requests on different adapters share every decode step (see bank.py). With
        `deterministic=True` a request's tokens do not depend on what else is batched with it
        (batch-invariant kernels; see README). With `rpc=["host:port", ...]` the base model's layers
        live on llama.cpp RPC workers (engine/rpc.py; docs/distributed.md). If any adapter fails, the whole load fails with that
        adapter's error and nothing stays loaded.
        """
        engine_names = {f.name for f in fields(EngineOptions)}
        opts = EngineOptions.from_keywords(options, **{k: v for k, v in keywords.items() if k in engine_names})
        source_options = {k: v for k, v in keywords.items() if k not in engine_names}
        path = config.default_model_path() if model is None else Path(model).expanduser()
        if opts.deterministic:
            if opts.flash_attn or opts.kv_unified:
                check_deterministic(None, opts.flash_attn, opts.kv_unified)
            N.enable_batch_invariant_kernels()
        devices = rpc.connect(opts.rpc) if opts.rpc else []  # typed errors here, before llama.cpp connects
        m = Model(path, n_gpu_layers=(opts.n_gpu_layers or -1) if opts.rpc else opts.n_gpu_layers,
                  use_mmap=opts.use_mmap, use_mlock=opts.use_mlock, repack=not opts.deterministic, devices=devices)
        try:
            eng = cls(m, opts)
        except BaseException:
            m.close()
            raise
        if opts.rpc:
            rpc.on_lost(eng.fail_lost)
        try:
            for spec in loras:
                spec = LoraSpec.parse(spec) if isinstance(spec, str) else spec
                eng.set_lora(spec.source, scale=spec.scale, name=spec.name, **source_options)
        except BaseException:
            eng.close()
            raise
        return eng

    @classmethod
    @contextlib.contextmanager
    def use(cls, engine_or_model: Engine | str | os.PathLike[str] | None = None,
            options: EngineOptions | None = None, **keywords: Any) -> Iterator[Engine]:
        """The Engine given, as is; or one loaded from a model path (None: the embedded model) for the
        duration of the block and closed afterwards. For tools (probe, drift, training) that accept either."""
        if isinstance(engine_or_model, Engine):
            yield engine_or_model
            return
        eng = cls.load(engine_or_model, options=options, **keywords)
        try:
            yield eng
        finally:
            eng.close()

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        cmds = self.commands
        while True:
            with cmds.busy:
                cmds.run_pending()
                self.loaded.settle()
                if self.pushes.pending:
                    self.pushes.service(self.scheduler)
            if cmds.closed:
                break
            if self.scheduler.has_work():
                with cmds.busy:
                    try:
                        self.scheduler.step()
                    except Exception as e:  # noqa: BLE001 - keep serving; fail only the requests involved
                        log.exception("scheduler step failed")
                        self.scheduler.fail_all(e)
                    self._free_retired()
                    self.loaded.settle(stepped=True)  # evict past max_loaded, let waiting submits in
            else:
                cmds.idle_wait(0.5)
        # commands queued after close() began are answered, never left hanging
        cmds.drain(EngineClosedError("the engine was closed"))

    @property
    def lost(self) -> Exception | None:
        """The typed RpcError once the RPC workers holding the model were lost, else None."""
        return self.commands.lost

    def fail_lost(self, message: str) -> None:
        """The RPC workers' connection broke (called by engine/rpc.py on a llama.cpp thread): fail every
        request and command with a typed RpcError and refuse new ones. The engine thread is parked in
        llama.cpp for good, so nothing can be freed: the process must be replaced (the server does it)."""
        if self.commands.closed and not self._thread.is_alive():
            return  # closed before the loss: nothing of it is left to fail
        lost = self.commands.lost = rpc.lost_error(message)
        self.commands.closed = True
        self.scheduler.fail_all(lost)
        self.commands.drain(lost)
        self.loaded.close(lost)

    @property
    def closed(self) -> bool:
        """True once close() began or the engine thread is gone."""
        return self.commands.closed or not self._thread.is_alive()

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between decodes and return its result (re-raising its error)."""
        return self.commands.call(fn)

    def call_between_decodes(self, fn: Callable[[], T]) -> T:
        """Run `fn` between decodes: the one hop of in-place factor writes and reads (factor_writer.py);
        at once on the caller's thread when the engine is idle (see engine/commands.py)."""
        return self.commands.call_between_decodes(fn)

    def call_async(self, fn: Callable[[], T]) -> Future[T]:
        """Queue `fn` for the engine thread and return its Future at once; commands run in queue order."""
        return self.commands.call_async(fn)

    def _free_retired(self) -> None:
        for a in list(self._retired):
            if not self.scheduler.uses(a):
                for c in (self.ctx, self.evaluator.ctx):
                    if c is not None and c.handle.uses_adapter(a.handle):
                        c.handle.set_adapters([], [])
                if self.bank is not None:
                    self.bank.forget(a)
                if a.close(wait=False):  # an adapter load on another thread holds llama.cpp's set: next step
                    self._retired.remove(a)

    # ------------------------------------------------------------------ adapters
    def load_lora(self, source: str | os.PathLike[str], name: str | None = None, *,
                  scale: float | None = None, pin: bool = False, **source_options: Any) -> LoRAAdapter:
        """Load (or replace) an adapter by source; activate it with `scale` unless scale is None.

        Validation, download and tensor discovery happen before anything changes: on any error the
        previous adapter of that name (and the active set) keep serving. Under `max_loaded` the least
        recently used adapters nothing uses are evicted (reloaded when a request names them again);
        `pin=True` keeps this one loaded for good (AdapterCapacityError when pinned and active adapters
        fill the bound).
        """
        src = os.fspath(source)
        name = name or adapter_name(src)
        if scale is not None:
            scale = check_scale(name, scale)
        path = _resolve(src, **source_options)
        if self.deterministic and "LLAMAFILE = 1" in N.system_info():
            log.warning("deterministic mode with adapters on a llama.cpp built with llamafile: adapter requests "
                        "may still depend on their batch; reinstall with CMAKE_ARGS=\"-DGGML_LLAMAFILE=OFF\" "
                        "pip install --force-reinstall --no-cache-dir llama-cpp-python==%s", N.PINNED_VERSION)

        with self._loads.running():
            adapter = self._build(path, name, src)  # all of the load, here: the engine thread only publishes it

            def commit() -> LoRAAdapter:
                self.loaded.check_room(name)
                self._publish(adapter, scale)
                self.loaded.loaded(adapter, pin)
                return adapter
            try:
                return self.call(commit)
            except BaseException:
                if self.registry.adapters.get(name) is not adapter:
                    adapter.close()  # refused (or the engine closed): never published, nothing uses it
                raise

    def _build(self, path: Path, name: str, source: str) -> LoRAAdapter:
        """Parse, check and load a file into llama.cpp, unpublished, warm from the parse (any thread)."""
        with self._loads.running():
            return build_adapter(self.model, path, name, source, self.call_between_decodes, self.bank,
                                 self.scheduler.guard)

    def _publish(self, adapter: LoRAAdapter, scale: float | None = None) -> None:
        """Publish a built adapter under its name, retiring the one it replaces (engine thread)."""
        if (old := self.registry.commit_add(adapter, scale)) is not None:
            self._retired.append(old)
            self._free_retired()

    def _retire(self, name: str) -> None:
        """Take an adapter out of the registry; it is freed once no request uses it (engine thread)."""
        self._retired.append(self.registry.remove(name))
        self._free_retired()

    def set_lora(self, source: str | os.PathLike[str], scale: float = 1.0, name: str | None = None,
                 **source_options: Any) -> LoRAAdapter:
        """Load an adapter and make it active with `scale`, or only update the scale if it is loaded.

        `source` may be the name of a loaded adapter, a path, an https:// URL or hf://owner/repo/file.gguf.
        """
        src = os.fspath(source)
        key = name or src
        cold = self.loaded.cold.get(key)
        if cold is not None and (name is None or src in (name, cold.source)):  # evicted: loaded again, at once
            def reload() -> LoRAAdapter:
                self.loaded.use_now([key])
                self.registry.set_scale(key, scale)
                return self.registry.get(key)
            return self.call(reload)
        if key in self.registry.adapters and (name is None or src in (name, str(self.registry.adapters[name].source))):
            self.call(lambda: self.registry.set_scale(key, scale))
            return self.registry.adapters[key]
        return self.load_lora(src, name, scale=scale, **source_options)

    def remove_lora(self, name: str) -> None:
        """Deactivate and unload one adapter (requests already running with it finish first)."""
        def rm() -> None:
            known = name in self.loaded.cold
            self.loaded.forget(name)
            if known and name not in self.registry.adapters:
                return  # evicted: only its record goes
            self._retire(name)
        self.call(rm)

    def clear_loras(self) -> None:
        """Deactivate and unload every adapter."""
        def clear() -> None:
            for n in list(self.registry.names()) + list(self.loaded.cold):
                self.loaded.forget(n)
            for n in list(self.registry.names()):
                self._retired.append(self.registry.remove(n))
            self._free_retired()
        self.call(clear)

    def push_factors(self, name: str, factors: Mapping[str, tuple[Any, Any]]) -> int:
        """Replace factors of adapter `name` as a new version, without a request ever seeing two.

        `factors`: base tensor name → (A (r, in), B (out, r)), rank and targets as loaded; targets not
        given keep their factors. Returns the new version once it is servable: at the next step
        boundary if no request runs on the adapter, else once the requests pinned to earlier versions
        finished (requests submitted meanwhile wait and run on this version; see engine/versions.py).
        All-or-nothing: refused factors (FactorError) leave the adapter as it was.
        """
        adapter = self.registry.get(name)
        try:  # idle: at once on this thread, with the engine held (no hop to the engine thread)
            landed = self.call_between_decodes(lambda: self.pushes.push(adapter, factors, self.scheduler,
                                                                        checked=False))
        except Exception as e:
            if not must_check(e):
                raise
            checked = check_factors(adapter, factors)  # it has to wait: refuse bad factors now, not when it lands
            landed = self.call(lambda: self.pushes.push(adapter, checked, self.scheduler, checked=True))
        return landed.result()

    @property
    def n_threads(self) -> int:
        """CPU threads llama.cpp uses for this engine's decodes."""
        return self._eval_opts.n_threads or default_threads()

    @property
    def active(self) -> dict[str, float]:
        """The default adapter set: name → scale, in application order."""
        return dict(self.registry.active)

    @property
    def adapters(self) -> dict[str, LoRAAdapter]:
        """Resident adapters by name."""
        return dict(self.registry.adapters)

    def adapter(self, name: str) -> LoRAAdapter:
        return self.registry.get(name)

    # ------------------------------------------------------------------ control vectors
    def set_control_vector(self, cv: ControlSource, strength: float = 1.0,
                           layers: tuple[int, int] | None = None) -> None:
        """Apply control vector(s) to every request that does not choose its own: a ControlVector or path,
        a list of them or of (vector|path, strength) pairs (summed), or a ControlSetting."""
        setting = ControlSetting.from_any(self.model, cv, strength, layers)
        self.call(lambda: setattr(self, "control", setting))

    def clear_control_vector(self) -> None:
        self.call(lambda: setattr(self, "control", None))

    # ------------------------------------------------------------------ text
    def tokenize(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.model.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.model.detokenize(tokens)

    def chat_template(self) -> ChatTemplate:
        """The model's chat template (its GGUF's, or the family fallback; see chat.py)."""
        return ChatTemplate.for_model(self.model)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **options: Any) -> str:
        """The prompt text for `messages`; `options`: continue_final_message, tools, kwargs (ChatTemplate.render)."""
        bos, eos = special_texts(self.model)
        return self.chat_template().render(messages, bos_token=bos, eos_token=eos,
                                           add_generation_prompt=add_generation_prompt, **options)

    def chat_tokens(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **options: Any) -> list[int]:
        """The prompt tokens for `messages`: template markers as special tokens, message text never."""
        text = self.apply_chat_template(messages, add_generation_prompt, **options)
        user = user_strings([{k: v for k, v in m.items() if k != "role"} for m in messages],
                            options.get("tools"), options.get("kwargs"))
        return tokenize_chat(self.model, text, user)

    # ------------------------------------------------------------------ generation
    def submit(self, prompt: str | Sequence[int], *, loras: LoraArg = None, control: ControlArg = Inherit.ENGINE,
               on_event: Callable[[str, Any], None] | None = None, share: Request | None = None,
               grammar: Grammar | ActiveGrammar | None = None, shown: Collection[int] = (),
               stop_tokens: Collection[int] = (), versions: Mapping[str, int] | None = None,
               party: object | None = None, **sampling: Any) -> Request:
        """Queue a generation; events arrive on `request.events` (and `on_event`, on the engine thread).
        Blocks while its adapters wait for room under `max_loaded` (see `submit_async`).

        `share`: an earlier request on the same prompt and adapters whose prompt KV this one reuses (n > 1).
        `grammar` constrains the output (see `loramux.engine.grammar`: JSON schemas, regexes, choices, GBNF);
        a compiled `ActiveGrammar` is used by this request alone. `shown`: control tokens whose text goes
        into the output (they are left out otherwise), e.g. a tool-call format's tags. `stop_tokens`: tokens
        that end the output as an end-of-generation token does (left out of it; ignore_eos does not apply).
        `versions`: adapter name → the content version this request must run on (AdapterVersionError if
        that is not the version it would get: the adapter moved on). `party`: any object the sequences of one
        request of several share (the server's HTTP request): they get a fair share of the engine together,
        not one each (engine/fairness.py)."""
        return self.submit_async(prompt, loras=loras, control=control, on_event=on_event, share=share,
                                 grammar=grammar, shown=shown, stop_tokens=stop_tokens, versions=versions,
                                 party=party, **sampling).result()

    def submit_async(self, prompt: str | Sequence[int], *, loras: LoraArg = None,
                     control: ControlArg = Inherit.ENGINE, on_event: Callable[[str, Any], None] | None = None,
                     share: Request | None = None, grammar: Grammar | ActiveGrammar | None = None,
                     shown: Collection[int] = (), stop_tokens: Collection[int] = (),
                     versions: Mapping[str, int] | None = None, party: object | None = None,
                     **sampling: Any) -> Future[Request]:
        """`submit`, returning at once a Future of the queued Request. Its adapters become loaded and in use
        in one engine-thread step (residency.LoadedTier): an evicted one is loaded again here, on the
        caller's thread, and only registered there; while no room can be made under `max_loaded` the Future waits
        (cancelling it withdraws the request). On the engine thread itself it never waits:
        AdapterCapacityError instead."""
        params = SamplingParams(**sampling).validate()
        if isinstance(grammar, Grammar):
            grammar = grammar.compile(self.model)
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not tokens:
            raise ParameterError("prompt", "is empty")
        self.ctx.check_fits(len(tokens) + (1 if params.max_tokens else 0))

        def build() -> Request:
            aset = self.registry.adapter_set(loras)
            cv = self.control if control is Inherit.ENGINE else control
            phases, alora = alora_phases(aset, cv, tokens)
            for ph in phases:  # pinned to the versions they will run on (a waiting push lands first)
                ph.adapters = self.pushes.pin(ph.adapters)
            check_versions(versions, {a.name: self.pushes.target(a) for a, _ in aset.items})
            req = Request(RequestInput(tokens, params, phases, alora, on_event=on_event, share=share,
                                       shown=frozenset(shown), stop_tokens=frozenset(stop_tokens), party=party),
                          grammar=grammar, scoring=Scoring.wanted(params.prompt_logprobs, params.logprobs))
            if params.max_tokens == 0 and params.prompt_logprobs is None:
                req.emit("done", Completion("", [], "length", len(tokens), aset.as_dict(), alora,
                                            versions=phases[-1].adapters.versions))
            else:
                self.scheduler.submit(req)
            return req

        names = requested_names(loras, self.registry.active)
        fut: Future[Request] = Future()
        if self.commands.on_thread():
            self.loaded.enter(names, build, fut, wait=False)
            return fut
        self.loaded.prepare(names)  # cold adapters are loaded here, off the engine thread
        cmd = self.call_async(lambda: self.loaded.enter(names, build, fut))
        cmd.add_done_callback(lambda f: pass_failure(f, fut))
        return fut

    def generate(self, prompt: str | Sequence[int], *, loras: LoraArg = None, **sampling: Any) -> Completion:
        """Generate a completion. `loras` (name → scale) overrides the default set for this call only."""
        it = self.stream(prompt, loras=loras, **sampling)
        for _ in it:
            pass
        assert it.completion is not None
        return it.completion

    def stream(self, prompt: str | Sequence[int], *, loras: LoraArg = None, **sampling: Any) -> TextStream:
        """Like generate, but iterate over text chunks as they come; `.completion` is set at the end."""
        return TextStream(self.submit(prompt, loras=loras, **sampling))

    def generate_many(self, prompts: Sequence[str | Sequence[int]], *, loras: Sequence[LoraArg] | None = None,
                      **sampling: Any) -> list[Completion]:
        """Generate for several prompts at once, each with its own adapter set; they share decode steps."""
        sets = list(loras) if loras is not None else [None] * len(prompts)
        if len(sets) != len(prompts):
            raise ParameterError("loras", f"got {len(sets)} adapter sets for {len(prompts)} prompts")
        streams = [self.stream(p, loras=s, **sampling) for p, s in zip(prompts, sets)]
        return [s.consume() for s in streams]

    def chat(self, messages: Sequence[Mapping[str, Any]], *, loras: LoraArg = None, stream: bool = False,
             **sampling: Any) -> Completion | TextStream:
        """One assistant turn, rendered with the model's chat template (sandboxed jinja2)."""
        tokens = self.chat_tokens(messages)
        s = self.stream(tokens, loras=loras, **sampling)
        return s if stream else s.consume()

    # ------------------------------------------------------------------ scoring
    def logprobs(self, prompt: str | Sequence[int], *, loras: LoraArg = None, top_logprobs: int = 0,
                 max_tokens: int = 0, **sampling: Any) -> Completion:
        """Score a prompt through the serving scheduler: `.prompt_logprobs` holds every prompt token's
        log-probability (the first None) with its `top_logprobs` alternatives; with max_tokens > 0 it also
        generates, and `.logprobs` holds the generated tokens' (see docs/scoring.md)."""
        return self.generate(prompt, loras=loras, max_tokens=max_tokens, prompt_logprobs=top_logprobs,
                             logprobs=top_logprobs if max_tokens else None, **sampling)

    def score(self, prompts: Sequence[str | Sequence[int]], *,
              loras: Mapping[str, float] | Sequence[LoraArg] | None = None,
              top_logprobs: int = 0, control: ControlArg = Inherit.ENGINE) -> list[list[TokenLogprob]]:
        """Per-token log-probabilities of several prompts at once, each under its own adapter set
        (`loras`: a mapping for all of them, or a list with one set per prompt). They share decode steps: with a slot
        bank, prompts on different adapters are scored in the same batch. Entry 0 of each is the first
        token, whose logprob is None; entry i is log p(prompt[i] | prompt[:i]), the negated per-token NLL
        of `Engine.loss`."""
        return score_many(self, prompts, loras, top_logprobs, control)

    # ------------------------------------------------------------------ evaluation (evaluation.py)
    def logits(self, prompt: str | Sequence[int], *, loras: LoraArg = None, control: ControlArg = Inherit.ENGINE) -> np.ndarray:
        """Logits of every position (n_tokens × n_vocab), one sequence alone in its own context."""
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_eval_length(len(tokens))
        cv = self.control if control is Inherit.ENGINE else control
        return self.call(lambda: self.evaluator.logits(tokens, loras, cv))

    def loss(self, texts: str | Sequence[str] | Sequence[Sequence[int]], *, loras: LoraArg = None,
             masks: Sequence[Sequence[bool]] | None = None, control: ControlArg = Inherit.ENGINE) -> float:
        """Mean token negative log-likelihood over all texts (float64 sums), one text at a time."""
        total, count = self.loss_sum(texts, loras=loras, masks=masks, control=control)
        return total / max(count, 1)

    def loss_sum(self, texts: str | Sequence[str] | Sequence[Sequence[int]], *, loras: LoraArg = None,
                 masks: Sequence[Sequence[bool]] | None = None, control: ControlArg = Inherit.ENGINE) -> tuple[float, int]:
        """(sum of token NLLs, number of tokens scored)."""
        items = [texts] if isinstance(texts, str) else list(texts)
        toks = [self.tokenize(t) if isinstance(t, str) else list(t) for t in items]
        for t in toks:
            self._check_eval_length(len(t))
        cv = self.control if control is Inherit.ENGINE else control
        return self.call(lambda: self.evaluator.loss_sum(toks, masks, loras, cv))

    def _check_eval_length(self, n: int) -> None:
        if n > self.n_ctx:
            raise ContextLengthError(n, self.n_ctx)

    # ------------------------------------------------------------------ lifecycle
    def stats(self) -> EngineStats:
        """The serving context's counters since start (a copy; read by attribute: see engine/stats.py)."""
        return self.scheduler.stats.frozen()

    def close(self) -> None:
        """Stop the engine thread, fail queued requests, free adapters, contexts and the model. Idempotent."""
        if (self.commands.closed and not self._thread.is_alive()) or self.lost:
            return  # lost: the engine thread and every native handle are stuck in llama.cpp
        self._loads.close()  # a load on another thread ends (published, or freed) before the model goes
        if self._thread.is_alive():
            try:
                self.call(lambda: self.scheduler.fail_all(EngineClosedError("the engine was closed")))
            except EngineClosedError:
                pass
            self.commands.stop()
            self._thread.join()
        self.commands.closed = True
        self.commands.drain(EngineClosedError("the engine was closed"))
        self.loaded.close(EngineClosedError("the engine was closed"))
        self.ctx.close()
        self.evaluator.close()
        for a in list(self.registry.adapters.values()) + self._retired:
            a.close()
        if self.bank is not None:
            self.bank.close()
        self.model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolve(src: str, **options: Any) -> Path:
    p = Path(src).expanduser()
    if p.is_file() and not options:
        return p
    return Path(resolve(src, **options))


# LoraSpec, adapter_name, Inherit, ControlArg (specs.py) and TextStream (streams.py) stay importable from here.
__all__ = ["Engine"]
