"""Constrained output on real llama.cpp (tiny model): every finished strict output parses and validates."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

import loramux as lm
from loramux.engine import grammar as G
from loramux.engine.regex_gbnf import integer_range, number_range
from loramux.errors import GrammarError

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 300},
                                      "x": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["n", "x"]},
    {"type": "object", "properties": {"e": {"enum": ["red", "green", 3, None]}, "c": {"const": "k"}},
     "required": ["e", "c"]},
    {"type": "object", "properties": {"l": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                            "minItems": 1, "maxItems": 3}}, "required": ["l"]},
    {"type": "object", "properties": {"o": {"type": "object", "properties": {
        "p": {"type": "boolean"}, "q": {"type": "string", "maxLength": 4}}, "required": ["p", "q"]}},
     "required": ["o"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 10, "maximum": 99},
                                                      {"type": "null"}]}}, "required": ["v"]},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                      "t": {"type": "string", "format": "time"},
                                      "u": {"type": "string", "format": "uuid"}}, "required": ["d", "t", "u"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"k": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}},
     "required": ["k"]},
    {"$defs": {"P": {"type": "object", "properties": {"z": {"type": "integer", "maximum": -3}}, "required": ["z"]}},
     "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}, "s": {"type": "string", "minLength": 2,
                                                                        "maxLength": 3}}, "required": ["p", "s"]},
]


@pytest.fixture(scope="module")
def eng(tiny_model):
    e = lm.Engine.load(tiny_model, n_ctx=1024, n_threads=2)
    yield e
    e.close()


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_strict_schema_outputs_validate(eng, i):
    schema = SCHEMAS[i]
    finished = 0
    for temperature, seed in [(0.0, 0), (0.8, 1), (1.5, 2), (1.5, 3)]:
        c = eng.generate("the cat", grammar=G.json_schema(schema, strict=True), max_tokens=400,
                         temperature=temperature, seed=seed)
        if c.finish_reason == "stop":
            finished += 1
            value = json.loads(c.text)
            jsonschema.validate(value, schema)
            _check_formats(value, schema)
    assert finished >= 2, "most runs should end inside max_tokens"


FORMATS = {"date": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
           "time": r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{3})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)",
           "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"}


def _check_formats(value: object, schema: dict) -> None:
    """The formats' shapes (the grammar, like llama.cpp's, checks a date's shape, not its calendar)."""
    for k, sub in schema.get("properties", {}).items():
        if "format" in sub:
            assert re.fullmatch(FORMATS[sub["format"]], value[k]), (k, value[k])


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_lazy_checks_equal_masking_every_token(eng, monkeypatch, penalty):
    """Greedy (plain, or through the sampler chain with a penalty): the chosen token checked first, the scan of
    the best few, then the full pass give the same tokens as masking the whole vocabulary before every choice.
    (Sampled runs draw their random numbers differently on a rejection, so only their validity is exact.)"""
    from loramux import _native as N

    def run() -> list[list[int]]:
        out = []
        for schema in SCHEMAS:
            for prompt in ("the cat", "hello world"):
                out.append(eng.generate(prompt, grammar=G.json_schema(schema), max_tokens=60,
                                        temperature=0, repeat_penalty=penalty).tokens)
        out.append(eng.generate("a dog", grammar=G.regex(r"[a-z ]{3,30}\."), max_tokens=40,
                                temperature=0, repeat_penalty=penalty).tokens)
        return out
    lazy = run()
    monkeypatch.setattr(N.GrammarHandle, "lazy", False)
    assert run() == lazy


def test_regex_choice_and_gbnf(eng):
    for seed in range(3):
        c = eng.generate("the dog", grammar=G.regex(r"(ab|cd)+-\d{2,3}[x-z]?"), max_tokens=40, temperature=1.2,
                         seed=seed)
        assert re.fullmatch(r"(ab|cd)+-\d{2,3}[x-z]?", c.text), c.text
        c = eng.generate("the dog", grammar=G.choice(["yes", "no", 'say "hi"']), max_tokens=10, temperature=1.0,
                         seed=seed)
        assert c.text in ("yes", "no", 'say "hi"')
    c = eng.generate("the dog", grammar=G.gbnf('root ::= "x" [0-9]'), max_tokens=10)
    assert re.fullmatch(r"x[0-9]", c.text)
    c = eng.generate("the dog", grammar=G.json_object(), max_tokens=300, temperature=1.0, seed=4)
    assert c.finish_reason != "stop" or isinstance(json.loads(c.text), dict)


