"""llama-server's API on loramux (docs/llama-server.md): its native routes, its fields on every route, its
shapes, errors, access and metrics, sent as llama-server's own test suite sends them, to a real uvicorn on
127.0.0.1 over real llama.cpp (the tiny model)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest
from test_server import adir, serving  # noqa: F401 - adir is a fixture
from tinymodel import FIM_TOKENS, write_tiny_model

from loramux.server.protocols import infill

PROMPT = "the cat sat on the mat"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
PAGE = "http://page.example:8080"  # a browser page on another origin


@pytest.fixture(scope="module")
def srv(tiny_model: Path, adir: Path):  # noqa: F811 - the fixture imported above
    with serving(tiny_model, adir, loras=("a",), cors_origins=(PAGE,), api_key="k") as s:
        yield s


KEY = {"Authorization": "Bearer k"}


def post(s, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(s[0].url + path, json=body, headers={**KEY, **kw.pop("headers", {})}, timeout=120, **kw)


def sse(r: httpx.Response) -> list[dict]:
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


# ------------------------------------------------------------------------------------------- /completion
def test_completion_native_body_and_response(srv):
    """llama-server's /completion body: the text is the engine's greedy output, the counts and the stop type are
    the engine's, return_tokens gives the generated ids; /completions is the same handler."""
    s = srv
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "return_tokens": True, "ignore_eos": True}
    r = post(s, "/completion", body)
    assert r.status_code == 200, r.text
    out = r.json()
    want = s[1].generate(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert out["content"] == want.text and out["tokens"] == want.tokens
    assert out["stop"] is True and out["stop_type"] == "limit" and out["tokens_predicted"] == 6
    assert out["tokens_evaluated"] == len(s[1].tokenize(PROMPT))
    assert out["timings"]["predicted_n"] == 6 and out["generation_settings"]["n_predict"] == 6
    assert out["prompt"].endswith(PROMPT) and out["model"] == "tiny"
    assert post(s, "/completions", body).json()["content"] == want.text
    # llama-server's defaults when a field is left out (temperature 0.8, top_k 40...), -1 = up to the context
    gs = post(s, "/completion", {"prompt": PROMPT, "n_predict": 1}).json()["generation_settings"]
    assert (gs["temperature"], gs["top_k"], gs["top_p"], gs["min_p"]) == (0.8, 40, 0.95, 0.05)
    full = post(s, "/completion", {"prompt": PROMPT, "temperature": 0, "ignore_eos": True}).json()
    assert full["tokens_predicted"] == s[1].n_ctx - full["tokens_evaluated"] and full["stop_type"] == "limit"


def test_completion_prompt_forms_and_stop_word(srv):
    s = srv
    ids = s[1].tokenize(PROMPT)
    a = post(s, "/completion", {"prompt": ids, "n_predict": 4, "temperature": 0}).json()
    b = post(s, "/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0}).json()
    assert a["content"] == b["content"] and a["tokens_evaluated"] == len(ids)
    mixed = post(s, "/completion", {"prompt": [ids[0], *ids[1:3], "the mat"], "n_predict": 1}).json()
    assert mixed["tokens_evaluated"] == 3 + len(s[1].tokenize("the mat", add_bos=False))
    text = post(s, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "ignore_eos": True}).json()
    word = text["content"][2:4]
    stopped = post(s, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "ignore_eos": True,
                                      "stop": [word]}).json()
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert stopped["content"] == text["content"][:text["content"].index(word)]


def test_completion_stream_chunks(srv):
    """Streamed: one chunk per piece with `stop: false`, then the final object (`stop: true`, timings), no
    [DONE]; the pieces join to the non-streamed text and their tokens to its tokens."""
    s = srv
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    whole = post(s, "/completion", body).json()
    r = post(s, "/completion", {**body, "stream": True, "timings_per_token": True})
    assert "[DONE]" not in r.text
    chunks = sse(r)
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert [t for c in chunks for t in c["tokens"]] == whole["tokens"]
    assert all("timings" in c for c in chunks) and chunks[-1]["timings"]["predicted_n"] == 6


