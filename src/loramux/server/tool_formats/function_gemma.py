"""FunctionGemma's tool-call format: reading calls out of the output, and the grammar that forces one.

FunctionGemma (Gemma 3 270M trained for function calling) answers a call as
`<start_function_call>call:NAME{key:value,...}<end_function_call>`, several in a row for parallel
calls. Values: strings between two `<escape>` tokens (so no character inside needs quoting), numbers,
`true`/`false`/`null`, objects `{key:value,...}` with bare keys and lists `[value,...]`. The tags and
`<escape>` are control tokens: the server shows them in the text of such requests (`TAG_TEXTS`) so that
this module can read them. After its calls the model would go on with `<start_function_response>`, the
tool's part: generation stops there (FunctionGemma's guide names it as a stop sequence). A template
that writes an assistant's call with `<start_function_call>` selects this format.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from ...engine.chat import TemplateCapabilities
from ...engine.grammar import MAX_GRAMMAR_CHARS
from ...engine.regex_gbnf import MAX_REPEAT
from ...errors import GrammarError
from ..schemas import Tool
from .base import MAX_PARALLEL, CallGrammar, Parsed, ToolFormat

OPEN, CLOSE, ESCAPE = "<start_function_call>", "<end_function_call>", "<escape>"
TAG_TEXTS = (OPEN, CLOSE, ESCAPE)  # control tokens rendered as text for requests in this format
STOP_TEXTS = ("<start_function_response>",)  # where the model hands over to the tool: its output ends there
MAX_DEPTH = 32  # nesting the reader follows (a deeper reply is not a call)
GRAMMAR_DEPTH = 12  # nesting the forcing grammar follows; deeper values take any value of the format
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")


class _Reader:
    """A cursor over one call's argument text; every method raises ValueError on what is not the format."""

    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    def skip(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\r\n":
            self.i += 1

    def take(self, token: str) -> bool:
        self.skip()
        if self.s.startswith(token, self.i):
            self.i += len(token)
            return True
        return False

    def value(self, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError("nested too deep")
        self.skip()
        if self.take(ESCAPE):
            end = self.s.find(ESCAPE, self.i)
            if end < 0:
                raise ValueError("an <escape> string is not closed")
            out, self.i = self.s[self.i:end], end + len(ESCAPE)
            return out
        if self.take("{"):
            return self.members(depth)
        if self.take("["):
            items: list[Any] = []
            if self.take("]"):
                return items
            while True:
                items.append(self.value(depth + 1))
                if self.take("]"):
                    return items
                if not self.take(","):
                    raise ValueError("expected ',' or ']'")
        for word, v in (("true", True), ("false", False), ("null", None)):
            if self.take(word):
                return v
        m = _NUMBER.match(self.s, self.i)
        if not m:
            raise ValueError(f"unexpected {self.s[self.i:self.i + 12]!r}")
        self.i = m.end()
        return json.loads(m.group(0))

    def members(self, depth: int) -> dict[str, Any]:
        """The rest of an object after its '{'."""
        out: dict[str, Any] = {}
        if self.take("}"):
            return out
        while True:
            self.skip()
            colon = self.s.find(":", self.i)
            key = self.s[self.i:colon].strip() if colon >= 0 else ""
            if not key or any(c in key for c in "{}[],<"):
                raise ValueError("expected key:")
            self.i = colon + 1
            out[key] = self.value(depth + 1)
            if self.take("}"):
                return out
            if not self.take(","):
                raise ValueError("expected ',' or '}'")


def parse(text: str) -> tuple[str, list[tuple[str, dict[str, Any]]]] | None:
    """(content before the calls, [(name, arguments)]) when `text` holds calls in this format, else None.
    A last call cut short by the end of the output (no closing tag) still counts when it is complete."""
    head, sep, rest = text.partition(OPEN)
    if not sep:
        return None
    calls = []
    for chunk in rest.split(OPEN):
        body = chunk.split(CLOSE, 1)[0].strip()
        if not body.startswith("call:") or "{" not in body:
            return None
        name, _, args = body[len("call:"):].partition("{")
        r = _Reader(args)
        try:
            arguments = r.members(0)
        except (ValueError, RecursionError):
            return None
        if r.s[r.i:].strip() or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name.strip()):
            return None
        calls.append((name.strip(), arguments))
    return head.strip(), calls


# ------------------------------------------------------------------------------ forcing a call

def grammar_rules(schemas: dict[str, dict[str, Any]], strict: set[str] | None = None
                  ) -> tuple[str, dict[str, str], dict[str, dict[str, Any]]]:
    """GBNF rules for a call in this format per tool (name → parameter schema), each one's top rule, and
    the numeric sub-schemas the caller converts with the JSON converter (numbers are written alike in
    both formats): the rules refer to each by `number_ref(key)`, a rule the caller defines as the
    converter's top rule of that key (`number_aliases`).

    Enforced: the object's properties (required ones first, in order, then the optional ones in the
    schema's order), strings (minLength/maxLength), enums of strings, numbers and integers with their
    bounds, booleans, null and lists (minItems/maxItems); a schema it does not describe that way takes
    any value of the format. A keyword this format cannot enforce (a string's pattern or format) is a
    GrammarError for a tool in `strict`, and left unenforced otherwise (as for JSON)."""
    rules = [
        f"fg-str ::= {ESCAPE} [^<]* {ESCAPE}",
        'fg-num ::= "-"? [0-9]+ ("." [0-9]+)? ([eE] [-+]? [0-9]+)?',
        'fg-int ::= "-"? [0-9]+',
        'fg-bool ::= "true" | "false"',
        'fg-key ::= [A-Za-z_] [A-Za-z0-9_]*',
        'fg-any ::= fg-str | fg-num | fg-bool | "null" | "{" (fg-key ":" fg-any ("," fg-key ":" fg-any)*)? "}" '
        '| "[" (fg-any ("," fg-any)*)? "]"',
    ]
    tops: dict[str, str] = {}
    numbers: dict[str, dict[str, Any]] = {}
    budget = _Budget(sum(len(r) for r in rules))
    for i, (name, schema) in enumerate(schemas.items()):
        ctx = _Ctx(rules, numbers, name, name in (strict or set()), budget)
        args = ctx.value(schema, f"fg{i}", 0)
        ctx.add(f"fg{i}", f'{OPEN} "call:{_lit(name)}" {args} {CLOSE}')
        tops[name] = f"fg{i}"
    return "\n".join(rules), tops, numbers


def number_ref(key: str) -> str:
    """The rule name by which the call rules refer to the numeric sub-schema `key`."""
    return "fg-numref-" + key


def number_aliases(tops: dict[str, str], keys: Sequence[str]) -> str:
    """The rules `number_ref(key) ::= <the converter's top rule of key>` for each numeric sub-schema."""
    return "\n".join(f"{number_ref(k)} ::= {tops[k]}" for k in keys)


def _lit(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


_NUMERIC_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


class _Budget:
    """The characters of the rules built so far, against MAX_GRAMMAR_CHARS: checked as each rule is added,
    so that no schema can make a grammar larger than the cap before the cap is looked at."""

    def __init__(self, used: int) -> None:
        self.used = used


class _Ctx:
    """One tool's conversion: the rules it appends to, its numeric sub-schemas, whether it is strict.

    Every object, list item and property value goes into a rule of its own, used by reference: the
    grammar grows with the schema's size, never with its depth (an inlined list item appears twice, so
    nested lists once doubled the grammar per level)."""

    def __init__(self, rules: list[str], numbers: dict[str, dict[str, Any]], tool: str, strict: bool,
                 budget: _Budget) -> None:
        self.rules, self.numbers, self.tool, self.strict, self.budget = rules, numbers, tool, strict, budget

    @property
    def param(self) -> str:
        return f"tools ({self.tool})"

    def add(self, name: str, body: str) -> str:
        """Append the rule `name ::= body` (a GrammarError once the grammar would pass the cap); its name."""
        self.budget.used += len(name) + len(body) + 6
        if self.budget.used > MAX_GRAMMAR_CHARS:
            raise GrammarError(self.param, f"the tools' call grammar would pass {MAX_GRAMMAR_CHARS} characters",
                               hint="smaller parameter schemas (fewer properties, shallower nesting)")
        self.rules.append(f"{name} ::= {body}")
        return name

    def count(self, schema: dict[str, Any], key: str) -> int | None:
        """A length bound of `schema` (minLength, maxItems, ...): None if absent, else an integer in
        [0, MAX_REPEAT] (a GrammarError otherwise)."""
        v = schema.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (math.inf, -math.inf) \
                or v != int(v) or not 0 <= v <= MAX_REPEAT:
            raise GrammarError(self.param, f"{key} must be a whole number in [0, {MAX_REPEAT}], got {v!r}")
        return int(v)

    def value(self, schema: Any, rule: str, depth: int) -> str:
        """The GBNF expression of one value of `schema` (new rules appended under the prefix `rule`)."""
        if not isinstance(schema, dict) or depth > GRAMMAR_DEPTH:
            return "fg-any"
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) and "<" not in v for v in enum):
            return self.add(f"{rule}-e", " | ".join(f'{ESCAPE} "{_lit(v)}" {ESCAPE}' for v in enum))
        kind = schema.get("type")
        if kind in ("number", "integer"):
            if any(k in schema for k in _NUMERIC_BOUNDS):
                key = f"fgnum{len(self.numbers)}"
                self.numbers[key] = {k: v for k, v in schema.items() if k in ("type", *_NUMERIC_BOUNDS)}
                return number_ref(key)
            return "fg-int" if kind == "integer" else "fg-num"
        if kind == "string":
            return self.string(schema)
        simple = {"boolean": "fg-bool", "null": '"null"'}
        if kind in simple:
            return simple[kind]
        if kind == "array":
            return self.array(schema, rule, depth)
        if kind == "object" or isinstance(schema.get("properties"), dict):
            return self.obj(schema, rule, depth)
        return "fg-any"

    def string(self, schema: dict[str, Any]) -> str:
        bad = [k for k in ("pattern", "format") if k in schema]
        if bad and self.strict:
            raise GrammarError(self.param, f"FunctionGemma's call format cannot enforce "
                               f"{', '.join(bad)} on a string", hint="drop those keywords, or send strict: false")
        lo, hi = self.count(schema, "minLength") or 0, self.count(schema, "maxLength")
        if not lo and hi is None:
            return "fg-str"
        if hi is not None and hi < lo:
            raise GrammarError(self.param, f"maxLength {hi} is below minLength {lo}")
        return f"{ESCAPE} [^<]{{{lo},{'' if hi is None else hi}}} {ESCAPE}"

    def array(self, schema: dict[str, Any], rule: str, depth: int) -> str:
        item = self.add(f"{rule}-i", self.value(schema.get("items"), f"{rule}-i", depth + 1))
        lo, hi = self.count(schema, "minItems") or 0, self.count(schema, "maxItems")
        if hi is not None and hi < lo:
            raise GrammarError(self.param, f"maxItems {hi} is below minItems {lo}")
        if not lo and hi is None:
            return self.add(f"{rule}-a", f'"[" ({item} ("," {item})*)? "]"')
        if hi == 0:
            return '"[" "]"'
        rest = f'("," {item}){{{max(lo - 1, 0)},{"" if hi is None else hi - 1}}}'
        body = f"{item} {rest}" if lo else f"({item} {rest})?"
        return self.add(f"{rule}-a", f'"[" {body} "]"')

    def obj(self, schema: dict[str, Any], rule: str, depth: int) -> str:
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            return '"{" (fg-key ":" fg-any ("," fg-key ":" fg-any)*)? "}"'
        required = schema.get("required", [])
        req = [k for k in (required if isinstance(required, list) else []) if isinstance(k, str) and k in props]
        req = list(dict.fromkeys(req))
        opt = [k for k in props if k not in req]
        parts = []
        for j, k in enumerate(req + opt):
            ref = self.add(f"{rule}-{j}", self.value(props[k], f"{rule}-{j}", depth + 1))
            parts.append(f'"{_lit(k)}:" {ref}')
        body = ' "," '.join(parts[:len(req)])
        optional = parts[len(req):]  # each may follow, in the schema's order
        if body:
            body += "".join(f' ("," {p})?' for p in optional)
        elif optional:  # none required: the first one present has no comma before it
            n = len(optional)
            for j in range(n - 1, 0, -1):  # t{j}: what may follow once optional[j - 1] is written
                self.add(f"{rule}-t{j}", f'("," {optional[j]})?' + (f" {rule}-t{j + 1}" if j + 1 < n else ""))
            for j in range(n - 1, -1, -1):
                after = f" {rule}-t{j + 1}" if j + 1 < n else ""
                self.add(f"{rule}-f{j}", f"{optional[j]}{after}" + (f" | {rule}-f{j + 1}" if j + 1 < n else ""))
            body = f"({rule}-f0)?"
        return self.add(f"{rule}-o", f'"{{" {body} "}}"')


