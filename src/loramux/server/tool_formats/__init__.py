"""The tool-call formats, one module each behind one interface (base.py), and the registry that picks one.

A chat template's format is the first registered format that detects itself in what the template renders
for a test conversation (`engine.chat.TemplateCapabilities`); `generic` comes last and takes every template.
`loramux serve --tool-format NAME` overrides the choice. A finished reply is read by every format in
registry order, so a model that writes another format's calls is still understood.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from ...engine.chat import ChatTemplate
from ...engine.grammar import Grammar, schemas_rules
from ...errors import ParameterError
from ..schemas import Tool
from .base import MAX_PARALLEL, CallGrammar, Parsed, ToolFormat
from .function_gemma import FunctionGemma
from .generic import Generic
from .hermes import Hermes

FORMATS: dict[str, ToolFormat] = {}  # in the order they are detected and read; generic last


def register(fmt: ToolFormat, *, before: str | None = "generic") -> None:
    """Add a format to the registry, ahead of `before` (the generic fallback, unless told otherwise)."""
    if not getattr(fmt, "name", "") or fmt.name in FORMATS:
        raise ParameterError("tool format", f"{getattr(fmt, 'name', '')!r} is empty or registered already")
    items = list(FORMATS.items())
    at = next((i for i, (name, _) in enumerate(items) if name == before), len(items))
    items.insert(at, (fmt.name, fmt))
    FORMATS.clear()
    FORMATS.update(items)


def unregister(name: str) -> None:
    """Remove a format (for the generic fallback: refused; every template needs one that takes it)."""
    if name == "generic":
        raise ParameterError("tool format", "the generic format is the fallback and cannot be removed")
    FORMATS.pop(name, None)


for _fmt in (FunctionGemma(), Hermes(), Generic()):
    register(_fmt, before=None)


def names() -> list[str]:
    """The registered formats' names, in registry order."""
    return list(FORMATS)


def detect(template: ChatTemplate, override: str | None = None) -> ToolFormat:
    """The format of `template`'s tool calls, or the one `override` names ('auto' and None: detect)."""
    if override not in (None, "auto"):
        if override not in FORMATS:
            raise ParameterError("tool_format", f"unknown tool-call format {override!r}",
                                 hint="one of: auto, " + ", ".join(FORMATS))
        return FORMATS[override]
    caps = template.capabilities
    return next(f for f in FORMATS.values() if f.detect(caps))


def make_call(name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI `tool_calls` entry (a new id; arguments as JSON text)."""
    import json

    args = arguments if isinstance(arguments, str) else json.dumps(
        arguments if arguments is not None else {}, ensure_ascii=False)
    return {"id": "call_" + secrets.token_hex(12), "type": "function", "function": {"name": name, "arguments": args}}


def parse_calls(text: str, known: Sequence[str]) -> tuple[str, list[dict[str, Any]]]:
    """(content left, tool calls) from a model's output, read by the first format whose output it is; calls to
    unknown tools are not calls (the text is then content)."""
    s = text.strip()
    for fmt in FORMATS.values():
        got = fmt.read(s)
        if got is None:
            continue
        content, calls = got
        if calls and all(name in known for name, _ in calls):
            return content, [make_call(name, args) for name, args in calls]
        return text, []
    return text, []


def call_starts() -> tuple[str, ...]:
    """What a reply that is a call can begin with, in any registered format."""
    return tuple(dict.fromkeys(s for f in FORMATS.values() for s in f.starts))


def inline_tags(fmt: ToolFormat) -> tuple[str, ...]:
    """The tags that start a call after some content: the format's own, or, for a format without one, every
    registered format's (such a model may still write a tagged call mid-text)."""
    if fmt.inline_tag:
        return (fmt.inline_tag,)
    return tuple(dict.fromkeys(f.inline_tag for f in FORMATS.values() if f.inline_tag))


def forcing_grammar(fmt: ToolFormat, tools: Sequence[Tool], *, parallel: bool,
                    answer_schema: dict[str, Any] | None = None) -> Grammar:
    """The grammar of a forced call in `fmt` to one of `tools`, or (with `answer_schema`) that call or an
    answer matching the schema."""
    cg = fmt.call_grammar(tools, parallel)
    schemas = dict(cg.schemas)
    if answer_schema is not None:
        schemas["answer"] = answer_schema
    rules, tops = schemas_rules(schemas, param="tools", strict=False) if schemas else ("", {})
    own, calls = cg.build(tops)
    rules = "\n".join(r for r in (rules, own) if r)
    root = f"{calls} | {tops['answer']}" if "answer" in tops else calls
    return Grammar(rules + f"\ntoolcalls ::= {calls}\nroot ::= {root}\n", "tools")


__all__ = ["FORMATS", "MAX_PARALLEL", "CallGrammar", "Parsed", "ToolFormat", "call_starts", "detect",
           "forcing_grammar", "inline_tags", "make_call", "names", "parse_calls", "register", "unregister"]
