"""What a GBNF grammar will cost llama.cpp's grammar sampler, read from its text before llama.cpp builds it.

llama.cpp's grammar keeps one *stack* per way the text so far can continue, and checks each candidate
token against every stack, following each of the token's characters through the stacks it reaches. Two
shapes make that explode, on the engine thread that serves every request:

- **runs of optional items**: consecutive items that may match nothing (`a? a? a?`, `(a?){10}`, nested
  repetitions of such bodies, whose counts multiply: `((a?){10}){10}` is a run of 100). After each
  character every later item of the run opens again, so a token of k characters is followed down
  about C(run, k) paths: `((a?){10}){10}` took 36 s for four tokens. An item whose shortest non-empty
  match has n characters counts 1/n (a token spans few of them).
- **breadth**: the number of alternatives open at one point (an enum of 24k strings, 32k GBNF
  alternatives): every candidate is checked against each.

`check` parses the grammar (llama.cpp's syntax, its rules for names, literals, classes, tokens, groups
and quantifiers) and refuses, with a `GrammarError` naming the field and the limit, a run, a breadth or
an expanded size over `GrammarLimits`; a syntax error names the reason, the line and the column. The
parse is iterative per rule and linear in the text.
"""

from __future__ import annotations

import functools
import re
import sys
import time
from dataclasses import dataclass

from ..errors import GrammarError, GrammarSyntaxError


@dataclass(frozen=True)
class GrammarLimits:
    """Budgets of one grammar: what `check` allows it to be, and the engine time it may take while it runs
    (server settings `grammar_*`; docs/structured.md)."""

    optional_run: float = 16.0  # weighted length of a run of optional items (nested repetitions multiply)
    breadth: int = 512  # alternatives open at one point of the grammar (OpenAI allows 500 enum values)
    elements: int = 1 << 20  # grammar elements after llama.cpp expands the repetitions
    repeat: int = 1000  # a {m,n} count
    depth: int = 2048  # groups nested in one rule (the JSON converter nests one per character of a maxLength)
    # engine time of the grammar sampler while the request runs (grammar.ActiveGrammar): one token's checks
    # and pass over the vocabulary, and all of the request's; over either, the request fails alone
    token_seconds: float = 0.2
    request_seconds: float = 30.0  # sampled JSON on Gemma 3: about 13 ms a token, so thousands of tokens


DEFAULT_LIMITS = GrammarLimits()
# This parse holds the GIL (a worker thread's, but the engine's Python and the event loop need it too):
# a megabyte of grammar takes a few seconds, in which a thread waiting for the GIL gets it only every
# switch interval (5 ms) and the decode steps of every other request crawl. Every this many items the
# parse gives it up at once.
YIELD_EVERY = 256
_PLAIN_LITERAL = re.compile(r'"([^"\\]*)"')
_PLAIN_CLASS = re.compile(r"\[\^?([^\]\\]*)\]")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_NAME = re.compile(r"[A-Za-z0-9_-]+")
_SPACE = re.compile(r"(?:[ \t]|#[^\r\n]*)*")
_SPACE_NL = re.compile(r"(?:[ \t\r\n]|#[^\r\n]*)*")


@dataclass
class _Cost:
    """One expression's shape: nullable (may match nothing), `short` (its shortest non-empty match),
    `open` (its weight inside an enclosing run, when nullable), `head`/`tail` (the weight of the optional
    items it starts/ends with, when not nullable), `run` (its widest run), `breadth` (alternatives open
    where it starts), `wide` (the most open anywhere in it), `size` (its elements in the rule it is part
    of) and `sub` (the elements of the rules llama.cpp generates for its groups and repetitions)."""

    nullable: bool
    short: int
    open: float = 0.0
    head: float = 0.0
    tail: float = 0.0
    run: float = 0.0
    breadth: int = 1
    wide: int = 1
    size: int = 1
    sub: int = 0


_EMPTY = _Cost(True, 1, breadth=0, wide=0, size=0)