def test_constrained_and_unconstrained_share_a_batch_with_adapters(tiny_dir):
    """Per request, any adapter set, through the slot bank: the constraint binds only its own request."""
    e = lm.Engine.load(tiny_dir / "tiny.gguf", n_ctx=512, n_parallel=3, n_threads=2, slots=2, slot_rank=4)
    try:
        e.load_lora(tiny_dir / "a.gguf", "a")
        e.load_lora(tiny_dir / "b.gguf", "b")
        free = e.generate("the cat", loras={"a": 1.0}, max_tokens=12)
        reqs = [e.stream("the cat", loras={"a": 1.0}, max_tokens=12),
                e.stream("the cat", loras={"b": 1.0}, grammar=G.choice(["left", "right"]), max_tokens=12),
                e.stream("the cat", grammar=G.regex(r"[0-9]{4}"), max_tokens=12)]
        out = [r.consume() for r in reqs]
        assert out[0].text == free.text
        assert out[1].text in ("left", "right") and re.fullmatch(r"[0-9]{4}", out[2].text)
    finally:
        e.close()


def test_strict_refuses_what_it_cannot_enforce():
    with pytest.raises(GrammarError) as ei:
        G.json_schema({"type": "object", "properties": {"a": {"type": "string", "format": "email"},
                                                        "b": {"type": "array", "uniqueItems": True}}})
    assert "format 'email'" in str(ei.value) and "uniqueItems" in str(ei.value)
    G.json_schema({"type": "array", "uniqueItems": True}, strict=False)  # non-strict: converted, not enforced
    for bad, what in [(r"a(?=b)", "lookahead"), (r"(a)\1", "backreference"), (r"\bx", "word boundary"),
                      ("(?i)a", "inline flag"), ("a{2000}", "repetition")]:
        with pytest.raises(GrammarError, match=what):
            G.regex(bad)


def accepts(model, gram: G.Grammar, text: str) -> bool:
    """Whether llama.cpp's grammar engine takes `text` (spelled in the tiny model's byte tokens) and then EOS."""
    g = gram.compile(model)
    try:
        for b in text.encode():
            tok = 3 + b  # <0xNN> byte tokens follow <unk>, <s>, </s>
            if not g.handle.allows(tok):
                return False
            g.accept(tok)
        return g.handle.allows(model.handle.eos)
    finally:
        g.close()


@pytest.mark.parametrize(("lo", "hi"), [(0, 0), (3, 117), (-50, 20), (-7, -3), (None, 5), (12, None), (-120, None)])
def test_integer_ranges_are_exact(eng, lo, hi):
    gram = G.Grammar("root ::= " + integer_range(lo, hi), "test")
    for v in list(range(-130, 131)) + [1000, -1000, 123456]:
        ok = (lo is None or v >= lo) and (hi is None or v <= hi)
        assert accepts(eng.model, gram, str(v)) == ok, (lo, hi, v)
    assert not accepts(eng.model, gram, "007")  # JSON has no leading zeros


def test_number_ranges_are_exact(eng):
    gram = G.Grammar("root ::= " + number_range(-2, 3), "test")
    for text, ok in [("0", True), ("-2", True), ("-2.0", True), ("-2.5", False), ("3", True), ("3.00", True),
                     ("3.01", False), ("2.999", True), ("-0.5", True), ("1e3", False), ("4", False)]:
        assert accepts(eng.model, gram, text) == ok, text


def test_bad_constraints_are_grammar_errors():
    with pytest.raises(GrammarError, match="repetition count of 5000"):
        G.gbnf('root ::= "a"{5000}')
    G.gbnf('root ::= "{99999}" [{}] # {7777}\n')  # counts inside literals, classes and comments are text
    for bad in [{"type": "array", "items": "x"}, {"properties": {"a": 3}}, {"$ref": "#/nowhere"},
                {"anyOf": "x"}, [], "x"]:
        with pytest.raises(GrammarError):
            G.json_schema(bad, strict=False)
    deep: dict = {}
    cur = deep
    for _ in range(5000):
        cur["items"] = {}
        cur = cur["items"]
    for strict in (True, False):
        with pytest.raises(GrammarError, match="deep|cannot be converted"):
            G.json_schema(deep, strict=strict)
    with pytest.raises(GrammarError):
        G.choice([])
    with pytest.raises(GrammarError, match="no value"):
        G.json_schema({"type": "integer", "minimum": 5, "maximum": 2})


# ------------------------------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def srv(tiny_model):
    from test_server import serving

    with serving(tiny_model, n_ctx=1024, parallel=2) as s:
        yield s[0]


SMALL = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
         "required": ["k", "n"], "additionalProperties": False}
