"""Tool calling over real HTTP with the official openai client: forced calls, parsing, streaming, history."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import tinymodel
from test_server import adir, client, serving  # noqa: F401 - adir is a fixture
from tinymodel import write_tiny_model

from loramux.engine.chat import ChatTemplate
from loramux.errors import GrammarError
from loramux.server.tool_formats import function_gemma as fg
from loramux.server.tools import ToolPlan, parse_calls

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <forecast>",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
HERMES = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call tools as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

FUNCTION_GEMMA = (  # FunctionGemma's layout, cut down: declarations, calls and turns
    "{{ bos_token }}{% if tools %}<start_of_turn>developer\n{% for t in tools %}<start_function_declaration>"
    "{{ t.function.name }}{{ t.function.parameters | tojson }}<end_function_declaration>{% endfor %}<end_of_turn>\n"
    "{% endif %}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<start_function_call>call:{{ c.function.name }}{}"
    "<end_function_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
FG_TAGS = ["<start_function_call>", "<end_function_call>", "<escape>", "<start_function_declaration>",
           "<end_function_declaration>", "<start_function_response>", "<end_function_response>"]


@pytest.fixture(scope="module")
def srv(tiny_model, adir):  # noqa: F811
    with serving(tiny_model, adir, loras=("a", "b"), parallel=2, n_ctx=2048, slots=2) as s:
        yield s


def _check_calls(calls, names=None) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("lora", [None, "a"])
def test_required_call_is_valid_and_streams_the_same(srv, lora):
    c = client(srv[0])
    model = lora or "tiny"
    kw = dict(model=model, messages=[{"role": "user", "content": "weather in paris?"}], tools=TOOLS,
              tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0, seed=1)
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert ch.message.content is None and len(ch.message.tool_calls) == 1
    _check_calls(ch.message.tool_calls)
    parts, reasons = {}, []
    for chunk in c.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        assert not d.content
        for tc in d.tool_calls or ():
            p = parts.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            p["id"] = tc.id or p["id"]
            p["name"] = (tc.function.name if tc.function and tc.function.name else p["name"])
            p["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert reasons[-1] == "tool_calls"
    assert [(p["name"], p["arguments"]) for p in parts.values()] == [
        (t.function.name, t.function.arguments) for t in ch.message.tool_calls]
    assert all(p["id"] for p in parts.values())


def test_named_choice_and_parallel_calls(srv):
    c = client(srv[0])
    for seed in range(3):
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "time?"}], tools=TOOLS,
                                      tool_choice={"type": "function", "function": {"name": "get_time"}},
                                      max_tokens=200, temperature=1.0, seed=seed)
        calls = r.choices[0].message.tool_calls
        _check_calls(calls, {"get_time"})
        assert len(calls) == 1  # a named function is one call
    r = c.chat.completions.create(model="b", messages=[{"role": "user", "content": "both"}], tools=TOOLS,
                                  tool_choice="required", max_tokens=400, temperature=0.7, seed=5)
    if r.choices[0].finish_reason == "tool_calls":
        _check_calls(r.choices[0].message.tool_calls)
        assert 1 <= len(r.choices[0].message.tool_calls) <= 4


def test_round_trip_with_history(srv):
    """The openai client's own objects go back as history: assistant tool_calls, then the tool's result."""
    c = client(srv[0])
    msgs = [{"role": "user", "content": "weather?"}]
    first = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=200, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    msgs += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21})}]
    second = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.tool_calls is None


def test_auto_with_response_format_is_a_call_or_the_answer(srv):
    c = client(srv[0])
    answer = {"type": "object", "properties": {"reply": {"type": "string", "maxLength": 5}}, "required": ["reply"]}
    for seed in range(4):
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                      tool_choice="auto", parallel_tool_calls=False, max_tokens=200,
                                      temperature=1.0, seed=seed,
                                      response_format={"type": "json_schema", "json_schema": {
                                          "name": "a", "schema": answer, "strict": True}})
        ch = r.choices[0]
        if ch.finish_reason == "tool_calls":
            _check_calls(ch.message.tool_calls)
        elif ch.finish_reason == "stop":
            jsonschema.validate(json.loads(ch.message.content), answer)


def test_refusals_name_the_field(srv):
    url = srv[0].url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "x"}]
    for body, param in [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"functions": [{"name": "f"}]}, "functions"),
                        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tools"),
                        ({"tools": [{"type": "function", "function": {
                            "name": "f", "strict": True,
                            "parameters": {"type": "array", "uniqueItems": True}}}], "tool_choice": "required"},
                         "tools (f)"),
                        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
                        ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
                          "stream": True, "max_tokens": 2}, None)]:
        r = httpx.post(url, json={"messages": msgs, **body})
        if param is None:
            assert r.status_code == 200  # a cut-off forced call streams out as text, the server stays up
            continue
        assert r.status_code == 400, (body, r.text)
        assert param in (r.json()["error"]["param"] or "") or param in r.json()["error"]["message"], r.text


def test_template_with_tools_gets_them_and_hermes_calls(tmp_path, monkeypatch):
    monkeypatch.setattr(tinymodel, "CHAT_TEMPLATE", HERMES)
    path = write_tiny_model(tmp_path / "hermes.gguf")
    with serving(path, n_ctx=2048) as (s, eng, _st):
        tmpl = eng.chat_template()
        assert tmpl.handles_tools and tmpl.handles_tool_calls
        r = client(s).chat.completions.create(model="hermes", messages=[{"role": "user", "content": "w?"}],
                                              tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                              max_tokens=200, temperature=0, extra_body={"return_token_ids": True})
        _check_calls(r.choices[0].message.tool_calls)
        prompt = eng.detokenize(r.choices[0].model_extra["prompt_token_ids"])
        assert '"description": "Weather <forecast>"' in prompt  # tojson, not HTML-escaped
        text = eng.detokenize(r.choices[0].model_extra["token_ids"])
        assert text.startswith("<tool_call>\n{") and text.rstrip().endswith("</tool_call>")


def test_fallback_prompt_describes_tools(tiny_model):
    from loramux.server.schemas import ChatRequest

    tmpl = ChatTemplate("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}", "plain")
    body = ChatRequest(messages=[{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}],
                       tools=TOOLS)
    plan = ToolPlan.from_request(body, tmpl)
    assert plan is not None and plan.fmt.name == "generic" and plan.choice == "auto"
    msgs = plan.messages(body.message_dicts(), tmpl)
    assert msgs[0]["content"].startswith("Be kind.\n\nYou can call these tools") and "get_weather" in msgs[0]["content"]
    assert plan.grammar(None, False) is None  # auto without a response schema: parsed, not forced
    none = ChatRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="none")
    assert ToolPlan.from_request(none, tmpl) is None


@pytest.mark.parametrize(("text", "content", "names"), [
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>', "", ["get_time"]),
    ('Let me check.\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": {"city": "x", "days": 2}}</tool_call>', "Let me check.",
     ["get_time", "get_weather"]),
    ('{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}]}', "", ["get_time"]),
    ('{"tool_call": {"name": "get_time", "arguments": {"zone": "UTC"}}}', "", ["get_time"]),
    ('{"name": "get_time", "parameters": {"zone": "UTC"}}', "", ["get_time"]),
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]', "", ["get_time"]),
    ('{"name": "unknown", "arguments": {}}', None, []),
    ('{"answer": 3}', None, []),
    ("plain text", None, []),
])
def test_parse_formats(text, content, names):
    got_content, calls = parse_calls(text, ["get_time", "get_weather"])
    assert [c["function"]["name"] for c in calls] == names
    assert got_content == (text if content is None else content)
    for c in calls:
        json.loads(c["function"]["arguments"])


def test_auto_stream_holds_only_what_could_be_a_call():
    from loramux.server.schemas import ChatRequest

    tmpl = ChatTemplate("x", "plain")
    plan = ToolPlan.from_request(ChatRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS), tmpl)
    s = plan.stream()
    out = [s.feed(t) for t in ["  ", "Sure", ", it is ", "<tool", "_call>", '{"name": "get_time", "arguments": {}}']]
    assert "".join(out) == "  Sure, it is "
    tail, calls = s.finish()
    assert tail == "" and [c["function"]["name"] for c in calls] == ["get_time"]
    s = plan.stream()
    assert s.feed('{"tool_calls": [') == "" and s.feed("]}") == ""
    assert s.finish() == ('{"tool_calls": []}', [])


@pytest.mark.parametrize("stream", [False, True])
def test_function_gemma_calls_are_forced_in_its_format_and_read_back(tmp_path, monkeypatch, stream):
    """A template with FunctionGemma's tags: a forced call comes out in its own syntax (tags, call:NAME{...},
    <escape> strings), which needs its control tokens kept in the text, and is read back as valid tool calls."""
    monkeypatch.setattr(tinymodel, "CHAT_TEMPLATE", FUNCTION_GEMMA)
    monkeypatch.setattr(tinymodel, "PIECES", tinymodel.PIECES + FG_TAGS)
    path = write_tiny_model(tmp_path / "fgemma.gguf")
    with serving(path, n_ctx=2048) as (s, eng, _st):
        assert all(len(eng.tokenize(t, add_bos=False)) == 1 for t in FG_TAGS)
        kw = dict(model="fgemma", messages=[{"role": "user", "content": "w?"}], tools=TOOLS, tool_choice="required",
                  max_tokens=300, temperature=0, extra_body={"return_token_ids": True})
        c = client(s)
        if stream:
            calls: dict[int, dict[str, str]] = {}
            reasons = []
            for chunk in c.chat.completions.create(**kw, stream=True):
                for ch in chunk.choices:
                    reasons.append(ch.finish_reason)
                    for d in ch.delta.tool_calls or ():
                        e = calls.setdefault(d.index, {"name": "", "arguments": ""})
                        e["name"] += (d.function.name or "") if d.function else ""
                        e["arguments"] += (d.function.arguments or "") if d.function else ""
            assert "tool_calls" in reasons and calls
            for e in calls.values():
                jsonschema.validate(json.loads(e["arguments"]), SCHEMAS[e["name"]])
            return
        r = c.chat.completions.create(**kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        _check_calls(ch.message.tool_calls)
        text = eng.model.detokenize(ch.model_extra["token_ids"], special=True)
        assert text.startswith("<start_function_call>call:get_") and "<end_function_call>" in text
        for seed in range(4):  # sampled: the schema's bounds (maxLength, the integer range) hold in this format too
            r = c.chat.completions.create(**{**kw, "temperature": 1.0, "seed": seed, "tool_choice": {
                "type": "function", "function": {"name": "get_weather"}}})
            _check_calls(r.choices[0].message.tool_calls, ["get_weather"])


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("<start_function_call>call:get_time{zone:<escape>UTC<escape>}<end_function_call>", "",
     [("get_time", {"zone": "UTC"})]),
    ("Checking.<start_function_call>call:get_weather{city:<escape>Paris, {FR}<escape>,days:3}<end_function_call>"
     "<start_function_call>call:get_time{zone:<escape>CET<escape>}<end_function_call>", "Checking.",
     [("get_weather", {"city": "Paris, {FR}", "days": 3}), ("get_time", {"zone": "CET"})]),
    ("<start_function_call>call:get_time{zone:<escape>UTC<escape>,opts:{deep:[1,2.5,-3e2,true,null],x:false}}",
     "", [("get_time", {"zone": "UTC", "opts": {"deep": [1, 2.5, -300.0, True, None], "x": False}})]),
    ("<start_function_call>call:get_time{}<end_function_call>", "", [("get_time", {})]),
    ("<start_function_call>call:unknown{a:1}<end_function_call>", None, []),
    ("<start_function_call>call:get_time{zone:<escape>UTC}<end_function_call>", None, []),  # unclosed string
    ("<start_function_call>call:get_time{zone:UTC}<end_function_call>", None, []),  # a bare word is no value
    ("<start_function_call>call:get_time{zone:<escape>a<escape>} trailing<end_function_call>", None, []),
    ("<start_function_call>get_time{}<end_function_call>", None, []),
])
def test_function_gemma_format_is_read(text, content, calls):
    got_content, got = parse_calls(text, ["get_time", "get_weather"])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert got_content == (text if content is None else content)


def test_function_gemma_grammar_and_stream_hold_back():
    from loramux.server.schemas import ChatRequest

    tmpl = ChatTemplate(FUNCTION_GEMMA, "fgemma")
    body = ChatRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    plan = ToolPlan.from_request(body, tmpl)
    assert plan is not None and plan.fmt.name == "function_gemma"
    assert plan.engine_args(lambda t: [len(t)]) == {"shown": [len(t) for t in fg.TAG_TEXTS],
                                                    "stop_tokens": [len("<start_function_response>")]}
    assert ToolPlan.from_request(body, ChatTemplate(HERMES, "hermes")).engine_args(lambda t: [1]) == {}
    s = plan.stream()
    out = [s.feed(t) for t in ["Sure", " thing ", "<start_func", "tion_call>call:get_time{}"]]
    assert "".join(out) == "Sure thing "
    assert [c["function"]["name"] for c in s.finish()[1]] == ["get_time"]
    rules, tops, numbers = fg.grammar_rules({"f": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "x+"}, "b": {"type": "integer", "maximum": 7}}}})
    assert tops == {"f": "fg0"} and "fg0-o ::= \"{\" (fg0-f0)? \"}\"" in rules  # neither is required
    assert numbers == {"fgnum0": {"type": "integer", "maximum": 7}} and fg.number_ref("fgnum0") in rules
    with pytest.raises(GrammarError) as err:  # a strict tool: what the format cannot enforce is refused
        fg.grammar_rules({"f": {"type": "object", "properties": {"a": {"type": "string", "pattern": "x+"}}}}, {"f"})
    assert err.value.parameter == "tools (f)" and "pattern" in str(err.value)


def test_stop_tokens_end_the_output_where_the_tool_takes_over(tmp_path, monkeypatch):
    """FunctionGemma goes on with <start_function_response> after its calls: the engine's stop tokens end
    the output there (finish_reason stop, the token left out), ignore_eos or not."""
    import loramux as lm
    from loramux.engine.grammar import Grammar

    monkeypatch.setattr(tinymodel, "PIECES", tinymodel.PIECES + FG_TAGS)
    path = write_tiny_model(tmp_path / "fgemma.gguf")
    with lm.Engine.load(path, n_ctx=256, n_threads=2) as eng:
        stop = eng.tokenize("<start_function_response>", add_bos=False)
        assert len(stop) == 1
        forced = Grammar('root ::= "the cat" <start_function_response> " sat"', "grammar")
        free = eng.generate("hello", grammar=forced, max_tokens=20)
        assert free.text == "the cat sat" and stop[0] in free.tokens  # the control token is not text
        got = eng.generate("hello", grammar=forced, stop_tokens=stop, max_tokens=20, ignore_eos=True)
        assert got.finish_reason == "stop" and got.text == "the cat" and stop[0] not in got.tokens


def test_tools_with_n_and_logprobs(srv):
    """Tools go through the fan-out path too: each of n sequences reads its own calls, with logprobs."""
    c = client(srv[0])
    kw = dict(model="a", messages=[{"role": "user", "content": "weather in paris?"}], tools=TOOLS,
              tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0.8, seed=4)
    r = c.chat.completions.create(n=2, logprobs=True, top_logprobs=2, **kw)
    assert [ch.index for ch in r.choices] == [0, 1]
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        _check_calls(ch.message.tool_calls)
        assert ch.logprobs.content and all(len(e.top_logprobs) == 2 for e in ch.logprobs.content)
    calls: dict[int, dict[int, dict[str, str]]] = {0: {}, 1: {}}
    reasons = {}
    for chunk in c.chat.completions.create(n=2, logprobs=True, stream=True, **kw):
        for ch in chunk.choices:
            for t in ch.delta.tool_calls or ():
                got = calls[ch.index].setdefault(t.index, {"name": "", "arguments": ""})
                got["name"] += (t.function.name or "") if t.function else ""
                got["arguments"] += (t.function.arguments or "") if t.function else ""
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    for k, ch in enumerate(r.choices):  # the same seeds: the streamed calls are the plain ones
        assert calls[k][0] == {"name": ch.message.tool_calls[0].function.name,
                               "arguments": ch.message.tool_calls[0].function.arguments}
    one = c.chat.completions.create(logprobs=True, **kw).choices[0]  # n = 1 with logprobs: the same path
    assert one.finish_reason == "tool_calls"
    _check_calls(one.message.tool_calls)
