"""Fair shares of the engine for a request of several sequences (`n`, `best_of`, several prompts, fan-out).

The server submits each sequence of one HTTP request as an engine request carrying the same `party`.
Three bounds keep such a request from taking every other request's turn:

- **slots**: one party holds at most `request_slots` sequence slots at once (by default all but one of
  `n_parallel`), so a request arriving while an `n` = 16 request runs finds a slot free at once instead
  of waiting for a whole wave of its sequences;
- **steps**: while a sequence of another party runs, one party puts at most `request_step_seqs` of its
  sequences into a decode step (default 1), taking turns (round-robin over them in slot order). Alone it
  decodes them all together;
- **turns**: while a sequence of another party runs, a party of several sequences takes part in one decode
  step of every `request_step_every` (default 2); the steps between serve the others alone, so a neighbour's
  step is its own size every other step instead of carrying one more sequence each time. The steps between
  go to requests of one sequence; a step they are not in (two requests of several sequences side by side,
  nobody else) every party takes: the shares never idle the engine.

Two kinds of request of one sequence take the same turns, because each of their steps costs a neighbour
more than a sequence of its own would (`held`):

- **a long prompt**: while another request decodes, a request with more than `prefill_step_tokens` prompt
  tokens still to decode puts at most that many into a step (`prompt_cap`), in turns. Without it a neighbour
  arriving during an 1,100-token prompt (a chat with tool declarations) waited for 512-token chunks of
  1.5-2 s each (BENCHMARKS.md, "Attacks beside a neighbour");
- **a costly grammar**: one whose checks and passes took, per token so far, more than `HEAVY_GRAMMAR` of a
  decode step (500 choices: 10-45 ms a token beside 22 ms steps).

Their turns are weighed by their cost (`turn_every`): such a request takes part in one step of every
1 + `TURN_WEIGHT` × (the engine time it adds to a step it is in, over the neighbours' step alone: the
sequences decoding in every step, `neighbours`), at least `request_step_every`. A neighbour then pays, per
token of its own, under 1/`TURN_WEIGHT` of its own step for it,
whatever the grammar costs: a FunctionGemma tool grammar of 40-70 ms a token beside 20-25 ms steps takes
about one step of eight, not one of two. The costs are measured as the engine runs (`StepClock`): a
decode step alone, what each further token adds to it, and what a prompt token adds.

None of them changes what a sequence computes (its own tokens, sampler and seed), only when; in deterministic
mode the tokens are then identical, elsewhere as identical as any change of batch composition leaves them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

# prompt tokens of a long prompt one decode step takes while another request decodes (the default of
# EngineOptions.prefill_step_tokens)
PREFILL_STEP_TOKENS = 16
# a grammar whose engine time per token exceeds this fraction of a decode step takes turns beside others
HEAVY_GRAMMAR = 0.25
# a request that takes turns takes part in one step of every 1 + TURN_WEIGHT × (its cost per step / a step)
TURN_WEIGHT = 2.0


class Spends(Protocol):
    """A request's grammar, as the shares read it: the engine seconds it has taken so far."""

    spent: float


class Member(Protocol):
    """What the shares read of a scheduler request."""

    generated: list[int]
    n_past: int
    pending: int | None
    grammar: Spends | None

    @property
    def prompt(self) -> list[int]: ...

    @property
    def party(self) -> object | None: ...

    @property
    def arrived(self) -> float: ...


M = TypeVar("M", bound=Member)


def party_of(r: Member) -> object:
    """The request a sequence belongs to: its `party`, or the sequence itself when it has none."""
    return r.party if r.party is not None else r


def slot_limit(request_slots: int, n_parallel: int) -> int:
    """The slots one party may hold: `request_slots`, or (0) all but one of `n_parallel`, at least 1."""
    return request_slots if request_slots > 0 else max(1, n_parallel - 1)


def over_slots(r: Member, running: Sequence[Member], limit: int) -> bool:
    """Would admitting `r` give its party more than `limit` running sequences? Single-sequence requests
    never are (a party of one holds one slot)."""
    if r.party is None:
        return False
    p = party_of(r)
    return sum(1 for q in running if party_of(q) is p) >= limit


def held(r: Member, prefill_step_tokens: int, step_s: float) -> bool:
    """Does `r` take turns while another party runs? A sequence of a party of several, a request with more
    than `prefill_step_tokens` prompt tokens left, or one whose grammar took more than `HEAVY_GRAMMAR` of a
    decode step (`step_s` seconds) per token so far."""
    return (r.party is not None or len(r.prompt) - r.n_past > prefill_step_tokens
            or _grammar_per_token(r) > HEAVY_GRAMMAR * step_s)


def neighbours(running: Sequence[Member], prefill_step_tokens: int, step_s: float) -> int:
    """The sequences a turn is weighed against: those decoding in every step (past their prompt, not held),
    at least 1. The held ones are left out, so an attacker's own tokens never make its turns cheaper."""
    return max(1, sum(1 for q in running if q.n_past >= len(q.prompt) and not held(q, prefill_step_tokens, step_s)))


def _grammar_per_token(r: Member) -> float:
    """Engine seconds `r`'s grammar took per token so far (0 without a grammar or a token)."""
    return r.grammar.spent / len(r.generated) if r.grammar is not None and r.generated else 0.0


