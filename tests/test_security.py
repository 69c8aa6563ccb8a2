"""The server against hostile and overloaded clients, on a real uvicorn (127.0.0.1, free port) and real
llama.cpp (tiny model): the admin plane, the Host allow-list, JSON-only POSTs, bounded inputs, linear
stop matching, the bounded queue, connection limits and timeouts, and bounded metric label sets."""

from __future__ import annotations

import codecs
import json
import random
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

import loramux as lm
from loramux.engine.sampling import TextAssembler
from loramux.server import LoraEntry, ServerSettings, ServerThread, create_app
from loramux.server.logit_bias import MAX_LOGIT_BIAS

KEY, ADMIN = "inference-key", "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
PROMPT = "the cat sat"


@pytest.fixture(scope="module")
def adir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    d = tmp_path_factory.mktemp("sec_adapters")
    for name in ("a", "b"):
        shutil.copy(tiny_dir / f"{name}.gguf", d / f"{name}.gguf")
    return d


@contextmanager
def serving(model: Path, adir: Path | None = None, *, loras: tuple[str, ...] = (), parallel: int = 1,
            n_ctx: int = 256, sndbuf: int | None = None, **settings: object) -> Iterator[tuple[ServerThread, lm.Engine,
                                                                                               object]]:
    """Engine + app + uvicorn thread (a ServerThread, so a test may shrink the socket's send buffer)."""
    eng = lm.Engine.load(model, n_ctx=n_ctx, n_parallel=parallel, n_threads=1, slots=0)
    try:
        entries = tuple(LoraEntry(n, str(adir / f"{n}.gguf")) for n in loras)
        for e in entries:
            eng.load_lora(e.source, e.name)
        cfg = ServerSettings(loras=entries, adapter_dirs=(str(adir),) if adir else (), parallel=parallel,
                             n_ctx=n_ctx, **settings)
        app = create_app(eng, cfg, own_engine=True)
    except BaseException:
        eng.close()
        raise
    srv = ServerThread(app)
    if sndbuf is not None:  # accepted sockets inherit the listening socket's buffer size (Linux)
        srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    with srv:
        yield srv, eng, app.state.lm


def err(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def load(srv: ServerThread, name: str, path: str, headers: dict | None = None, **extra: object) -> httpx.Response:
    return httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **extra},
                      headers=headers, timeout=60)


