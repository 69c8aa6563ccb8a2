"""Many adapters over time: load/unload cycles through the bank's tiers do not grow the process.

RSS is read from /proc (Linux); elsewhere these tests skip. Bounds are relative to the same run's
early cycles (what the allocator settled at), plus a little slack for page-granular bookkeeping.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
from tinymodel import random_factors

import loramux as lm
from loramux.gguf_io import write_adapter

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RSS from /proc")
SLACK = 1 << 20  # bytes: allocator and page granularity, far below what a per-cycle leak adds up to


def _rss() -> int:
    gc.collect()
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _adapters(tmp_path: Path, n: int) -> list[Path]:
    return [write_adapter(tmp_path / f"c{i}.gguf", "llama", random_factors(rank=2 + i % 3, seed=500 + i, scale=0.3),
                          4.0) for i in range(n)]


@pytest.mark.slow
def test_ten_thousand_slot_load_unload_cycles_do_not_grow_rss(tiny_model, tmp_path):
    """10,000 cycles of: an adapter is made warm in the background, written into a slot, used, and
    now and then unloaded from the bank (its slot and warm blocks forgotten). Three adapters through two
    slots and a warm tier smaller than all three, so loads come from warm and cold and evictions run too."""
    files = _adapters(tmp_path, 3)
    with lm.Engine.load(tiny_model, n_ctx=64, n_parallel=2, n_threads=1, slots=2, slot_rank=4,
                        loras=[lm.LoraSpec(str(p), 0.0, name=p.stem) for p in files]) as eng:
        bank = eng.bank
        ads = [eng.adapter(p.stem) for p in files]
        sizes = [bank.prepare(a).nbytes for a in ads]
        bank.warm.max_bytes = sizes[1] + sizes[2]  # room for any two of the three (ranks 2, 3, 4)
        order = [0, 1, 0, 2]  # one hot adapter, two taking turns: slot hits, warm hits and evictions

        def cycles(start: int, n: int) -> None:
            for i in range(start, start + n):
                a = ads[order[i % 4]]
                if i % 7 == 0:
                    bank.prefetcher.submit(a)  # now and then prepared by the worker, racing the write
                k = bank.take_slot(a)
                assert k is not None
                bank.return_slot(k)
                if i % 5 == 0:
                    bank.forget(a)  # unloaded from the bank: slot and warm blocks go

        eng.call(lambda: cycles(0, 1000))
        marks = [_rss()]
        for start in range(1000, 10_000, 3000):
            eng.call(lambda s=start: cycles(s, 3000))
            marks.append(_rss())
        assert bank.writes >= 4000 and bank.warm.stats["hits"] > 0 and bank.warm.stats["evictions"] > 0
        assert bank.warm.bytes <= bank.warm.max_bytes
    assert marks[-1] - marks[0] <= SLACK, f"RSS after 1,000 / 4,000 / 7,000 / 10,000 cycles: {marks}"


@pytest.mark.slow
def test_engine_load_request_unload_cycles_do_not_grow_rss(tiny_model, tmp_path):
    """The full path: load an adapter into the engine, serve a request on it (banked: it is prefetched
    and written into a slot), unload it. 600 cycles (each a real llama.cpp load); after the first 100,
    RSS stays within SLACK plus 1 % of what it was then. Before the fix, blocks prefetched for an
    adapter that was unloaded meanwhile stayed in the warm tier: about 7 kB per cycle."""
    path = _adapters(tmp_path, 1)[0]
    with lm.Engine.load(tiny_model, n_ctx=64, n_parallel=2, n_threads=1, slots=2, slot_rank=4) as eng:
        def cycle() -> None:
            eng.load_lora(str(path), name="x")
            eng.generate([1, 2, 3], loras={"x": 1.0}, max_tokens=1)
            eng.remove_lora("x")
        for _ in range(100):
            cycle()
        base = _rss()
        marks = []
        for i in range(500):
            cycle()
            if i % 100 == 99:
                marks.append(_rss())
        assert len(eng.bank.warm) == 0 and eng.bank.writes >= 600
    assert marks[-1] - base <= SLACK + base // 100, f"RSS {base} after 100 cycles, then every 100: {marks}"


def test_bank_size_follows_parallel_and_the_start_adapters_ranks(tmp_path):
    from loramux.engine.options import bank_size
    from loramux.server.config import LoraEntry, ServerSettings

    assert bank_size(8) == (8, 16)  # no rank known: the old default rank
    assert bank_size(8, [8]) == (8, 8) and bank_size(4, [3, 12]) == (4, 16) and bank_size(2, [64]) == (2, 64)
    assert bank_size(1, [8]) == (0, 8)  # one sequence: nothing to share a decode with, no bank
    files = [write_adapter(tmp_path / f"r{r}.gguf", "llama", random_factors(rank=r, seed=r), float(r)) for r in (4, 12)]
    loras = tuple(LoraEntry(p.stem, str(p)) for p in files) + (LoraEntry("remote", "hf://o/r/x.gguf"),)
    opts = ServerSettings(parallel=6, loras=loras).engine_options()
    assert (opts.slots, opts.slot_rank) == (6, 16)  # the rank-12 file, rounded up; the remote one unread
    opts = ServerSettings(parallel=6, slots=2, slot_rank=32, loras=loras).engine_options()
    assert (opts.slots, opts.slot_rank) == (2, 32)  # given values win


def test_bank_dtype_f16_reaches_the_bank_from_the_command_line(tiny_model, tmp_path):
    """`loramux serve --bank-dtype f16` builds the bank with F16 factors, and requests on two adapters share
    decodes through it; an unknown type and f16 with --deterministic are refused, naming the option."""
    from loramux.cli import build_parser
    from loramux.cli.serve import settings_from_args
    from loramux.engine.options import EngineOptions
    from loramux.errors import ParameterError
    from loramux.ggml_types import F16

    ap = build_parser()
    files = [write_adapter(tmp_path / f"{n}.gguf", "llama", random_factors(rank=4, seed=70 + i, scale=0.4), 4.0)
             for i, n in enumerate("AB")]
    args = ["serve", str(tiny_model), "--parallel", "2", "--bank-dtype", "f16", "--n-ctx", "128"]
    opts = settings_from_args(ap.parse_args(args + [f"--lora={p.stem}={p}" for p in files])).engine_options()
    assert opts.bank_dtype == "f16" and opts.slots == 2
    assert settings_from_args(ap.parse_args(["serve"])).engine_options().bank_dtype == "f32"
    with pytest.raises(SystemExit):
        ap.parse_args(["serve", "--bank-dtype", "q8_0"])
    with pytest.raises(ParameterError, match="bank_dtype"):
        EngineOptions(bank_dtype="f16", deterministic=True)
    loras = [lm.LoraSpec(str(p), 0.0, name=p.stem) for p in files]
    with lm.Engine.load(tiny_model, options=opts, n_threads=1, loras=loras) as eng:
        types = {eng.bank.adapter.factor_tensors()[t].type for t in eng.bank.targets}
        assert types == {F16}, types
        toks = eng.tokenize("the cat sat on the mat")
        # the first call writes the slots (B's beside A's decodes, so B may start late); the second, with
        # both in their slots, admits the two at once
        for _ in range(2):
            done = eng.generate_many([toks, toks], loras=[{"A": 1.0}, {"B": 1.0}], max_tokens=6, ignore_eos=True)
            assert [len(c.tokens) for c in done] == [6, 6]
        assert eng.stats().bank_decodes > 0


def test_serve_bank_dtype_f16_serves_two_adapters_through_the_bank(tiny_model, tmp_path):
    """`loramux serve MODEL --bank-dtype f16 --lora ... --lora ...` as a user types it: requests on the two
    adapters, B sent while A is decoding, both complete and share decodes through the bank (its /metrics
    counter)."""
    import os
    import socket
    import subprocess
    import time

    import httpx

    files = [write_adapter(tmp_path / f"{n}.gguf", "llama", random_factors(rank=4, seed=80 + i, scale=0.4), 4.0)
             for i, n in enumerate("AB")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "loramux", "serve", str(tiny_model), "--bank-dtype", "f16", "--parallel", "2",
           "--n-ctx", "4096", "--threads", "1", "--port", str(port), "--public-metrics",
           *(x for p in files for x in ("--lora", f"{p.stem}={p}"))]
    proc = subprocess.Popen(cmd, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        # A streams a long answer (4,000 tokens: seconds, where this tiny model decodes 160 in the time a
        # request takes to arrive); B is sent once A's first token is out, and A is still streaming when B
        # is done, so the two decoded together whatever the machine's speed. Each adapter is put in its
        # slot first, alone.
        body = {"prompt": "the cat sat on the mat", "ignore_eos": True}
        for name in "AB":
            assert httpx.post(url + "/v1/completions", timeout=120,
                              json={**body, "model": name, "max_tokens": 2}).status_code == 200
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={**body, "model": "A", "max_tokens": 4000, "stream": True}) as a:
            assert a.status_code == 200
            lines = a.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            b = httpx.post(url + "/v1/completions", timeout=120, json={**body, "model": "B", "max_tokens": 24})
            after = next(line for line in lines if line.startswith("data: "))
        assert b.status_code == 200, b.text
        assert b.json()["usage"]["completion_tokens"] == 24
        assert after.startswith("data: {") and '"finish_reason":null' in after.replace(" ", ""), \
            "A ended before B was served"
        metrics = httpx.get(url + "/metrics", timeout=30).text
        banked = next(float(line.split()[1]) for line in metrics.splitlines()
                      if line.startswith("loramux_bank_decodes_total "))
        assert banked > 0, "the two adapters never shared a decode through the bank"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
