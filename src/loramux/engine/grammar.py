"""Constrained output: JSON schemas, JSON mode, regular expressions, choices and GBNF grammars.

Each constraint becomes one GBNF grammar, run by llama.cpp's grammar sampler (`_native.GrammarHandle`),
checked lazily per token by the scheduler. JSON schemas go through llama-cpp-python's maintained port of
llama.cpp's converter (`llama_cpp.llama_grammar.SchemaConverter`, reached through `_native`), extended here with what it lacks:
integer and number bounds, and `pattern` through `regex_gbnf` (a documented subset).

A *strict* schema (OpenAI's `strict: true`) is refused with a `GrammarError` naming every keyword the
grammar cannot enforce, so that every finished output validates. A non-strict one is converted with
those keywords left unenforced (docs/structured.md lists them).
"""

from __future__ import annotations

import copy
import json
import math
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _native as N
from ..errors import BackendError, GrammarBudgetError, GrammarError
from .grammar_cost import DEFAULT_LIMITS, YIELD_EVERY, GrammarLimits, check, syntax_error
from .regex_gbnf import MAX_REPEAT, choice_gbnf, integer_range, number_range, regex_to_gbnf
from .work_clock import work_time

if TYPE_CHECKING:
    from .model import Model

MAX_GRAMMAR_CHARS = 1 << 20  # a GBNF grammar or a converted schema
MAX_SCHEMA_CHARS = 1 << 18  # a JSON schema, as JSON text
MAX_CHOICES = 1024
MAX_SCHEMA_DEPTH = 64  # a JSON schema's nesting (objects and lists of its text)
MAX_SCHEMA_PROPERTIES = 5000  # properties over the whole schema (as OpenAI allows; each becomes rules)

# Keywords the grammar enforces (or that only annotate); any other one makes a strict schema a 400.
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly", "$defs", "definitions", "discriminator", "strict", "name"}
_ENFORCED = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
             "maxItems", "enum", "const", "anyOf", "oneOf", "$ref", "minLength", "maxLength", "pattern",
             "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
_FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}


@dataclass(frozen=True)
class Grammar:
    """A GBNF grammar for one request, with the request field it came from (named by its errors)."""

    gbnf: str
    param: str
    root: str = "root"

    def compile(self, model: Model, limits: GrammarLimits = DEFAULT_LIMITS) -> ActiveGrammar:
        """llama.cpp's grammar sampler for this grammar (`model`: an engine `Model`); a GrammarError if it
        does not parse or would cost over `limits` (grammar_cost.py), checked before llama.cpp builds it.
        Safe on any thread: it only reads the vocabulary."""
        if len(self.gbnf) > MAX_GRAMMAR_CHARS:
            raise GrammarError(self.param, f"the grammar has {len(self.gbnf)} characters; at most "
                                           f"{MAX_GRAMMAR_CHARS} are accepted")
        self._check_tokens(model, check(self.gbnf, param=self.param, root=self.root, limits=limits))
        try:
            return ActiveGrammar(model, N.GrammarHandle.create(model.handle, self.gbnf, self.root), self.param,
                                 limits, narrows="<" not in self.gbnf)
        except BackendError as e:
            raise GrammarError(self.param, f"llama.cpp cannot use this grammar: {e.message}",
                               hint="GBNF syntax: https://github.com/ggml-org/llama.cpp/blob/master/grammars/"
                                    "README.md") from None


    def _check_tokens(self, model: Model, refs: Sequence[tuple[str, int]]) -> None:
        """Each token reference must name one token of this vocabulary (llama.cpp's parser only says that
        the grammar failed): `<[id]>` an id below n_vocab, `<text>` a text that is exactly one token."""
        for text, at in refs:
            if text.startswith("<[") and text.endswith("]>"):
                ok = text[2:-2].isdigit() and int(text[2:-2]) < model.n_vocab
            else:
                ok = len(model.handle.tokenize(text, False, True)) == 1
            if not ok:
                raise syntax_error(self.gbnf, self.param, f"the token reference {text[:40]!r} is not one token of "
                                   f"this model's vocabulary ({model.n_vocab} tokens)", at, "unknown_token")


