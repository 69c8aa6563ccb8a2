"""Chaos soak: concurrent valid requests across several adapters, mixed with malformed requests, hot loads and
unloads (admin key), clients that disconnect mid-stream or give up waiting, clients that read slowly and
clients that stop reading, against a deterministic-mode server on 127.0.0.1 (real uvicorn, real llama.cpp,
the tiny model, a slot bank).

Asserted: 0 failed valid requests, and each one's greedy (or seeded) output equal to the same request sent
alone before the soak; every malformed request gets its 4xx, every admin call an allowed answer; the server
ends idle (no sequence, queue place, adapter reference or generation job left), healthy, with no 5xx in
its metrics, serving the same outputs as before; and its RSS after the soak within RSS_BOUND of the RSS
after a warm-up. The valid requests use the base and the adapters pinned at start (STABLE); the hot loads
and unloads touch other adapters (HOT), whose requests may legitimately get a 404, and must match their own
solo outputs when they get a 200.

The server runs in its own process (tests/chaos_worker.py): deterministic mode with adapters needs a
llama.cpp built with -DGGML_LLAMAFILE=OFF (see docs and scripts/det-venv.sh), given by LORAMUX_DET_PYTHON,
or this interpreter when its llama.cpp is built so; otherwise the test is skipped. Bounded: a fixed number
of actions, each under a client timeout, and a time budget for the whole soak (past it no new action
starts; the count is printed). Nothing is asserted about speed.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from tinymodel import write_tiny_lora

WORKER = Path(__file__).with_name("chaos_worker.py")
STABLE = ("c1", "c2", "c3")  # pinned at start and never unloaded: the valid requests use these
HOT = ("h1", "h2")  # loaded, replaced and unloaded during the soak
STALL = "stall"  # pinned too, used only by the clients that stop reading (its 499s count their drops)
ADMIN_KEY = "chaos-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPTS = ["the cat sat on the mat", "hello world", "a big red dog ran", "she and he is on the world"]
SCALE = max(1, int(os.environ.get("LORAMUX_CHAOS_SCALE", "1")))  # more actions, for a longer run by hand
WARM, MAIN = 100, 500 * SCALE  # actions before the RSS baseline, and after it
CONCURRENCY = 12  # clients at once, against --parallel 4
BUDGET_S = 240.0 * SCALE  # no new action starts past this (a slow machine sends fewer; the count is printed)
TIMEOUT_S = 60.0  # per client call
WRITE_TIMEOUT_S = 4.0  # the server's --write-timeout: a client that stops reading is dropped after it
# RSS after the soak vs after the warm-up. The model, KV cache and slot bank are allocated before the
# warm-up; what a request allocates (its sequence, sampler, text, job and queue) is freed when it ends.
# 64 MiB is far above allocator noise (glibc arenas, Python's free lists: +6 to +10 MiB measured over
# 500 to 2,000 actions, levelling off) and is crossed by a leak of ~130 KiB per request over the 500
# actions after the warm-up (a KV sequence copy, the logits of every step, a stream's buffered chunks);
# smaller leaks are caught by the counts of jobs, queue places, sequences and adapter references left at
# idle.
RSS_BOUND = 64 << 20
KINDS = ("valid", "stream", "slow", "hot", "bad", "admin", "cut", "give_up", "stall")


def _det_python() -> str | None:
    """A Python whose llama.cpp has llamafile off: LORAMUX_DET_PYTHON, else this one if it is built so."""
    if os.environ.get("LORAMUX_DET_PYTHON"):
        return os.environ["LORAMUX_DET_PYTHON"]
    from loramux import _native as N

    return None if "LLAMAFILE = 1" in N.system_info() else sys.executable


def _valid() -> list[tuple[str, dict]]:
    """The distinct short valid requests (path, body): base, each stable adapter, stacks; completions and
    chat; greedy, and seeded sampling. (LONG: the ones the slow readers read.)"""
    sets = [("tiny", None), ("c1", None), ("c2", None), ("c3", None),
            ("tiny", [{"name": "c1", "scale": 0.5}, {"name": "c3", "scale": -0.7}]), ("c2", [{"name": "c1"}])]
    out: list[tuple[str, dict]] = []
    for i, (model, lora) in enumerate(sets):
        extra = {"lora": lora} if lora else {}
        for j, prompt in enumerate(PROMPTS[:2]):
            out.append(("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 6 + 4 * ((i + j) % 4),
                                            "temperature": 0, "ignore_eos": True, **extra}))
        out.append(("/v1/chat/completions", {"model": model, "max_tokens": 12, "temperature": 0, **extra,
                                             "messages": [{"role": "user", "content": PROMPTS[i % 4]}]}))
    out += [("/v1/completions", {"model": "c3", "prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0.9,
                                 "top_k": 40, "top_p": 0.95, "seed": 11, "ignore_eos": True}),
            ("/v1/chat/completions", {"model": "tiny", "lora": [{"name": "c2", "scale": 0.8}], "seed": 5,
                                      "temperature": 0.7, "max_tokens": 12,
                                      "messages": [{"role": "user", "content": PROMPTS[3]}]})]
    return out


VALID = _valid()
LONG = [("/v1/completions", {"model": m, "prompt": PROMPTS[k], "max_tokens": 500, "temperature": 0,
                             "ignore_eos": True}) for k, m in enumerate(("tiny", "c1", "c3"))]
HOT_REQUESTS = [("/v1/completions", {"model": h, "prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0,
                                     "ignore_eos": True}) for h in HOT] + \
    [("/v1/completions", {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0,
                          "ignore_eos": True, "lora": [{"name": "c1", "scale": 0.5}, {"name": h}]}) for h in HOT]
BAD: list[tuple[str, Any, dict, int]] = [  # path, body (bytes: sent as is), headers, expected status
    ("/v1/completions", {"model": "nope", "prompt": "x"}, {}, 404),
    ("/v1/completions", {"model": "c1", "prompt": "x", "n": 17}, {}, 400),
    ("/v1/completions", {"prompt": "the " * 2100}, {}, 400),  # longer than the context
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, {}, 400),
    ("/v1/completions", {"model": "c2"}, {}, 400),
    ("/v1/completions", {"prompt": "a\ud800"}, {}, 400),
    ("/v1/completions", {"prompt": "x", "lora": [{"name": "nope"}]}, {}, 404),
    ("/v1/completions", b"{oops", {"content-type": "application/json"}, 400),
    ("/v1/completions", b'{"prompt": "x"}', {"content-type": "text/plain"}, 415),
    ("/v1/completions", {"prompt": "x"}, {"host": "evil.example"}, 421),
    ("/v1/completions", {"prompt": "x" * 70_000}, {}, 413),
    ("/v1/chat/completions", {"messages": []}, {}, 400),
    ("/v1/unload_lora_adapter", {"lora_name": "c1"}, {}, 401),  # a pinned one, without the admin key
    ("/v1/load_lora_adapter", {"lora_name": "c1", "lora_path": "h1.gguf", "replace": True}, {}, 401),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "../x.gguf"}, ADMIN, 403),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "nope.gguf"}, ADMIN, 400),
]


def _body(path: str, body: dict) -> bytes:
    return json.dumps(body).encode()  # lone surrogates escaped, as a client's JSON encoder writes them


def _text(path: str, result: dict) -> str:
    choice = result["choices"][0]
    return choice["message"]["content"] if "chat" in path else choice["text"]


def _sse_text(path: str, lines: list[str]) -> str | None:
    """The text of a whole event stream, or None if it does not end properly."""
    lines = [ln for ln in lines if ln]
    if not lines or lines[-1] != "data: [DONE]":
        return None
    out = []
    for ln in lines[:-1]:
        event = json.loads(ln.removeprefix("data: "))
        if "error" in event:
            return None
        if event["choices"]:
            c = event["choices"][0]
            out.append((c["delta"].get("content") or "") if "chat" in path else c["text"])
    return "".join(out)


class Worker:
    """The server process: started, asked for stats over stdin/stdout, stopped; every wait bounded."""

    def __init__(self, python: str, cfg_path: Path, log: Path) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen([python, str(WORKER), str(cfg_path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self.get(180)
        self.url = f"http://127.0.0.1:{self.ready['port']}"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def get(self, timeout: float = 60.0) -> dict:
        try:
            return json.loads(self.lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"the chaos worker did not answer (exit {self.proc.poll()}); see {self.log.name}") from None

    def stats(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return self.get()

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            self.proc.kill()
            self.proc.wait(timeout=30)
        finally:
            self.log.close()


async def _raw(port: int, request: bytes, rcvbuf: int = 4096) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection with a small receive buffer and a small read-ahead, so that what the client does not
    read stays in the server's buffers (asyncio's reader would otherwise take up to 128 KiB ahead)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    writer.write(request)
    await writer.drain()
    return reader, writer


def _http(path: str, body: dict, version: bytes = b"1.0") -> bytes:
    data = _body(path, body)
    return (b"POST %s HTTP/%s\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (path.encode(), version, len(data), data))


async def _read_all(reader: asyncio.StreamReader, pause: float = 0.0) -> bytes:
    """Everything until the server closes (a reset counts as closed), `pause` seconds between small reads."""
    out = b""
    try:
        while chunk := await reader.read(512):
            out += chunk
            if pause:
                await asyncio.sleep(pause)
    except ConnectionResetError:
        pass
    return out


class Chaos:
    """The soak's clients: a seeded schedule of actions, a tally, and the failures."""

    def __init__(self, url: str, refs: dict[str, str], seed: int) -> None:
        self.url, self.port, self.refs = url, int(url.rsplit(":", 1)[1]), refs
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self.unsent = 0
        self.stalling: asyncio.Lock | None = None

    def check(self, kind: str, ok: bool, detail: str) -> None:
        self.counts[kind] += 1
        if not ok:
            self.failures.append(f"{kind}: {detail}")

    def same(self, kind: str, path: str, body: dict, text: str | None) -> None:
        ref = self.refs[_key(path, body)]
        self.check(kind, text == ref, f"{body}: {text!r} alone it was {ref!r}")

    async def valid(self, c: httpx.AsyncClient) -> None:
        path, body = self.rng.choice(VALID)
        r = await c.post(path, content=_body(path, body), headers={"content-type": "application/json"})
        if r.status_code != 200:
            return self.check("valid", False, f"{body} → {r.status_code} {r.text[:200]}")
        self.same("valid", path, body, _text(path, r.json()))

    async def stream(self, c: httpx.AsyncClient) -> None:
        path, body = self.rng.choice(VALID)
        async with c.stream("POST", path, json={**body, "stream": True}) as r:
            lines = [ln async for ln in r.aiter_lines()]
        if r.status_code != 200:
            return self.check("stream", False, f"{body} → {r.status_code} {lines[-1:]}")
        self.same("stream", path, body, _sse_text(path, lines))

    async def slow(self, c: httpx.AsyncClient) -> None:
        """A valid stream read a little at a time: the server's writes wait for it (and are not dropped)."""
        path, body = self.rng.choice(LONG)
        reader, writer = await _raw(self.port, _http(path, {**body, "stream": True}))
        try:
            got = await asyncio.wait_for(_read_all(reader, pause=0.002), TIMEOUT_S)
        finally:
            writer.close()
        head, _, rest = got.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            return self.check("slow", False, f"{body} → {head[:100]!r}")
        self.same("slow", path, body, _sse_text(path, rest.decode().split("\n")))

    async def stall(self, c: httpx.AsyncClient) -> None:
        """A stream whose client stops reading: dropped after the write timeout, its request cancelled. Only
        these requests use STALL, one at a time, so its 499 count tells when the server has dropped this one."""
        assert self.stalling is not None
        async with self.stalling:
            await self._stall(c)

    async def _stall(self, c: httpx.AsyncClient) -> None:
        before = await _cancelled(c)
        body = {"model": STALL, "prompt": PROMPTS[0], "max_tokens": 1500, "ignore_eos": True, "stream": True,
                "temperature": 0}
        reader, writer = await _raw(self.port, _http("/v1/completions", body, b"1.1"))
        try:
            dropped = time.monotonic() + TIMEOUT_S
            while await _cancelled(c) <= before and time.monotonic() < dropped:
                await asyncio.sleep(0.2)
            got = await asyncio.wait_for(_read_all(reader), TIMEOUT_S)
        finally:
            writer.close()
        ok = time.monotonic() < dropped and got.startswith(b"HTTP/1.1 200") and b"[DONE]" not in got
        self.check("stall", ok, f"not dropped within {TIMEOUT_S:.0f} s: {got[:60]!r}…{got[-60:]!r}")

    async def hot(self, c: httpx.AsyncClient) -> None:
        path, body = self.rng.choice(HOT_REQUESTS)
        r = await c.post(path, json=body)
        self.outcomes[f"hot {r.status_code}"] += 1
        if r.status_code == 404:  # the adapter was unloaded: allowed, named
            return self.check("hot", r.json()["error"]["code"] in ("model_not_found", "adapter_not_found"), r.text)
        if r.status_code != 200:
            return self.check("hot", False, f"{body} → {r.status_code} {r.text[:200]}")
        self.same("hot", path, body, _text(path, r.json()))

    async def bad(self, c: httpx.AsyncClient) -> None:
        path, body, headers, want = self.rng.choice(BAD)
        content = body if isinstance(body, bytes) else _body(path, body)
        r = await c.post(path, content=content, headers={"content-type": "application/json", **headers})
        ok = r.status_code == want and isinstance(r.json().get("error", {}).get("message"), str)
        self.check("bad", ok, f"{path} {str(body)[:80]} → {r.status_code} (want {want}) {r.text[:200]}")

    async def admin(self, c: httpx.AsyncClient) -> None:
        """Hot load, replace and unload of HOT adapters, global scales, listings."""
        name, op = self.rng.choice(HOT), self.rng.choice(["load", "replace", "unload", "scales", "list"])
        if op in ("load", "replace"):
            r = await c.post("/v1/load_lora_adapter", headers=ADMIN, json={"lora_name": name, "lora_path":
                             f"{name}.gguf", "replace": op == "replace"})
            ok = r.status_code == 200 or (r.status_code == 400 and r.json()["error"]["code"] == "adapter_exists")
        elif op == "unload":
            r = await c.post("/v1/unload_lora_adapter", headers=ADMIN, json={"lora_name": name})
            ok = r.status_code in (200, 404)
        elif op == "scales":  # every global scale 0: what base requests without `lora` already get
            r = await c.post("/lora-adapters", headers=ADMIN, json=[])
            ok = r.status_code == 200
        else:
            r = await c.get(self.rng.choice(["/v1/models", "/lora-adapters", "/metrics"]), headers=ADMIN)
            ok = r.status_code == 200
        self.outcomes[f"admin {op} {r.status_code}"] += 1
        self.check("admin", ok, f"{op} {name} → {r.status_code} {r.text[:200]}")

    async def cut(self, c: httpx.AsyncClient) -> None:
        """A stream the client leaves after a few events (the connection closes mid-stream)."""
        path, body = self.rng.choice(LONG)
        async with c.stream("POST", path, json={**body, "stream": True}) as r:
            n, want = 0, self.rng.randint(1, 4)
            async for ln in r.aiter_lines():
                n += ln.startswith("data: ")
                if n >= want:
                    break
        self.check("cut", r.status_code == 200, f"{r.status_code}")

    async def give_up(self, c: httpx.AsyncClient) -> None:
        path, body = self.rng.choice(LONG)
        try:
            r = await c.post(path, json=body, timeout=self.rng.uniform(0.005, 0.05))
        except httpx.TimeoutException:
            return self.check("give_up", True, "")
        self.check("give_up", r.status_code == 200, f"{r.status_code} {r.text[:200]}")

    async def run(self, n: int, deadline: float) -> None:
        """`n` actions from CONCURRENCY clients; each call is bounded by the client's timeout."""
        weights = {"valid": 30, "stream": 14, "slow": 5, "hot": 10, "bad": 16, "admin": 10, "cut": 7, "give_up": 5,
                   "stall": 2}
        plan = self.rng.choices(list(weights), weights=list(weights.values()), k=n)
        self.stalling = asyncio.Lock()  # of this run's event loop
        limits = httpx.Limits(keepalive_expiry=1.0)  # under the server's 5 s keep-alive: no race with its close
        async with httpx.AsyncClient(base_url=self.url, timeout=TIMEOUT_S, limits=limits) as c:
            async def client() -> None:
                while plan:
                    kind = plan.pop()
                    if time.monotonic() > deadline:
                        self.unsent += 1
                        continue
                    try:
                        await getattr(self, kind)(c)
                    except (TimeoutError, httpx.HTTPError, OSError) as e:
                        self.check(kind, False, f"{type(e).__name__}: {e}")
            await asyncio.gather(*(client() for _ in range(CONCURRENCY)))


