"""Anthropic's Messages API on a real loramux server (tiny model, adapters a and b), talked to with the `anthropic`
SDK, LangChain's ChatAnthropic and raw HTTP. On the tiny model tool calls are valid because tool_choice forces
them through the grammar."""

from __future__ import annotations

from typing import Literal

import httpx
import pydantic
import pytest
from test_server import adir, serving  # noqa: F401 - adir is a fixture

anthropic = pytest.importorskip("anthropic")

ADD = {"name": "add", "description": "Add two integers.", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}


class Pet(pydantic.BaseModel):
    """A pet."""

    name: str = pydantic.Field(max_length=6)
    legs: int = pydantic.Field(ge=0, le=8)


class Kind(pydantic.BaseModel):
    """A kind of pet."""

    kind: Literal["cat", "dog"]
    tame: bool


@pytest.fixture(scope="module")
def srv(tiny_model, adir):  # noqa: F811
    with serving(tiny_model, adir, loras=("a", "b"), parallel=2, n_ctx=1024, api_key="sk-test") as s:
        yield s


def _client(srv, key: str = "sk-test") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv[0].url, api_key=key, max_retries=0, timeout=120)


def test_create_and_stream_agree_per_adapter(srv):
    c = _client(srv)
    # the SDK no longer has sampling arguments; older clients send temperature, which is honoured
    kw = {"max_tokens": 12, "extra_body": {"temperature": 0}, "system": "be brief", "messages": [{"role": "user", "content": "the cat"}]}
    texts = {}
    for model in ("tiny", "a"):
        m = c.messages.create(model=model, **kw)
        assert m.type == "message" and m.role == "assistant" and m.model == model
        assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.input_tokens > 0
        assert (m.stop_reason == "max_tokens") == (m.usage.output_tokens == 12)
        with c.messages.stream(model=model, **kw) as s:
            deltas = list(s.text_stream)
            final = s.get_final_message()
        assert "".join(deltas) == m.content[0].text == final.content[0].text
        assert final.usage.output_tokens == m.usage.output_tokens and final.stop_reason == m.stop_reason
        texts[model] = m.content[0].text
    assert texts["tiny"] != texts["a"]  # the adapter reached the engine


def test_stop_sequence_is_reported(srv):
    c = _client(srv)
    kw = {"model": "tiny", "max_tokens": 16, "extra_body": {"temperature": 0}, "messages": [{"role": "user", "content": "hello"}]}
    text = c.messages.create(**kw).content[0].text
    stop = text[len(text) // 2:][:2]
    if not stop.strip():
        pytest.skip("no usable stop string in this output")
    m = c.messages.create(**kw, stop_sequences=["zzzq", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop and stop not in m.content[0].text


def test_tool_round_trip_and_count_tokens(srv):
    c = _client(srv)
    ask = [{"role": "user", "content": "what is 2 + 3?"}]
    t0 = {"temperature": 0}
    m = c.messages.create(model="b", max_tokens=300, tools=[ADD], tool_choice={"type": "any"}, messages=ask,
                          extra_body=t0)
    assert m.stop_reason == "tool_use"
    use = next(b for b in m.content if b.type == "tool_use")
    assert use.name == "add" and isinstance(use.input["a"], int) and use.id.startswith("toolu_")
    history = [*ask, {"role": "assistant", "content": m.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "RESULT-5"}]}]
    n_ask = c.messages.count_tokens(model="b", messages=ask, tools=[ADD]).input_tokens
    n_hist = c.messages.count_tokens(model="b", messages=history, tools=[ADD]).input_tokens
    assert n_hist > n_ask + 5
    reply = c.messages.create(model="b", max_tokens=4, tools=[ADD], messages=history)
    assert reply.usage.input_tokens == n_hist  # what count_tokens said is what the request took
    with c.messages.stream(model="tiny", max_tokens=300, tools=[ADD], messages=ask, extra_body=t0,
                           tool_choice={"type": "tool", "name": "add"}) as s:
        final = s.get_final_message()
    block = final.content[-1]
    assert final.stop_reason == "tool_use" and block.type == "tool_use" and isinstance(block.input["b"], int)


def test_keys_and_errors_are_anthropic_shaped(srv):
    url = srv[0].url
    with pytest.raises(anthropic.AuthenticationError) as e:
        _client(srv, key="wrong").messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    ok = httpx.post(url + "/v1/messages", headers={"Authorization": "Bearer sk-test", "anthropic-version": "2023-06-01"},
                    json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert ok.status_code == 200 and ok.json()["type"] == "message"

    def err(body: dict, status: int, *words: str, path: str = "/v1/messages") -> None:
        r = httpx.post(url + path + "?beta=true", json=body, headers={"x-api-key": "sk-test"})
        assert r.status_code == status, r.text
        got = r.json()
        assert got["type"] == "error" and set(got["error"]) == {"type", "message"}, got
        for w in words:
            assert w in got["error"]["message"], got

    base = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    err({**base, "model": "zzz"}, 404, "zzz")
    err({**base, "max_tokens": 10**6}, 400, "max_tokens", "1024")
    err({k: v for k, v in base.items() if k != "max_tokens"}, 400, "max_tokens")
    err({**base, "mystery": 1}, 400, "mystery")
    err({**base, "stop_sequences": ["x"] * 40}, 400, "stop")
    err({**base, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "image")
    err({**base, "tools": [ADD], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "nope")
    err({**base, "temperature": 3}, 400, "temperature")
    err({**base, "tool_choice": {"type": "any"}}, 400, "tool_choice")
    err({**base, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": {}}]}]}, 400, "id")
    err({"model": "zzz", "messages": base["messages"]}, 404, "zzz", path="/v1/messages/count_tokens")
    assert httpx.get(url + "/health").status_code == 200


def test_thinking_and_context_management_are_answered_visibly(srv):
    m = _client(srv).messages.create(model="tiny", max_tokens=4, thinking={"type": "adaptive"},
                                     messages=[{"role": "user", "content": "x"}])
    assert all(b.type == "text" for b in m.content)  # this model does not think: no thinking block
    r = httpx.post(srv[0].url + "/v1/messages", headers={"x-api-key": "sk-test"}, json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}})
    assert r.status_code == 200 and r.json()["context_management"] == {"applied_edits": []}
    # a system turn inside messages (Claude Code sends one) goes into the prompt
    c, msgs = _client(srv), [{"role": "user", "content": "x"}]
    plain = c.messages.count_tokens(model="tiny", messages=msgs).input_tokens
    turn = c.messages.count_tokens(model="tiny", messages=[*msgs, {"role": "system", "content": "AGENTS: a, b"}])
    assert turn.input_tokens > plain + 5


def test_langchain_chat_anthropic(srv):
    pytest.importorskip("langchain_anthropic")
    from langchain_anthropic import ChatAnthropic
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatAnthropic(base_url=srv[0].url, api_key="sk-test", model="a", max_tokens=200, temperature=0,
                        max_retries=0)
    msg = llm.bind_tools([add], tool_choice="any", parallel_tool_calls=False).invoke("what is 2 + 3?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "add"
    assert add.invoke(msg.tool_calls[0]["args"]) == sum(msg.tool_calls[0]["args"].values())
    pet = llm.with_structured_output(Pet).invoke("a pet")
    assert isinstance(pet, Pet)
    # the client's own schema transform (for Anthropic's structured outputs) drops maxLength: an enum is kept
    kind = llm.with_structured_output(Kind, method="json_schema").invoke("a pet")
    assert isinstance(kind, Kind)
