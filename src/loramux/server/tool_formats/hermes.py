"""The Hermes tool-call format (Qwen 2.5/3, Hermes and many fine-tunes): each call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; detected when the template writes an
assistant's call that way.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...engine.chat import TemplateCapabilities
from ..schemas import Tool
from .base import MAX_PARALLEL, CallGrammar, Parsed, ToolFormat, call_schemas, one_of_calls, read_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(ToolFormat):
    """Calls as JSON between `<tool_call>` tags, possibly after some content."""

    name = "hermes"
    starts = (OPEN,)
    inline_tag = OPEN

    def detect(self, caps: TemplateCapabilities) -> bool:
        return OPEN in caps.call_text

    def read(self, text: str) -> Parsed | None:
        head, sep, rest = text.partition(OPEN)
        if not sep:
            return None
        calls = []
        for chunk in rest.split(OPEN):
            got = read_json(chunk.split(CLOSE, 1)[0].strip())
            if not got:
                return head.strip(), []
            calls += got
        return head.strip(), calls

    def call_grammar(self, tools: Sequence[Tool], parallel: bool) -> CallGrammar:
        def build(tops: dict[str, str]) -> tuple[str, str]:
            one = f'"{OPEN}\\n" {one_of_calls(tops, len(tools))} "\\n{CLOSE}"'
            return "", f'{one} ("\\n" {one}){{0,{MAX_PARALLEL - 1}}}' if parallel else one
        return CallGrammar(call_schemas(tools), build)


__all__ = ["CLOSE", "OPEN", "Hermes"]
