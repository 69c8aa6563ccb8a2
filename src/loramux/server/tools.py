"""Tool calling: tools into the prompt, forced calls by grammar, calls parsed out of the output.

Two output formats, picked by the chat template:
- **hermes** (the template itself mentions `<tool_call>`: Qwen 2.5/3, Hermes, many fine-tunes): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, and the template renders `tools`.
- **generic** (llama.cpp's generic format, for every other template, the Gemma and ChatML fallbacks
  included): the reply is the JSON `{"tool_calls": [{"name": ..., "arguments": {...}}]}`; the tools and
  this instruction go into the system message (folded into the first user turn on Gemma).

- **function_gemma** (the template mentions `<start_function_call>`: FunctionGemma, the Gemma 3 270M
  function-calling model): `<start_function_call>call:NAME{key:<escape>text<escape>,...}<end_function_call>`
  (see function_gemma.py); its control tags are shown in the output text of such requests.

Parsing (`tool_choice` auto) also recognises `{"tool_call": {...}}`, a bare `{"name": ..., "arguments" |
"parameters": ...}` (Llama 3.x) and Mistral's `[TOOL_CALLS][...]`. `required` and a named function are forced
by a grammar built from the tools' parameter schemas (`engine.grammar`); with `response_format` and `auto`
the grammar allows either the answer or a tool call.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine.chat import ChatTemplate
from ..engine.grammar import Grammar, schemas_rules, unenforced
from ..errors import GrammarError
from . import function_gemma as fg
from .schemas import ChatRequest, Tool

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_TAG = "[TOOL_CALLS]"
MAX_PARALLEL = 4  # calls a forced grammar allows in one reply (parallel_tool_calls)
GENERIC_INSTRUCTIONS = (
    "You can call these tools (JSON schemas of their parameters):\n{tools}\n\n"
    "To call one or more tools, reply with only this JSON and nothing else: "
    '{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<the arguments>}}}}]}}. '
    "Otherwise answer normally."
)


def tool_format(template: ChatTemplate) -> str:
    """'function_gemma', 'hermes' or 'generic' (see the module docstring)."""
    if fg.OPEN in template.source:
        return "function_gemma"
    return "hermes" if HERMES_OPEN in template.source else "generic"


@dataclass
class ToolPlan:
    """What a request's tools do: prompt additions, an optional grammar, and how to read the output."""

    tools: list[Tool]
    choice: str  # "auto" | "required" | "named"
    named: str | None
    parallel: bool
    fmt: str

    @classmethod
    def from_request(cls, body: ChatRequest, template: ChatTemplate) -> ToolPlan | None:
        """None when the request has no tools or tool_choice is none (the tools are then left out)."""
        tc = body.tool_choice
        if not body.tools or tc == "none":
            return None
        names = [t.function.name for t in body.tools]
        if len(set(names)) != len(names):
            raise GrammarError("tools", "tool names must be unique")
        named = None
        if tc is not None and not isinstance(tc, str):
            named = tc.function.name
            if named not in names:
                raise GrammarError("tool_choice", f"names {named!r}, which is not among the tools "
                                                  f"({', '.join(names)})")
        choice = "named" if named else (tc or "auto")
        parallel = body.parallel_tool_calls is not False and named is None
        return cls(list(body.tools), choice, named, parallel, tool_format(template))

    # -- prompt --------------------------------------------------------------------------------
    def template_tools(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def messages(self, messages: list[dict[str, Any]], template: ChatTemplate) -> list[dict[str, Any]]:
        """The history as this template can render it, with the tool description when it has none."""
        out = history(messages, template)
        if template.handles_tools:
            return out
        described = [{"name": t.function.name, "description": t.function.description or "",
                      "parameters": t.function.parameters or {"type": "object"}} for t in self.tools]
        text = GENERIC_INSTRUCTIONS.format(tools=json.dumps(described, ensure_ascii=False, indent=1))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + text).strip()}
        else:
            out.insert(0, {"role": "system", "content": text})
        return out

    # -- grammar -------------------------------------------------------------------------------
    def grammar(self, answer_schema: dict[str, Any] | None, strict: bool) -> Grammar | None:
        """The forcing grammar: a call (required/named); a call or the answer (auto with a response schema)."""
        if self.choice == "auto" and answer_schema is None:
            return None
        tools = [t for t in self.tools if self.named in (None, t.function.name)]
        schemas: dict[str, Any] = {}
        for i, t in enumerate(tools):
            schemas[f"call{i}"] = {"type": "object", "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or {"type": "object"}}, "required": ["name", "arguments"]}
        if self.choice == "auto":
            schemas["answer"] = answer_schema
        # strictness is per schema: each tool's own `strict`, the response format's for the answer
        for t in tools:
            if t.function.strict:
                _check_strict(t.function.parameters or {}, f"tools ({t.function.name})")
        if strict and answer_schema is not None and self.choice == "auto":
            _check_strict(answer_schema, "response_format")
        if self.fmt == "function_gemma":  # numbers are written alike: the JSON converter's rules serve both
            fg_rules, fg_tops, numbers = fg.grammar_rules(
                {t.function.name: t.function.parameters or {"type": "object"} for t in tools},
                {t.function.name for t in tools if t.function.strict})
            schemas = {k: v for k, v in schemas.items() if k == "answer"} | numbers
        rules, tops = schemas_rules(schemas, param="tools", strict=False)
        if self.fmt == "function_gemma":
            for key in numbers:
                fg_rules = fg_rules.replace(f"@{key}@", tops[key])
            rules += "\n" + fg_rules
            call = "(" + " | ".join(fg_tops.values()) + ")"
            calls = f"{call}{{1,{MAX_PARALLEL}}}" if self.parallel else call
        elif self.fmt == "hermes":
            call = "(" + " | ".join(tops[f"call{i}"] for i in range(len(tools))) + ")"
            one = f'"{HERMES_OPEN}\\n" {call} "\\n{HERMES_CLOSE}"'
            calls = f'{one} ("\\n" {one}){{0,{MAX_PARALLEL - 1}}}' if self.parallel else one
        else:
            call = "(" + " | ".join(tops[f"call{i}"] for i in range(len(tools))) + ")"
            many = f'{call} ("," space {call}){{0,{MAX_PARALLEL - 1}}}' if self.parallel else call
            calls = f'"{{" space "\\"tool_calls\\"" space ":" space "[" space {many} "]" space "}}" space'
        root = f"{calls} | {tops['answer']}" if "answer" in tops else calls
        return Grammar(rules + f"\ntoolcalls ::= {calls}\nroot ::= {root}\n", "tools")

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def engine_args(self, tokenize: Callable[[str], list[int]]) -> dict[str, list[int]]:
        """Engine.submit's `shown` (control tokens whose text the output must keep for this format to be
        read: its tags) and `stop_tokens` (where the format hands over to the tool), as token ids."""
        if self.fmt != "function_gemma":
            return {}

        def ids(texts: Sequence[str]) -> list[int]:
            got = [tokenize(t) for t in texts]
            return [i[0] for i in got if len(i) == 1]
        return {"shown": ids(fg.TAG_TEXTS), "stop_tokens": ids(fg.STOP_TEXTS)}


def _check_strict(schema: Any, param: str) -> None:
    bad = unenforced(schema)
    if bad:
        raise GrammarError(param, "this strict schema uses what constrained decoding cannot enforce: "
                           + "; ".join(bad[:8]), hint="drop those keywords, or send strict: false")


def history(messages: list[dict[str, Any]], template: ChatTemplate) -> list[dict[str, Any]]:
    """Assistant `tool_calls` and `tool` results as the template can take them: with arguments as objects for a
    template that renders tool calls itself, as generic-format text for one that does not."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            parsed = [{"id": c.get("id"), "type": "function", "function": {
                "name": c["function"]["name"], "arguments": _as_object(c["function"]["arguments"])}} for c in calls]
            if template.handles_tool_calls:
                m["tool_calls"] = parsed
            else:
                text = json.dumps({"tool_calls": [{"name": c["function"]["name"],
                                                   "arguments": c["function"]["arguments"]} for c in parsed]},
                                  ensure_ascii=False)
                m.pop("tool_calls")
                m["content"] = (m["content"] + "\n" if m["content"] else "") + text
        if m["role"] == "tool" and not template.handles_tool_calls:
            m["content"] = f"Tool result ({m.get('name') or m.get('tool_call_id') or 'tool'}): {m['content']}"
        out.append(m)
    return out


def _as_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


# ------------------------------------------------------------------------------ reading the output

def _call(name: Any, arguments: Any) -> dict[str, Any] | None:
    if not isinstance(name, str) or not name:
        return None
    args = arguments if isinstance(arguments, str) else json.dumps(
        arguments if arguments is not None else {}, ensure_ascii=False)
    return {"id": "call_" + secrets.token_hex(12), "type": "function", "function": {"name": name, "arguments": args}}


def _from_json(obj: Any) -> list[dict[str, Any]] | None:
    if isinstance(obj, list):
        calls = [_from_json(o) for o in obj]
        return [c for cs in calls if cs for c in cs] if all(calls) and calls else None
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("tool_calls"), list):
        return _from_json(obj["tool_calls"])
    if isinstance(obj.get("tool_call"), dict):
        return _from_json(obj["tool_call"])
    if isinstance(obj.get("function"), dict):
        return _from_json(obj["function"])
    if "name" in obj and ("arguments" in obj or "parameters" in obj):
        c = _call(obj["name"], obj.get("arguments", obj.get("parameters")))
        return [c] if c else None
    return None


def parse_calls(text: str, known: Sequence[str]) -> tuple[str, list[dict[str, Any]]]:
    """(content left, tool calls) from a model's output; calls to unknown tools are not calls."""
    def ok(calls: list[dict[str, Any]] | None) -> bool:
        return bool(calls) and all(c["function"]["name"] in known for c in calls or ())
    s = text.strip()
    if fg.OPEN in s:
        got = fg.parse(s)
        fcalls = [c for c in (_call(n, a) for n, a in got[1]) if c] if got else []
        return (got[0], fcalls) if got and len(fcalls) == len(got[1]) and ok(fcalls) else (text, [])
    if HERMES_OPEN in s:
        head, _, rest = s.partition(HERMES_OPEN)
        calls: list[dict[str, Any]] = []
        for chunk in (HERMES_OPEN + rest).split(HERMES_OPEN)[1:]:
            body = chunk.split(HERMES_CLOSE, 1)[0].strip()
            try:
                got = _from_json(json.loads(body))
            except ValueError:
                got = None
            if not got:
                return text, []
            calls += got
        return (head.strip(), calls) if ok(calls) else (text, [])
    if s.startswith(MISTRAL_TAG):
        s = s[len(MISTRAL_TAG):].strip()
    if s.startswith("```"):
        s = s.strip("`").removeprefix("json").strip()
    if s[:1] in "{[":
        try:
            got = _from_json(json.loads(s))
        except ValueError:
            got = None
        if ok(got):
            return "", got or []
    return text, []


_STARTS = ("{", "[", MISTRAL_TAG, HERMES_OPEN, "```", fg.OPEN)


@dataclass
class ToolStream:
    """Streams content while it cannot be a tool call; holds back what could be one, parsed at the end."""

    plan: ToolPlan
    held: str = ""
    streaming: bool = False  # decided: plain content goes out as it comes
    sent: list[str] = field(default_factory=list)

    def feed(self, text: str) -> str:
        """New text from the model; returns the content that can be shown now."""
        self.held += text
        if self.plan.choice != "auto":
            return ""
        if not self.streaming:
            s = self.held.lstrip()
            if not s or any(x.startswith(s[:len(x)]) for x in _STARTS):
                return ""
            self.streaming = True
        tag = fg.OPEN if self.plan.fmt == "function_gemma" else HERMES_OPEN
        if tag in self.held:
            return ""  # a call began mid-text: the rest is read at the end
        keep = next((k for k in range(min(len(tag) - 1, len(self.held)), 0, -1)
                     if tag.startswith(self.held[-k:])), 0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        self.sent.append(out)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content not shown yet, tool calls) at the end of the output."""
        return parse_calls(self.held, [t.function.name for t in self.plan.tools])


__all__ = ["GENERIC_INSTRUCTIONS", "ToolPlan", "ToolStream", "history", "parse_calls", "tool_format"]