class ActiveGrammar:
    """One request's grammar state: llama.cpp's grammar sampler plus a UTF-8 guard.

    llama.cpp's grammar reads a token's bytes as code points and is lenient about UTF-8: it takes a stray
    continuation byte (a byte-fallback token such as <0x80>) for a character of its own, and accepts
    overlong forms and surrogates. Unguarded, a string could come out as invalid UTF-8 (and then not parse
    as JSON). The guard bans, at each step, the tokens whose bytes would make the text so far invalid."""

    def __init__(self, model: Model, handle: N.GrammarHandle, param: str = "grammar",
                 limits: GrammarLimits = DEFAULT_LIMITS, narrows: bool = False) -> None:
        self.model, self.handle, self.param, self.limits = model, handle, param, limits
        # first-character narrowing of vocabulary passes (`_Utf8Table.refused_by_first`): only for grammars
        # without token references (<...>), which match a token by its id rather than its text
        self.narrows = narrows
        self.table = _utf8_table(model)
        self.state: tuple[int, int, int] = (0, 0, 0)  # (continuation bytes owed, range of the next one)
        # CPU seconds of the engine thread in this grammar's checks, passes and advances so far: CPU time,
        # not wall time, so that a thread kept waiting (the GIL, a busy machine) is not charged for it, and
        # none of a garbage collection that ran meanwhile (work_clock.py)
        self.spent = 0.0

    def pick(self, ctx: N.ContextHandle, idx: int, chain: N.SamplerHandle | None) -> int:
        """The next token (see `_native.GrammarHandle.pick`), within the time budgets: a GrammarBudgetError
        once this token or the whole request took longer than `limits` allows."""
        t0 = work_time()
        left = min(self.limits.token_seconds, self.limits.request_seconds - self.spent)
        try:
            deadline = t0 + max(left, 0.0)
            # between characters (no multi-byte character pending) a pass asks about each first character once
            narrow = (lambda: self.table.refused_by_first(self.handle.allowed_among(self.table.probes, deadline, work_time))
                      ) if self.narrows and self.state[0] == 0 else None
            tok = self.handle.pick(ctx, idx, chain, self.table.ban(self.state), deadline=deadline, narrow=narrow,
                                   clock=work_time)
        except TimeoutError:
            self.spent += work_time() - t0
            raise self._over(work_time() - t0) from None
        self._charge(t0)
        return tok

    def accept(self, token: int) -> None:
        """Advance by `token` (checked against the grammar first unless `pick` just chose it)."""
        t0 = work_time()
        self.handle.accept(token)
        self.state = _advance(self.state, self.model.handle.token_bytes(token))
        self._charge(t0)

    def _charge(self, t0: float) -> None:
        took = work_time() - t0
        self.spent += took
        if took > self.limits.token_seconds or self.spent > self.limits.request_seconds:
            raise self._over(took)

    def _over(self, took: float) -> GrammarBudgetError:
        if self.spent > self.limits.request_seconds:
            return GrammarBudgetError(self.param, "grammar_request_seconds", f"the grammar took {self.spent:.2f} s "
                                      f"of engine time in this request: at most {self.limits.request_seconds:g} s "
                                      "(grammar_request_seconds); the request ended there")
        return GrammarBudgetError(self.param, "grammar_token_seconds", f"the grammar took over {took:.2f} s for "
                                  f"one token: at most {self.limits.token_seconds:g} s (grammar_token_seconds); "
                                  "the request ended there")

    def close(self) -> None:
        self.handle.close()


def _lead(b: int) -> tuple[int, int, int]:
    """After a lead byte: (continuation bytes owed, the range the first of them must be in); need 0 for
    ASCII, and -1 for a byte UTF-8 never uses there."""
    if b < 0x80:
        return 0, 0, 0
    if 0xC2 <= b <= 0xDF:
        return 1, 0x80, 0xBF
    if 0xE0 <= b <= 0xEF:
        return 2, 0xA0 if b == 0xE0 else 0x80, 0x9F if b == 0xED else 0xBF
    if 0xF0 <= b <= 0xF4:
        return 3, 0x90 if b == 0xF0 else 0x80, 0x8F if b == 0xF4 else 0xBF
    return -1, 0, 0


def _advance(state: tuple[int, int, int], data: bytes) -> tuple[int, int, int]:
    need, lo, hi = state
    for b in data:
        if need > 0:
            need, lo, hi = need - 1, 0x80, 0xBF  # (checked by the ban before it was accepted)
        else:
            need, lo, hi = _lead(b)
            need = max(need, 0)
    return need, lo, hi