def _one(n: int) -> _Cost:
    return _Cost(False, max(n, 1), size=max(n, 1))


def _seq(items: list[_Cost]) -> _Cost:
    if not items:
        return _EMPTY
    cur, run, head, first_hard = 0.0, 0.0, 0.0, None
    breadth, lead = 0, True
    for c in items:
        if lead:
            breadth += c.breadth
            lead = c.nullable
        if c.nullable:
            cur += c.open
        else:
            cur += c.head
            if first_hard is None:
                first_hard, head = c, cur
            run = max(run, cur)
            cur = c.tail
        run = max(run, c.run, cur)
    size, sub = sum(c.size for c in items), sum(c.sub for c in items)
    wide = max(breadth, max(c.wide for c in items))
    if first_hard is None:
        return _Cost(True, min(c.short for c in items), open=cur, run=run, breadth=breadth, wide=wide, size=size,
                     sub=sub)
    short = sum(c.short for c in items if not c.nullable)
    return _Cost(False, short, head=head, tail=cur, run=run, breadth=breadth, wide=wide, size=size, sub=sub)


def _alt(alts: list[_Cost]) -> _Cost:
    if len(alts) == 1:
        return alts[0]
    short = min(a.short for a in alts)
    run = max(a.run for a in alts)
    breadth, size, sub = sum(a.breadth for a in alts), sum(a.size for a in alts), sum(a.sub for a in alts)
    wide = max(breadth, max(a.wide for a in alts))
    if any(a.nullable for a in alts):
        hard = [a for a in alts if not a.nullable]
        opn = sum(a.open for a in alts if a.nullable) + (1.0 / min(a.short for a in hard) if hard else 0.0)
        return _Cost(True, short, open=opn, run=max(run, opn), breadth=breadth, wide=wide, size=size, sub=sub)
    return _Cost(False, short, head=max(a.head for a in alts), tail=max(a.tail for a in alts), run=run,
                 breadth=breadth, wide=wide, size=size, sub=sub)


def _rep(x: _Cost, lo: int, hi: int | None, where: str) -> _Cost:
    if x.nullable:
        if hi is None:
            raise ValueError(f"{where}: an unbounded repetition (*, + or {{m,}}) of something that can match "
                             "nothing")
        opn, breadth = hi * x.open, x.breadth * max(hi, 1)
        return _Cost(True, x.short, open=opn, run=max(x.run, opn), breadth=breadth, wide=max(x.wide, breadth),
                     size=x.size * max(hi, 1), sub=x.sub)
    copies = lo + 1 if hi is None else max(hi, 1)
    joint = x.tail + x.head if hi is None or hi > 1 else 0.0  # where one copy ends and the next begins
    run = max(x.run, joint)
    if lo == 0:
        opn = 1.0 / x.short + x.head
        return _Cost(True, x.short, open=opn, run=max(run, opn), breadth=x.breadth, wide=x.wide,
                     size=x.size * copies, sub=x.sub)
    tail = x.tail + (1.0 / x.short if hi is None or hi > lo else 0.0)
    return _Cost(False, x.short * lo, head=x.head, tail=tail, run=max(run, tail), breadth=x.breadth, wide=x.wide,
                 size=x.size * copies, sub=x.sub)


def syntax_error(text: str, param: str, what: str, at: int, reason: str = "syntax") -> GrammarSyntaxError:
    """A GrammarSyntaxError for `what`, found at character `at` of `text` (its line and column named)."""
    line = text.count("\n", 0, at) + 1
    col = at - (text.rfind("\n", 0, at) + 1) + 1
    near = text[at:at + 24].split("\n")[0]
    return GrammarSyntaxError(param, reason, f"the grammar does not parse: {what} at line {line}, column {col}"
                                             + (f" (near {near!r})" if near else ""), line=line, column=col,
                              hint="GBNF syntax: https://github.com/ggml-org/llama.cpp/blob/master/grammars/"
                                   "README.md")