class StepClock:
    """What the turns are weighed by, measured as the engine runs (averages over about 8 steps): `step_s`,
    seconds of a decode step of decode tokens only; `one_s`, of such a step of one token (a neighbour's step
    alone); `row_s`, what each further decode token adds to one (on a CPU about a whole step, where each
    row's output projection is most of it; on a GPU nearly nothing); `token_s`, what a prompt token adds."""

    def __init__(self) -> None:
        self.step_s = 0.0
        self.one_s = 0.0
        self.row_s = 0.0
        self.token_s = 0.0

    def alone(self, decoding: int) -> float:
        """Seconds of a decode step of `decoding` decode tokens and nothing else: the step that neighbours
        pay anyway, which a turn's extra cost is weighed against (0 before anything was measured). Weighed
        against a lone neighbour's step instead, a 16-token prompt piece beside 8 decoding sequences waited
        about 9 steps for each turn on a CPU, its sequence idle meanwhile, where against their 8-token step
        it takes one of every 3 (BENCHMARKS.md, "Turns weighed against the neighbours' step")."""
        if self.one_s <= 0:
            return self.step_s
        return self.one_s + self.row_s * max(0, decoding - 1)

    def observe(self, seconds: float, tokens: int, prompt_tokens: int) -> None:
        """One decode of `tokens` tokens, `prompt_tokens` of them prompt tokens, took `seconds`."""
        if prompt_tokens == 0:
            self.step_s += (seconds - self.step_s) / 8
            if tokens == 1:
                self.one_s += (seconds - self.one_s) / 8
            elif self.one_s > 0:
                self.row_s += (max(0.0, seconds - self.one_s) / (tokens - 1) - self.row_s) / 8
        elif self.step_s > 0:
            self.token_s += (max(0.0, seconds - self.step_s) / prompt_tokens - self.token_s) / 8


def turn_every(r: Member, prefill_step_tokens: int, clock: StepClock, every: int, decoding: int = 1) -> int:
    """1 when `r` does not take turns (`held`), else the steps from one of its turns to the next: `every`,
    or more for a request whose step costs more: 1 + TURN_WEIGHT × its cost per step over the neighbours'
    step alone (`decoding` of them: `neighbours`, `StepClock.alone`). That cost is its grammar's time per token
    with the row its token adds, or what its next prompt piece adds. The neighbours then pay, per token of
    their own, under 1/TURN_WEIGHT of their own step for it."""
    if not held(r, prefill_step_tokens, clock.step_s):
        return 1
    base = clock.alone(decoding)
    if base <= 0:
        return every
    grammar = _grammar_per_token(r)
    cost = grammar + clock.row_s if grammar > HEAVY_GRAMMAR * clock.step_s else 0.0  # a costly one only
    if len(r.prompt) - r.n_past > prefill_step_tokens:
        cost = max(cost, prefill_step_tokens * clock.token_s)
    return max(every, math.ceil(1 + TURN_WEIGHT * cost / base))


def prompt_cap(r: Member, running: Sequence[Member], prefill_step_tokens: int, chunk_tokens: int = 0
               ) -> int | None:
    """The most prompt tokens of `r` one decode step may take: `prefill_step_tokens` while a request of
    another party decodes (its steps would carry the chunk), else `chunk_tokens` (0: None, the batch's room:
    a request arriving during that decode waits for all of it)."""
    p = party_of(r)  # (a request past its prompt decodes: its pending token may be in this batch already)
    if any(q.n_past >= len(q.prompt) and party_of(q) is not p for q in running):
        return prefill_step_tokens
    return chunk_tokens or None


def step_share(members: list[M], running: Sequence[Member], per_step: int, step: int,
               every: int = 1, spacing: Callable[[M], int] | None = None) -> list[M]:
    """The members decode step `step` serves: all of them when one party runs alone, else at most
    `per_step` of each party's, in turn (the window moves on by `per_step` each step the party takes), and
    those that take turns only in their turns: a member `m` with `spacing(m)` = n > 1 in one step of every
    n (by default the sequences of a party of several, n = `every`)."""
    parties = {id(party_of(q)) for q in running}
    if len(parties) < 2:
        return members
    turn = step
    if every > 1:
        turn = step // every
        gap = spacing or (lambda r: every if r.party is not None else 1)
        gaps = [gap(r) for r in members]
        if 1 in gaps:  # someone never held back: the others only in their turns
            members = [r for r, n in zip(members, gaps) if step % n == 0]
    by_party: dict[int, list[M]] = {}
    for r in members:
        by_party.setdefault(id(party_of(r)), []).append(r)
    chosen: set[int] = set()
    for group in by_party.values():
        if len(group) <= per_step:
            chosen.update(id(r) for r in group)
            continue
        start = turn * per_step % len(group)
        chosen.update(id(r) for r in (group[start:] + group[:start])[:per_step])
    return [r for r in members if id(r) in chosen]


__all__ = ["HEAVY_GRAMMAR", "PREFILL_STEP_TOKENS", "TURN_WEIGHT", "Member", "Spends", "StepClock", "held",
           "neighbours", "over_slots", "party_of", "prompt_cap", "slot_limit", "step_share", "turn_every"]
