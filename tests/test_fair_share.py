"""A request of several sequences takes a fair share of the engine (engine/fairness.py): beside an `n` = 16
request a neighbour is admitted at once and finishes within its own number of decode steps, one request
never runs more than `request_slots` sequences nor puts more than `request_step_seqs` of them into a step
while another request runs, and takes part in only one step of every `request_step_every` then, prompt scoring keeps to `score_rows_shared` rows a step beside a neighbour,
and every sequence's tokens are those it gets without the neighbour. On real llama.cpp and the tiny model;
steps are counted with the scheduler's decode-step counter (no timings)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from test_server import serving

import loramux as lm
from loramux.cli.serve import add_parsers, settings_from_args
from loramux.engine.fairness import (
    HEAVY_GRAMMAR,
    PREFILL_STEP_TOKENS,
    TURN_WEIGHT,
    StepClock,
    held,
    neighbours,
    slot_limit,
    step_share,
    turn_every,
)
from loramux.engine.request import Request
from loramux.errors import ParameterError

PROMPT = "the cat sat on the mat"
SEQS, TOKENS, NEIGHBOUR = 16, 24, 8
PARALLEL = 4


class Trace:
    """Which party got a token at which decode step (read on the engine thread, as it samples)."""

    def __init__(self, eng: lm.Engine) -> None:
        self.eng = eng
        self.steps: dict[str, Counter[int]] = {}
        self.first: dict[str, int] = {}
        self.who: dict[int, list[int]] = {}  # step -> the big request's sequences that got a token

    def listener(self, party: str, started: threading.Event | None = None, seq: int = 0):
        counts = self.steps.setdefault(party, Counter())

        def on_event(kind: str, _value: object) -> None:
            if kind == "logprobs":  # one per generated token (logprobs=0 asks for them)
                step = self.eng.scheduler.stats.decode_steps
                counts[step] += 1
                if party == "big":
                    self.who.setdefault(step, []).append(seq)
                self.first.setdefault(party, step)
                if started is not None and sum(counts.values()) >= 2 * PARALLEL:
                    started.set()
        return on_event


def _sixteen(eng: lm.Engine, trace: Trace, started: threading.Event | None = None) -> list[Request]:
    """An `n` = 16 request as the server submits it: one party, the later sequences sharing the first's
    prompt KV, each its own seed."""
    party = object()
    reqs: list[Request] = []
    for j in range(SEQS):
        reqs.append(eng.submit(PROMPT, max_tokens=TOKENS, ignore_eos=True, temperature=1.0, seed=100 + j,
                               logprobs=0, party=party, share=reqs[0] if reqs else None,
                               on_event=trace.listener("big", started, j)))
    return reqs


def _tokens(req: Request) -> list[int]:
    while True:
        kind, value = req.events.get(timeout=120)
        if kind == "done":
            return list(value.tokens)
        if kind == "error":
            raise value


def _run(tiny_model: Path, neighbour: bool, **options: object) -> tuple[Trace, list[list[int]], dict]:
    eng = lm.Engine.load(tiny_model, n_ctx=256, n_threads=2, n_parallel=PARALLEL, **options)
    try:
        trace, started = Trace(eng), threading.Event()
        big = _sixteen(eng, trace, started)
        info: dict = {}
        if neighbour:
            assert started.wait(120)  # the n = 16 request is decoding: the neighbour arrives now
            at = eng.scheduler.stats.decode_steps
            n = eng.submit("the dog ran", max_tokens=NEIGHBOUR, ignore_eos=True, temperature=0, logprobs=0,
                           on_event=trace.listener("neighbour"))
            info = {"at": at, "tokens": _tokens(n), "last": max(trace.steps["neighbour"])}
        return trace, [_tokens(r) for r in big], info
    finally:
        eng.close()


@pytest.fixture(scope="module")
def alone(tiny_model):
    return _run(tiny_model, neighbour=False)


@pytest.fixture(scope="module")
def beside(tiny_model):
    return _run(tiny_model, neighbour=True)


def test_alone_the_request_runs_all_but_one_slot_at_once(alone):
    trace, tokens, _ = alone
    per_step = trace.steps["big"]
    assert all(len(t) == TOKENS for t in tokens)
    assert max(per_step.values()) == slot_limit(0, PARALLEL) == PARALLEL - 1  # work-conserving up to its share
    assert sum(per_step.values()) == SEQS * TOKENS


def test_a_neighbour_is_admitted_at_once_and_finishes_in_its_own_steps(beside):
    trace, _, info = beside
    # one prompt decode, then one token a step: NEIGHBOUR steps from its admission, which is the next step
    # (a slot is free). Without the slot share it waits for a whole wave of the big request (TOKENS steps).
    assert info["last"] - info["at"] <= NEIGHBOUR + 2, info
    assert len(info["tokens"]) == NEIGHBOUR


def test_beside_a_neighbour_one_sequence_a_step_in_turn(beside):
    trace, _, info = beside
    big, near = trace.steps["big"], trace.steps["neighbour"]
    shared = list(near)  # the steps where the neighbour decoded: another request was running
    assert shared and all(big.get(s, 0) <= 1 for s in shared), {s: big.get(s, 0) for s in shared}
    served = [q for s in shared for q in trace.who.get(s, [])]
    assert len(set(served)) >= PARALLEL - 1, served  # in turn: its running sequences all advance
    assert all(v <= PARALLEL - 1 for v in big.values())
    assert sum(big.values()) == SEQS * TOKENS  # every sequence finished its tokens


def test_beside_a_neighbour_the_request_takes_every_other_step(beside):
    """`request_step_every` = 2 (the default): of the K steps the neighbour decodes in, the big request takes
    part in at most ⌈K/2⌉, so every other step of the neighbour's is its own size, as alone."""
    trace, _, _ = beside
    big, near = trace.steps["big"], trace.steps["neighbour"]
    k = len(near)
    took = [s for s in near if big.get(s, 0)]
    assert k >= NEIGHBOUR and len(took) <= -(-k // 2), (sorted(near), took)
    assert took, "it still advances beside the neighbour"


def test_with_every_step_the_request_takes_each_of_the_neighbours_steps(tiny_model):
    """`request_step_every` = 1 is the share without turns: one sequence of the big request in every step."""
    trace, _, _ = _run(tiny_model, neighbour=True, request_step_every=1)
    big, near = trace.steps["big"], trace.steps["neighbour"]
    took = [s for s in near if big.get(s, 0)]
    assert len(took) > -(-len(near) // 2), (sorted(near), took)


@dataclasses.dataclass
class _Seq:
    party: object | None
    arrived: float = 0.0
    generated: list[int] = dataclasses.field(default_factory=list)
    n_past: int = 0


def test_the_turns_never_leave_a_step_empty():
    """Two requests of several sequences beside each other and nobody else: no step sits out (the engine
    would otherwise spin on an empty step), and the turns rotate through each request's sequences."""
    a, b = object(), object()
    seqs = [_Seq(a), _Seq(a), _Seq(b), _Seq(b)]
    for step in range(8):
        got = step_share(seqs, seqs, 1, step, 2)
        assert {id(r.party) for r in got} == {id(a), id(b)}, step
    single = _Seq(None)
    mixed = [*seqs[:2], single]
    served = [step_share(mixed, mixed, 1, step, 2) for step in range(8)]
    assert all(single in got for got in served)
    assert [sum(r.party is a for r in got) for got in served] == [1, 0] * 4
    assert {id(got[0]) for got in served[::2]} == {id(seqs[0]), id(seqs[1])}  # in turn, both of a's


def test_every_sequence_gets_the_tokens_it_gets_without_the_neighbour(alone, beside, tiny_model):
    """The shares only change when a sequence decodes, not what: same seeds, same tokens, sequence by
    sequence; the neighbour's tokens are those it gets alone."""
    assert beside[1] == alone[1]
    assert len({tuple(t) for t in alone[1]}) > 1  # the seeds differ: not 16 copies of one answer
    with lm.Engine.load(tiny_model, n_ctx=256, n_threads=2, n_parallel=PARALLEL) as eng:
        solo = eng.generate("the dog ran", max_tokens=NEIGHBOUR, ignore_eos=True, temperature=0)
    assert beside[2]["tokens"] == solo.tokens


def test_prompt_scoring_keeps_to_its_shared_rows_beside_a_neighbour(tiny_model):
    """A long scored prompt computes at most `score_rows_shared` rows in each decode the neighbour shares."""
    with lm.Engine.load(tiny_model, n_ctx=512, n_threads=2, n_parallel=2, score_rows=16,
                        score_rows_shared=1) as eng:
        toks = (eng.tokenize("the history of the river valley") * 40)[:300]
        started = threading.Event()
        scored = eng.submit(toks, max_tokens=1, prompt_logprobs=0)
        rows: list[tuple[int, int]] = []

        def on_event(kind: str, _value: object) -> None:
            if kind == "logprobs":
                rows.append((eng.scheduler.stats.decode_steps, len(scored.scoring.prompt)))
                started.set()
        n = eng.submit("the dog ran", max_tokens=NEIGHBOUR, ignore_eos=True, temperature=0, logprobs=0,
                       on_event=on_event)
        assert _tokens(n) and started.is_set()
        _tokens(scored)
    steps = [(s1 - s0, r1 - r0) for (s0, r0), (s1, r1) in zip(rows, rows[1:])]
    assert steps and all(ds == 1 for ds, _ in steps), steps  # a token of the neighbour every step
    assert all(dr <= 1 for _, dr in steps) and any(dr == 1 for _, dr in steps), steps


def test_the_shares_are_serve_options_and_are_checked():
    import argparse

    ap = argparse.ArgumentParser()
    add_parsers(ap.add_subparsers())
    args = ap.parse_args(["serve", "--request-slots", "2", "--request-step-seqs", "3", "--score-rows", "8",
                          "--score-rows-shared", "1", "--request-step-every", "3"])
    opts = settings_from_args(args).engine_options()
    assert (opts.request_slots, opts.request_step_seqs, opts.score_rows, opts.score_rows_shared,
            opts.request_step_every) == (2, 3, 8, 1, 3)
    assert settings_from_args(ap.parse_args(["serve"])).engine_options().request_step_every == 2
    assert slot_limit(0, 1) == 1 and slot_limit(0, 4) == 3 and slot_limit(2, 4) == 2
    for bad in (["--request-slots", "-1"], ["--request-step-seqs", "0"], ["--score-rows-shared", "0"],
                ["--request-step-every", "0"]):
        with pytest.raises(ParameterError, match=bad[0][2:].replace("-", "_")):
            settings_from_args(ap.parse_args(["serve", *bad]))
    for name in ("request_step_seqs", "request_step_every"):
        with pytest.raises(ParameterError, match=name):
            lm.EngineOptions(**{name: 0})


def test_an_n16_request_through_the_server_leaves_a_slot_and_a_turn(tiny_model):
    """Over HTTP: the sequences of one `n` request are one party. While it runs, a neighbour is admitted
    and finishes within its own decode steps (counted from its submission to the engine to its end), and
    the request's choices equal the same request's made alone. On a loaded host the neighbour's HTTP request
    can reach the engine only after the `n` request is nearly done (the tiny model's steps take about a
    millisecond); that run shows nothing, so it is run again (at most 3 times)."""
    body = {"prompt": PROMPT, "n": SEQS, "max_tokens": 160, "ignore_eos": True, "temperature": 1.0,
            "seed": 7, "return_token_ids": True}
    with serving(tiny_model, parallel=PARALLEL, n_ctx=256) as (srv, eng, _state):
        ref = httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()
        for _ in range(3):
            steps, got, r = _n16_with_a_neighbour(srv, eng, body)
            if steps["beside"] >= PARALLEL - 1:
                break
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == NEIGHBOUR == steps["left"]
    took = steps["done"] - steps["submitted"]
    assert steps["beside"] >= PARALLEL - 1, steps  # it did arrive while the n = 16 request ran
    assert took <= NEIGHBOUR + 2, steps  # its own steps, not a wave of the n = 16 request (160 steps)
    assert [c["token_ids"] for c in got["choices"]] == [c["token_ids"] for c in ref["choices"]]


def _n16_with_a_neighbour(srv, eng: lm.Engine, body: dict) -> tuple[dict, dict, httpx.Response]:
    """The `n` request over HTTP and, once it decodes, a neighbour's: (the neighbour's steps, the `n`
    request's response, the neighbour's response)."""
    sched, steps = eng.scheduler, {}
    submit = sched.submit

    def watched(req: Request) -> None:  # the neighbour's steps, read on the engine thread
        if req.party is None:
            steps["submitted"], listener = sched.stats.decode_steps, req.input.on_event
            steps["beside"] = sum(q.party is not None for q in sched.running + sched.waiting)

            def on_event(kind: str, value: object) -> None:
                if kind == "done":
                    steps["done"] = sched.stats.decode_steps
                if listener is not None:
                    listener(kind, value)
            req.input = dataclasses.replace(req.input, on_event=on_event)
        submit(req)
    sched.submit = watched
    try:
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(httpx.post(
            srv.url + "/v1/completions", json=body, timeout=120).json()))
        t.start()
        generated = sched.stats.generated_tokens
        for _ in range(20000):  # until the n = 16 request has decoded a few steps
            if sched.stats.generated_tokens >= generated + 8:
                break
            time.sleep(0.002)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "the dog ran", "max_tokens": NEIGHBOUR,
                                                          "ignore_eos": True, "temperature": 0}, timeout=120)
        t.join(120)
        steps["left"] = sched.stats.generated_tokens - generated - SEQS * 160  # the neighbour's, once all is done
    finally:
        sched.submit = submit
    return steps, got, r