def raw_http(srv: ServerThread, data: bytes, timeout: float = 30.0, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    s.connect(("127.0.0.1", srv.port))
    if data:
        s.sendall(data)
    return s


def read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


# ===================================================================================== admin plane
def test_fresh_server_exposes_no_state_changing_endpoint(tiny_model, adir):
    """Defaults: load, unload, pinning and global scales answer 403 and say how to enable them."""
    with serving(tiny_model, adir, loras=("a",)) as (srv, eng, state):
        for path, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "b.gguf"}),
                           ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "b.gguf", "replace": True,
                                                      "pinned": True}),
                           ("/v1/unload_lora_adapter", {"lora_name": "a"}),
                           ("/lora-adapters", [{"id": 0, "scale": 1.0}])):
            for headers in (None, AUTH, ADMIN_AUTH):
                r = httpx.post(srv.url + path, json=body, headers=headers)
                assert r.status_code == 403, (path, r.text)
                e = err(r)
                assert e["code"] == "admin_disabled" and "--admin-api-key" in e["message"], e
        assert sorted(eng.adapters) == ["a"] and state.pool.entries["a"].global_scale == 0.0
        assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]] == ["tiny", "a"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "a", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200  # the inference plane works


def test_admin_key_is_separate_from_the_api_key(tiny_model, adir):
    with serving(tiny_model, adir, api_key=KEY, admin_api_key=ADMIN) as (srv, eng, state):
        assert load(srv, "x", "b.gguf").status_code == 401
        assert load(srv, "x", "b.gguf", {"Authorization": "Bearer nope"}).status_code == 401
        r = load(srv, "x", "b.gguf", AUTH, pinned=True)  # the inference key is not enough, pinning included
        assert r.status_code == 403 and err(r)["code"] == "admin_key_required", r.text
        r = httpx.post(srv.url + "/lora-adapters", json=[], headers=AUTH)
        assert r.status_code == 403
        assert eng.adapters == {}
        r = load(srv, "x", "b.gguf", ADMIN_AUTH, pinned=True)
        assert r.status_code == 200, r.text
        assert state.pool.entries["x"].pinned
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        assert c.completions.create(model="x", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(srv.url + "/v1/models", headers=ADMIN_AUTH).status_code == 200  # admin ⊇ inference
        with pytest.raises(openai.PermissionDeniedError):
            c.post("/unload_lora_adapter", body={"lora_name": "x"}, cast_to=object)
        assert httpx.post(srv.url + "/lora-adapters", json=[{"id": 0, "scale": 0.5}],
                          headers=ADMIN_AUTH).status_code == 200
        r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=ADMIN_AUTH)
        assert r.status_code == 200 and eng.adapters == {}
    # an admin key alone: inference stays open, the admin plane needs the key
    with serving(tiny_model, adir, admin_api_key=ADMIN) as (srv, eng, _):
        assert httpx.get(srv.url + "/v1/models").status_code == 200
        assert load(srv, "x", "b.gguf").status_code == 401
        assert load(srv, "x", "b.gguf", ADMIN_AUTH).status_code == 200
    for bad in (dict(api_key="same", admin_api_key="same"), dict(admin_api_key="has space"),
                dict(admin_api_key="")):
        with pytest.raises(lm.errors.ParameterError):
            ServerSettings(**bad).validated()


def test_every_state_changing_route_is_on_the_admin_plane(tiny_model, adir):
    """All routes but GETs and the two generation endpoints: a route added later is admin by default."""
    from loramux.server.guard import INFERENCE_ROUTES

    with serving(tiny_model, adir, api_key=KEY, admin_api_key=ADMIN) as (srv, _, state):
        app = srv.server.config.app
        routes = {(m, r.path) for r in app.routes for m in getattr(r, "methods", ()) or ()}
        changing = {(m, p) for m, p in routes if m not in ("GET", "HEAD")} - INFERENCE_ROUTES
        assert {("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
                ("POST", "/lora-adapters")} <= changing
        for method, path in sorted(changing):
            r = httpx.request(method, srv.url + path, json={}, headers=AUTH)
            assert r.status_code == 403 and err(r)["code"] == "admin_key_required", (method, path, r.text)


def test_keys_from_files_and_environment(tiny_model, adir, tmp_path, monkeypatch):
    from loramux.cli import build_parser
    from loramux.cli.serve import settings_from_args

    (tmp_path / "key").write_text(KEY + "\n")
    (tmp_path / "admin").write_text(ADMIN + "\r\n")
    parse = build_parser().parse_args
    s = settings_from_args(parse(["serve", str(tiny_model), "--api-key-file", str(tmp_path / "key"),
                                  "--admin-api-key-file", str(tmp_path / "admin")]))
    assert (s.api_key, s.admin_api_key) == (KEY, ADMIN)  # trailing newline stripped
    monkeypatch.setenv("LORAMUX_API_KEY", "env-key")
    monkeypatch.setenv("LORAMUX_ADMIN_API_KEY", "env-admin\n")
    s = settings_from_args(parse(["serve", str(tiny_model)]))
    assert (s.api_key, s.admin_api_key) == ("env-key", "env-admin")
    s = settings_from_args(parse(["serve", str(tiny_model), "--admin-api-key", "flag-admin"]))
    assert s.admin_api_key == "flag-admin"  # the option beats the environment
    with pytest.raises(lm.errors.ParameterError, match="not both"):
        settings_from_args(parse(["serve", "--api-key", "x", "--api-key-file", str(tmp_path / "key")]))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(lm.errors.ParameterError, match="empty"):
        settings_from_args(parse(["serve", "--admin-api-key-file", str(tmp_path / "empty")]))
    cfg = tmp_path / "deploy.toml"
    cfg.write_text(f'admin_api_key_file = "{tmp_path / "admin"}"\napi_key_env = "MY_KEY"\n')
    monkeypatch.setenv("MY_KEY", "toml-env-key")
    s = ServerSettings.from_toml(cfg)
    assert (s.api_key, s.admin_api_key) == ("toml-env-key", ADMIN)
    # the keys read from the files work against a live server
    monkeypatch.delenv("LORAMUX_API_KEY")
    monkeypatch.delenv("LORAMUX_ADMIN_API_KEY")
    s = settings_from_args(parse(["serve", "--api-key-file", str(tmp_path / "key"),
                                  "--admin-api-key-file", str(tmp_path / "admin")]))
    with serving(tiny_model, adir, api_key=s.api_key, admin_api_key=s.admin_api_key) as (srv, _, _):
        assert httpx.get(srv.url + "/v1/models", headers=AUTH).status_code == 200
        assert load(srv, "x", "a.gguf", ADMIN_AUTH).status_code == 200


def test_keys_are_compared_in_constant_time(tiny_model, adir, monkeypatch):
    from loramux.server import guard as guard_mod

    calls = []

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return _real(a, b)
    _real = guard_mod.compare_digest
    monkeypatch.setattr(guard_mod, "compare_digest", spy)
    with serving(tiny_model, adir, api_key=KEY, admin_api_key=ADMIN) as (srv, _, _):
        assert httpx.get(srv.url + "/v1/models", headers=AUTH).status_code == 200
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer x"}).status_code == 401
    compared = {(a, b) for a, b in calls}
    assert {(KEY.encode(), KEY.encode()), (KEY.encode(), ADMIN.encode()), (b"x", KEY.encode()),
            (b"x", ADMIN.encode())} <= compared, compared


def test_host_allow_list(tiny_model, adir):
    """DNS rebinding: a page on evil.example that resolves to 127.0.0.1 sends Host: evil.example."""
    with serving(tiny_model, adir) as (srv, _, _):
        p = srv.port
        for host in ("127.0.0.1", f"127.0.0.1:{p}", "localhost", f"localhost:{p}", f"[::1]:{p}", "LOCALHOST.",
                     "[::1]"):
            assert httpx.get(srv.url + "/v1/models", headers={"Host": host}).status_code == 200, host
        for host in ("evil.example", f"evil.example:{p}", "127.0.0.1.evil.example", f"localhost.evil:{p}",
                     "127.0.0.2", "0.0.0.0"):
            r = httpx.get(srv.url + "/v1/models", headers={"Host": host})
            assert r.status_code == 421 and err(r)["code"] == "host_not_allowed", (host, r.text)
            assert "--allowed-hosts" in err(r)["message"]
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1},
                           headers={"Host": host})
            assert r.status_code == 421
        # probes (kubelet sends the pod's IP) may reach /health under any name; it tells nothing
        assert httpx.get(srv.url + "/health", headers={"Host": "10.1.2.3:8080"}).status_code == 200
    with serving(tiny_model, adir, allowed_hosts=("llm.internal", "api.example:8443", "*.svc.local")) as (srv, _, _):
        for host, ok in (("llm.internal", True), ("llm.internal:1234", True), ("api.example:8443", True),
                         ("api.example:80", False), ("api.example", False), ("x.svc.local", True),
                         ("svc.local", False), (f"127.0.0.1:{srv.port}", False)):
            r = httpx.get(srv.url + "/v1/models", headers={"Host": host})
            assert r.status_code == (200 if ok else 421), host
    with serving(tiny_model, adir, allowed_hosts=("*",)) as (srv, _, _):
        assert httpx.get(srv.url + "/v1/models", headers={"Host": "anything.example"}).status_code == 200