class _Utf8Table:
    """Per token: its first bytes, its leading continuation bytes, and whether the rest is strict UTF-8."""

    def __init__(self, model: Model) -> None:
        import codecs

        n = model.n_vocab
        self.first = np.zeros(n, dtype=np.int16)
        self.lead = np.zeros(n, dtype=np.int16)
        self.size = np.zeros(n, dtype=np.int32)
        self.ok = np.ones(n, dtype=bool)
        plain: list[bytes] = []
        for t in range(n):
            b = model.handle.token_bytes(t)
            plain.append(b)
            self.size[t] = len(b)
            if not b or max(b) < 0x80:
                continue
            self.first[t] = b[0]
            i = 0
            while i < len(b) and 0x80 <= b[i] <= 0xBF:
                i += 1
            self.lead[t] = i
            try:
                codecs.getincrementaldecoder("utf-8")("strict").decode(b[i:], final=False)
            except UnicodeDecodeError:
                self.ok[t] = False
        self._bans: dict[tuple[int, int, int], np.ndarray] = {}
        self._first_chars(model, plain)

    def _first_chars(self, model: Model, plain: list[bytes]) -> None:
        """The first-character buckets of `refused_by_first`: per token whose text llama.cpp's grammar reads
        (the piece with special text, which for every token but control tokens is its plain text) starts
        with a whole character, the index of that character among
        the probes, the one-character tokens (the lowest id of each character); -1 for the rest (end tokens,
        pieces that start mid-character: the grammar is always asked about those)."""
        n = model.n_vocab
        bucket = np.full(n, -1, dtype=np.int32)
        probe_of: dict[str, int] = {}
        firsts: list[tuple[int, str]] = []
        for t in range(n):
            b = plain[t]  # a token with text of its own reads the same with or without special text
            if not b or model.handle.is_eog(t):
                continue  # end tokens and control tokens (no plain text): llama.cpp treats them apart
            head = b[:4].decode("utf-8", errors="ignore")[:1]
            if not head or not b.startswith(head.encode("utf-8")):
                continue
            if len(b) == len(head.encode("utf-8")):
                probe_of.setdefault(head, t)
            firsts.append((t, head))
        order = sorted(probe_of.items(), key=lambda kv: kv[1])
        self.probes = np.array([t for _, t in order], dtype=np.int32)
        index = {head: i for i, (head, _) in enumerate(order)}
        for t, head in firsts:
            bucket[t] = index.get(head, -1)
        self.bucketed = np.flatnonzero(bucket >= 0)
        self.bucket = bucket[self.bucketed]

    def refused_by_first(self, allowed: np.ndarray) -> np.ndarray:
        """The tokens whose first character the grammar refuses, from its verdict on the probes.

        Exact: llama.cpp's grammar accepts a token when its whole text can begin a match, so a token whose
        first character alone cannot begin one (its probe is refused) is refused too; a character without a
        probe token decides nothing."""
        out = np.zeros(len(self.ok), dtype=bool)
        out[self.bucketed] = ~allowed[self.bucket]
        return out

    def ban(self, state: tuple[int, int, int]) -> np.ndarray:
        hit = self._bans.get(state)
        if hit is None:
            need, lo, hi = state
            if need == 0:
                hit = ~self.ok | (self.lead != 0)
            else:
                hit = (~self.ok | (self.lead != np.minimum(self.size, need))
                       | (self.first < lo) | (self.first > hi))
            self._bans[state] = hit
        return hit


_SYNTAX_ONLY = GrammarLimits(optional_run=math.inf, breadth=1 << 62, elements=1 << 62)

_TABLES: weakref.WeakKeyDictionary[Any, _Utf8Table] = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def _utf8_table(model: Model) -> _Utf8Table:
    """Once per model (about a second for a 262k vocabulary), on the thread that compiles the first grammar."""
    with _TABLES_LOCK:
        hit = _TABLES.get(model)
        if hit is None:
            hit = _TABLES[model] = _Utf8Table(model)
        return hit


def gbnf(text: Any, param: str = "grammar") -> Grammar:
    """A grammar given as GBNF text (llama-server's `grammar`, vLLM's `guided_grammar`), root rule `root`."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(param, "must be a non-empty GBNF grammar (a string with a 'root ::= ...' rule)")
    # The syntax and the repetition counts now, with the request's field; its cost against the server's
    # budgets when it is compiled.
    check(text, param=param, limits=_SYNTAX_ONLY)
    return Grammar(text, param)


def json_object(param: str = "response_format") -> Grammar:
    """OpenAI's JSON mode: any JSON object."""
    return Grammar(N.JSON_GBNF, param)


