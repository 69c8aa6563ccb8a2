"""Tool-call formats as modules behind one interface: detection by rendering, the registry, --tool-format.

The fictional `bracket` format below is the whole of what adding a format takes: one class implementing
`ToolFormat` and one `register` call. A server on a template that writes calls that way then forces, reads
and streams them like any other format.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import tinymodel
from test_server import client, serving

from loramux.engine.chat import ChatTemplate, TemplateCapabilities
from loramux.errors import ParameterError
from loramux.server import tool_formats
from loramux.server.config import ServerSettings
from loramux.server.schemas import ChatRequest, Tool
from loramux.server.tool_formats import CallGrammar, Parsed, ToolFormat
from loramux.server.tools import ToolPlan

TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
BRACKET_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "[[call {{ c.function.name }} {{ c.function.arguments | tojson }}]]{% endfor %}{% else %}{{ m.content }}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CALL = re.compile(r"\[\[call (\S+) (\{.*?\})\]\]", re.S)


class Bracket(ToolFormat):
    """`[[call NAME {json arguments}]]`, one or more."""

    name = "bracket"
    starts = ("[[",)
    inline_tag = "[[call"

    def detect(self, caps: TemplateCapabilities) -> bool:
        return "[[call " in caps.call_text

    def read(self, text: str) -> Parsed | None:
        if "[[call" not in text:
            return None
        calls = [(name, json.loads(args)) for name, args in _CALL.findall(text)]
        return text.split("[[call", 1)[0].strip(), calls

    def call_grammar(self, tools: Sequence[Tool], parallel: bool) -> CallGrammar:
        schemas = {f"args{i}": t.function.parameters or {"type": "object"} for i, t in enumerate(tools)}

        def build(tops: dict[str, str]) -> tuple[str, str]:
            one = "(" + " | ".join(f'"[[call {t.function.name} " {tops[f"args{i}"]} "]]"'
                                   for i, t in enumerate(tools)) + ")"
            return "", f"{one}+" if parallel else one
        return CallGrammar(schemas, build)

    def engine_args(self, tokenize: Callable[[str], list[int]]) -> dict[str, list[int]]:
        return {}


@pytest.fixture
def bracket() -> Iterator[Bracket]:
    fmt = Bracket()
    tool_formats.register(fmt)
    yield fmt
    tool_formats.unregister(fmt.name)


def _body(**kw: object) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "time?"}], tools=TOOLS, **kw)


def test_a_new_format_is_one_class_and_one_registration(bracket, tmp_path: Path, monkeypatch):
    """Registered, the fictional format is detected for its template, forced by its grammar over real HTTP,
    read back into OpenAI tool calls, and held back while streaming; unregistered, the template is generic."""
    assert tool_formats.names()[-2:] == ["bracket", "generic"]
    tmpl = ChatTemplate(BRACKET_TEMPLATE, "bracket")
    assert tool_formats.detect(tmpl).name == "bracket"
    monkeypatch.setattr(tinymodel, "CHAT_TEMPLATE", BRACKET_TEMPLATE)
    path = tinymodel.write_tiny_model(tmp_path / "bracket.gguf")
    with serving(path, n_ctx=2048) as (s, eng, _st):
        r = client(s).chat.completions.create(
            model="bracket", messages=[{"role": "user", "content": "time?"}], tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=60, temperature=0, extra_body={"return_token_ids": True})
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_time"]
        assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET")
        assert eng.detokenize(r.choices[0].model_extra["token_ids"]).startswith("[[call get_time {")
    stream = ToolPlan.from_request(_body(), tmpl).stream()
    shown = [stream.feed(t) for t in ["It is ", "[[ca", 'll get_time {"zone": "UTC"}]]']]
    assert "".join(shown) == "It is " and [c["function"]["name"] for c in stream.finish()[1]] == ["get_time"]
    tool_formats.unregister("bracket")
    assert tool_formats.detect(tmpl).name == "generic"
    tool_formats.register(bracket)  # for the fixture's own unregister


@pytest.mark.parametrize(("source", "tools", "calls", "fmt"), [
    # only words in a comment: a substring test would take these for tool-rendering templates
    ("{# tools, tool_calls and <tool_call> are not rendered here #}{% for m in messages %}{{ m.content }}"
     "{% endfor %}", False, False, "generic"),
    ("{% for m in messages %}{% if m.tool_calls %}<tool_call>{{ m.tool_calls[0].function.name }}</tool_call>"
     "{% else %}{{ m.content }}{% endif %}{% endfor %}", False, True, "hermes"),
    ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}",
     True, False, "generic"),
    # a template that refuses the test conversation renders nothing: no capability is claimed
    ("{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('no assistant turns') }}"
     "{% endif %}{{ m.content }}{% endfor %}", False, False, "generic"),
])
def test_capabilities_come_from_what_the_template_renders(source, tools, calls, fmt):
    tmpl = ChatTemplate(source, "probe")
    assert (tmpl.handles_tools, tmpl.handles_tool_calls) == (tools, calls)
    assert tool_formats.detect(tmpl).name == fmt


def test_tool_format_setting_overrides_detection_and_is_checked():
    tmpl = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", "plain")
    assert ToolPlan.from_request(_body(), tmpl).fmt.name == "generic"
    assert ToolPlan.from_request(_body(), tmpl, "hermes").fmt.name == "hermes"
    assert ServerSettings(tool_format="function_gemma").tool_format == "function_gemma"
    with pytest.raises(ParameterError) as e:
        ServerSettings(tool_format="xml").validated()
    assert "tool_format: 'xml'" in str(e.value) and "hermes" in str(e.value)


def test_a_server_with_tool_format_forces_calls_in_it(tiny_model: Path):
    """--tool-format hermes on a template without tools: the forced call comes out in `<tool_call>` tags."""
    with serving(tiny_model, n_ctx=2048, tool_format="hermes") as (s, eng, _st):
        r = client(s).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "time?"}], tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=240, temperature=0, extra_body={"return_token_ids": True})
        assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]
        assert eng.detokenize(r.choices[0].model_extra["token_ids"]).startswith("<tool_call>\n{")


def test_every_format_forces_a_call_it_can_read_back(tmp_path: Path, monkeypatch):
    """Each registered format's grammar, compiled by llama.cpp and sampled on the tiny model (with
    FunctionGemma's tags in its vocabulary), gives a reply that the registry reads back as a call to the tool."""
    from test_tools import FG_TAGS

    from loramux import Engine

    monkeypatch.setattr(tinymodel, "PIECES", tinymodel.PIECES + FG_TAGS)
    path = tinymodel.write_tiny_model(tmp_path / "tags.gguf")
    tool = Tool.model_validate(TOOLS[0])
    with Engine.load(path, n_ctx=1024) as eng:
        def tokenize(text: str) -> list[int]:
            return eng.model.tokenize(text, add_bos=False, special=True)
        for fmt in tool_formats.FORMATS.values():
            grammar = tool_formats.forcing_grammar(fmt, [tool], parallel=False).compile(eng.model)
            shown = fmt.engine_args(tokenize).get("shown", ())
            text = eng.generate("the cat", grammar=grammar, max_tokens=240, temperature=0, shown=shown).text
            _, calls = tool_formats.parse_calls(text, ["get_time"])
            assert [c["function"]["name"] for c in calls] == ["get_time"], (fmt.name, text)
