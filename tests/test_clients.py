"""Third-party clients against a real loramux server (tiny model): LangChain's ChatOpenAI and the OpenAI Agents
SDK through its chat-completions model. On the tiny model the validity comes from the grammar."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import pydantic
import pytest
from test_server import client, serving

pytest.importorskip("langchain_openai")
pytest.importorskip("agents")


class Pet(pydantic.BaseModel):
    """A pet."""

    name: str = pydantic.Field(max_length=6)
    legs: int = pydantic.Field(ge=0, le=8)
    kind: str = pydantic.Field(json_schema_extra={"enum": ["cat", "dog"]})


@pytest.fixture(scope="module")
def srv(tiny_model):
    with serving(tiny_model, n_ctx=2048, parallel=2) as s:
        yield s[0]


def _chat(srv, **kw):
    from langchain_openai import ChatOpenAI

    kw = {"temperature": 0, **kw}
    return ChatOpenAI(base_url=srv.url + "/v1", api_key="unused", model="tiny", max_retries=0, max_tokens=200, **kw)


def test_openai_parse_with_pydantic(srv):
    r = client(srv).beta.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "a pet"}],
                                                response_format=Pet, max_tokens=200, temperature=0.8, seed=3)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog") and 0 <= pet.legs <= 8


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(srv, method):
    llm = _chat(srv)
    if method == "json_mode":  # any JSON object: on a random model, sampled until one closes inside max_tokens
        got = []
        for seed in range(6):
            try:
                got.append(_chat(srv, temperature=1.0, seed=seed).with_structured_output(
                    None, method="json_mode").invoke("a pet as JSON"))
            except Exception as e:  # noqa: BLE001 - an object cut off by max_tokens does not parse
                assert "length" in str(e).lower() or "json" in str(e).lower(), e
        assert got and all(isinstance(o, dict) for o in got)
        return
    out = llm.with_structured_output(Pet, method=method).invoke("a pet")
    assert isinstance(out, Pet), out


def test_langchain_bind_tools(srv):
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    msg = _chat(srv).bind_tools([add], tool_choice="any", parallel_tool_calls=False).invoke("what is 2 + 3?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "add"
    args = msg.tool_calls[0]["args"]
    assert isinstance(args["a"], int) and isinstance(args["b"], int)
    assert add.invoke(args) == args["a"] + args["b"]


def test_agents_sdk_calls_a_function_tool_and_uses_its_result(srv):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
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
        if request.url.path.endswith("/chat/completions"):
            sent.append(json.loads(request.content))

    async def run() -> object:
        http = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=120)
        oai = AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", http_client=http, max_retries=0)
        agent = Agent(name="shop", instructions="Answer with prices.", tools=[lookup_price],
                      model=OpenAIChatCompletionsModel(model="tiny", openai_client=oai),
                      model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                   temperature=0, max_tokens=300))
        try:
            return await Runner.run(agent, "price of tea?", max_turns=4)
        finally:
            await http.aclose()

    result = asyncio.run(run())
    assert calls and calls[0]["item"] in ("tea", "coffee") and isinstance(calls[0]["count"], int)
    # the tool's result went back to the model in the next request, as a tool message after the call
    later = sent[1]["messages"]
    assert sent[0]["messages"][0] == {"role": "system", "content": "Answer with prices."}
    assert any(m.get("tool_calls") for m in later if m["role"] == "assistant")
    assert any(m["role"] == "tool" and "PRICE-IS-42" in str(m["content"]) for m in later)
    assert isinstance(result.final_output, str)