class FunctionGemma(ToolFormat):
    """FunctionGemma's `<start_function_call>call:NAME{...}<end_function_call>`."""

    name = "function_gemma"
    starts = (OPEN,)
    inline_tag = OPEN

    def detect(self, caps: TemplateCapabilities) -> bool:
        return OPEN in caps.call_text

    def read(self, text: str) -> Parsed | None:
        if OPEN not in text:
            return None
        return parse(text) or (text, [])

    def call_grammar(self, tools: Sequence[Tool], parallel: bool) -> CallGrammar:
        rules, tops, numbers = grammar_rules(
            {t.function.name: t.function.parameters or {"type": "object"} for t in tools},
            {t.function.name for t in tools if t.function.strict})

        def build(json_tops: dict[str, str]) -> tuple[str, str]:
            call = "(" + " | ".join(tops.values()) + ")"
            own = (number_aliases(json_tops, list(numbers)) + "\n" + rules).strip()
            return own, f"{call}{{1,{MAX_PARALLEL}}}" if parallel else call
        return CallGrammar(numbers, build)

    def engine_args(self, tokenize: Callable[[str], list[int]]) -> dict[str, list[int]]:
        def ids(texts: Sequence[str]) -> list[int]:
            got = [tokenize(t) for t in texts]
            return [i[0] for i in got if len(i) == 1]
        return {"shown": ids(TAG_TEXTS), "stop_tokens": ids(STOP_TEXTS)}


__all__ = ["CLOSE", "ESCAPE", "OPEN", "STOP_TEXTS", "TAG_TEXTS", "FunctionGemma", "grammar_rules",
           "number_aliases", "number_ref", "parse"]
