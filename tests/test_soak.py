"""Soak: hundreds of mixed requests against one server (random adapters and stacks, streams cut short,
clients that give up, malformed requests, adapters loaded and unloaded meanwhile). The server must stay
up, answer every request with the status its kind calls for (never a 5xx) and a well-formed body, count
what it served, free every sequence, and its memory must level off. A fixed number of requests, each under
a client timeout; nothing is asserted about how fast they go."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
import pytest
from tinymodel import write_tiny_lora

import loramux as lm
from loramux.server import LoraEntry, ServerSettings, create_app, serve_in_thread

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "hello", "world", "big", "red", "is", "and", "a"]
ADAPTERS = ["a1", "a2", "a3"]
ADMIN_KEY = "soak-admin-key"  # load and unload are on the admin plane
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
STABLE = ("tiny", *ADAPTERS)  # served names never unloaded ("hot" comes and goes)
WARM, MORE = 120, 480  # requests before the memory baseline, and after it


class Soak:
    def __init__(self, url: str, seed: int) -> None:
        self.url = url
        self.rng = random.Random(seed)
        self.counts: dict[str, int] = {}
        self.failures: list[str] = []
        # by model: completions received whole (status 200), streams cut short after a 200, requests
        # the client gave up on before an answer
        self.served: Counter[str] = Counter()
        self.cut: Counter[str] = Counter()
        self.abandoned: Counter[str] = Counter()

    def note(self, kind: str, ok: bool, detail: str = "") -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if not ok:
            self.failures.append(f"{kind}: {detail}")

    def body(self) -> dict:
        r = self.rng
        model = r.choice(["tiny", *ADAPTERS, "hot"])
        body = {"model": model, "prompt": " ".join(r.choices(WORDS, k=r.randint(1, 30))),
                "max_tokens": r.randint(1, 24), "temperature": r.choice([0.0, 0.8]), "seed": r.randint(0, 99)}
        if r.random() < 0.3:  # pinned ones: a stack of a3 and hot cannot be resident at once (503)
            body["lora"] = [{"name": n, "scale": round(r.uniform(-1, 1), 2)}
                            for n in r.sample(ADAPTERS[:2], r.randint(1, 2))]
        return body

    async def one(self, c: httpx.AsyncClient) -> None:
        kind = self.rng.choices(["plain", "stream", "cut_stream", "give_up", "bad", "admin"],
                                weights=[40, 20, 12, 6, 18, 4])[0]
        try:
            await getattr(self, kind)(c)
        except httpx.TransportError as e:
            self.note(kind, False, f"{type(e).__name__}: {e}")

    def check_completion(self, body: dict, result: dict) -> str | None:
        """What is wrong with a completion's body, or None."""
        choice, usage = result["choices"][0], result["usage"]
        if not isinstance(choice["text"], str) or result["model"] != body["model"]:
            return f"text {choice['text']!r}, model {result['model']!r} for {body['model']!r}"
        n, cap = usage["completion_tokens"], body["max_tokens"]
        if choice["finish_reason"] not in ("stop", "length") or n > cap or (choice["finish_reason"] == "length") != (n == cap):
            return f"finish_reason {choice['finish_reason']!r} with {n} of at most {cap} tokens"
        return None

    async def plain(self, c: httpx.AsyncClient) -> None:
        body = self.body()
        r = await c.post("/v1/completions", json=body)
        if r.status_code == 200:
            self.served[body["model"]] += 1
            problem = self.check_completion(body, r.json())
            self.note("plain", problem is None, f"{problem}: {r.text[:200]}")
        else:
            self.note("plain", r.status_code == 404 and body["model"] == "hot", f"{r.status_code} {r.text[:200]}")

    async def stream(self, c: httpx.AsyncClient) -> None:
        body = {**self.body(), "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            lines = [ln async for ln in r.aiter_lines() if ln]
        if r.status_code != 200:
            self.note("stream", r.status_code == 404 and body["model"] == "hot", f"{r.status_code} {lines[-1:]}")
            return
        self.served[body["model"]] += 1
        chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
        finish = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]]
        ok = (lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
              and finish and finish[-1] in ("stop", "length") and not any(finish[:-1]))
        self.note("stream", bool(ok), f"{lines[-3:]}")

    async def cut_stream(self, c: httpx.AsyncClient) -> None:
        body = {**self.body(), "stream": True, "max_tokens": 150, "ignore_eos": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            n, first = 0, ""
            async for ln in r.aiter_lines():
                first = first or ln
                n += ln.startswith("data: ")
                if n >= self.rng.randint(1, 4):
                    break  # leaving the block closes the connection mid-stream
        ok = r.status_code == 200 or (r.status_code == 404 and body["model"] == "hot")
        self.cut[body["model"]] += r.status_code == 200
        self.note("cut_stream", ok, f"{r.status_code} {body} {first[:300]}")

    async def give_up(self, c: httpx.AsyncClient) -> None:
        body = {**self.body(), "max_tokens": 150, "ignore_eos": True}
        try:
            r = await c.post("/v1/completions", json=body, timeout=self.rng.uniform(0.001, 0.05))
        except httpx.TimeoutException:
            self.abandoned[body["model"]] += 1
            self.note("give_up", True)
            return
        # answered before the client gave up (a 404 for an unloaded "hot" comes back at once)
        self.served[body["model"]] += r.status_code == 200
        ok = r.status_code == 200 or (r.status_code == 404 and body["model"] == "hot")
        self.note("give_up", ok, f"{r.status_code} {r.text[:200]}")

    async def bad(self, c: httpx.AsyncClient) -> None:
        r = self.rng
        cases = [({"model": "nope", "prompt": "x"}, 404), ({"model": "tiny", "prompt": "x", "n": 99}, 400),
                 ({"model": "tiny", "prompt": "the " * 300}, 400), ({"model": "tiny"}, 400),
                 ({"model": "tiny", "prompt": "x", "lora": [{"id": 999}]}, 404),
                 ({"model": "tiny", "prompt": "x", "temperature": "hot"}, 400), (b"{oops", 400)]
        body, want = r.choice(cases)
        if isinstance(body, bytes):
            resp = await c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        else:
            resp = await c.post("/v1/completions", json=body)
        self.note("bad", resp.status_code == want and "error" in resp.json(), f"{body!r} → {resp.status_code}")

    async def admin(self, c: httpx.AsyncClient) -> None:
        if self.rng.random() < 0.5:
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": "hot.gguf"},
                             headers=ADMIN)
            ok = r.status_code == 200 or (r.status_code == 400 and r.json()["error"]["code"] == "adapter_exists")
        else:
            r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "hot"}, headers=ADMIN)
            ok = r.status_code in (200, 404)
        self.note("admin", ok, f"{r.status_code} {r.text[:200]}")

    async def run(self, n: int, concurrency: int) -> None:
        """Send exactly `n` requests from `concurrency` workers. Every request is bounded by the client's
        timeout, so the run is too; nothing here depends on how fast the machine is."""
        sent = 0
        # keep-alive shorter than the server's 5 s, so a pooled connection never races its close
        limits = httpx.Limits(keepalive_expiry=1.0)
        async with httpx.AsyncClient(base_url=self.url, timeout=60, limits=limits) as c:
            async def worker() -> None:
                nonlocal sent
                while sent < n:
                    sent += 1
                    await self.one(c)
            await asyncio.gather(*(worker() for _ in range(concurrency)))