def choice(options: Any, param: str = "guided_choice") -> Grammar:
    """Exactly one of these strings."""
    if (not isinstance(options, (list, tuple)) or not options or len(options) > MAX_CHOICES
            or not all(isinstance(o, str) and o for o in options)):
        raise GrammarError(param, f"must be a list of 1 to {MAX_CHOICES} non-empty strings")
    return Grammar(choice_gbnf(list(dict.fromkeys(options))), param)


def regex(pattern: Any, param: str = "guided_regex") -> Grammar:
    """The whole output matches this regular expression (the subset in `regex_gbnf`)."""
    return Grammar("root ::= " + regex_to_gbnf(pattern, param=param), param)


def json_schema(schema: Any, *, param: str = "response_format", strict: bool = True) -> Grammar:
    """Output that is JSON valid against `schema` (see the module docstring for `strict`)."""
    rules, _ = schema_rules(schema, param=param, strict=strict, name="")
    return Grammar(rules, param)


def schema_rules(schema: Any, *, param: str, strict: bool, name: str) -> tuple[str, str]:
    """GBNF rules for `schema` and the name of its top rule (`root` when `name` is empty)."""
    rules, names = schemas_rules({name: schema}, param=param, strict=strict)
    return rules, names[name]


def schemas_rules(schemas: dict[str, Any], *, param: str, strict: bool) -> tuple[str, dict[str, str]]:
    """GBNF rules for several schemas in one grammar (rule names prefixed by their keys), and each one's top
    rule: for callers that build a larger grammar around them (tool calls)."""
    conv = _Converter(param=param, strict=strict)
    tops = {}
    for name, schema in schemas.items():
        if isinstance(schema, bool):
            schema = {} if schema else None
        if not isinstance(schema, dict):
            raise GrammarError(param, "the JSON schema must be an object")
        try:
            size = len(json.dumps(schema))
        except (TypeError, ValueError, RecursionError):
            raise GrammarError(param, "the JSON schema is not JSON (or nests too deep)") from None
        if size > MAX_SCHEMA_CHARS:
            raise GrammarError(param, f"the JSON schema has {size} characters; at most {MAX_SCHEMA_CHARS}")
        _precheck(schema, param)
        if strict:
            try:
                bad = unenforced(schema)
            except RecursionError:
                raise GrammarError(param, "the JSON schema nests too deep") from None
            if bad:
                raise GrammarError(param, "this strict schema uses what constrained decoding cannot enforce: "
                                   + "; ".join(bad[:8]),
                                   hint="drop those keywords, or send strict: false to have them ignored")
        try:
            # resolve_refs rewrites the schema in place: work on a copy, the caller keeps its own
            tops[name] = conv.visit(conv.resolve_refs(copy.deepcopy(schema), f"request-{name or 'root'}"), name)
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 - the converter asserts, indexes and recurses on what it is given
            raise GrammarError(param, f"the JSON schema cannot be converted to a grammar: {type(e).__name__}: "
                                      f"{str(e)[:300]}") from None
    return conv.format_grammar(), tops


_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")


def _precheck(schema: Any, param: str) -> None:
    """What the converter would turn into an unbounded grammar or a deep recursion, refused before it runs
    (iteratively, so any nesting gets an answer): nesting past MAX_SCHEMA_DEPTH, more than
    MAX_SCHEMA_PROPERTIES properties, a length or item count past MAX_REPEAT (each becomes that many
    nested rules), an enum longer than MAX_CHOICES."""
    todo: list[tuple[Any, int, str]] = [(schema, 0, "$")]
    n_props = 0
    while todo:
        node, depth, path = todo.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(param, f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} deep (at {path[:80]}…)")
        if isinstance(node, list):
            todo += [(v, depth + 1, f"{path}[{i}]") for i, v in enumerate(node) if isinstance(v, (dict, list))]
            continue
        if not isinstance(node, dict):
            continue
        for k in _COUNTS:
            v = node.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v != int(v) or not 0 <= v <= MAX_REPEAT):
                raise GrammarError(param, f"{path}.{k} must be a whole number in [0, {MAX_REPEAT}], got {v!r}",
                                   hint="longer strings or lists: leave the bound out")
        props = node.get("properties")
        n_props += len(props) if isinstance(props, dict) else 0
        if n_props > MAX_SCHEMA_PROPERTIES:
            raise GrammarError(param, f"the JSON schema has more than {MAX_SCHEMA_PROPERTIES} properties in all: "
                                      "each is a rule of the grammar, converted with the GIL held")
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > MAX_CHOICES:
            raise GrammarError(param, f"{path}.enum has {len(enum)} values: at most {MAX_CHOICES}")
        for k, v in node.items():
            if isinstance(v, (dict, list)) and k not in ("enum", "const", "default", "examples"):
                todo.append((v, depth + 1, f"{path}.{k}"))


