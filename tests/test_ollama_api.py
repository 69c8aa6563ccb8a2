"""Ollama's API on a real loramux server (tiny model, adapters a and b), talked to with the `ollama` Python client,
LangChain's ChatOllama and raw HTTP. On the tiny model the validity of JSON and tool calls comes from the grammar."""

from __future__ import annotations

import json

import httpx
import pydantic
import pytest
from test_server import adir, serving  # noqa: F401 - adir is a fixture

ollama = pytest.importorskip("ollama")


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    legs: int = pydantic.Field(ge=0, le=8)


@pytest.fixture(scope="module")
def srv(tiny_model, adir):  # noqa: F811
    with serving(tiny_model, adir, loras=("a", "b"), parallel=2, n_ctx=1024) as s:
        yield s


def _client(srv) -> ollama.Client:
    return ollama.Client(host=srv[0].url, timeout=120)


ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def test_probe_version_tags_show_ps(srv):
    url = srv[0].url
    r = httpx.get(url + "/")
    assert r.status_code == 200 and r.text == "Ollama is running"
    assert httpx.head(url + "/").status_code == 200
    assert httpx.get(url + "/", headers={"Accept": "text/html,application/xhtml+xml"}).status_code == 404  # a browser
    assert httpx.get(url + "/api/version").json()["version"].count(".") == 2
    assert httpx.head(url + "/api/tags").status_code == 200
    c = _client(srv)
    names = [m.model for m in c.list().models]
    assert names == ["tiny:latest", "tiny:a", "tiny:b"]
    info = c.show("tiny:a")
    assert "tools" in info.capabilities and "completion" in info.capabilities
    assert info.details.parent_model == "tiny" and info.details.format == "gguf"
    arch = info.modelinfo["general.architecture"]
    assert info.modelinfo[f"{arch}.context_length"] == 1024
    assert c.show("tiny").details.parent_model == ""
    assert httpx.post(url + "/api/show", json={"name": "b:latest"}).json()["details"]["parent_model"] == "tiny"
    assert [m.model for m in c.ps().models] == names
    with pytest.raises(ollama.ResponseError) as e:
        c.show("nope")
    assert e.value.status_code == 404 and "nope" in e.value.error


def test_chat_and_generate_plain_and_streamed_agree(srv):
    c = _client(srv)
    opts = {"temperature": 0, "num_predict": 12, "seed": 1}
    msgs = [{"role": "user", "content": "the cat sat"}]
    for model in ("tiny", "tiny:a", "b:latest"):
        whole = c.chat(model=model, messages=msgs, options=opts, stream=False)
        parts = list(c.chat(model=model, messages=msgs, options=opts, stream=True))
        assert parts[-1].done and parts[-1].eval_count == whole.eval_count <= 12
        assert whole.done_reason == ("length" if whole.eval_count == 12 else "stop")
        assert whole.prompt_eval_count > 0 and whole.total_duration > 0
        assert "".join(p.message.content for p in parts) == whole.message.content
        g = c.generate(model=model, prompt="the cat sat", options=opts, stream=False)
        assert g.done and 0 < g.eval_count <= 12
        assert "".join(p.response for p in c.generate(model=model, prompt="the cat sat", options=opts, stream=True)) == g.response
    # the adapter changes the output: the tag reached the engine
    outs = {m: c.chat(model=m, messages=msgs, options=opts, stream=False).message.content for m in ("tiny", "tiny:a")}
    assert outs["tiny"] != outs["tiny:a"]