async def _cancelled(c: httpx.AsyncClient) -> float:
    """How many STALL requests the server has cancelled (its metrics: status 499)."""
    text = (await c.get("/metrics")).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith(f'loramux_requests_total{{model="{STALL}",status="499"}}'))


def _key(path: str, body: dict) -> str:
    return path + " " + json.dumps(body, sort_keys=True)


def _alone(url: str, requests: list[tuple[str, dict]]) -> dict[str, str]:
    """Each request's output, sent alone (one at a time, nothing else running)."""
    out = {}
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as c:
        for path, body in requests:
            r = c.post(path, json=body)
            assert r.status_code == 200, (body, r.text)
            out[_key(path, body)] = _text(path, r.json())
    return out


def _hot_references(url: str) -> dict[str, str]:
    """The HOT adapters' outputs alone: loaded for this, then unloaded (the soak loads them again)."""
    with httpx.Client(base_url=url, timeout=TIMEOUT_S, headers=ADMIN) as c:
        for h in HOT:
            assert c.post("/v1/load_lora_adapter", json={"lora_name": h, "lora_path": f"{h}.gguf"}).status_code == 200
        refs = _alone(url, HOT_REQUESTS)
        for h in HOT:
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": h}).status_code == 200
    return refs


def _idle(worker: Worker, timeout: float = 120.0) -> dict:
    """Stats once nothing is left: no sequence running or waiting, no queue place, adapter reference or
    generation job (cut, abandoned and stalled requests included); bounded."""
    deadline = time.monotonic() + timeout
    while True:
        s = worker.stats()
        left = s["running"] + s["waiting"] + s["in_flight"] + s["jobs"] + sum(s["adapter_inflight"].values())
        if not left or time.monotonic() > deadline:
            assert not left, f"left over after the soak: {s}"
            return s
        time.sleep(0.2)