def unenforced(schema: Any, path: str = "$") -> list[str]:
    """'path: keyword' for every keyword of `schema` the grammar would not enforce."""
    out: list[str] = []
    if not isinstance(schema, dict):
        return out if isinstance(schema, bool) else [f"{path}: a schema must be an object"]
    for k in schema:
        if k not in _ENFORCED and k not in _ANNOTATIONS:
            out.append(f"{path}: {k}")
    fmt = schema.get("format")
    if fmt is not None and fmt not in _FORMATS:
        out.append(f"{path}: format {fmt!r} (enforced: {', '.join(sorted(_FORMATS))})")
    if "pattern" in schema and ({"minLength", "maxLength", "format"} & set(schema)):
        out.append(f"{path}: pattern together with minLength/maxLength/format")
    split = split_types(schema)
    if split is not None:  # each type's branch carries that type's constraints
        return out + unenforced(split, path)
    if "enum" in schema or "const" in schema:
        return out  # the values are literal: nothing under them needs checking
    out += _number_problems(schema, path)
    for key in ("properties", "$defs", "definitions"):
        for k, sub in (schema.get(key) or {}).items():
            out += unenforced(sub, f"{path}.{key}.{k}" if key != "properties" else f"{path}.{k}")
    for key in ("anyOf", "oneOf", "prefixItems"):
        for i, sub in enumerate(schema.get(key) or ()):
            out += unenforced(sub, f"{path}.{key}[{i}]")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            out += unenforced(schema[key], f"{path}.{key}")
    return out


# The keywords that constrain values of each JSON type (JSON Schema: a keyword of another type is vacuous).
_TYPE_KEYWORDS = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "array": {"items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains", "minContains",
              "maxContains", "unevaluatedItems", "additionalItems"},
    "object": {"properties", "required", "additionalProperties", "minProperties", "maxProperties",
               "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas",
               "unevaluatedProperties"},
    "boolean": set(), "null": set(),
}


def split_types(schema: dict[str, Any]) -> dict[str, Any] | None:
    """A schema with a list of types (`{"type": ["string", "null"], "maxLength": 40}`, what OpenAI's strict
    mode and pydantic's Optional fields produce) as an anyOf of one branch per type, each with the keywords
    of its type, so the constraints are enforced; None when `schema` has no such list (or has an enum or a
    const, which are literal values already)."""
    types = schema.get("type")
    if not isinstance(types, list) or "enum" in schema or "const" in schema:
        return None
    if not types or not all(isinstance(t, str) and t in _TYPE_KEYWORDS for t in types):
        return None  # left to the converter, which names what it does not know
    typed = set().union(*_TYPE_KEYWORDS.values())
    common = {k: v for k, v in schema.items() if k != "type" and k not in typed}
    branches = [{"type": t, **{k: v for k, v in schema.items() if k in _TYPE_KEYWORDS[t]}}
                for t in dict.fromkeys(types)]
    return {**common, "anyOf": branches} if "anyOf" not in common else {**common, "allOf": [{"anyOf": branches}]}


def _number_problems(schema: dict[str, Any], path: str) -> list[str]:
    bounds = [k for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in schema]
    if not bounds:
        return []
    if schema.get("type") not in ("integer", "number"):
        return [f"{path}: {bounds[0]} without type integer or number"]
    vals = [schema[k] for k in bounds]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in vals):
        return [f"{path}: {bounds[0]} must be a finite number"]
    if schema["type"] == "number":
        if any(float(v) != int(v) for v in vals):
            return [f"{path}: a number bound that is not a whole number ({', '.join(bounds)})"]
        if any(k.startswith("exclusive") for k in bounds):
            return [f"{path}: exclusiveMinimum/exclusiveMaximum on a number (only on integers)"]
    return []