def test_posts_need_a_json_content_type(tiny_model, adir):
    """A cross-site form or a text/plain fetch needs no CORS preflight: such POSTs are refused (415)."""
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 1})
    with serving(tiny_model, adir, admin_api_key=ADMIN) as (srv, eng, _):
        url = srv.url + "/v1/completions"
        for ctype in ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x", None):
            headers = {"content-type": ctype} if ctype else {}
            r = httpx.post(url, content=body, headers=headers)
            assert r.status_code == 415 and err(r)["code"] == "unsupported_media_type", (ctype, r.text)
        r = httpx.post(url, data={"model": "tiny", "prompt": PROMPT})  # what an HTML form sends
        assert r.status_code == 415
        r = httpx.post(srv.url + "/v1/load_lora_adapter", content=json.dumps({"lora_name": "x", "lora_path": "a.gguf"}),
                       headers={**ADMIN_AUTH, "content-type": "text/plain"})
        assert r.status_code == 415 and eng.adapters == {}
        for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
            assert httpx.post(url, content=body, headers={"content-type": ctype}).status_code == 200, ctype


def test_paths_are_shown_only_to_the_admin_plane(tiny_model, adir):
    with serving(tiny_model, adir, loras=("a",), admin_api_key=ADMIN) as (srv, _, _):
        for headers in (None, {"Authorization": "Bearer wrong"}):
            text = httpx.get(srv.url + "/v1/models", headers=headers).text + \
                httpx.get(srv.url + "/lora-adapters", headers=headers).text
            assert str(adir) not in text and str(tiny_model.parent) not in text, text
            assert "a.gguf" in text  # the file's name still tells which file it is
        text = httpx.get(srv.url + "/v1/models", headers=ADMIN_AUTH).text
        assert str(adir / "a.gguf") in text and str(tiny_model) in text
        assert str(adir) in httpx.get(srv.url + "/lora-adapters", headers=ADMIN_AUTH).text