class _Parser:
    """llama.cpp's GBNF syntax (llama-grammar.cpp's parser), building `_Cost`s instead of rules."""

    def __init__(self, text: str, param: str, limits: GrammarLimits) -> None:
        self.s, self.i, self.param, self.limits = text, 0, param, limits
        self.rules: dict[str, list[tuple[str, int]]] = {}  # rule name -> [(raw body start, end)]
        self.items = 0  # items parsed so far (see `sequence`)
        self.bodies: dict[str, _Cost | None] = {}
        self.tokens: list[tuple[str, int]] = []  # token references <...>: (their text, where they start)

    def error(self, what: str, at: int | None = None, reason: str = "syntax") -> GrammarSyntaxError:
        return syntax_error(self.s, self.param, what, self.i if at is None else at, reason)

    def space(self, newline_ok: bool) -> None:
        self.i = (_SPACE_NL if newline_ok else _SPACE).match(self.s, self.i).end()
        s, n = self.s, len(self.s)
        while self.i < n:
            c = s[self.i]
            if c == "#":
                while self.i < n and s[self.i] not in "\r\n":
                    self.i += 1
            elif c in " \t" or (newline_ok and c in "\r\n"):
                self.i += 1
            else:
                break

    def name(self) -> str:
        m = _NAME.match(self.s, self.i)
        if not m:
            raise self.error("expecting a rule name")
        self.i = m.end()
        return m.group(0)

    def char(self) -> None:
        """One character of a literal or class (escapes: \\xHH \\uHHHH \\UHHHHHHHH \\t \\r \\n \\\\ \\" \\[ \\] \\-)."""
        if self.i >= len(self.s):
            raise self.error("unexpected end of input")
        if self.s[self.i] != "\\":
            self.i += 1
            return
        e = self.s[self.i + 1:self.i + 2]
        hexes = {"x": 2, "u": 4, "U": 8}.get(e)
        if hexes:
            digits = self.s[self.i + 2:self.i + 2 + hexes]
            if len(digits) != hexes or any(c not in "0123456789abcdefABCDEF" for c in digits):
                raise self.error(f"expecting {hexes} hex digits after \\{e}", reason="bad_escape")
            self.i += 2 + hexes
        elif e and e in 'trn\\"[]-':
            self.i += 2
        else:
            raise self.error(f"an unknown escape {self.s[self.i:self.i + 2]!r}", reason="bad_escape")

    def count(self) -> int:
        j = self.i
        while j < len(self.s) and self.s[j] in "0123456789":
            j += 1
        if j == self.i:
            raise self.error("expecting an integer")
        digits, self.i = self.s[self.i:j], j
        if len(digits) > 9 or int(digits) > self.limits.repeat:
            raise GrammarError(self.param, f"a repetition count of {digits[:12]}{'…' if len(digits) > 12 else ''}:"
                                           f" at most {self.limits.repeat} (grammar_max_repeat)")
        return int(digits)

    def rules_pass(self) -> None:
        """Split the text into rules, checking the syntax; each rule's cost comes later (rule refs)."""
        self.space(True)
        while self.i < len(self.s):
            name = self.name()
            self.space(False)
            if not self.s.startswith("::=", self.i):
                raise self.error("expecting '::='")
            self.i += 3
            self.space(True)
            start = self.i
            self.alternates(False, 0, dry=True)
            self.rules.setdefault(name, []).append((start, self.i))
            if self.s.startswith("\r\n", self.i):
                self.i += 2
            elif self.i < len(self.s) and self.s[self.i] in "\r\n":
                self.i += 1
            elif self.i < len(self.s) and self.s[self.i] in ")]":
                raise self.error(f"a {self.s[self.i]!r} that closes nothing", reason="unmatched_close")
            elif self.i < len(self.s):
                raise self.error("expecting a newline or the end")
            self.space(True)

    def alternates(self, nested: bool, depth: int, dry: bool = False) -> _Cost:
        if depth > self.limits.depth:
            raise GrammarError(self.param, f"groups nested more than {self.limits.depth} deep in one rule")
        alts = [self.sequence(nested, depth, dry)]
        while self.i < len(self.s) and self.s[self.i] == "|":
            self.i += 1
            self.space(True)
            alts.append(self.sequence(nested, depth, dry))
        return _EMPTY if dry else _alt(alts)

    def sequence(self, nested: bool, depth: int, dry: bool) -> _Cost:
        items: list[_Cost] = []
        s = self.s
        while self.i < len(s):
            self.items += 1
            if not self.items % YIELD_EVERY:
                time.sleep(0)  # hand the GIL to the engine and the event loop now and then (see YIELD_EVERY)
            c, at = s[self.i], self.i
            if c in "\"[":
                items.append(self.literal(c, at))
            elif c in "<!":
                self.i += 1 if c == "<" else 2
                j = s.find(">", self.i)
                if (c == "!" and s[at + 1:at + 2] != "<") or j < 0:
                    raise self.error("expecting a token <...>", at)
                if dry:  # (rule bodies are parsed again for their costs: each reference is kept once)
                    start = at + (c == "!")
                    self.tokens.append((s[start:j + 1], start))
                self.i = j + 1
                items.append(_one(1))
            elif c == ".":
                self.i += 1
                items.append(_one(1))
            elif c in _NAME_CHARS:
                name = self.name()
                items.append(_EMPTY if dry else self.ref(name, at))
            elif c == "(":
                self.i += 1
                self.space(True)
                inner = self.alternates(True, depth + 1, dry)
                if not s.startswith(")", self.i):
                    raise self.error("a '(' that is never closed (expecting ')' "
                                     + ("at the end)" if self.i >= len(s) else f"before {s[self.i]!r})"), at,
                                     reason="unclosed_group")
                self.i += 1
                items.append(_group(inner))
            elif c in "*+?{":
                if not items:
                    raise self.error(f"{c!r} with nothing before it to repeat")
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}.get(c, (0, 0))
                if c == "{":
                    lo, hi = self.braces()
                if not dry:
                    try:
                        items[-1] = _rep(items[-1], lo, hi, f"at character {at}")
                    except ValueError as e:
                        raise GrammarError(self.param, f"the grammar has {e}: llama.cpp cannot use it") from None
            else:
                break
            self.space(nested)
        return _EMPTY if dry else _seq(items)

    def literal(self, c: str, at: int) -> _Cost:
        """A string literal or a character class, from its opening quote or bracket."""
        s = self.s
        fast = (_PLAIN_LITERAL if c == '"' else _PLAIN_CLASS).match(s, self.i)
        if fast:  # no escapes inside: nothing to check character by character
            self.i = fast.end()
            n = len(fast.group(1))
        else:
            self.i += 1
            if c == "[" and s.startswith("^", self.i):
                self.i += 1
            n = 0
            while self.i < len(s) and s[self.i] != ('"' if c == '"' else "]"):
                self.char()
                n += 1
                if c == "[" and s.startswith("-", self.i) and not s.startswith("-]", self.i):
                    self.i += 1
                    self.char()
            if self.i >= len(s):
                raise self.error("an unclosed " + ("string literal" if c == '"' else "character class"), at,
                                 reason="unclosed_literal")
            self.i += 1
        return _EMPTY if c == '"' and n == 0 else _one(n if c == '"' else 1)

    def braces(self) -> tuple[int, int | None]:
        self.space(True)
        lo = self.count()
        self.space(True)
        hi: int | None = lo
        if self.s.startswith(",", self.i):
            self.i += 1
            self.space(True)
            hi = self.count() if self.i < len(self.s) and self.s[self.i] in "0123456789" else None
            self.space(True)
        if not self.s.startswith("}", self.i):
            raise self.error("expecting '}'")
        self.i += 1
        if hi is not None and hi < lo:
            raise self.error(f"a repetition {{{lo},{hi}}} whose maximum is below its minimum")
        return lo, hi

    def ref(self, name: str, at: int) -> _Cost:
        if name not in self.rules:
            raise self.error(f"the rule {name!r} is used but never defined", at, reason="undefined_rule")
        if name in self.bodies:
            got = self.bodies[name]
            return _one(1) if got is None else _ref(got)  # None: recursion (a later character ends it)
        self.bodies[name] = None
        saved = self.i
        alts = []
        for start, end in self.rules[name]:
            self.i = start
            alts.append(self.alternates(False, 0))
            if self.i != end:
                raise self.error("cannot parse this rule", start)
        self.i = saved
        self.bodies[name] = got = _alt(alts)
        return _ref(got)