def test_n_probs(srv):
    """n_probs: per generated token its id, text, bytes, logprob and the top N; greedy picks the first of
    them; the numbers are the OpenAI route's logprobs (one engine computation); streamed one per chunk."""
    s = srv
    body = {"prompt": PROMPT, "n_probs": 3, "temperature": 0, "n_predict": 5, "ignore_eos": True}
    out = post(s, "/completion", body).json()
    probs = out["completion_probabilities"]
    assert len(probs) == 5
    for p in probs:
        assert p["logprob"] <= 0.0 and len(p["top_logprobs"]) == 3
        assert p["id"] == p["top_logprobs"][0]["id"] and p["logprob"] == p["top_logprobs"][0]["logprob"]
        assert bytes(p["bytes"]).decode("utf-8", "ignore") == p["token"]
    oai = post(s, "/v1/completions", {"prompt": PROMPT, "logprobs": 3, "temperature": 0, "max_tokens": 5,
                                      "ignore_eos": True}).json()["choices"][0]["logprobs"]
    assert [p["logprob"] for p in probs] == pytest.approx(oai["token_logprobs"], abs=1e-6)
    streamed = [c for c in sse(post(s, "/completion", {**body, "stream": True})) if not c["stop"]]
    got = [p for c in streamed for p in c["completion_probabilities"]]
    assert [p["id"] for p in got] == [p["id"] for p in probs]
    alias = post(s, "/completion", {**{k: v for k, v in body.items() if k != "n_probs"}, "logprobs": 3}).json()
    assert alias["completion_probabilities"] == probs  # llama-server reads logprobs as n_probs
    # n_probs on the OpenAI routes: logprobs with that many alternatives
    chat = post(s, "/v1/chat/completions", {**CHAT, "n_probs": 2, "max_tokens": 3}).json()
    assert all(len(t["top_logprobs"]) == 2 for t in chat["choices"][0]["logprobs"]["content"])


def test_response_fields(srv):
    out = post(srv, "/completion", {"prompt": PROMPT, "n_predict": 4,
                                    "response_fields": ["content", "generation_settings/n_predict", "nope"]}).json()
    assert set(out) == {"content", "generation_settings/n_predict"} and out["generation_settings/n_predict"] == 4


def test_per_request_lora_by_id(srv):
    s = srv
    lid = httpx.get(s[0].url + "/lora-adapters", headers=KEY).json()[0]["id"]
    body = {"prompt": PROMPT, "n_predict": 5, "temperature": 0, "ignore_eos": True}
    with_a = post(s, "/completion", {**body, "lora": [{"id": lid, "scale": 1.0}]}).json()
    assert with_a["content"] == s[1].generate(PROMPT, max_tokens=5, temperature=0.0, ignore_eos=True,
                                              loras={"a": 1.0}).text
    assert with_a["generation_settings"]["lora"] == [{"id": lid, "scale": 1.0}]