# =================================================================================== bounded input
def test_input_limits_are_400s_naming_the_parameter(tiny_model, adir):
    from loramux.server import schemas as S

    msg = [{"role": "user", "content": "hi"}]
    comp = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    chat = {"model": "tiny", "messages": msg, "max_tokens": 2}
    cases = [
        ("completions", {**comp, "stop": ["x"] * (S.MAX_STOP + 1)}, "stop"),
        ("completions", {**comp, "stop": "y" * (S.MAX_STOP_CHARS + 1)}, "stop"),
        ("completions", {**comp, "stop": ["z", "y" * (S.MAX_STOP_CHARS + 1)]}, "stop"),
        ("completions", {**comp, "max_tokens": 300}, "max_tokens"),
        ("chat/completions", {**chat, "max_tokens": None, "max_completion_tokens": 10**12}, "max_completion_tokens"),
        ("completions", {**comp, "prompt": list(range(40, 50)) * 30}, "prompt"),
        ("completions", {**comp, "prompt": "x" * (S.MAX_PROMPT_CHARS + 1)}, "prompt"),
        ("chat/completions", {**chat, "messages": [{"role": "user", "content": "the cat " * 200}]}, "messages"),
        ("chat/completions", {**chat, "messages": msg * (S.MAX_MESSAGES + 1)}, "messages", str(S.MAX_MESSAGES)),
        ("chat/completions", {**chat, "messages": [{"role": "user", "content": "x" * (S.MAX_CONTENT_CHARS + 1)}]},
         "messages.0.content"),
        ("chat/completions", {**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] *
                                                    (S.MAX_CONTENT_PARTS + 1)}]}, "messages.0.content"),
        ("chat/completions", {**chat, "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                                for i in range(S.MAX_TOOLS + 1)]}, "tools"),
        ("chat/completions", {**chat, "functions": [{"name": "f"}]}, "functions"),
        ("chat/completions", {**chat, "tool_choice": "auto"}, "tool_choice"),
        ("completions", {**comp, "n": 17}, "n"),
        ("completions", {**comp, "logit_bias": [[50, 1.0]] * (MAX_LOGIT_BIAS + 1)}, "logit_bias",
         str(MAX_LOGIT_BIAS)),
        ("completions", {**comp, "lora": [{"name": "a"}] * (S.MAX_LORA_REFS + 1)}, "lora"),
        ("completions", {**comp, "top_k": 2**40}, "top_k"),
        ("completions", {**comp, "model": "m" * (S.MAX_NAME_CHARS + 1)}, "model"),
        ("completions", {**comp, "control_vector": {"name": "c", "strength": 1e30}}, "control_vector.strength"),
    ]
    with serving(tiny_model, adir, loras=("a",), max_body_bytes=8 << 20) as (srv, _, _):
        for path, body, param, *needle in cases:
            r = httpx.post(f"{srv.url}/v1/{path}", json=body, timeout=60)
            assert r.status_code == 400, (param, r.text[:300])
            assert err(r)["param"] == param, (param, err(r))
            assert all(n in err(r)["message"] for n in needle), (param, err(r))
        # at the limits: accepted
        ok = {**comp, "stop": ["q" * S.MAX_STOP_CHARS] * S.MAX_STOP,
              "lora": [{"name": "a"}] * S.MAX_LORA_REFS}
        assert httpx.post(srv.url + "/v1/completions", json=ok, timeout=60).status_code == 200


def test_deeply_nested_json_is_a_400_not_a_500(tiny_model, adir):
    deep = "[" * 100_000 + "]" * 100_000
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": ' + deep + "}"
    with serving(tiny_model, adir) as (srv, _, _):
        r = httpx.post(srv.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text[:300]
        assert httpx.get(srv.url + "/health").status_code == 200


def test_the_most_stop_strings_allowed_through_the_server(tiny_model, adir):
    """16 stop strings of 256 characters: accepted, never matching text is left alone, a matching one cuts."""
    from loramux.server.schemas import MAX_STOP, MAX_STOP_CHARS

    with serving(tiny_model, adir, loras=("a",), n_ctx=1024) as (srv, eng, _):
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0)
        kw = dict(model="a", prompt=PROMPT, max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
        full = c.completions.create(**kw).choices[0].text
        assert len(full) > 100
        stops = [(full[:40] + chr(0x4E00 + i)) * 7 for i in range(MAX_STOP)]  # share a long prefix with the text
        stops = [s[:MAX_STOP_CHARS] for s in stops]
        assert c.completions.create(stop=stops, **kw).choices[0].text == full
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(stop=stops, stream=True, **kw))
        assert streamed == full
        cut = full[len(full) // 2:len(full) // 2 + 3]
        r = c.completions.create(stop=stops[1:] + [cut], **kw).choices[0]
        assert r.text == full[:full.index(cut)] and r.finish_reason == "stop"


# ------------------------------------------------------------------------------- stop matching
class NaiveAssembler:
    """The reference: the whole text searched after every token (quadratic, obviously right)."""

    def __init__(self, stop: list[str]) -> None:
        self.stop, self.text, self.emitted, self.stopped = stop, "", 0, False
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> str:
        if self.stopped:
            return ""
        self.text += self.dec.decode(piece)
        hits = [i for s in self.stop if (i := self.text.find(s)) >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
            upto = len(self.text)
        else:
            hold = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
            upto = max(self.emitted, len(self.text) - hold)
        out, self.emitted = self.text[self.emitted:upto], upto
        return out

    def flush(self) -> str:
        if not self.stopped:
            self.text += self.dec.decode(b"", final=True)
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out


def _run(asm, pieces: list[bytes]) -> tuple[list[str], str, bool]:
    """Feed tokens as the scheduler does: until a stop string ends the generation, then flush."""
    chunks = []
    for p in pieces:
        chunks.append(asm.feed(p))
        if asm.stopped:
            break
    chunks.append(asm.flush())
    return chunks, asm.text, asm.stopped


def test_stop_matching_equals_a_naive_reference_on_random_strings():
    rng = random.Random(1234)
    alphabet = "ab cé"  # few letters: many partial and overlapping matches; é is two UTF-8 bytes
    for _ in range(4000):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 5))]
        data = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))).encode()
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 20)))) if len(data) > 1 else []
        pieces = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)]) if j > i]
        assert _run(TextAssembler(stops), pieces) == _run(NaiveAssembler(stops), pieces), (stops, pieces)