def test_options_stop_and_raw_generate(srv):
    c = _client(srv)
    base = c.generate(model="tiny", prompt="hello world", raw=True, options={"temperature": 0, "num_predict": 16},
                      stream=False).response
    assert base
    cut = base[len(base) // 2:][:2].strip() or base[-1]
    got = c.generate(model="tiny", prompt="hello world", raw=True, stream=False,
                     options={"temperature": 0, "num_predict": 16, "stop": [cut]}).response
    assert cut not in got and base.startswith(got)


def test_format_json_and_schema(srv):
    c = _client(srv)
    got = c.chat(model="tiny:a", messages=[{"role": "user", "content": "a pet"}], format=Pet.model_json_schema(),
                 options={"temperature": 0.7, "seed": 3, "num_predict": 200}, stream=False)
    Pet.model_validate_json(got.message.content)
    text = "".join(p.response for p in c.generate(model="tiny", prompt="json", format="json",
                                                   options={"seed": 5, "num_predict": 200}, stream=True))
    if not text.rstrip().endswith("}"):
        pytest.skip("the random model ran out of tokens inside the object")
    assert isinstance(json.loads(text), dict)


def test_tools_round_trip(srv):
    url = srv[0].url
    # loramux's extension tool_choice forces a call (the grammar); the arguments come back as an object
    r = httpx.post(url + "/api/chat", timeout=120, json={
        "model": "tiny:b", "stream": False, "tools": [ADD], "tool_choice": "required",
        "messages": [{"role": "user", "content": "2 + 3?"}], "options": {"temperature": 0, "num_predict": 200}})
    assert r.status_code == 200, r.text
    call = r.json()["message"]["tool_calls"][0]["function"]
    assert call["name"] == "add" and isinstance(call["arguments"]["a"], int)
    # the client sends the call and its result back; the server renders both into the next prompt
    c = _client(srv)
    history = [{"role": "user", "content": "2 + 3?"},
               {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
               {"role": "tool", "content": "RESULT-5", "tool_name": "add"}]
    with_result = c.chat(model="tiny:b", messages=history, tools=[ADD], options={"num_predict": 1}, stream=False)
    without = c.chat(model="tiny:b", messages=history[:1], tools=[ADD], options={"num_predict": 1}, stream=False)
    assert with_result.prompt_eval_count > without.prompt_eval_count + 5
    with httpx.stream("POST", url + "/api/chat", timeout=120, json={
            "model": "tiny", "tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "add"}},
            "messages": [{"role": "user", "content": "2 + 3?"}], "options": {"num_predict": 200}}) as s:
        lines = [json.loads(x) for x in s.iter_lines() if x]
    calls = [x["message"]["tool_calls"] for x in lines if x.get("message", {}).get("tool_calls")]
    assert lines[-1]["done"] and calls and calls[0][0]["function"]["name"] == "add"


def test_langchain_chat_ollama(srv):
    pytest.importorskip("langchain_ollama")
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_ollama import ChatOllama

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOllama(base_url=srv[0].url, model="tiny:a", temperature=0, num_predict=200, seed=3)
    out = llm.with_structured_output(Pet, method="json_schema").invoke("a pet")
    assert isinstance(out, Pet)
    assert isinstance(llm.invoke("hello").content, str)
    assert "".join(c.content for c in llm.stream("hello"))
    bound = llm.bind_tools([add])
    history = [HumanMessage("2 + 3?"), AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "c1"}]),
               ToolMessage("5", tool_call_id="c1")]
    reply = bound.invoke(history)
    assert isinstance(reply, AIMessage) and reply.response_metadata["done"]


def test_refusals_are_ollama_shaped(srv):
    url = srv[0].url

    def err(r: httpx.Response, status: int, *words: str) -> None:
        assert r.status_code == status, r.text
        body = r.json()
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        for w in words:
            assert w in body["error"], body

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    err(httpx.post(url + "/api/chat", json={**chat, "options": {"num_thread": 4}}), 400, "num_thread")
    err(httpx.post(url + "/api/chat", json={**chat, "keep_alive": 0}), 400, "keep_alive")
    err(httpx.post(url + "/api/chat", json={**chat, "think": True}), 400, "think")
    err(httpx.post(url + "/api/chat", json={**chat, "model": "zzz"}), 404, "zzz")
    err(httpx.post(url + "/api/chat", json={**chat, "options": {"num_ctx": 10**6}}), 400, "num_ctx")
    err(httpx.post(url + "/api/chat", json={**chat, "options": {"num_predict": 5000}}), 400, "num_predict", "1024")
    err(httpx.post(url + "/api/chat", content=b"{not json", headers={"Content-Type": "application/json"}), 400, "JSON")
    err(httpx.post(url + "/api/generate", json={"model": "tiny", "prompt": "x", "suffix": "y"}), 400, "suffix")
    err(httpx.post(url + "/api/chat", json={**chat, "messages": [{"role": "user", "content": "x", "images": ["a"]}]}),
        400, "images")
    err(httpx.post(url + "/api/pull", json={"model": "llama3"}), 400, "load_lora_adapter")
    err(httpx.request("DELETE", url + "/api/delete", json={"model": "tiny:a"}), 400, "delete")
    err(httpx.post(url + "/api/embed", json={"model": "tiny", "input": "x"}), 501, "embeddings")
    err(httpx.post(url + "/api/chat", json={**chat, "stop": ["x"] * 3}), 400, "stop")
    # keep_alive that keeps the model loaded is honoured (it is loaded); an empty chat is Ollama's load call
    ok = httpx.post(url + "/api/chat", json={"model": "tiny", "messages": [], "keep_alive": "10m"}).json()
    assert ok["done"] and ok["done_reason"] == "load"
    assert httpx.get(url + "/health").status_code == 200  # the server survived all of it