class _Converter(N.SchemaConverter):  # type: ignore[misc]
    """llama-cpp-python's SchemaConverter, plus numeric bounds and our regex subset for `pattern`."""

    def __init__(self, *, param: str, strict: bool) -> None:
        super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        self.param, self.strict = param, strict
        self._same: dict[str, dict[str, str]] = {}  # escaped name -> {rule text: the numbered name it got}
        self._free: dict[str, int] = {}  # escaped name -> the next number to try

    def _add_rule(self, name: str, rule: str) -> str:
        """Upstream's, in constant time: names that escape alike (property names of other scripts or of
        punctuation all become 'a-') get numbers; upstream searched them from 0 for each one (quadratic:
        a 258 KB schema took 38 s with the GIL held)."""
        if not len(self._rules) % YIELD_EVERY:
            time.sleep(0)  # the converter holds the GIL too: give it up now and then (grammar_cost.YIELD_EVERY)
        esc = N.GRAMMAR_INVALID_CHARS.sub("-", name)
        if esc not in self._rules or self._rules[esc] == rule:
            key = esc
        else:
            same = self._same.setdefault(esc, {})
            got = same.get(rule)
            if got is None:
                i = self._free.get(esc, 0)
                while f"{esc}{i}" in self._rules:
                    i += 1
                got = same[rule] = f"{esc}{i}"
                self._free[esc] = i + 1
            key = got
        self._rules[key] = rule
        return key

    def visit(self, schema: Any, name: str) -> str:
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise GrammarError(self.param, f"a JSON schema must be an object, got {type(schema).__name__}")
        split = split_types(schema)
        if split is not None:
            return self.visit(split, name)
        rule_name = name + "-" if name in N.GRAMMAR_RESERVED_NAMES else name or "root"
        t = schema.get("type")
        if t in ("integer", "number") and not ({"enum", "const"} & set(schema)) and not _number_problems(
                schema, "") and any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum",
                                                          "exclusiveMaximum")):
            lo, hi = _bounds(schema, self.param)
            body = integer_range(lo, hi) if t == "integer" else number_range(lo, hi)
            return self._add_rule(rule_name, body + " space")
        if t in (None, "string") and isinstance(schema.get("pattern"), str) and "enum" not in schema:
            expr = regex_to_gbnf(schema["pattern"], param=self.param, json_string=True, anchored=False)
            return self._add_rule(rule_name, f'"\\"" {expr} "\\"" space')
        return super().visit(schema, name)

    def format_grammar(self) -> str:
        # Upstream's string character admits raw control characters, which JSON does not: a string holding a
        # raw newline would not parse. Use the JSON grammar's definition.
        char = self._rules.get("char")
        if char is not None and char.startswith('[^"\\\\]'):
            self._rules["char"] = '[^"\\\\\\x7F\\x00-\\x1F]' + char[len('[^"\\\\]'):]
        return str(super().format_grammar())


def _bounds(schema: dict[str, Any], param: str) -> tuple[int | None, int | None]:
    lo = hi = None
    if "minimum" in schema:
        lo = math.ceil(schema["minimum"])
    if "exclusiveMinimum" in schema:
        v = math.floor(schema["exclusiveMinimum"]) + 1
        lo = v if lo is None else max(lo, v)
    if "maximum" in schema:
        hi = math.floor(schema["maximum"])
    if "exclusiveMaximum" in schema:
        v = math.ceil(schema["exclusiveMaximum"]) - 1
        hi = v if hi is None else min(hi, v)
    if lo is not None and hi is not None and lo > hi:
        raise GrammarError(param, f"the bounds leave no value (minimum {lo} > maximum {hi})")
    return lo, hi


def union(grammars: Sequence[str]) -> str:
    """An alternation of GBNF expressions."""
    return "(" + " | ".join(grammars) + ")"


__all__ = ["ActiveGrammar", "MAX_CHOICES", "MAX_GRAMMAR_CHARS", "MAX_SCHEMA_CHARS", "Grammar", "choice", "gbnf",
           "json_object", "json_schema", "regex", "schema_rules", "schemas_rules", "union",
           "unenforced"]