@pytest.mark.parametrize("stops, pieces, text, chunks", [
    (["END"], [b"abcE", b"N", b"Dxyz"], "abc", ["abc", "", "", ""]),  # split across tokens, held back
    (["stop"], [b"stop", b"more"], "", ["", ""]),  # at the very start
    (["aab"], [b"a", b"a", b"a", b"b"], "a", ["", "", "a", "", ""]),  # overlapping candidates
    (["bc", "abcd"], [b"abc", b"d"], "a", ["a", ""]),  # the first to complete ends it
    (["abcd", "bc"], [b"ab", b"c", b"d"], "a", ["", "a", ""]),
    (["abcd", "bc"], [b"ab", b"cd"], "", ["", "", ""]),  # both complete in one token: the earlier start
    (["xyz", "yz!"], [b"xy", b"z!"], "", ["", "", ""]),
    (["ab", "abc"], [b"zab", b"c"], "z", ["z", ""]),  # a stop that is a prefix of another
    (["é!"], [b"\xc3", b"\xa9", b"!"], "", ["", "", "", ""]),  # a character split between tokens
    (["ab"], [b"a", b"x"], "ax", ["", "ax", ""]),  # a held-back prefix released
])
def test_stop_matching_edge_cases(stops, pieces, text, chunks):
    for asm in (TextAssembler(stops), NaiveAssembler(stops)):
        got = _run(asm, pieces)
        assert got[0] == chunks and got[1] == text, (type(asm).__name__, got)


