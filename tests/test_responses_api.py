"""OpenAI's Responses API on a real loramux server (tiny model, adapters a and b), talked to with the `openai`
client's responses.create, the OpenAI Agents SDK with its default (Responses) model, and raw HTTP. On the tiny
model tool calls and JSON are valid because tool_choice and text.format force them through the grammar."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import httpx
import pydantic
import pytest
from test_server import adir, client, serving  # noqa: F401 - adir is a fixture

ADD = {"type": "function", "name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    legs: int = pydantic.Field(ge=0, le=8)


@pytest.fixture(scope="module")
def srv(tiny_model, adir):  # noqa: F811
    with serving(tiny_model, adir, loras=("a", "b"), parallel=2, n_ctx=2048) as s:
        yield s


def test_text_plain_and_streamed_agree_per_adapter(srv):
    c = client(srv[0])
    kw = {"instructions": "be brief", "input": "the cat sat", "max_output_tokens": 12, "temperature": 0}
    texts = {}
    for model in ("tiny", "a"):
        r = c.responses.create(model=model, **kw)
        assert r.object == "response" and r.model == model and r.reasoning is None
        assert r.status == ("incomplete" if r.usage.output_tokens == 12 else "completed")
        assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.usage.input_tokens > 0
        events = list(c.responses.create(model=model, stream=True, **kw))
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == ("response.incomplete" if r.status == "incomplete" else "response.completed")
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == r.output_text == events[-1].response.output_text
        texts[model] = r.output_text
    assert texts["tiny"] != texts["a"]  # the adapter reached the engine


def test_function_tool_round_trip(srv):
    c = client(srv[0])
    ask = [{"role": "user", "content": [{"type": "input_text", "text": "what is 2 + 3?"}]}]
    r = c.responses.create(model="b", input=ask, tools=[ADD], tool_choice="required", parallel_tool_calls=False,
                           temperature=0, max_output_tokens=300)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add" and r.status == "completed"
    args = json.loads(calls[0].arguments)
    assert isinstance(args["a"], int) and isinstance(args["b"], int)
    history = [*ask, calls[0].model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "RESULT-5"}]
    first = c.responses.create(model="b", input=ask, tools=[ADD], max_output_tokens=1)
    called = c.responses.create(model="b", input=history[:-1], tools=[ADD], max_output_tokens=1)
    then = c.responses.create(model="b", input=history, tools=[ADD], max_output_tokens=1)
    # the call reached the prompt, and then its output
    assert first.usage.input_tokens + 5 < called.usage.input_tokens < then.usage.input_tokens - 5
    # streamed: the call comes as an output item with its arguments
    events = list(c.responses.create(model="tiny", input=ask, tools=[ADD], stream=True, temperature=0,
                                     tool_choice={"type": "function", "name": "add"}, max_output_tokens=300))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert done and done[0].name == "add" and deltas == [done[0].arguments]
    assert events[-1].response.output[-1].arguments == done[0].arguments


def test_text_format(srv):
    c = client(srv[0])
    r = c.responses.parse(model="a", input="a pet", text_format=Pet, temperature=0.7, max_output_tokens=200)
    assert isinstance(r.output_parsed, Pet)
    r = c.responses.create(model="tiny", input="a pet", max_output_tokens=200, temperature=0.7,
                           text={"format": {"type": "json_schema", "name": "pet", "schema": Pet.model_json_schema(),
                                            "strict": False}})
    Pet.model_validate_json(r.output_text)
    assert r.text.format.type == "json_schema"


def test_codex_shaped_request(srv):
    """What Codex CLI sends with every turn: developer messages, function and namespace tools, a hosted
    web_search tool, reasoning, include, prompt_cache_key, client_metadata, store false, stream."""
    body = {"model": "tiny", "stream": True, "store": False, "tool_choice": "auto", "parallel_tool_calls": True,
            "instructions": "You are a coding agent.", "reasoning": {"summary": "auto"},
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k1", "client_metadata": {"id": "x"},
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "tools": [ADD, {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
                            "tools": [{**ADD, "name": "spawn"}]},
                      {"type": "web_search", "external_web_access": False}],
            "max_output_tokens": 8}
    with httpx.stream("POST", srv[0].url + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
    final = events[-1]["response"]
    assert final["tools_not_offered"] == ["web_search"] and [t["type"] for t in final["tools"]] == ["function", "namespace"]
    assert final["reasoning"] is None and final["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    forced = {**body, "stream": False, "tool_choice": {"type": "function", "name": "spawn"}, "max_output_tokens": 250,
              "temperature": 0, "parallel_tool_calls": False}
    got = httpx.post(srv[0].url + "/v1/responses", json=forced, timeout=120).json()
    out = got.get("output", got)
    assert isinstance(out, list), out
    assert out[-1]["type"] == "function_call" and out[-1]["name"] == "spawn"  # a namespace's tool is callable


def test_refusals_are_openai_shaped(srv):
    url = srv[0].url

    def err(extra: dict, status: int, param: str, *words: str) -> None:
        r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "x", "max_output_tokens": 4, **extra})
        assert r.status_code == status, r.text
        e = r.json()["error"]
        assert set(e) >= {"message", "type", "param", "code"} and e["param"] == param, e
        for w in words:
            assert w in e["message"], e

    err({"store": True}, 400, "store")
    err({"previous_response_id": "resp_1"}, 400, "previous_response_id")
    err({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, 400, "tool_choice", "web_search")
    err({"tools": [{"type": "mystery_tool", "name": "x"}]}, 400, "tools.0.type", "mystery_tool")
    err({"tools": [{"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "lark",
                                                               "definition": "start: /a/"}}]}, 400, "tools.0.format",
        "Lark")
    err({"include": ["message.output_text.logprobs"]}, 400, "include")
    err({"max_output_tokens": 10**6}, 400, "max_output_tokens", "2048", "max_output_tokens")
    err({"input": "x " * 5000}, 400, "input", "2048")
    err({"model": "zzz"}, 404, "model", "zzz")
    err({"truncation": "auto"}, 400, "truncation")
    err({"mystery": 1}, 400, "mystery")
    err({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
        "input.0.content.0.type")
    assert httpx.get(url + "/health").status_code == 200


def test_agents_sdk_default_responses_model(srv):
    agents = pytest.importorskip("agents")
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[dict] = []
    sent: list[dict] = []

    @function_tool
    def lookup_price(item: Literal["tea", "coffee"], count: int) -> str:
        """The price of an item."""
        calls.append({"item": item, "count": count})
        return "PRICE-IS-42"

    async def record(request: httpx.Request) -> None:
        sent.append({"path": request.url.path, "body": json.loads(request.content or b"{}")})

    async def run() -> object:
        http = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=120)
        set_default_openai_client(AsyncOpenAI(base_url=srv[0].url + "/v1", api_key="unused", http_client=http,
                                              max_retries=0), use_for_tracing=False)
        agent = Agent(name="shop", instructions="Answer with prices.", tools=[lookup_price], model="tiny",
                      model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                   temperature=0, max_tokens=300))
        try:
            return await Runner.run(agent, "price of tea?", max_turns=4)
        finally:
            await http.aclose()

    result = asyncio.run(run())
    assert agents and {s["path"] for s in sent} == {"/v1/responses"}
    assert calls and calls[0]["item"] in ("tea", "coffee") and isinstance(calls[0]["count"], int)
    later = sent[1]["body"]["input"]
    assert any(i.get("type") == "function_call_output" and "PRICE-IS-42" in str(i.get("output")) for i in later)
    assert isinstance(result.final_output, str)


def test_custom_tool_with_a_regex_grammar(srv):
    """A freeform tool: its input is text matching the tool's regex (the grammar), as a custom_tool_call item;
    the call and its output go back as items."""
    c = client(srv[0])
    tool = {"type": "custom", "name": "set_code", "description": "Set a code.",
            "format": {"type": "grammar", "syntax": "regex", "definition": "[A-Z]{3}-[0-9]{2}"}}
    ask = [{"role": "user", "content": "set a code"}]
    r = c.responses.create(model="a", input=ask, tools=[tool], tool_choice={"type": "custom", "name": "set_code"},
                           parallel_tool_calls=False, temperature=0.7, max_output_tokens=200)
    call = r.output[-1]
    assert call.type == "custom_tool_call" and call.name == "set_code"
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", call.input), call.input
    history = [*ask, call.model_dump(exclude_none=True),
               {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "DONE-OK"}]
    n_call = c.responses.create(model="a", input=history[:-1], tools=[tool], max_output_tokens=1).usage.input_tokens
    n_out = c.responses.create(model="a", input=history, tools=[tool], max_output_tokens=1).usage.input_tokens
    assert n_out > n_call + 3
    events = list(c.responses.create(model="a", input=ask, tools=[tool], stream=True, temperature=0.7,
                                     tool_choice={"type": "custom", "name": "set_code"}, parallel_tool_calls=False,
                                     max_output_tokens=200))
    done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert done and re.fullmatch(r"[A-Z]{3}-[0-9]{2}", done[0].input)
