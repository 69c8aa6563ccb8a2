"""llama.cpp's generic tool-call format, for every template that writes calls no other way (the Gemma and
ChatML fallbacks included): the reply is the JSON `{"tool_calls": [{"name": ..., "arguments": {...}}]}`.

Reading also takes the other JSON shapes models write (`calls_from_json`), Mistral's `[TOOL_CALLS][...]` and a
```json fence around any of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...engine.chat import TemplateCapabilities
from ..schemas import Tool
from .base import MAX_PARALLEL, CallGrammar, Parsed, ToolFormat, call_schemas, one_of_calls, read_json

MISTRAL_TAG = "[TOOL_CALLS]"


class Generic(ToolFormat):
    """The JSON object of calls; the fallback, detected for every template."""

    name = "generic"
    starts = ("{", "[", MISTRAL_TAG, "```")

    def detect(self, caps: TemplateCapabilities) -> bool:
        return True

    def read(self, text: str) -> Parsed | None:
        s = text.removeprefix(MISTRAL_TAG).strip()
        if s.startswith("```"):
            s = s.strip("`").removeprefix("json").strip()
        if s[:1] not in ("{", "["):
            return None
        return "", read_json(s) or []

    def call_grammar(self, tools: Sequence[Tool], parallel: bool) -> CallGrammar:
        def build(tops: dict[str, str]) -> tuple[str, str]:
            call = one_of_calls(tops, len(tools))
            many = f'{call} ("," space {call}){{0,{MAX_PARALLEL - 1}}}' if parallel else call
            return "", f'"{{" space "\\"tool_calls\\"" space ":" space "[" space {many} "]" space "}}" space'
        return CallGrammar(call_schemas(tools), build)


__all__ = ["MISTRAL_TAG", "Generic"]