def test_stop_matching_work_per_token_is_bounded():
    """The most stop strings the server accepts, made to match as much as possible for as long as possible:
    every token's text goes through the matcher once, with at most its own length plus the longest stop
    string in failure steps, and only less than the longest stop string is kept apart, whatever the output
    length. (No timing: the automaton counts its own steps.)"""
    from loramux.server.schemas import MAX_STOP, MAX_STOP_CHARS

    stops = ["a" * (MAX_STOP_CHARS - 1) + chr(ord("A") + i) for i in range(MAX_STOP - 1)]
    stops.append(("ab" * MAX_STOP_CHARS)[:MAX_STOP_CHARS - 1] + "!")
    asm = TextAssembler(stops)
    rng = random.Random(7)
    fed = 0
    while fed < 20_000:
        piece = rng.choice(["a", "aa", "aaaa", "ab", "b", "abab", "aaaaaaaa"]) + ("x" if rng.random() < 0.01 else "")
        before = asm.matcher.work
        asm.feed(piece.encode())
        fed += len(piece)
        step = asm.matcher.work - before
        assert step <= 2 * len(piece) + MAX_STOP_CHARS, step
        assert len(asm.text) - asm.emitted == asm.matcher.held < MAX_STOP_CHARS
    assert not asm.stopped and len(asm.text) == fed
    assert asm.matcher.work <= 2 * fed + MAX_STOP_CHARS, (asm.matcher.work, fed)


def test_stop_tables_are_built_off_the_engine_thread():
    from loramux.engine import sampling

    stops = ("one", "two")
    sampling.StopMatcher.prepare(stops)

    hits = sampling._automaton.cache_info().hits
    TextAssembler(stops)
    assert sampling._automaton.cache_info().hits == hits + 1  # admission reuses the prepared tables


# ==================================================================================== bounded load
def test_queue_limit_answers_429_with_retry_after(tiny_model, adir):
    assert ServerSettings(parallel=3).queue_limit() == 3 + 64 and ServerSettings(parallel=16).queue_limit() == 16 + 128
    assert ServerSettings(max_queue=2).queue_limit(1) == 3
    long = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with serving(tiny_model, adir, parallel=1, max_queue=1, n_ctx=4096) as (srv, eng, state):
        with httpx.Client(timeout=60) as h:
            streams = [h.stream("POST", srv.url + "/v1/completions", json=long) for _ in range(2)]
            responses = [s.__enter__() for s in streams]
            try:
                assert [r.status_code for r in responses] == [200, 200]
                assert state.in_flight == 2
                r = httpx.post(srv.url + "/v1/completions", json={**long, "stream": False, "max_tokens": 2})
                assert r.status_code == 429 and err(r)["code"] == "queue_full", r.text
                assert r.headers["retry-after"] == "1"
                c = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
                snap = eng.scheduler.snapshot()
                assert snap.running + snap.waiting <= 2  # refused before reaching the engine
            finally:
                for s in streams:
                    s.__exit__(None, None, None)
        wait_for(lambda: state.in_flight == 0, "tickets not released")
        wait_for(lambda: eng.scheduler.snapshot().running == 0, "sequences not freed")
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'loramux_requests_total{model="tiny",status="429"} 2.0' in metrics
        assert "loramux_requests_in_flight 0.0" in metrics
        assert httpx.post(srv.url + "/v1/completions", json={**long, "stream": False, "max_tokens": 2}
                          ).status_code == 200


def test_connection_limit(tiny_model, adir):
    with serving(tiny_model, adir, max_connections=3) as (srv, _, _):
        idle = [raw_http(srv, b"") for _ in range(2)]
        try:
            wait_for(lambda: len(srv.server.server_state.connections) == 2, "idle connections not seen")
            r = httpx.get(srv.url + "/health")
            assert r.status_code == 503, r.text
        finally:
            for s in idle:
                s.close()
        wait_for(lambda: len(srv.server.server_state.connections) == 0, "connections not closed")
        assert httpx.get(srv.url + "/health").status_code == 200


