"""Regular expressions as GBNF, for `guided_regex` and JSON-schema `pattern`: a documented subset.

Supported (Python `re` syntax, whole-output match): literals and escaped literals; `.` (any character but
a newline); classes `[a-z0-9_]`, `[^...]` and the escapes `\\d \\D \\w \\W \\s \\S` (ASCII meaning) inside or
outside them; `\\n \\r \\t \\f \\v \\0 \\xHH \\uHHHH`; groups `(...)`, `(?:...)`, `(?P<name>...)`,
`(?<name>...)`; alternation `|`; quantifiers `* + ? {n} {n,} {n,m}` (a lazy `?` after one changes
nothing when the whole output must match); `^` at the very start and `$` at the very end.

Refused, with a `GrammarError` naming the construct: lookahead and lookbehind, backreferences, word
boundaries `\\b \\B`, `\\A \\Z`, inline flags `(?i)`, possessive quantifiers, Unicode properties `\\p{..}`,
anchors anywhere else, repetition counts above `MAX_REPEAT`.

In JSON mode (a string schema's `pattern`) the grammar produces the pattern's text as the inside of a
JSON string: `"` and `\\` come out escaped, and control characters, which JSON cannot hold raw, are
left out of classes.

Also the GBNF writers the other constraints share: literals and classes, choice lists as prefix trees
(`choice_gbnf`: a regex `a|b|c` of plain strings, written so that llama.cpp keeps few stacks), and the
bounded JSON integers and numbers of a schema's `minimum`/`maximum` (`integer_range`, `number_range`).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from ..errors import GrammarError

MAX_PATTERN_CHARS = 8192
MAX_DIGITS = 15  # unbounded integer parts: at most this many digits, as llama.cpp's converter does
MAX_REPEAT = 1000  # {n,m} bounds: llama.cpp expands repetitions into rules
MAX_DEPTH = 64
MAX_CODE = 0x10FFFF

Ranges = list[tuple[int, int]]

_DIGIT: Ranges = [(0x30, 0x39)]
_WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE: Ranges = [(0x09, 0x0D), (0x20, 0x20)]
_SIMPLE = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0"}
_JSON_UNSAFE: Ranges = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]


def _norm(r: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(r):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(r: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in _norm(r):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE:
        out.append((nxt, MAX_CODE))
    return out


def _minus(r: Ranges, cut: Ranges) -> Ranges:
    keep = _complement(cut)
    out = []
    for lo, hi in _norm(r):
        for a, b in keep:
            if max(lo, a) <= min(hi, b):
                out.append((max(lo, a), min(hi, b)))
    return out


def _class_char(c: int) -> str:
    ch = chr(c)
    if ch in "]\\-^[\"" or c < 0x20 or c == 0x7F or not ch.isprintable():
        return f"\\x{c:02X}" if c <= 0xFF else (f"\\u{c:04X}" if c <= 0xFFFF else f"\\U{c:08X}")
    return ch


def gbnf_class(r: Ranges) -> str:
    """A GBNF character class for these code-point ranges."""
    parts = [_class_char(a) if a == b else f"{_class_char(a)}-{_class_char(b)}" for a, b in _norm(r)]
    return "[" + "".join(parts) + "]"


def gbnf_literal(text: str) -> str:
    """A GBNF string literal."""
    out = []
    for ch in text:
        c = ord(ch)
        if ch in "\"\\":
            out.append("\\" + ch)
        elif c < 0x20 or c == 0x7F:
            out.append(f"\\x{c:02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


class _Parser:
    def __init__(self, pattern: str, param: str, json_mode: bool) -> None:
        self.p, self.i, self.param, self.json = pattern, 0, param, json_mode

    def fail(self, what: str) -> GrammarError:
        return GrammarError(self.param, f"the regular expression uses {what} (at character {self.i}), which "
                                        "constrained decoding does not support",
                            hint="see docs/structured.md for the supported regex subset")

    def peek(self) -> str:
        return self.p[self.i] if self.i < len(self.p) else ""

    def alternation(self, depth: int) -> str:
        if depth > MAX_DEPTH:
            raise self.fail(f"groups nested more than {MAX_DEPTH} deep")
        alts = [self.sequence(depth)]
        while self.peek() == "|":
            self.i += 1
            alts.append(self.sequence(depth))
        return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"

    def sequence(self, depth: int) -> str:
        items: list[str] = []
        while self.i < len(self.p) and self.peek() not in "|)":
            atom = self.atom(depth)
            items.append(self.quantified(atom))
        return "(" + " ".join(items) + ")" if items else '""'

    def quantified(self, atom: str) -> str:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            out = f"({atom}){c}"
        elif c == "{" and self._is_count():
            lo, hi = self._count()
            out = f"({atom}){{{lo}}}" if lo == hi else f"({atom}){{{lo},{'' if hi is None else hi}}}"
        else:
            return atom
        if self.peek() == "?":
            self.i += 1  # lazy: the same language when the whole output must match
        elif self.peek() == "+":
            raise self.fail("a possessive quantifier")
        elif self.peek() in ("*", "+", "?", "{"):
            raise self.fail("a repeated quantifier")
        return out

    def _is_count(self) -> bool:
        j = self.p.find("}", self.i)
        body = self.p[self.i + 1:j] if j > 0 else ""
        return bool(body) and all(ch.isdigit() or ch == "," for ch in body) and body.count(",") <= 1 \
            and body[0] != ","

    def _count(self) -> tuple[int, int | None]:
        j = self.p.find("}", self.i)
        body = self.p[self.i + 1:j]
        self.i = j + 1
        lo_s, _, hi_s = body.partition(",")
        lo = int(lo_s)
        hi = lo if "," not in body else (int(hi_s) if hi_s else None)
        if max(lo, hi or 0) > MAX_REPEAT or (hi is not None and hi < lo):
            raise self.fail(f"the repetition {{{body}}} (counts must be ordered and at most {MAX_REPEAT})")
        return lo, hi

    def atom(self, depth: int) -> str:
        c = self.peek()
        if c == "(":
            return self.group(depth)
        if c == "[":
            return self.chars(self.char_class())
        if c == ".":
            self.i += 1
            return self.chars(_complement([(0x0A, 0x0A)]))
        if c == "\\":
            esc = self.escape()
            return self.chars(esc) if isinstance(esc, list) else self.literal(esc)
        if c in "^$":
            raise self.fail(f"the anchor {c!r} inside the pattern (only ^ at the start and $ at the end)")
        if c in "*+?":
            raise self.fail(f"a quantifier {c!r} with nothing to repeat")
        self.i += 1
        return self.literal(c)

    def group(self, depth: int) -> str:
        self.i += 1
        if self.p.startswith("?", self.i):
            rest = self.p[self.i:]
            if rest.startswith("?:"):
                self.i += 2
            elif rest.startswith(("?P<", "?<")) and not rest.startswith(("?<=", "?<!")):
                j = self.p.find(">", self.i)
                if j < 0:
                    raise self.fail("an unterminated group name")
                self.i = j + 1
            else:
                names = {"?=": "a lookahead", "?!": "a negative lookahead", "?<=": "a lookbehind",
                         "?<!": "a negative lookbehind", "?P=": "a named backreference", "?#": "a comment"}
                kind = next((v for k, v in names.items() if rest.startswith(k)), "an inline flag or extension")
                raise self.fail(f"{kind} '({rest[:3]}'")
        inner = self.alternation(depth + 1)
        if self.peek() != ")":
            raise self.fail("an unbalanced '('")
        self.i += 1
        return f"({inner})"

    def escape(self) -> str | Ranges:
        """After a backslash: a literal character, or ranges for a class escape."""
        self.i += 1
        c = self.peek()
        if not c:
            raise self.fail("a trailing backslash")
        self.i += 1
        classes = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
        if c in classes:
            return list(classes[c])
        if c.lower() in classes:
            return _complement(classes[c.lower()])
        if c in _SIMPLE:
            return _SIMPLE[c]
        if c in "xu":
            n = 2 if c == "x" else 4
            digits = self.p[self.i:self.i + n]
            if len(digits) != n or any(ch not in "0123456789abcdefABCDEF" for ch in digits):
                raise self.fail(f"a malformed \\{c} escape")
            self.i += n
            return chr(int(digits, 16))
        if c.isdigit():
            raise self.fail(f"a backreference '\\{c}'")
        if c in "bB":
            raise self.fail(f"a word boundary '\\{c}'")
        if c in "AZzG":
            raise self.fail(f"the anchor '\\{c}'")
        if c in "pP":
            raise self.fail(f"a Unicode property '\\{c}'")
        if c.isalnum():
            raise self.fail(f"the unknown escape '\\{c}'")
        return c

    def char_class(self) -> Ranges:
        self.i += 1
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        out: Ranges = []
        first = True
        while True:
            c = self.peek()
            if not c:
                raise self.fail("an unterminated '['")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_item()
            if isinstance(lo, list):
                out += lo
                continue
            if self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.class_item()
                if isinstance(hi, list) or ord(hi) < ord(lo):
                    raise self.fail("a bad class range")
                out.append((ord(lo), ord(hi)))
            else:
                out.append((ord(lo), ord(lo)))
        return _complement(out) if negate else _norm(out)

    def class_item(self) -> str | Ranges:
        c = self.peek()
        if c == "\\":
            return self.escape()
        if c == "[" and self.p.startswith("[:", self.i):
            raise self.fail("a POSIX class '[:...:]'")
        self.i += 1
        return c

    def chars(self, r: Ranges) -> str:
        if not self.json:
            if not r:
                raise self.fail("an empty character class")
            return gbnf_class(r)
        alts = []
        safe = _minus(r, _JSON_UNSAFE)
        if safe:
            alts.append(gbnf_class(safe))
        for code, text in ((0x22, '\\"'), (0x5C, "\\\\")):
            if any(a <= code <= b for a, b in r):
                alts.append(gbnf_literal(text))
        if not alts:
            raise self.fail("a character class with nothing a JSON string can hold")
        return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"

    def literal(self, ch: str) -> str:
        return gbnf_literal(json.dumps(ch, ensure_ascii=False)[1:-1] if self.json else ch)


def regex_to_gbnf(pattern: str, *, param: str, json_string: bool = False, anchored: bool = True) -> str:
    """A GBNF expression (not a whole grammar) for `pattern`.

    `anchored`: the whole text must match (guided_regex). Otherwise (JSON schema `pattern`, a search) a
    side without its anchor may carry any text.
    """
    if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN_CHARS:
        raise GrammarError(param, f"a regular expression must be a string of at most {MAX_PATTERN_CHARS} characters")
    start, end = pattern.startswith("^"), pattern.endswith("$") and not pattern.endswith("\\$")
    body = pattern[1 if start else 0: len(pattern) - (1 if end else 0)]
    p = _Parser(body, param, json_string)
    expr = p.alternation(0)
    if p.i != len(body):
        raise p.fail("an unbalanced ')'")
    if anchored:
        return expr
    anything = p.chars(_complement([]))
    return " ".join(([] if start else [f"{anything}*"]) + [expr] + ([] if end else [f"{anything}*"]))


def choice_gbnf(options: list[str]) -> str:
    """A grammar for exactly one of `options`, their shared prefixes written once (a radix tree, one rule
    per branching node): llama.cpp keeps one stack per alternative still open, so after `option number `
    a flat list of 500 `option number N` keeps 500 stacks and checks every candidate token against each,
    the tree 10."""
    root: dict[str, Any] = {}  # char-keyed trie; "" marks the end of an option
    for o in options:
        node = root
        for ch in o:
            node = node.setdefault(ch, {})
        node[""] = {}
    rules: list[str] = []
    todo: list[tuple[str, dict[str, Any]]] = [("root", root)]
    names = itertools.count(1)
    while todo:
        name, node = todo.pop()
        alts = []
        for ch, child in node.items():
            if not ch:
                continue
            edge = ch
            while len(child) == 1 and "" not in child:  # follow the branchless run
                (nxt, child), = child.items()
                edge += nxt
            if set(child) == {""}:
                alts.append(gbnf_literal(edge))
            else:
                sub = f"choice-{next(names)}"
                todo.append((sub, child))
                alts.append(f"{gbnf_literal(edge)} {sub}")
        body = " | ".join(alts)
        rules.append(f"{name} ::= ( {body} )?" if "" in node else f"{name} ::= {body}")
    return "\n".join(rules) + "\n"



# ------------------------------------------------------------------------------ bounded numbers

def _same_length(a: str, b: str) -> list[str]:
    """GBNF sequences for the digit strings of one length from a to b."""
    if a == b:
        return [" ".join(f'"{c}"' for c in a)]
    if len(a) == 1:
        return [f"[{a}-{b}]"]
    if a[0] == b[0]:
        return [f'"{a[0]}" {p}' for p in _same_length(a[1:], b[1:])]
    out, rest = [], len(a) - 1
    lo_full, hi_full = int(a[0]), int(b[0])
    if a[1:] != "0" * rest:
        out += [f'"{a[0]}" {p}' for p in _same_length(a[1:], "9" * rest)]
        lo_full += 1
    tail = []
    if b[1:] != "9" * rest:
        tail = [f'"{b[0]}" {p}' for p in _same_length("0" * rest, b[1:])]
        hi_full -= 1
    if lo_full <= hi_full:
        first = f'"{lo_full}"' if lo_full == hi_full else f"[{lo_full}-{hi_full}]"
        out.append(first + f" [0-9]{{{rest}}}")
    return out + tail


def _natural_range(lo: int, hi: int | None) -> str:
    """GBNF for the decimal naturals in [lo, hi] (hi None: unbounded), with no leading zeros."""
    alts: list[str] = []
    d = len(str(lo))
    while hi is None or lo <= hi:
        top = 10 ** d - 1
        end = top if hi is None else min(hi, top)
        alts += _same_length(str(lo), str(end))
        if hi is None:
            alts.append(f"[1-9] [0-9]{{{d},{MAX_DIGITS}}}")
            break
        lo, d = end + 1, d + 1
    return "(" + " | ".join(alts) + ")"


def integer_range(lo: int | None, hi: int | None) -> str:
    """GBNF for the JSON integers in [lo, hi] (None: unbounded on that side)."""
    alts = []
    if hi is None or hi >= 0:
        alts.append(_natural_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        m_lo = 1 if hi is None or hi >= 0 else -hi
        alts.append('"-" ' + _natural_range(m_lo, None if lo is None else -lo))
    return "(" + " | ".join(alts) + ")"


def number_range(lo: int | None, hi: int | None) -> str:
    """GBNF for JSON numbers in [lo, hi] with whole-number bounds: a decimal point, no exponent."""
    frac = '("." [0-9]{1,15})?'
    zero_frac = '("." "0"{1,15})?'

    def magnitude(a: int, b: int | None) -> list[str]:  # decimals in [a, b], a, b whole and ≥ 0
        if b is None:
            return [f"{_natural_range(a, None)} {frac}"]
        out = [f"{_natural_range(a, b - 1)} {frac}"] if b > a else []
        return out + [f"{_natural_range(b, b)} {zero_frac}"]
    alts = []
    if hi is None or hi >= 0:
        alts += magnitude(max(lo, 0) if lo is not None else 0, hi)
    if lo is None or lo < 0:
        alts += ['"-" ' + m for m in magnitude(0 if hi is None or hi >= 0 else -hi, None if lo is None else -lo)]
    return "(" + " | ".join(alts) + ")"


__all__ = ["MAX_DIGITS", "MAX_PATTERN_CHARS", "MAX_REPEAT", "choice_gbnf", "gbnf_class", "gbnf_literal", "integer_range",
           "number_range", "regex_to_gbnf"]