@pytest.fixture(scope="module")
def chaos_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("chaos")
    for i, name in enumerate((*STABLE, *HOT, STALL)):
        write_tiny_lora(d / f"{name}.gguf", seed=90 + i, rank=4, scale=0.5)
    return d


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_chaos_soak(tiny_model: Path, chaos_dir: Path, tmp_path: Path) -> None:
    python = _det_python()
    if python is None:
        pytest.skip("deterministic mode with adapters needs a llama.cpp built with -DGGML_LLAMAFILE=OFF: set "
                    "LORAMUX_DET_PYTHON to a Python that has one (scripts/det-venv.sh makes it)")
    cfg = {"model": str(tiny_model), "adapter_dir": str(chaos_dir), "stable": [*STABLE, STALL], "admin_key": ADMIN_KEY,
           "deterministic": os.environ.get("LORAMUX_CHAOS_DETERMINISTIC", "1") == "1", "n_ctx": 2048,
           "parallel": 4, "slots": 2, "slot_rank": 4, "write_timeout_s": WRITE_TIMEOUT_S,
           "max_body_bytes": 65536, "sndbuf": 4096}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    worker = Worker(python, tmp_path / "cfg.json", tmp_path / "worker.log")
    try:
        assert worker.ready["llamafile"] is False, worker.ready
        started = time.monotonic()
        refs = {**_alone(worker.url, VALID + LONG), **_hot_references(worker.url)}
        assert len(set(refs.values())) == len(refs), refs  # every request tells its adapters apart
        chaos = Chaos(worker.url, refs, seed=19)
        deadline = time.monotonic() + BUDGET_S
        asyncio.run(chaos.run(WARM, deadline))
        warm = _idle(worker)
        asyncio.run(chaos.run(MAIN, deadline))
        end = _idle(worker)
        took = time.monotonic() - started
        after = _alone(worker.url, VALID + LONG)
        metrics = httpx.get(worker.url + "/metrics").text
        health = httpx.get(worker.url + "/health").json()
    finally:
        worker.close()
    growth = end["rss"] - warm["rss"]
    print(f"\nchaos: {sum(chaos.counts.values())} actions in {took:.0f} s ({chaos.unsent} not started past the "
          f"budget) {dict(chaos.counts)}; {dict(chaos.outcomes)}; RSS {warm['rss'] / 2**20:.1f} → "
          f"{end['rss'] / 2**20:.1f} MiB; shared decode steps {end['multi_seq_steps'] - warm['multi_seq_steps']}")
    assert not chaos.failures, f"{len(chaos.failures)} failures:\n" + "\n".join(chaos.failures[:15])
    assert set(chaos.counts) == set(KINDS), chaos.counts  # the schedule did everything it is meant to
    assert health == {"status": "ok"} and 'status="5' not in metrics
    stalls = f'loramux_requests_total{{model="{STALL}",status="499"}} {float(chaos.counts["stall"])}'
    assert stalls in metrics, [ln for ln in metrics.splitlines() if STALL in ln]  # each one dropped, once
    assert all(after[k] == refs[k] for k in after), "outputs changed after the soak"
    # requests were decoded together (the identity with the solo outputs is not a trivial one)
    assert end["multi_seq_steps"] > warm["multi_seq_steps"], (warm, end)
    assert growth < RSS_BOUND, f"RSS grew by {growth / 2**20:.1f} MiB after the warm-up"