def test_slow_clients_are_cut_off(tiny_model, adir):
    """Slow-loris: a connection that sends nothing, headers that never end, a body that never ends."""
    with serving(tiny_model, adir, read_timeout_s=0.5, keep_alive_s=0.5) as (srv, _, _):
        silent = raw_http(srv, b"")
        assert b"408" in read_until_closed(silent)  # the server closed it: recv did not time out
        partial = raw_http(srv, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        assert read_until_closed(partial).startswith(b"HTTP/1.1 408")
        body = raw_http(srv, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json"
                             b"\r\ncontent-length: 100\r\n\r\n{\"prompt\"")
        read_until_closed(body)
        # keep-alive: a finished request's idle connection is closed too
        ka = raw_http(srv, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_until_closed(ka).startswith(b"HTTP/1.1 200")
        # and the next request on a kept-alive connection has the same deadline as the first
        again = raw_http(srv, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        got = b""
        while b'{"status":"ok"}' not in got:
            got += again.recv(65536)
        again.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        assert read_until_closed(again).startswith(b"HTTP/1.1 408")
        huge = raw_http(srv, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"x" * 20000)
        assert read_until_closed(huge).startswith(b"HTTP/1.1 400")  # an unfinished head over 16 KiB
        for s in (silent, partial, body, ka, again, huge):
            s.close()
        assert httpx.get(srv.url + "/health").status_code == 200


def test_client_that_stops_reading_is_dropped_and_its_request_cancelled(tiny_model, adir):
    """A streamed request whose client never reads: once the socket buffers are full the write stalls; after
    --write-timeout the connection is dropped, the request cancelled (499), its sequence and adapters freed."""
    body = json.dumps({"model": "a", "prompt": PROMPT, "max_tokens": 8000, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    with serving(tiny_model, adir, loras=("a",), n_ctx=8192, write_timeout_s=0.5, sndbuf=4096) as (srv, eng, state):
        s = raw_http(srv, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%s" % (len(body), body), rcvbuf=4096)
        try:
            wait_for(lambda: eng.stats().generated_tokens > 0, "the request never ran")
            wait_for(lambda: state.in_flight == 0, "the stalled request was never cancelled", timeout=120)
            wait_for(lambda: eng.scheduler.snapshot().running == 0, "its sequence was not freed")
            assert state.pool.entries["a"].inflight == 0
            got = read_until_closed(s)  # what the buffers held, then the server's reset or close
            assert got.startswith(b"HTTP/1.1 200") and b"[DONE]" not in got
        finally:
            s.close()
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'loramux_requests_total{model="a",status="499"} 1.0' in metrics
        ok = httpx.post(srv.url + "/v1/completions", json={"model": "a", "prompt": PROMPT, "max_tokens": 3})
        assert ok.status_code == 200


# ========================================================================================== metrics
def test_unloaded_adapters_leave_the_metrics(tiny_model, adir):
    with serving(tiny_model, adir, loras=("a",), admin_api_key=ADMIN) as (srv, _, _):
        assert load(srv, "gone", "b.gguf", ADMIN_AUTH).status_code == 200
        for model, extra in (("gone", {}), ("tiny", {"lora": [{"name": "gone"}]}), ("a", {})):
            r = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2,
                                                              **extra})
            assert r.status_code == 200
        assert httpx.post(srv.url + "/v1/completions", json={"model": "nope", "prompt": PROMPT}).status_code == 404
        before = httpx.get(srv.url + "/metrics").text
        assert 'model="gone"' in before and 'adapter="gone"' in before
        r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "gone"}, headers=ADMIN_AUTH)
        assert r.status_code == 200
        after = httpx.get(srv.url + "/metrics").text
        assert '"gone"' not in after, [ln for ln in after.splitlines() if "gone" in ln]
        assert 'model="a"' in after and 'adapter="a"' in after  # the served ones stay
        assert 'loramux_requests_total{model="_unknown_",status="404"} 1.0' in after  # unknown names: one label
        r = httpx.post(srv.url + "/v1/completions", json={"model": "gone", "prompt": PROMPT})
        assert r.status_code == 404 and '"gone"' not in httpx.get(srv.url + "/metrics").text


def test_metrics_are_rendered_off_the_event_loop(tiny_model, adir):
    import asyncio

    seen = []

    class Probe:
        def describe(self):
            return []

        def collect(self):
            try:
                asyncio.get_running_loop()
                seen.append(("loop", threading.current_thread().name))
            except RuntimeError:
                seen.append(("no loop", threading.current_thread().name))
            return iter(())
    with serving(tiny_model, adir) as (srv, _, state):
        state.metrics.registry.register(Probe())
        assert httpx.get(srv.url + "/metrics").status_code == 200
    assert seen and seen[0][0] == "no loop" and not seen[0][1].startswith("loramux-server"), seen


# ============================================================= found by the API fuzz (test_api_fuzz.py)
def _post_raw(srv: ServerThread, path: str, body: object, headers: dict | None = None) -> httpx.Response:
    """POST a body that may hold lone surrogates: json.dumps escapes them ("\\ud800"), as any client may."""
    return httpx.post(srv.url + path, content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


def test_text_that_is_not_unicode_is_a_400_naming_the_field(tiny_model, adir):
    """JSON may carry lone surrogates ("\\ud800") that UTF-8 cannot hold: they were a 500 from the tokenizer,
    and any error message quoting one failed to render (500)."""
    msg = [{"role": "user", "content": "hi"}]
    cases = [
        ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": ["\udc00"], "max_tokens": 2, "stream": True}, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stop": ["x", "\ud800"]}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x\ud800"}]}, "messages.0.content"),
        ("/v1/chat/completions", {"messages": [*msg, {"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
         "messages.1.content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "\ud800", "text": "x"}]}]},
         "messages"),
    ]
    with serving(tiny_model, adir) as (srv, _, state):
        for path, body, param in cases:
            r = _post_raw(srv, path, body)
            assert r.status_code == 400, (body, r.text[:300])
            assert err(r)["param"] == param, (body, err(r))
        assert "\\ud800" in err(r)["message"]  # shown escaped
        assert state.in_flight == 0
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200


def test_adapter_paths_no_file_can_have_are_400s(tiny_model, adir):
    """A NUL byte, a '~user' nobody is, a name longer than the file system allows: each was a 500."""
    with serving(tiny_model, adir, loras=("a",), admin_api_key=ADMIN) as (srv, eng, _):
        for path in ("a\x00.gguf", "/\x00", "~no-such-user-here/a.gguf", "x" * 300 + ".gguf", "d/" + "y" * 300):
            r = load(srv, "x", path, ADMIN_AUTH)
            assert r.status_code == 400, (path, r.text[:300])
            assert err(r)["param"] == "lora_path" and err(r)["code"] in ("invalid_source", "adapter_file_not_found")
        for body, path in (({"lora_name": "x", "lora_path": "a.gguf", "scale": 1e9}, "/v1/load_lora_adapter"),
                           ([{"id": 0, "scale": -1e9}], "/lora-adapters")):
            r = httpx.post(srv.url + path, json=body, headers=ADMIN_AUTH)
            assert r.status_code == 400 and err(r)["param"] == "scale" and err(r)["code"] == "invalid_scale", r.text
        assert sorted(eng.adapters) == ["a"]
        assert load(srv, "x", "b.gguf", ADMIN_AUTH).status_code == 200


def test_max_completion_tokens_zero_is_honoured(tiny_model, adir):
    """max_completion_tokens 0 was read as 'not given' and max_tokens applied instead."""
    with serving(tiny_model, adir) as (srv, _, _):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "max_completion_tokens": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0, r.text
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "max_completion_tokens": 3}, timeout=60)
        assert r.json()["usage"]["completion_tokens"] == 3
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.json()["usage"]["completion_tokens"] == 10


def test_client_that_leaves_after_its_generation_finished_counts_as_cancelled(tiny_model, adir):
    """Found by the chaos soak: the engine had finished, the rest of the stream waited in the server's queue
    for a client that stopped reading; once the client was gone every send returned at once, the rest of
    the queue went out in one go and the request counted as a 200, before the disconnect could be seen."""
    body = json.dumps({"model": "a", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    with serving(tiny_model, adir, loras=("a",), n_ctx=2048, sndbuf=4096) as (srv, eng, state):
        s = raw_http(srv, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%s" % (len(body), body), rcvbuf=4096)
        try:
            wait_for(lambda: eng.stats().generated_tokens >= 1500, "the generation did not finish")
            wait_for(lambda: eng.scheduler.snapshot().running == 0, "the sequence was not freed")
            assert state.in_flight == 1  # ~225 KB of events, a few KB of buffers: the stream is still going
        finally:
            s.close()  # with unread data: a reset
        wait_for(lambda: state.in_flight == 0, "the request was not finished after its client left")
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'loramux_requests_total{model="a",status="499"} 1.0' in metrics
        assert 'loramux_requests_total{model="a",status="200"}' not in metrics