def _batches(eng: lm.Engine) -> list[Counter[int]]:
    """Tokens per sequence of every decode from now on, read on the engine thread around the real decode."""
    sched, seen = eng.scheduler, []
    real = sched._decode

    def decode(entries, guarded, masked):
        b = sched.ctx.batch
        seen.append(Counter(int(s) for s in b.seq[: b.n]))
        real(entries, guarded, masked)
    sched._decode = decode
    return seen


def test_a_long_prompt_goes_in_pieces_and_turns_beside_a_decoding_neighbour(tiny_model):
    """While a neighbour decodes, a long prompt puts at most `prefill_step_tokens` tokens into a step and
    takes part in at most every other one of the neighbour's steps (fairness.py, `prompt_cap` and `held`);
    alone it goes on in whole batches. Every prompt token is decoded once."""
    with lm.Engine.load(tiny_model, n_ctx=1024, n_threads=2, n_parallel=2, prefill_step_tokens=8) as eng:
        toks = (eng.tokenize("the history of the river valley") * 120)[:600]
        seen = _batches(eng)
        # 120 tokens: n must still decode when the long prompt arrives (a fast host decodes the tiny model's
        # tokens in ~0.1 ms, and 48 could all go by in one poll), and end while pieces of it are left (75 of
        # them, at most one every other step: 150 steps)
        n = eng.submit("the dog ran", max_tokens=120, ignore_eos=True, temperature=0)
        for _ in range(200000):
            if eng.scheduler.stats.generated_tokens >= 4:
                break
            time.sleep(0.0005)
        long = eng.submit(toks, max_tokens=1, temperature=0)
        assert len(_tokens(n)) == 120 and len(_tokens(long)) == 1
        clock = eng.scheduler.clock  # what the turns are weighed by, measured as the engine ran
        assert clock.step_s > 0 and clock.token_s > 0, (clock.step_s, clock.token_s)
    near, far = n.seq, long.seq
    shared = [c for c in seen if c[near]]  # the neighbour's steps
    took = [c[far] for c in shared if c[far]]
    assert took and max(took) <= 8, took  # pieces of at most prefill_step_tokens beside its decode
    during = shared[shared.index(next(c for c in shared if c[far])):]  # from the long prompt's first piece
    assert len([c for c in during if c[far]]) <= -(-len(during) // 2) + 1, [c[far] for c in during]
    assert sum(c[far] for c in seen) == len(toks)  # every prompt token once (and its one sampled token: none)
    assert max(c[far] for c in seen) > 8  # alone again: whole batches


@dataclasses.dataclass
class _Spent:
    spent: float


@dataclasses.dataclass
class _Req(_Seq):
    pending: int | None = None
    grammar: _Spent | None = None
    prompt: list[int] = dataclasses.field(default_factory=list)


def test_which_requests_take_turns():
    """`held`: a sequence of a party of several, a prompt with more than `prefill_step_tokens` left, and a
    grammar that took more than HEAVY_GRAMMAR of a decode step per token so far; nothing else."""
    step = 0.02
    assert held(_Req(object()), 16, step)
    assert not held(_Req(None, prompt=[1] * 16), 16, step)  # a short prompt: in one piece, no turns
    assert held(_Req(None, prompt=[1] * 17), 16, step)
    assert not held(_Req(None, n_past=17, pending=5, prompt=[1] * 17), 16, step)  # decoding now
    cheap = _Req(None, n_past=3, pending=5, prompt=[1] * 3, generated=[1, 2, 3, 4])
    cheap.grammar = _Spent(4 * step * HEAVY_GRAMMAR * 0.9)
    costly = dataclasses.replace(cheap, grammar=_Spent(4 * step * HEAVY_GRAMMAR * 1.1))
    assert not held(cheap, 16, step) and held(costly, 16, step)
    assert not held(dataclasses.replace(costly, generated=[]), 16, step)  # nothing measured yet


def test_turns_are_weighed_by_what_a_step_of_the_request_costs():
    """`turn_every`: a request that takes turns takes one step of every 1 + TURN_WEIGHT × (its cost per step /
    a neighbour's step alone), at least request_step_every. A costly grammar's cost is its time per token
    plus the row its token adds to a step; a long prompt's, what its next piece adds. Others: every step."""
    clock = StepClock()
    for _ in range(60):
        clock.observe(0.02, 1, 0)  # a neighbour alone: 20 ms
        clock.observe(0.036, 2, 0)  # a second token adds 16 ms
        clock.observe(0.02 + 16 * 0.005, 17, 16)  # a 16-token piece beside it adds 5 ms a token
    assert clock.one_s == pytest.approx(0.02, rel=1e-2) and clock.row_s == pytest.approx(0.016, rel=5e-2)
    assert clock.token_s == pytest.approx(0.005, rel=0.3)
    clock.step_s, clock.one_s, clock.row_s, clock.token_s = 0.02, 0.02, 0.016, 0.0049  # exact from here on
    gen = [1, 2, 3, 4]
    plain = _Req(None, n_past=3, pending=5, prompt=[1] * 3, generated=gen)
    assert turn_every(plain, 16, clock, 2) == 1
    assert turn_every(_Req(object()), 16, clock, 2) == 2  # a party of several: request_step_every
    heavy = dataclasses.replace(plain, grammar=_Spent(4 * 0.078))  # 78 ms a token, + 16 ms for its row
    assert turn_every(heavy, 16, clock, 2) == 11 and TURN_WEIGHT == 2  # ceil(1 + 2 × 94 / 20)
    light = dataclasses.replace(plain, grammar=_Spent(4 * 0.02 * HEAVY_GRAMMAR * 1.1))  # 5.5 ms a token
    assert turn_every(light, 16, clock, 2) == 4  # ceil(1 + 2 × 21.5 / 20)
    clock.row_s = 0.0  # a device where a second row costs nothing: the turns of request_step_every
    assert turn_every(light, 16, clock, 2) == 2
    clock.row_s = 0.016
    long = _Req(None, prompt=[1] * 300)
    assert turn_every(long, 16, clock, 2) == 9  # ceil(1 + 2 × 16 × 4.9 ms / 20 ms)
    assert turn_every(long, 16, StepClock(), 2) == 2  # nothing measured yet
    seqs = [plain, heavy, dataclasses.replace(heavy, grammar=_Spent(0.0), party=object())]
    served = [step_share(seqs, seqs, 1, step, 2, lambda r: turn_every(r, 16, clock, 2)) for step in range(18)]
    assert all(plain in got for got in served)
    assert [i for i, got in enumerate(served) if heavy in got] == [0, 11]
    assert [i for i, got in enumerate(served) if seqs[2] in got] == list(range(0, 18, 2))


def test_turns_are_weighed_against_the_step_of_the_sequences_decoding_beside():
    """Against the neighbours' own step: `neighbours` counts the sequences decoding in every step (past their
    prompt and not held themselves), and a 16-token piece beside 8 of them takes one step of every 3, where
    against one neighbour's step it takes one of every 9 (its sequence idle in between)."""
    clock = StepClock()
    assert clock.alone(8) == 0.0  # nothing measured yet
    clock.step_s, clock.one_s, clock.row_s, clock.token_s = 0.02, 0.02, 0.016, 0.0049
    assert clock.alone(1) == pytest.approx(0.02) and clock.alone(8) == pytest.approx(0.02 + 7 * 0.016)
    long = _Req(None, prompt=[1] * 300)
    assert turn_every(long, 16, clock, 2, 1) == 9  # ceil(1 + 2 × 78.4 ms / 20 ms)
    assert turn_every(long, 16, clock, 2, 8) == 3  # ceil(1 + 2 × 78.4 ms / 132 ms)
    plain = _Req(None, n_past=3, pending=5, prompt=[1] * 3, generated=[1, 2])
    heavy = dataclasses.replace(plain, grammar=_Spent(2 * 0.078))
    party = dataclasses.replace(plain, party=object())
    assert neighbours([plain] * 5 + [long, heavy, party], 16, 0.02) == 5  # the prompt and the held ones: out
    assert neighbours([long, heavy], 16, 0.02) == 1  # at least one: the step alone


def test_the_scheduler_weighs_a_long_prompt_against_the_sequences_decoding(tiny_model, monkeypatch):
    """The count of decoding neighbours reaches `turn_every` (without it a long prompt beside many decoding
    sequences waits as long for each turn as beside one)."""
    from loramux.engine import fairness

    seen: list[int] = []
    real = fairness.turn_every

    def spy(r, prefill_step_tokens, clock, every, decoding=1):
        if len(r.prompt) - r.n_past > prefill_step_tokens:
            seen.append(decoding)
        return real(r, prefill_step_tokens, clock, every, decoding)
    monkeypatch.setattr(fairness, "turn_every", spy)
    with lm.Engine.load(tiny_model, n_ctx=1024, n_threads=2, n_parallel=4, prefill_step_tokens=8) as eng:
        # 400 tokens each: they must still decode when the long prompt arrives (a fast host decodes the tiny
        # model's tokens in ~0.1 ms, and 64 steps could all go by in one poll)
        near = [eng.submit(f"the dog ran {i}", max_tokens=400, ignore_eos=True, temperature=0) for i in range(3)]
        for _ in range(200000):
            if eng.scheduler.stats.generated_tokens >= 6:
                break
            time.sleep(0.0005)
        long = eng.submit((eng.tokenize("the history of the river valley") * 20)[:120], max_tokens=1, temperature=0)
        assert len(_tokens(long)) == 1 and all(len(_tokens(n)) == 400 for n in near)
    assert seen and max(seen) == 3, seen


def test_prefill_step_tokens_is_a_serve_option_and_is_checked():
    import argparse

    ap = argparse.ArgumentParser()
    add_parsers(ap.add_subparsers())
    opts = settings_from_args(ap.parse_args(["serve", "--prefill-step-tokens", "32"])).engine_options()
    assert opts.prefill_step_tokens == 32
    assert settings_from_args(ap.parse_args(["serve"])).engine_options().prefill_step_tokens == PREFILL_STEP_TOKENS
    with pytest.raises(ParameterError, match="prefill_step_tokens"):
        settings_from_args(ap.parse_args(["serve", "--prefill-step-tokens", "0"]))
    with pytest.raises(ParameterError, match="prefill_step_tokens"):
        lm.EngineOptions(prefill_step_tokens=0)
    opts = settings_from_args(ap.parse_args(["serve", "--prefill-chunk-tokens", "64"])).engine_options()
    assert opts.prefill_chunk_tokens == 64
    assert settings_from_args(ap.parse_args(["serve"])).engine_options().prefill_chunk_tokens == 0
    with pytest.raises(ParameterError, match="prefill_chunk_tokens"):
        settings_from_args(ap.parse_args(["serve", "--prefill-chunk-tokens", "-1"]))


@pytest.mark.parametrize("chunk", [0, 24])
def test_prefill_chunk_tokens_bounds_a_prompt_decoded_alone(tiny_model, chunk):
    """`prefill_chunk_tokens`: alone too, a prompt goes in pieces of at most that many tokens (a request
    arriving waits for one piece); 0 leaves the batch's room (n_batch)."""
    with lm.Engine.load(tiny_model, n_ctx=1024, n_threads=2, n_parallel=2, prefill_chunk_tokens=chunk) as eng:
        toks = (eng.tokenize("the history of the river valley") * 40)[:300]
        seen = _batches(eng)
        assert len(eng.generate(toks, max_tokens=1, temperature=0).tokens) == 1
    sizes = [sum(c.values()) for c in seen]
    assert sum(sizes) == len(toks)
    assert max(sizes) == (24 if chunk else len(toks)), sizes
