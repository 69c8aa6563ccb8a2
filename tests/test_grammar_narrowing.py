"""First-character narrowing of the grammar's vocabulary passes (engine/grammar.py `refused_by_first`):
asking llama.cpp's grammar about one token per first character, then only about the tokens whose first
character it accepts, gives exactly the mask of asking about every token. Real llama.cpp, tiny model."""

from __future__ import annotations

import numpy as np
import pytest
from test_structured import accepts

import loramux as lm
from loramux import _native as N
from loramux.engine import grammar as G
from loramux.engine.regex_gbnf import gbnf_literal

GRAMMARS = [
    G.choice([f"option number {i}" for i in range(40)] + ["yes", "no"]),
    G.regex(r"(ab|cd)+-\d{2,3}[x-z]?"),
    G.json_schema({"type": "object", "properties": {"a": {"type": "integer"}, "name": {"type": "string"}},
                   "required": ["a", "name"]}),
    G.gbnf('root ::= ( [a-c] | "the" | "\\u00e9t\\u00e9" ) root?'),
]


@pytest.fixture(scope="module")
def eng(tiny_model):
    e = lm.Engine.load(tiny_model, n_ctx=512, n_threads=2)
    yield e
    e.close()


def _full_mask(g: G.ActiveGrammar, n_vocab: int) -> np.ndarray:
    return g.handle.allowed_among(np.arange(n_vocab, dtype=np.int32))


@pytest.mark.parametrize("i", range(len(GRAMMARS)))
def test_narrowed_pass_equals_the_full_pass(eng, i):
    """At every point of a walk through the grammar (each step takes the lowest allowed token that is not
    an end token), the tokens refused by their first character are refused by the full pass, and the
    narrowed pass (the rest asked one by one) allows exactly what the full pass allows."""
    model = eng.model
    g = GRAMMARS[i].compile(model)
    narrowed_any = 0
    try:
        for _ in range(12):
            full = _full_mask(g, model.n_vocab)
            known = g.table.refused_by_first(g.handle.allowed_among(g.table.probes))
            assert not (known & full).any(), "a token refused by its first character is allowed by the grammar"
            rest = np.flatnonzero(~known)
            narrowed = np.zeros(model.n_vocab, dtype=bool)
            narrowed[rest] = g.handle.allowed_among(rest.astype(np.int32))
            assert (narrowed == full).all()
            narrowed_any += int(known.sum())
            options = [t for t in np.flatnonzero(full) if not model.is_eog(int(t))]
            if not options:
                break
            g.accept(int(options[0]))
    finally:
        g.close()
    assert narrowed_any > 0, "the narrowing never removed a token: the test proves nothing"


def test_narrowing_leaves_greedy_outputs_unchanged(eng, monkeypatch):
    """Whole generations: greedy through the lazy checks with narrowed passes equals masking every token
    with full passes (no narrowing), token for token."""
    def run() -> list[list[int]]:
        return [eng.generate(p, grammar=g, max_tokens=30, temperature=0).tokens
                for g in GRAMMARS for p in ("the cat", "a dog")]
    narrowed = run()
    monkeypatch.setattr(N.GrammarHandle, "lazy", False)
    monkeypatch.setattr(G._Utf8Table, "refused_by_first", lambda self, allowed: np.zeros(len(self.ok), bool))
    assert run() == narrowed


def test_token_references_turn_narrowing_off(eng):
    """A grammar with a token reference (<...>) matches a token by id, not by its first character."""
    g = G.gbnf("root ::= <[5]> [a-z]").compile(eng.model)
    h = G.gbnf('root ::= "x" [a-z]').compile(eng.model)
    try:
        assert not g.narrows and h.narrows
    finally:
        g.close()
        h.close()


CHOICES = [["yes", "no", "yesno", "ye"], [f"option {i}" for i in range(25)], ["a", "aa", "aaa", "ab", "b"],
           ['say "hi"', "say \\n", "sa", "x\u00e9t\u00e9", "x\u00e9"]]


@pytest.mark.parametrize("i", range(len(CHOICES)))
def test_choice_tree_accepts_exactly_the_options(eng, i):
    """guided_choice is written as a prefix tree (one stack per open branch, not per option): it accepts
    each option and nothing else (prefixes, extensions, near misses), exactly as the flat alternation."""
    options = CHOICES[i]
    tree = G.choice(options)
    flat = G.Grammar("root ::= " + " | ".join(gbnf_literal(o) for o in options), "test")
    probes = set(options) | {o[:-1] for o in options} | {o + "a" for o in options} | {o + "0" for o in options}
    probes |= {"", "option 2", "option 30", "yesn", "aab", "abb", "x\u00e9t"}
    for text in sorted(probes):
        assert accepts(eng.model, tree, text) == (text in options) == accepts(eng.model, flat, text), text