# ------------------------------------------------------------------------------- its fields, every route
def test_fields_honoured_on_the_openai_routes(srv):
    s = srv
    r = post(s, "/v1/chat/completions", {**CHAT, "n_predict": 3, "ignore_eos": True, "cache_prompt": True,
                                         "id_slot": -1, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = post(s, "/v1/completions", {"prompt": PROMPT, "n_predict": 2, "max_tokens": 9, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 2  # n_predict wins, as in llama-server


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/chat/completions", {"cache_prompt": False}, "cache_prompt"),
    ("/v1/chat/completions", {"id_slot": 1}, "id_slot"),
    ("/v1/chat/completions", {"post_sampling_probs": True}, "post_sampling_probs"),
    ("/v1/chat/completions", {"return_progress": True}, "return_progress"),
    ("/v1/chat/completions", {"verbose": True}, "verbose"),
    ("/v1/chat/completions", {"return_tokens": True}, "return_tokens"),
    ("/v1/chat/completions", {"response_fields": ["content"]}, "response_fields"),
    ("/v1/completions", {"n_predict": -1}, "n_predict"),
    ("/completion", {"post_sampling_probs": True}, "post_sampling_probs"),
    ("/completion", {"cache_prompt": False}, "cache_prompt"),
    ("/completion", {"mirostat": 3}, "mirostat"),
    ("/completion", {"dynatemp_range": 0.5}, "dynatemp_range"),
    ("/completion", {"samplers": ["adaptive_p"]}, "samplers"),
    ("/completion", {"n": 2}, "n"),
    ("/completion", {"return_token_ids": True}, "return_token_ids"),
    ("/completion", {"stream": True, "stream_options": {"include_usage": True}}, "stream_options.include_usage"),
    ("/completion", {"id_slot": 0}, "id_slot"),
    ("/v1/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("/completion", {"logit_bias": [[3, True]]}, "logit_bias"),
    ("/completion", {"logit_bias": [[3, 1e308]]}, "logit_bias"),
])
def test_fields_refused_by_name(srv, path, extra, param):
    body = {**CHAT} if "chat" in path else {"prompt": PROMPT}
    r = post(srv, path, {**body, "max_tokens": 2, **extra} if path != "/completion" else {**body, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_logit_bias_both_forms(srv):
    """OpenAI's {"id": bias} and llama-server's [[id | text, bias | false]]: a banned token never comes, a
    strongly favoured one always; a text stands for its tokens."""
    s = srv
    base = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    free = post(s, "/v1/completions", base).json()["choices"][0]["token_ids"]
    banned = post(s, "/v1/completions", {**base, "logit_bias": {str(free[0]): -100}}).json()["choices"][0]
    assert free[0] not in banned["token_ids"]
    native = post(s, "/completion", {"prompt": PROMPT, "n_predict": 5, "temperature": 0, "ignore_eos": True,
                                     "return_tokens": True, "logit_bias": [[free[0], False]]}).json()
    assert native["tokens"] == banned["token_ids"]
    word = s[1].tokenize(" red", add_bos=False, special=False)
    forced = post(s, "/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0.7, "seed": 3,
                                     "return_tokens": True, "logit_bias": {" red": 1000}}).json()
    assert set(forced["tokens"]) <= set(word)


# ------------------------------------------------------------------------------------------- shapes
def test_openai_shapes_llama_server_adds(srv):
    """system_fingerprint, timings, usage.prompt_tokens_details.cached_tokens (a repeated prompt reuses its
    cached prefix), a first streamed delta with content null, timings_per_token in every chunk."""
    s = srv
    body = {**CHAT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    post(s, "/v1/chat/completions", body)
    out = post(s, "/v1/chat/completions", body).json()
    n_prompt = out["usage"]["prompt_tokens"]
    assert isinstance(out["system_fingerprint"], str) and out["timings"]["predicted_n"] == 3
    assert 0 < out["usage"]["prompt_tokens_details"]["cached_tokens"] < n_prompt
    assert out["timings"]["cache_n"] + out["timings"]["prompt_n"] == n_prompt
    chunks = sse(post(s, "/chat/completions", {**body, "stream": True, "timings_per_token": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all("timings" in c for c in chunks[1:])



def test_responses_of_several_sequences_carry_the_fingerprint_and_cached_tokens(srv):
    """n = 2 and logprobs (the grouped path): system_fingerprint on the body and every chunk, cached_tokens the
    sum over the sequences (the second reuses the first's prompt), no timings (they describe one sequence)."""
    s = srv
    body = {**CHAT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "n": 2, "logprobs": True}
    out = post(s, "/v1/chat/completions", body).json()
    assert len(out["choices"]) == 2 and out["system_fingerprint"].startswith("loramux-") and "timings" not in out
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached <= out["usage"]["prompt_tokens"]
    chunks = sse(post(s, "/v1/chat/completions", {**body, "stream": True,
                                                 "stream_options": {"include_usage": True}}))
    assert chunks and all(c["system_fingerprint"] == out["system_fingerprint"] for c in chunks)
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

def test_context_error_carries_the_numbers(srv):
    s = srv
    r = post(s, "/completion", {"prompt": "the cat " * 200, "n_predict": 2})
    e = r.json()["error"]
    assert r.status_code == 400 and e["type"] == "exceed_context_size_error" and e["code"] == 400
    assert e["n_ctx"] == s[1].n_ctx and e["n_prompt_tokens"] == len(s[1].tokenize("the cat " * 200))
    r = post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "the cat " * 200}]})
    e = r.json()["error"]
    assert e["code"] == "context_length_exceeded" and e["n_ctx"] == s[1].n_ctx and e["n_prompt_tokens"] > s[1].n_ctx


def test_two_assistant_messages_at_the_end_are_refused(srv):
    msgs = [{"role": "user", "content": "test"}, {"role": "assistant", "content": "test"},
            {"role": "assistant", "content": "test"}]
    r = post(srv, "/chat/completions", {"messages": msgs, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert post(srv, "/chat/completions", {"messages": msgs[:2], "max_tokens": 2}).status_code == 200
    r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    r = post(srv, "/v1/chat/completions", {"messages": msgs[:2], "continue_final_message": True,
                                           "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_json_object_with_schema_is_applied(srv):
    """llama-server's response_format {"type": "json_object", "schema": …}: the output follows the schema;
    an invalid schema is a 400 naming it."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7}},
              "required": ["n"], "additionalProperties": False}
    r = post(srv, "/v1/chat/completions", {**CHAT, "max_tokens": 60, "temperature": 1.0, "seed": 5,
                                           "response_format": {"type": "json_object", "schema": schema}})
    value = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(value) == {"n"} and 3 <= value["n"] <= 7
    bad = post(srv, "/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object",
                                                                          "schema": {"type": 123}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.schema"


@pytest.mark.parametrize("strict", [True, False])
def test_a_list_of_types_with_constraints_is_enforced(srv, strict):
    """{"type": ["string", "null"], "maxLength": 4} (OpenAI strict mode, pydantic Optional[constr]): enforced."""
    schema = {"type": "object", "properties": {"s": {"type": ["string", "null"], "maxLength": 4}},
              "required": ["s"], "additionalProperties": False}
    for seed in range(3):
        r = post(srv, "/v1/chat/completions", {
            **CHAT, "max_tokens": 40, "temperature": 1.5, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                       "strict": strict}}})
        assert r.status_code == 200, r.text
        s = json.loads(r.json()["choices"][0]["message"]["content"])["s"]
        assert s is None or (isinstance(s, str) and len(s) <= 4), s


# -------------------------------------------------------------------------------------- other routes
def test_apply_template_input_tokens_props_slots_aliases(srv):
    s = srv
    msgs = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    prompt = post(s, "/apply-template", {"messages": msgs}).json()["prompt"]
    assert prompt == s[1].apply_chat_template(msgs)
    n = post(s, "/chat/completions/input_tokens", {"messages": msgs}).json()["input_tokens"]
    usage = post(s, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1}).json()["usage"]
    assert n == usage["prompt_tokens"] == post(s, "/v1/chat/completions/input_tokens",
                                               {"messages": msgs}).json()["input_tokens"]
    props = httpx.get(s[0].url + "/props", headers=KEY).json()
    assert props["total_slots"] == s[1].n_parallel and props["default_generation_settings"]["n_ctx"] == s[1].n_ctx
    assert props["chat_template"] == s[1].chat_template().source and props["model_alias"] == "tiny"
    slots = httpx.get(s[0].url + "/slots", headers=KEY).json()
    assert [x["id"] for x in slots] == list(range(s[1].n_parallel)) and not any(x["is_processing"] for x in slots)
    assert httpx.post(s[0].url + "/props", json={}, headers=KEY).json()["error"]["code"] == 501
    assert httpx.get(s[0].url + "/models", headers=KEY).json() == httpx.get(s[0].url + "/v1/models",
                                                                            headers=KEY).json()
    assert httpx.get(s[0].url + "/v1/health").json() == {"status": "ok"}


def test_infill_with_fim_tokens(tmp_path: Path, adir: Path):  # noqa: F811
    """The FIM prompt in llama-server's layout ([FIM_SEP]file, BOS, FIM_PRE prefix prompt, FIM_SUF suffix,
    FIM_MID), generated from as /completion would; llama-server's invalid input_extra shapes are 400s."""
    model = write_tiny_model(tmp_path / "fim.gguf", fim=True)
    with serving(model, adir) as (s, eng, _):
        body = {"input_prefix": "the cat", "prompt": " sat", "input_suffix": "the mat", "n_predict": 4,
                "temperature": 0, "ignore_eos": True, "return_tokens": True,
                "input_extra": [{"filename": "a.txt", "text": "red dog"}]}
        r = httpx.post(s.url + "/infill", json=body, timeout=120)
        assert r.status_code == 200, r.text
        tok = lambda t: eng.tokenize(t, add_bos=False, special=False)  # noqa: E731
        pre, suf, mid = FIM_TOKENS["pre"], FIM_TOKENS["suf"], FIM_TOKENS["mid"]
        want = [*infill_extra(tok), eng.model.handle.bos, pre, *tok("the cat"), *tok(" sat"), suf, *tok("the mat"), mid]
        assert infill.prompt_tokens(eng, "the cat", "the mat", [("a.txt", "red dog")], " sat") == want
        assert r.json()["tokens"] == eng.generate(want, max_tokens=4, temperature=0.0, ignore_eos=True).tokens
        for extra in ({}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"}):
            bad = httpx.post(s.url + "/infill", json={**body, "input_extra": [extra]}, timeout=60)
            assert bad.status_code == 400 and "input_extra" in bad.json()["error"]["param"], bad.text


def infill_extra(tok) -> list[int]:
    """The tiny FIM model has no FIM_REP or FIM_SEP token: each extra file comes after a snippet line."""
    return [*tok(infill.SNIPPET), *tok("red dog")]


def test_infill_without_fim_tokens_is_a_clear_501(srv):
    r = post(srv, "/infill", {"input_prefix": "a", "input_suffix": "b"})
    e = r.json()["error"]
    assert r.status_code == 501 and e["reason"] == "infill_not_supported" and "prefix" in e["message"]


# ---------------------------------------------------------------------------------- access, metrics
def test_cors_preflight_before_auth_and_x_api_key(srv):
    s = srv
    pre = httpx.options(s[0].url + "/completion", headers={"Origin": PAGE, "Access-Control-Request-Method": "POST",
                                                           "Access-Control-Request-Headers": "content-type,x-api-key"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == PAGE
    assert "x-api-key" in pre.headers["access-control-allow-headers"]
    r = httpx.post(s[0].url + "/completion", json={"prompt": PROMPT, "n_predict": 1},
                   headers={"Origin": PAGE, "X-Api-Key": "k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
    assert httpx.post(s[0].url + "/completion", json={"prompt": PROMPT}, headers={"Origin": PAGE}).status_code == 401
    other = httpx.options(s[0].url + "/completion", headers={"Origin": "http://evil.example",
                                                             "Access-Control-Request-Method": "POST"})
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
    plain = httpx.post(s[0].url + "/completion", json={"prompt": PROMPT, "n_predict": 1},
                       headers={"Origin": "http://evil.example", **KEY})
    assert "access-control-allow-origin" not in plain.headers


def test_no_cors_unless_configured(tiny_model: Path):
    with serving(tiny_model) as (s, _, _):
        r = httpx.options(s.url + "/v1/models", headers={"Origin": PAGE, "Access-Control-Request-Method": "GET"})
        assert "access-control-allow-origin" not in r.headers


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_llamacpp_metrics(srv):
    s = srv
    before = httpx.get(s[0].url + "/metrics", headers=KEY)
    for _ in range(2):  # the second reuses the first one's prompt from the cache
        post(s, "/completion", {"prompt": PROMPT, "n_predict": 2, "ignore_eos": True})
    after = httpx.get(s[0].url + "/metrics", headers=KEY)
    assert int(after.headers["process-start-time-unix"]) == s[2].started
    got = {n: _metric(after.text, n) - _metric(before.text, n)
           for n in ("llamacpp:tokens_predicted_total", "llamacpp:prompt_tokens_total",
                     "llamacpp:prompt_tokens_cached_total")}
    assert got["llamacpp:tokens_predicted_total"] == 4 and got["llamacpp:prompt_tokens_cached_total"] > 0
    assert got["llamacpp:prompt_tokens_total"] + got["llamacpp:prompt_tokens_cached_total"] == 2 * len(
        s[1].tokenize(PROMPT))
    for name in ("llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:n_decode_total",
                 "llamacpp:prompt_seconds_total", "llamacpp:tokens_predicted_seconds_total"):
        assert math.isfinite(_metric(after.text, name))


def test_clients_accept_a_null_first_delta(srv):
    """The openai client and LangChain read the streamed chat (first delta content null) as before."""
    import openai
    from langchain_openai import ChatOpenAI

    s = srv
    c = openai.OpenAI(base_url=s[0].url + "/v1", api_key="k", max_retries=0)
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=CHAT["messages"], max_tokens=4, temperature=0, stream=True))
    whole = c.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=4, temperature=0)
    assert text == whole.choices[0].message.content
    llm = ChatOpenAI(base_url=s[0].url + "/v1", api_key="k", model="tiny", max_tokens=4, temperature=0,
                     max_retries=0)
    assert "".join(str(m.content) for m in llm.stream("hi")) == whole.choices[0].message.content


def test_cors_origins_from_the_command_line_and_the_settings_file(tiny_model: Path, tmp_path: Path):
    from loramux.cli import build_parser
    from loramux.cli.serve import settings_from_args
    from loramux.errors import ParameterError
    from loramux.server import ServerSettings

    args = build_parser().parse_args(["serve", str(tiny_model), "--cors-origins", f"{PAGE},https://b.example",
                                      "--cors-origins", "http://c.example"])
    assert settings_from_args(args).cors_origins == (PAGE, "https://b.example", "http://c.example")
    cfg = tmp_path / "deploy.toml"
    cfg.write_text(f'cors_origins = ["{PAGE}", "*"]\n')
    assert ServerSettings.from_toml(cfg).cors_origins == (PAGE, "*")
    for bad in ("page.example", "http://page.example/app", "http://page.example?x=1"):
        with pytest.raises(ParameterError, match="cors_origins"):
            ServerSettings(cors_origins=(bad,)).validated()
