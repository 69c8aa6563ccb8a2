"""What a tool-call format is: the one small interface every format module implements.

A format answers four questions: does this chat template speak it (`detect`, from what the template renders
for a test conversation), which grammar forces a call in it (`call_grammar`), which calls a finished reply
holds (`read`), and what a streamed reply may begin with before it is known to be a call (`starts`,
`inline_tag`). Formats are listed in the registry (`tool_formats/__init__.py`); adding one is a new module
and one line there.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ...engine.chat import TemplateCapabilities
from ..schemas import Tool

MAX_PARALLEL = 4  # calls a forced grammar allows in one reply (parallel_tool_calls)

# (content before the calls, [(tool name, arguments: a JSON value or its text)])
Parsed = tuple[str, list[tuple[str, Any]]]


@dataclass(frozen=True)
class CallGrammar:
    """A format's forcing grammar in two halves. `schemas`: the JSON sub-schemas it needs converted by the JSON
    converter, in the same grammar as a response schema (so their rules share one namespace). `build`: takes
    the converter's top rule of each and returns (the format's own rules, the GBNF expression of its calls)."""

    schemas: dict[str, Any]
    build: Callable[[dict[str, str]], tuple[str, str]]


class ToolFormat(ABC):
    """One tool-call output format."""

    name: ClassVar[str]
    starts: ClassVar[tuple[str, ...]] = ()  # what a reply that is a call in this format can begin with
    inline_tag: ClassVar[str | None] = None  # a tag that starts a call after some content (None: there is none)

    @abstractmethod
    def detect(self, caps: TemplateCapabilities) -> bool:
        """Whether a chat template with these capabilities writes tool calls in this format."""

    @abstractmethod
    def read(self, text: str) -> Parsed | None:
        """The calls in `text` (stripped) if it is written in this format, else None. A reply that carries the
        format's marker but no readable call gives calls `[]`: it is this format's, and holds no call."""

    @abstractmethod
    def call_grammar(self, tools: Sequence[Tool], parallel: bool) -> CallGrammar:
        """The grammar that forces one of `tools` to be called (up to MAX_PARALLEL of them if `parallel`)."""

    def engine_args(self, tokenize: Callable[[str], list[int]]) -> dict[str, list[int]]:
        """Engine.submit's `shown` (control tokens whose text the output must keep for the format to be read)
        and `stop_tokens` (where the format hands over to the tool), as token ids; most formats need neither."""
        return {}


def call_schemas(tools: Sequence[Tool]) -> dict[str, Any]:
    """`call{i}`: the JSON object `{"name": <the tool's name>, "arguments": <its parameters>}` per tool, for the
    formats whose calls are JSON."""
    return {f"call{i}": {"type": "object", "properties": {
        "name": {"const": t.function.name},
        "arguments": t.function.parameters or {"type": "object"}}, "required": ["name", "arguments"]}
        for i, t in enumerate(tools)}


def one_of_calls(tops: dict[str, str], n: int) -> str:
    """The alternatives of the `call{i}` rules of `call_schemas` for n tools."""
    return "(" + " | ".join(tops[f"call{i}"] for i in range(n)) + ")"


def calls_from_json(obj: Any) -> list[tuple[str, Any]] | None:
    """Calls in the JSON shapes models write: `{"tool_calls": [...]}`, `{"tool_call": {...}}`,
    `{"function": {...}}`, `{"name": ..., "arguments" | "parameters": ...}` (Llama 3.x), or a list of those.
    None when `obj` is none of them (or names no tool)."""
    if isinstance(obj, list):
        calls = [calls_from_json(o) for o in obj]
        return [c for cs in calls if cs for c in cs] if calls and all(calls) else None
    if not isinstance(obj, dict):
        return None
    for key in ("tool_calls", "tool_call", "function"):
        inner = obj.get(key)
        if isinstance(inner, list if key == "tool_calls" else dict):
            return calls_from_json(inner)
    if "name" in obj and ("arguments" in obj or "parameters" in obj):
        name = obj["name"]
        if not isinstance(name, str) or not name:
            return None
        return [(name, obj.get("arguments", obj.get("parameters")))]
    return None


def read_json(text: str) -> list[tuple[str, Any]] | None:
    """`calls_from_json` of `text` parsed as JSON; None when it does not parse."""
    try:
        return calls_from_json(json.loads(text))
    except ValueError:
        return None


__all__ = ["MAX_PARALLEL", "CallGrammar", "Parsed", "ToolFormat", "call_schemas", "calls_from_json",
           "one_of_calls", "read_json"]
