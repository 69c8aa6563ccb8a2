"""Tool calling: tools into the prompt, forced calls by grammar, calls parsed out of the output.

The output formats are modules of `tool_formats/` behind one interface, picked per chat template by what it
renders (or by `--tool-format`):
- **hermes** (Qwen 2.5/3, Hermes, many fine-tunes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
- **function_gemma** (FunctionGemma): `<start_function_call>call:NAME{key:<escape>text<escape>,...}
  <end_function_call>`; its control tags are shown in the output text of such requests.
- **generic** (llama.cpp's generic format, for every other template, the Gemma and ChatML fallbacks
  included): the reply is the JSON `{"tool_calls": [{"name": ..., "arguments": {...}}]}`.

A template that does not render `tools` itself gets them, with the generic format's instruction, in the
system message (folded into the first user turn on Gemma). Parsing (`tool_choice` auto) tries every format
(and the other JSON shapes models write: Llama 3.x's bare call, Mistral's `[TOOL_CALLS]`). `required` and a
named function are forced by the format's grammar over the tools' parameter schemas (`engine.grammar`); with
`response_format` and `auto` the grammar allows either the answer or a tool call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.chat import ChatTemplate
from ..engine.grammar import Grammar, unenforced
from ..errors import GrammarError
from . import tool_formats
from .schemas import ChatRequest, Tool
from .tool_formats import ToolFormat, parse_calls

GENERIC_INSTRUCTIONS = (
    "You can call these tools (JSON schemas of their parameters):\n{tools}\n\n"
    "To call one or more tools, reply with only this JSON and nothing else: "
    '{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<the arguments>}}}}]}}. '
    "Otherwise answer normally."
)


def tool_format(template: ChatTemplate, override: str | None = None) -> str:
    """The name of the template's tool-call format (see tool_formats)."""
    return tool_formats.detect(template, override).name


@dataclass
class ToolPlan:
    """What a request's tools do: prompt additions, an optional grammar, and how to read the output."""

    tools: list[Tool]
    choice: str  # "auto" | "required" | "named"
    named: str | None
    parallel: bool
    fmt: ToolFormat

    @classmethod
    def from_request(cls, body: ChatRequest, template: ChatTemplate, tool_format: str | None = None
                     ) -> ToolPlan | None:
        """None when the request has no tools or tool_choice is none (the tools are then left out).
        `tool_format`: the server's --tool-format (None or 'auto': the template's own)."""
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
        return cls(list(body.tools), choice, named, parallel, tool_formats.detect(template, tool_format))

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
        # strictness is per schema: each tool's own `strict`, the response format's for the answer
        for t in tools:
            if t.function.strict:
                _check_strict(t.function.parameters or {}, f"tools ({t.function.name})")
        answer = answer_schema if self.choice == "auto" else None
        if strict and answer is not None:
            _check_strict(answer, "response_format")
        return tool_formats.forcing_grammar(self.fmt, tools, parallel=self.parallel, answer_schema=answer)

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def engine_args(self, tokenize: Callable[[str], list[int]]) -> dict[str, list[int]]:
        """Engine.submit's `shown` and `stop_tokens` for this format (tool_formats.base.ToolFormat)."""
        return self.fmt.engine_args(tokenize)


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
            if not s or any(x.startswith(s[:len(x)]) for x in tool_formats.call_starts()):
                return ""
            self.streaming = True
        tags = tool_formats.inline_tags(self.plan.fmt)
        if any(tag in self.held for tag in tags):
            return ""  # a call began mid-text: the rest is read at the end
        keep = max((k for tag in tags for k in range(min(len(tag) - 1, len(self.held)), 0, -1)
                    if tag.startswith(self.held[-k:])), default=0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        self.sent.append(out)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content not shown yet, tool calls) at the end of the output."""
        return parse_calls(self.held, [t.function.name for t in self.plan.tools])


__all__ = ["GENERIC_INSTRUCTIONS", "ToolPlan", "ToolStream", "history", "tool_format"]
