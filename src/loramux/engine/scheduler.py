"""Continuous batching on the engine thread: requests, sequence slots, adapter-set groups.

Each decode step serves the running sequences of one adapter-set group (the set is baked into
llama.cpp's graph), up to `n_parallel` sequences and `n_batch` tokens, mixing prefill chunks and
decode tokens. Groups take turns (round-robin, bounded run length) so none starves. KV prefixes
are reused only within the same fingerprint (adapter identity + content version + scale + control
vector), never across adapter sets.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .. import _native as N
from ..errors import LoramuxError, RequestFailed
from . import fairness
from .bank import SlotBank
from .fairness import PREFILL_STEP_TOKENS, over_slots, prompt_cap, slot_limit, step_share
from .kv_guard import KvGuard, may_leave_bad_values, read_bad_values_error
from .linestops import LineStops
from .model import Context, Model
from .phases import BatchEntry, Phase
from .request import Request
from .sampling import Completion, TextAssembler
from .scoring import SCORE_ROWS, SCORE_ROWS_SHARED
from .stats import Counters, GapClock, SchedulerSnapshot, SlotWaits

log = logging.getLogger("loramux")

GROUP_RUN_STEPS = 8  # steps a group keeps the context before another waiting group gets it
SLOT_WAITS_KEPT = 4096  # recent slot waits kept for the p50/p99 figures


class Scheduler:
    """Owns the serving context. Only the engine thread calls into it."""

    def __init__(self, model: Model, ctx: Context, n_parallel: int, bank: SlotBank | None = None,
                 deterministic: bool = False, guard: KvGuard | None = None, score_rows: int = SCORE_ROWS,
                 score_rows_shared: int = SCORE_ROWS_SHARED, request_slots: int = 0, request_step_seqs: int = 1,
                 request_step_every: int = 2, prefill_step_tokens: int = PREFILL_STEP_TOKENS,
                 prefill_chunk_tokens: int = 0) -> None:
        self.model = model
        self.score_rows = score_rows  # prompt-scoring rows per decode while nothing else runs (scoring.py)
        self.score_rows_shared = score_rows_shared  # ... and while another request runs
        # one request of several sequences: slots it holds at once, sequences per step beside others
        self.request_slots = slot_limit(request_slots, n_parallel)
        self.request_step_seqs = request_step_seqs
        self.request_step_every = request_step_every  # ... and it takes one step in this many beside others
        self.prefill_step_tokens = prefill_step_tokens  # a long prompt's tokens per step beside a decode
        self.prefill_chunk_tokens = prefill_chunk_tokens  # ... and otherwise (0: the batch's room)
        self.clock = fairness.StepClock()  # a decode step's and a prompt token's recent cost (what turns are weighed by)
        self.ctx = ctx
        self.bank = bank
        # The guard checks KV writes through the bank's eval callback, one ubatch per decode on a unified
        # cache (kv_guard.py); elsewhere a risky set is refused at submit, or failed before it decodes.
        self.guard = guard
        self.can_guard = guard is not None and guard.available and ctx.opts.kv_unified
        self.quarantined: set[int] = set()  # per-sequence streams that may hold bad values until cleared
        # Deterministic mode never mixes a prompt chunk with other sequences' tokens: llama.cpp would
        # re-split it per sequence, and a 1-token piece takes another attention kernel than solo.
        self.deterministic = deterministic
        self._prefill_turn = False
        self.n_parallel = n_parallel
        self.waiting: list[Request] = []
        self.slots: list[Request | None] = [None] * n_parallel
        self.slot_cache: list[tuple[tuple[Any, ...], list[int]]] = [((), []) for _ in range(n_parallel)]
        self.group: tuple[Any, ...] | None = None
        self.group_steps = 0
        self.applied_cvec: Any = None
        self._slot_waits: deque[float] = deque(maxlen=SLOT_WAITS_KEPT)
        self._slot_wait_steps: deque[int] = deque(maxlen=SLOT_WAITS_KEPT)  # the same waits in decode steps
        self.stats = Counters()  # engine thread only; readers get `stats.frozen()` (stats.py)
        self.gaps = GapClock()  # time between decodes while sequences run (stats.py)

    # -- bookkeeping --------------------------------------------------------------------------
    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(self.slots)

    def uses(self, adapter: Any) -> bool:
        return any(a is adapter for r in self.waiting + self.running for ph in r.phases for a, _ in ph.adapters.items)

    def users(self, adapter: Any) -> int:
        """Requests waiting or running on `adapter` (any thread: it reads copies, so it may be a step old)."""
        return sum(any(a is adapter for ph in r.phases for a, _ in ph.adapters.items)
                   for r in list(self.waiting) + self.running)

    def submit(self, req: Request) -> None:
        """Queue a request; a risky adapter set this engine cannot guard is refused here (ScaleError)."""
        sets = [ph.adapters for ph in req.phases]
        if self.guard is not None and not self.can_guard and self.guard.risky(sets):
            raise self.guard.refusal(sets)
        self.waiting.append(req)
        if self.bank is not None and len(self.waiting) > self.slots.count(None):
            # it will wait: make its adapters warm meanwhile (off this thread). Not for one admitted at
            # once: its admission (this loop, next step) would prepare them here before the worker is done,
            # so both would (measured: slower at 256 adapters over 8 slots, BENCHMARKS.md)
            self._prefetch(req)

    def _prefetch(self, req: Request) -> None:
        assert self.bank is not None
        self.bank.prefetch([a for ph in req.phases for a, _ in ph.adapters.items])

    def snapshot(self) -> SchedulerSnapshot:
        """Load figures for metrics. Safe from any thread: it reads copies, so values may be a step old."""
        waiting = list(self.waiting)
        running = [r for r in list(self.slots) if r is not None]

        def per_adapter(reqs: list[Request]) -> dict[str, int]:
            out: dict[str, int] = {}
            for r in reqs:
                for a, _ in r.phases[-1].adapters.items:
                    out[a.name] = out.get(a.name, 0) + 1
            return out
        return SchedulerSnapshot(
            waiting=len(waiting), running=len(running), kv_used=sum(r.n_past for r in running),
            kv_total=self.ctx.n_ctx, running_adapters=per_adapter(running), waiting_adapters=per_adapter(waiting),
            slot_waits=self.slot_wait_quantiles(), counters=self.stats.frozen(),
            kv_guarded_decodes=self.guard.guarded_decodes if self.guard is not None else 0,
            decode_gaps=self.gaps.frozen())

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> None:
        self._drop_cancelled()
        self._admit()
        runnable = self.running
        if not runnable:
            return
        group = self._pick_group(runnable)
        decoding = fairness.neighbours(runnable, self.prefill_step_tokens, self.clock.step_s)
        turn = step_share([r for r in runnable if r.phase_at(r.n_past).group_key == group], runnable,
                          self.request_step_seqs, self.stats.decode_steps, self.request_step_every,
                          lambda r: fairness.turn_every(r, self.prefill_step_tokens, self.clock,
                                                        self.request_step_every, decoding))
        members, guarded = self._guard_plan(turn)
        if not members:
            return
        phase = members[0].phase_at(members[0].n_past)  # before _fill_batch advances n_past
        plan, entries = self._fill_batch(members)
        # deterministic mode keeps every banked decode on the bank: native and bank products round apart
        masked = self.bank is not None and phase.banked and (self.deterministic or not _uniform(entries))
        try:
            self._apply(phase, masked)
            self.gaps.decoding()
            t0 = time.perf_counter()
            self._decode(entries, guarded, masked)
            self.clock.observe(time.perf_counter() - t0, self.ctx.batch.n,  # (a 1-token chunk counts as decode)
                               sum(e.n_tokens for e in entries if e.n_tokens > 1))
        except Exception as e:  # noqa: BLE001 - the batch's requests fail; waiting ones and the engine go on
            err = e if isinstance(e, LoramuxError) else RequestFailed("decode", phase.adapters.as_dict(), e)
            for r, _ in plan:
                self._finish(r, error=err)
            return
        self.gaps.decoded(running=True)
        self.stats.decode_steps += 1
        self.stats.bank_decodes += masked
        b = self.ctx.batch
        self.stats.batch_tokens += b.n
        self.stats.multi_seq_steps += int(b.n > 0 and bool((b.seq[: b.n] != b.seq[0]).any()))
        if guarded:
            plan = self._fail_overflows(plan, entries)
        for r, out_idx in plan:
            if self.slots[r.seq] is not r:  # failed meanwhile (its cells were cleared with another's)
                continue
            if r.scoring is not None and not self._score_or_fail(r):
                continue
            if out_idx is not None:
                self._sample_or_fail(r, out_idx)
        if not any(self.slots):
            self.gaps.decoded(running=False)  # the engine may go idle now: that wait is no gap

    def _guard_plan(self, members: list[Request]) -> tuple[list[Request], bool]:
        """Every decode that holds a risky set runs with the KV guard, whatever its size; where the guard
        cannot run, a set that became risky after admission (an in-place write) fails before it decodes."""
        g = self.guard
        risky = {id(r) for r in members if g is not None and g.risky(ph.adapters for ph in r.phases)}
        if not risky or self.can_guard:
            return members, bool(risky)
        assert g is not None
        for r in members:
            if id(r) in risky:
                self._finish(r, error=g.refusal([ph.adapters for ph in r.phases]))
        return [r for r in members if id(r) not in risky], False

    def _decode(self, entries: list[BatchEntry], guarded: bool, masked: bool) -> None:
        """Decode the filled batch, through the bank's masks if asked, with the KV guard if asked."""
        guard = self.guard if guarded else None
        if guard is not None:
            guard.arm(self.ctx.batch.n)
        try:
            if masked:
                assert self.bank is not None
                self.bank.decode(self.ctx, entries)  # plans the per-token masks, decodes, checks them
            else:  # one adapter set, natively: no stop needed unless the KV guard checks writes
                self.ctx.handle.decode(self.ctx.batch, eval_callback=guard is not None)
        finally:
            if guard is not None:
                guard.disarm()  # raises BackendError when a KV write could not be checked

    def _fail_overflows(self, plan: list[tuple[Request, int | None]],
                        entries: list[BatchEntry]) -> list[tuple[Request, int | None]]:
        """Fail the requests whose tokens the guard zeroed in the cache; the rest of the plan goes on."""
        assert self.guard is not None
        hit = self.guard.hit_entries([e.n_tokens for e in entries])
        self.stats.kv_guard_failures += len(hit)
        for i in hit:
            r = plan[i][0]
            self._finish(r, error=self.guard.overflow_error(r.phase_at(r.n_past - 1).adapters.as_dict()))
        return [p for i, p in enumerate(plan) if i not in hit]

    def _drop_cancelled(self) -> None:
        for r in list(self.waiting):
            if r.cancelled.is_set():
                self.waiting.remove(r)
                r.emit("done", self._completion(r, "cancelled"))
        for r in self.running:
            if r.cancelled.is_set():
                self._finish(r, reason="cancelled")

    def _admit(self) -> None:
        if self.quarantined and not self.running:
            self._clear_kv()
        blocked: list[Request] = []
        skipped: list[Request] = []  # blocked ones and those waiting for a pushed version, in order
        while self.waiting and any(s is None and i not in self.quarantined for i, s in enumerate(self.slots)):
            r = self.waiting.pop(0)
            if not self._on_version(r) or over_slots(r, self.running, self.request_slots):
                skipped.append(r)  # (or its request holds its share of the slots already: fairness.py)
                continue
            if self._waits_for_sibling(r) or (blocked and self._held_back(blocked[0], r)):
                blocked.append(r)
                skipped.append(r)
                continue
            try:
                admitted = self._acquire_slots(r)
            except LoramuxError as e:  # e.g. its slot write failed: this request fails, no other
                self._finish(r, error=e)
                continue
            if not admitted:
                if r.blocked_step is None:
                    r.blocked_step, r.blocked_at = self.stats.decode_steps, time.monotonic()
                    self._prefetch(r)  # its slot load at admission is then a copy
                blocked.append(r)  # its adapters wait for bank slots; later requests may still go
                skipped.append(r)
                continue
            r.admitted_step = self.stats.decode_steps
            if r.slots:
                self._slot_waits.append(time.monotonic() - r.blocked_at if r.blocked_at is not None else 0.0)
                self._slot_wait_steps.append(self.stats.decode_steps - r.blocked_step if r.blocked_step is not None
                                             else 0)
            free = [i for i, s in enumerate(self.slots) if s is None and i not in self.quarantined]
            seq, keep = max(((i, self._reusable(i, r)) for i in free), key=lambda x: x[1])
            shared = self._share(r, seq)
            if shared:
                keep = shared
            elif keep == 0 or not self.ctx.handle.memory_seq_rm(seq, keep, -1):
                self.ctx.handle.memory_seq_rm(seq, -1, -1)
                keep = 0
            r.seq, r.n_past, r.cached = seq, keep, keep
            if not r.params.plain_greedy:  # plain greedy reads the argmax directly (see _sample)
                r.sampler = N.SamplerHandle.chain(self.model.handle, **r.params.sampler_args())
            r.text = TextAssembler(r.params.stop)
            r.lines = LineStops.make(r.params.n_indent, r.params.t_max_predict_ms)
            self.slots[seq] = r
            self.stats.prompt_tokens += len(r.prompt)
            self.stats.prompt_tokens_reused += keep
        self.waiting[:0] = skipped

    def _acquire_slots(self, r: Request) -> bool:
        """Let the bank admit the request (banked with its slots, or native); False: wait for slots."""
        if self.bank is None:
            return True
        # while others decode, a slot write runs beside their steps (slot_copier.py) and this request waits
        adm = self.bank.take_slots([ph.adapters for ph in r.phases], background=bool(self.running))
        if adm is None:
            return False
        for i, ph in enumerate(r.phases):
            ph.banked = adm.banked
            ph.slot_scales = list(adm.scales[i]) if adm.banked else []
        r.slots = list(adm.slots)
        return True

    def _held_back(self, head: Request, r: Request) -> bool:
        """May `r` not pass `head`, which waits for bank slots? The bank decides (`SlotBank.holds_back`)."""
        if self.bank is None:
            return False
        assert head.blocked_step is not None
        return self.bank.holds_back([ph.adapters for ph in head.phases], self.stats.decode_steps - head.blocked_step,
                                    [ph.adapters for ph in r.phases])

    def slot_wait_quantiles(self) -> SlotWaits:
        """p50 / p99 / max seconds that recent banked requests waited for bank slots (0 when not at all)."""
        waits = sorted(self._slot_waits)
        if not waits:
            return SlotWaits()
        return SlotWaits(p50_s=waits[len(waits) // 2], p99_s=waits[min(len(waits) - 1, int(0.99 * len(waits)))],
                         max_s=waits[-1], max_steps=max(self._slot_wait_steps, default=0))

    def _shareable(self, r: Request) -> Request | None:
        """The running sibling whose prompt KV `r` can share (unified KV, same prompt and adapters), or None."""
        sib = r.input.share
        if (sib is None or sib.seq is None or self.slots[sib.seq] is not sib or self.deterministic
                or not self.ctx.opts.kv_unified or sib.prompt != r.prompt or sib.cache_key != r.cache_key
                or (r.scoring is not None and r.scoring.scores_prompt)):
            return None
        return sib

    def _waits_for_sibling(self, r: Request) -> bool:
        """Hold `r` back while the sibling it will share with has not decoded its prompt yet."""
        if r.input.share is None or (r.scoring is not None and r.scoring.scores_prompt):
            return False
        if any(w is r.input.share for w in self.waiting):
            return True
        sib = self._shareable(r)
        return sib is not None and sib.n_past < len(sib.prompt) - 1

    def _share(self, r: Request, seq: int) -> int:
        """Give `r` its sibling's prompt KV but the last token (decoded again for its own logits)."""
        sib = self._shareable(r)
        n = len(r.prompt) - 1
        if sib is None or n <= 0 or sib.n_past < n:
            return 0
        assert sib.seq is not None
        self.ctx.handle.memory_seq_rm(seq, -1, -1)
        N.memory_seq_cp(self.ctx.handle, sib.seq, seq, 0, n)
        return n

    def _reusable(self, seq: int, r: Request) -> int:
        key, toks = self.slot_cache[seq]
        if key != r.cache_key or self.deterministic or (r.scoring is not None and r.scoring.scores_prompt):
            # (a scored prompt needs the logits of every row, so none of it may come from the cache)
            # deterministic: a reused prefix leaves a short tail computed with other kernels than solo
            return 0
        n = 0
        for a, b in zip(toks, r.prompt[:-1]):  # always recompute the last prompt token for its logits
            if a != b:
                break
            n += 1
        return n

    def _pick_group(self, runnable: list[Request]) -> tuple[Any, ...]:
        keys = []
        for r in sorted(runnable, key=lambda r: r.input.arrived):
            k = r.phase_at(r.n_past).group_key
            if k not in keys:
                keys.append(k)
        if self.group in keys and (self.group_steps < GROUP_RUN_STEPS or len(keys) == 1):
            self.group_steps += 1
            return self.group
        nxt = keys[(keys.index(self.group) + 1) % len(keys)] if self.group in keys else keys[0]
        self.group, self.group_steps = nxt, 1
        return nxt

    def _fill_batch(self, members: list[Request]
                    ) -> tuple[list[tuple[Request, int | None]], list[BatchEntry]]:
        """Fill the batch; returns the sampling plan and the batch's entries, in batch order."""
        b = self.ctx.batch
        b.clear()
        plan: list[tuple[Request, int | None]] = []
        entries: list[BatchEntry] = []
        if self.deterministic:
            members = self._deterministic_members(members)
        # decode tokens first (one each, cheap), then prompt chunks with what is left of n_batch
        for r in members:
            if r.pending is not None:
                entries.append(BatchEntry(1, r.phase_at(r.n_past).slot_scales))
                b.add([r.pending], r.n_past, r.seq, True)
                plan.append((r, b.n - 1))
                r.n_past += 1
                r.pending = None
        # full-vocabulary logit rows that prompt scoring may still take this decode: fewer while another
        # request runs (each row is an output projection and a pass over the vocabulary; scoring.py)
        rows_left = min(self.score_rows_shared, self.score_rows) if any(
            q.scoring is None or not q.scoring.scores_prompt for q in self.running) else self.score_rows
        for r in members:
            if r.n_past >= len(r.prompt) or b.n >= b.capacity:
                continue
            end = min(len(r.prompt), r.n_past + b.capacity - b.n, _phase_end(r))
            cap = None if self.deterministic else prompt_cap(r, self.running, self.prefill_step_tokens,
                                                             self.prefill_chunk_tokens)
            end = end if cap is None else min(end, r.n_past + cap)  # a piece at a time (fairness.py)
            flags: list[bool] | None = None
            if r.scoring is not None:
                end = r.scoring.chunk_end(r.n_past, end, rows_left)
                if end <= r.n_past:
                    continue  # no rows left in this decode: its next chunk waits for the next one
                flags = r.scoring.flags(b.n, r.n_past, end, len(r.prompt), r.params.max_tokens > 0)
                rows_left -= sum(flags)
            chunk = r.prompt[r.n_past:end]
            last = end == len(r.prompt)
            flags = flags if flags is not None else [False] * (len(chunk) - 1) + [last]
            entries.append(BatchEntry(len(chunk), r.phase_at(r.n_past).slot_scales))
            b.add(chunk, r.n_past, r.seq, flags)
            plan.append((r, b.n - 1 if last and flags[-1] else None))
            r.n_past = end
        return plan, entries

    def _deterministic_members(self, members: list[Request]) -> list[Request]:
        """Either every pending decode token, or one request's prompt chunk (alternating when both wait)."""
        decoders = [r for r in members if r.pending is not None]
        prefill = [r for r in members if r.pending is None and r.n_past < len(r.prompt)]
        use_prefill = bool(prefill) and (not decoders or self._prefill_turn)
        self._prefill_turn = not self._prefill_turn
        return prefill[:1] if use_prefill else decoders

    def _apply(self, phase: Phase, masked: bool) -> None:
        """Put the decode's adapters in the graph: the bank when its masks select per token, else the
        phase's own set (a decode whose tokens all use one set needs no masks: natively it skips the
        bank's K·r-wide products and its graph stops; switching costs a graph re-reserve, ~1 ms)."""
        assert self.bank is not None or not masked
        adapters = [(self.bank.adapter, 1.0)] if masked and self.bank is not None else list(phase.adapters.items)
        if self.ctx.handle.set_adapters([a.handle for a, _ in adapters], [s for _, s in adapters]):
            self.stats.adapter_switches += 1
        ckey = getattr(phase.cvec, "key", None)
        if ckey != getattr(self.applied_cvec, "key", None):
            if phase.cvec is None:
                self.ctx.handle.set_control_vector(None, self.model.n_embd, 0, 0)
            else:
                phase.cvec.apply(self.ctx.handle)
            self.applied_cvec = phase.cvec

    def _sample_or_fail(self, r: Request, idx: int) -> None:
        """Sample one request's next token; an error there (sampler, text assembly) ends that request only."""
        try:
            self._sample(r, idx)
        except Exception as e:  # noqa: BLE001 - failure isolation: fail this request, not the step
            log.exception("sampling failed for one request")
            err = e if isinstance(e, LoramuxError) else RequestFailed(
                "sample", r.phase_at(r.n_past).adapters.as_dict(), e)
            if r.seq is not None and self.slots[r.seq] is r:
                self._finish(r, error=err)

    def _score_or_fail(self, r: Request) -> bool:
        """Read a scored request's prompt rows of this decode; False once it ended (failed, or scored all
        of a prompt it generates nothing for)."""
        assert r.scoring is not None
        try:
            r.scoring.collect(self.ctx.handle, r.prompt, r.emit)
        except Exception as e:  # noqa: BLE001 - failure isolation, as for sampling
            log.exception("scoring failed for one request")
            self._finish(r, error=e if isinstance(e, LoramuxError) else RequestFailed(
                "score", r.phase_at(r.n_past).adapters.as_dict(), e))
            return False
        if r.params.max_tokens == 0 and r.n_past >= len(r.prompt):
            self._finish(r, reason="length")
            return False
        return True

    def _sample(self, r: Request, idx: int) -> None:
        assert r.text is not None
        if r.grammar is not None:
            tok = self._constrained(r, idx)
        elif r.sampler is None:
            tok = self.ctx.handle.argmax(idx)
        else:
            if not self.ctx.handle.logits_finite(idx):  # a sampler would pick garbage from NaN silently
                raise FloatingPointError(f"the logits of row {idx} are not finite (NaN or +Inf)")
            tok = r.sampler.sample(self.ctx.handle, idx)  # llama_sampler_sample accepts the token itself
        if r.scoring is not None:
            entry = r.scoring.on_token(self.ctx.handle, idx, tok)  # the EOG token too: clients count it
            if entry is not None:
                r.emit("logprobs", entry)
        if r.first_token_at is None:
            r.first_token_at = time.monotonic()
        if (self.model.is_eog(tok) and not r.params.ignore_eos) or tok in r.input.stop_tokens:
            if r.lines is not None:  # llama-server checks the end token's (empty) text too: it may cut a line
                r.lines.stop(r.text, "", time.monotonic() - r.first_token_at)
            self._finish(r, reason="stop")
            return
        r.generated.append(tok)
        self.stats.generated_tokens += 1
        chunk = r.text.feed(self.model.handle.token_bytes(tok, special=tok in r.input.shown))
        if chunk:
            r.emit("text", chunk)
        if r.text.stopped:
            self._finish(r, reason="stop")
        elif r.lines is not None and r.lines.stop(r.text, chunk, time.monotonic() - r.first_token_at):
            self._finish(r, reason="length")  # llama-server's stop_type "limit"
        elif len(r.generated) >= r.params.max_tokens or r.n_past + 1 >= self._seq_room():
            self._finish(r, reason="length")
        else:
            r.pending = tok

    def _constrained(self, r: Request, idx: int) -> int:
        """The grammar's choice: the unconstrained token when the grammar allows it, else one it allows."""
        assert r.grammar is not None
        tok = r.grammar.pick(self.ctx.handle, idx, r.sampler)
        if not self.model.is_eog(tok):  # an end token only ends a finished grammar: nothing to advance
            r.grammar.accept(tok)
        if r.sampler is not None:
            N.sampler_accept(r.sampler, tok)
        return tok

    def _seq_room(self) -> int:
        o = self.ctx.opts
        return self.ctx.n_ctx if o.kv_unified else self.ctx.n_ctx // max(1, o.n_seq_max)

    def _finish(self, r: Request, reason: str = "stop", error: Exception | None = None) -> None:
        if r.seq is not None and self.slots[r.seq] is not r:
            return  # finished already (failed with another request's cells)
        if r.seq is not None:
            self.slots[r.seq] = None
            if error is None:
                decoded = (r.prompt + r.generated)[: r.n_past]
                self.slot_cache[r.seq] = (r.cache_key, decoded)
            else:  # no prefix reuse of a failed request's cells
                self.ctx.handle.memory_seq_rm(r.seq, -1, -1)
                self.slot_cache[r.seq] = ((), [])
                if may_leave_bad_values(error):
                    self._scrub(r.seq)
        if r.sampler is not None:
            r.sampler.close()
        if r.grammar is not None:
            r.grammar.close()
        if self.bank is not None:
            for k in r.slots:
                self.bank.return_slot(k)
            r.slots = []
        if error is not None:
            r.emit("error", error)
            return
        tail = r.text.flush() if r.text is not None else ""
        if tail:
            r.emit("text", tail)
        r.emit("done", self._completion(r, reason))

    def _scrub(self, seq: int) -> None:
        """A failed request may have left out-of-range values in its cells, which attention reads masked
        too (0·Inf = NaN). On a unified cache every running sequence has read them: they fail, and the data
        is cleared at once. On per-sequence streams only `seq`'s stream holds them: nothing is admitted to
        it until no request runs, then the data is cleared."""
        if self.ctx.opts.kv_unified:
            for o in self.running:
                self._finish(o, error=read_bad_values_error(o.phase_at(o.n_past).adapters.as_dict()))
            self._clear_kv()
        else:
            self.quarantined.add(seq)
            if not self.running:
                self._clear_kv()

    def _clear_kv(self) -> None:
        self.ctx.handle.memory_clear()  # llama_memory_clear(data=True): the K/V data too, not only the cells
        self.slot_cache = [((), []) for _ in range(self.n_parallel)]
        self.quarantined.clear()
        self.stats.kv_clears += 1

    def _completion(self, r: Request, reason: str) -> Completion:
        text = r.text.text if r.text is not None else ""
        sc = r.scoring
        return Completion(text=text, tokens=list(r.generated), finish_reason=reason, prompt_tokens=len(r.prompt),
                          loras=r.phases[-1].adapters.as_dict(), alora=dict(r.input.alora),
                          versions={k: v for ph in r.phases for k, v in ph.adapters.versions.items()},
                          logprobs=list(sc.generated) if sc and sc.gen_top is not None else None,
                          prompt_logprobs=list(sc.prompt) if sc and sc.scores_prompt else None)

    def fail_waiting(self, which: Callable[[Request], bool], error: Exception) -> None:
        """Fail the waiting requests `which` selects (a push they waited for could not land)."""
        for r in [r for r in self.waiting if which(r)]:
            self.waiting.remove(r)
            r.emit("error", error)

    def _on_version(self, r: Request) -> bool:
        """Can `r` start now? Not while a version it is pinned to is still to come (a push waits for
        earlier requests, engine/versions.py); a version a direct write replaced is re-keyed to the live one."""
        for ph in r.phases:
            live = tuple((a.uid, a.version, s) for a, s in ph.adapters.items)
            if live != ph.adapters.key:
                if any(v > a.version for (a, _), (_, v, _) in zip(ph.adapters.items, ph.adapters.key)):
                    return False
                ph.adapters = type(ph.adapters)(ph.adapters.items)
        return True

    def fail_all(self, error: Exception) -> None:
        for r in self.waiting:
            r.emit("error", error)
        self.waiting.clear()
        for r in self.running:
            self._finish(r, error=error)


def _uniform(entries: list[BatchEntry]) -> bool:
    """Do all the batch's tokens use the same slots at the same scales (one adapter set)?"""
    first = entries[0].slot_scales if entries else []
    return all(e.slot_scales == first for e in entries)


def _phase_end(r: Request) -> int:
    for ph in r.phases:
        if ph.start > r.n_past:
            return ph.start
    return len(r.prompt)


__all__ = ["Scheduler"]