def _group(c: _Cost) -> _Cost:
    """A group: its elements go into a rule of its own (one element here)."""
    return _Cost(c.nullable, c.short, c.open, c.head, c.tail, c.run, c.breadth, c.wide, 1, c.sub + c.size)


def _ref(c: _Cost) -> _Cost:
    """A reference to a named rule (whose elements `check` counts once)."""
    return _Cost(c.nullable, c.short, c.open, c.head, c.tail, c.run, c.breadth, c.wide, 1, 0)


def check(text: str, *, param: str, root: str = "root", limits: GrammarLimits = DEFAULT_LIMITS
          ) -> tuple[tuple[str, int], ...]:
    """Refuse a grammar that does not parse or would cost over `limits` (see the module docstring); returns
    its token references (`<name>`, `<[id]>`: their text and offset), which only a vocabulary can check."""
    run, breadth, size, tokens = _measure(text, param, root, limits.repeat, limits.depth)
    if run > limits.optional_run:
        raise GrammarError(param, f"the grammar has a run of optional items of weight {run:g} (nested optional "
                                  f"repetitions multiply, e.g. ((a?){{10}}){{10}} weighs 100): at most "
                                  f"{limits.optional_run:g} (grammar_max_optional_run)",
                           hint="make the repeated item non-optional (a{0,100} rather than (a?){100}), "
                                "or repeat fewer optional items")
    if breadth > limits.breadth:
        raise GrammarError(param, f"the grammar has {breadth} alternatives open at one point: at most "
                                  f"{limits.breadth} (grammar_max_alternatives)",
                           hint="fewer alternatives (a shorter enum or choice list), or a pattern instead")
    if size > limits.elements:
        raise GrammarError(param, f"the grammar expands to about {size} elements: at most {limits.elements} "
                                  "(grammar_max_elements)", hint="smaller repetition counts")
    return tokens