FIELDS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SMALL, "strict": True}}},
     lambda t: jsonschema.validate(json.loads(t), SMALL)),
    ({"response_format": {"type": "json_schema", "schema": SMALL}}, lambda t: jsonschema.validate(json.loads(t), SMALL)),
    ({"json_schema": SMALL}, lambda t: jsonschema.validate(json.loads(t), SMALL)),
    ({"guided_json": json.dumps(SMALL)}, lambda t: jsonschema.validate(json.loads(t), SMALL)),
    ({"structured_outputs": {"json": SMALL}}, lambda t: jsonschema.validate(json.loads(t), SMALL)),
    ({"grammar": 'root ::= "ok" [0-9]'}, lambda t: re.fullmatch(r"ok[0-9]", t) or pytest.fail(t)),
    ({"guided_grammar": 'root ::= "ok" [0-9]'}, lambda t: re.fullmatch(r"ok[0-9]", t) or pytest.fail(t)),
    ({"structured_outputs": {"grammar": 'root ::= "ok" [0-9]'}}, lambda t: re.fullmatch(r"ok[0-9]", t) or pytest.fail(t)),
    ({"guided_regex": r"[a-c]{2}\d"}, lambda t: re.fullmatch(r"[a-c]{2}\d", t) or pytest.fail(t)),
    ({"structured_outputs": {"regex": r"[a-c]{2}\d"}}, lambda t: re.fullmatch(r"[a-c]{2}\d", t) or pytest.fail(t)),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right") or pytest.fail(t)),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right") or pytest.fail(t)),
]


@pytest.mark.parametrize("i", range(len(FIELDS)))
def test_every_constraint_field_is_honoured_streamed_or_not(srv, i):
    fields, check = FIELDS[i]
    for path, key in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
        body = {key: [{"role": "user", "content": "the cat"}] if key == "messages" else "the cat",
                "max_tokens": 120, "temperature": 0.7, "seed": 11, **fields}
        r = httpx.post(srv.url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        text = ch["message"]["content"] if key == "messages" else ch["text"]
        assert ch["finish_reason"] == "stop", text
        check(text)
        streamed = []
        with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    c = json.loads(line[6:])["choices"][0]
                    streamed.append((c.get("delta") or {}).get("content") or c.get("text") or "")
        assert "".join(streamed) == text


def test_json_object_mode(srv):
    for seed in range(4):
        r = httpx.post(srv.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
            "max_tokens": 300, "temperature": 1.0, "seed": seed}, timeout=120)
        ch = r.json()["choices"][0]
        if ch["finish_reason"] == "stop":
            assert isinstance(json.loads(ch["message"]["content"]), dict)


@pytest.mark.parametrize(("fields", "param"), [
    ({"guided_regex": "a(?!b)"}, "guided_regex"),
    ({"grammar": "root ::= nothing"}, "grammar"),
    ({"grammar": 'root ::= "a"{9999}'}, "grammar"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                  "schema": {"type": "string", "format": "email"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"enum": ["a\ud800"]}}, "guided_json"),  # lone surrogates anywhere: a 400, not a 500
    ({"messages": [{"role": "user", "content": "x", "name": "a\udc00b"}]}, "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]}, "description"),
])
def test_refused_constraints_name_the_field(srv, fields, param):
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **fields})  # ASCII escapes
    r = httpx.post(srv.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code != 500, r.text
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or param in err["message"], err
    assert httpx.get(srv.url + "/health").status_code == 200


def test_utf8_guard_follows_the_standard(eng):
    """The ban per state, on the tiny model's byte tokens (<0xNN> = 3 + NN): what may come next."""
    g = G.regex(r".{0,8}").compile(eng.model)
    try:
        def banned(b: int) -> bool:
            return bool(g.table.ban(g.state)[3 + b])
        assert banned(0x80) and banned(0xBF) and banned(0xC0) and banned(0xF8) and not banned(0x41)
        assert not banned(0xC3) and not banned(0xE0) and not banned(0xF0)
        for lead, good, bad in [(0xC3, 0xA9, 0x41), (0xE0, 0xA0, 0x80), (0xED, 0x9F, 0xA0), (0xF0, 0x90, 0x8F),
                                (0xF4, 0x8F, 0x90)]:
            g.close()  # a fresh grammar per lead: llama.cpp's own state keeps the unfinished character
            g = G.regex(r".{0,8}").compile(eng.model)
            g.accept(3 + lead)
            assert not banned(good) and banned(bad) and banned(0x41), (hex(lead), g.state)
        g.close()
        g = G.regex(r".{0,8}").compile(eng.model)
        for b in (0xE2, 0x82):
            g.accept(3 + b)
        assert g.state[0] == 1 and not banned(0xAC) and banned(0xC3)
        g.accept(3 + 0xAC)  # "€" is complete
        assert g.state[0] == 0 and banned(0x80) and not banned(0x41)
    finally:
        g.close()