@pytest.fixture(scope="module")
def soak_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("soak")
    for i, name in enumerate([*ADAPTERS, "hot"]):
        write_tiny_lora(d / f"{name}.gguf", seed=50 + i, rank=4)
    return d


def test_soak(tiny_model: Path, soak_dir: Path) -> None:
    eng = lm.Engine.load(tiny_model, n_ctx=256, n_parallel=4, n_threads=1)
    entries = tuple(LoraEntry(n, str(soak_dir / f"{n}.gguf")) for n in ADAPTERS[:2])  # pinned
    for e in entries:
        eng.load_lora(e.source, e.name)
    # a3 and hot are loaded at runtime, unpinned: with max_loaded=3 they evict each other (LRU) and
    # come back on demand while requests use them
    app = create_app(eng, ServerSettings(loras=entries, adapter_dirs=(str(soak_dir),), max_loaded=3,
                                         admin_api_key=ADMIN_KEY),
                     own_engine=True)
    proc = psutil.Process()
    with serve_in_thread(app) as srv:
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": "a3.gguf"},
                       headers=ADMIN)
        assert r.status_code == 200, r.text
        soak = Soak(srv.url, seed=1234)
        asyncio.run(soak.run(WARM, 12))
        gc.collect()
        rss_warm = proc.memory_info().rss
        asyncio.run(soak.run(MORE, 12))
        gc.collect()
        rss_end = proc.memory_info().rss
        assert not soak.failures, soak.failures[:10]
        assert sum(soak.counts.values()) == WARM + MORE, soak.counts  # every request got its answer
        assert set(soak.counts) == {"plain", "stream", "cut_stream", "give_up", "bad", "admin"}, soak.counts
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
        _wait_idle(eng)
        assert all(e.inflight == 0 for e in app.state.lm.pool.entries.values())
        # the server counted every completion the clients received whole; at most the cut and abandoned
        # ones besides (those it may have finished before it saw the client leave). Only for the models
        # that stay loaded: an unloaded adapter's series may be dropped from /metrics.
        served, most = (sum(c[m] for m in STABLE) for c in (soak.served, soak.served + soak.cut + soak.abandoned))
        metrics = _metrics_once_counted(srv.url, served)
        assert 'status="5' not in metrics  # no request ever got a server error
        ok = _successes(metrics)
        assert served <= ok <= most, (ok, soak.served, soak.cut, soak.abandoned)
        growth = rss_end - rss_warm
        evictions = [ln for ln in metrics.splitlines() if ln.startswith("loramux_adapter_evictions_total")]
        print(f"\nsoak: {WARM + MORE} requests {soak.counts}, RSS {rss_warm / 2**20:.0f} → "
              f"{rss_end / 2**20:.0f} MiB; {evictions}")
        assert growth < 64 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB after warm-up"


def _wait_idle(eng: lm.Engine, timeout: float = 120.0) -> None:
    """Wait (bounded) until every cut or abandoned request has freed its sequence."""
    deadline = time.monotonic() + timeout
    while (s := eng.scheduler.snapshot()).running + s.waiting and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.running == 0 and s.waiting == 0, s


def _metrics_once_counted(url: str, served: int, timeout: float = 30.0) -> str:
    """/metrics once the server has recorded `served` successes (a stream is recorded as it closes, which
    may come just after the client read its last line); bounded."""
    deadline = time.monotonic() + timeout
    text = httpx.get(url + "/metrics").text
    while _successes(text) < served and time.monotonic() < deadline:
        time.sleep(0.05)
        text = httpx.get(url + "/metrics").text
    return text


def _successes(text: str) -> float:
    """loramux_requests_total{status="200"} summed over the models in STABLE."""
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("loramux_requests_total{") and 'status="200"' in ln
               and any(f'model="{m}"' in ln for m in STABLE))