@functools.lru_cache(maxsize=8)  # a client's GBNF is measured when the request is read and when it compiles
def _measure(text: str, param: str, root: str, repeat: int, depth: int
             ) -> tuple[float, int, int, tuple[tuple[str, int], ...]]:
    """(widest run of optional items, most alternatives open at once, expanded elements, token references)
    of a grammar that parses (a GrammarError otherwise, not cached)."""
    limits = GrammarLimits(repeat=repeat, depth=depth)
    p = _Parser(text, param, limits)
    # Groups recurse here as in llama.cpp's parser, three frames a level: make room for `limits.depth` of
    # them (Python-to-Python calls do not grow the C stack, so a higher limit is safe).
    if sys.getrecursionlimit() < 4 * depth + 1000:
        sys.setrecursionlimit(4 * depth + 1000)
    try:
        p.rules_pass()
        if root not in p.rules:
            raise GrammarSyntaxError(param, "missing_root", f"the grammar has no {root!r} rule (the rule output "
                                     "starts from)", hint=f"add a rule '{root} ::= ...'")
        for name in p.rules:
            p.ref(name, 0)
    except RecursionError:
        raise GrammarError(param, "the grammar's rules refer to one another too deep (a chain of a few hundred "
                                  "rules, each the first item of the one before)") from None
    costs = [c for c in p.bodies.values() if c is not None]
    return (max((c.run for c in costs), default=0.0), max((c.wide for c in costs), default=0),
            sum(c.size + c.sub for c in costs) + len(costs), tuple(p.tokens))


__all__ = ["DEFAULT_LIMITS", "GrammarLimits", "check", "syntax_error"]
