"""Prompt and decode speed: loramux vs llama-cpp-python's `Llama` vs llama.cpp's own tools.

    python benchmarks/decode.py [--repeats 7] [--ranks 2,16,64] [--threads 2] [--no-server] ...

For no adapter and for random F32 adapters of each rank over all 7 projections of every block,
it measures, side by side in one run (every adapter row and system once per round, in a
rotated order):

- pp: prompt processing of a random `--n-prompt`-token prompt (BOS + random ids), tok/s;
- tg: greedy decode of `--n-gen` tokens after a one-token (BOS) prompt, EOS ignored, tok/s.

Systems (same threads, n_ctx, n_batch, flash attention off unless --flash-attn):

- loramux: `Engine.submit` (the path under `Engine.generate`), consumed by a caller thread as
  `generate` does. Timed on the engine thread: pp = request queued → first token sampled,
  tg = first token sampled → last token sampled (n_gen decodes + samples + text assembly);
- Llama: llama-cpp-python's high-level class, one instance per adapter row (`lora_path` for its
  one adapter). pp = `generate` until the first token; tg = the next n_gen tokens, each detokenized;
- llama-bench (same vendored llama.cpp): `-p N -n N -r 1`, once per round. It has no LoRA options
  in this version, so it only has the no-adapter row;
- llama-server (same source; every adapter loaded with `--lora-init-without-apply`, one chosen per
  request through the `lora` field): its own `timings` of a /completion request, so llama.cpp's own
  adapter overhead is measured too.

Every system runs in a process of its own (loramux and Llama in worker processes of this script),
so each has one OpenMP team and the same libgomp spin-wait behaviour: two teams in one process
make libgomp throttle its spinning, which on a loaded machine changes speed several-fold.
`--gomp-spincount N` exports GOMP_SPINCOUNT=N to every system (useful on a busy machine).
Every process is restarted each round (`--fresh-every N` to restart less often): on a VM the same
program runs up to ±10 % faster or slower from one process to the next (memory placement), so a
whole run measured in one long-lived process would carry that one process's luck.

tok/s are medians over `--repeats` rounds; ratios and adapter overheads (extra time per token vs
the same system's no-adapter row) are medians of per-round ratios, robust to drifting load. The
no-adapter ratios also get a 95 % bootstrap confidence interval and a count of rounds won.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402 - benchmarks/ is not a package

SYSTEMS = ("loramux", "Llama", "llama-bench", "llama-server")


class LoramuxRunner:
    """loramux's Engine with every test adapter resident (inactive); per-request adapter sets."""

    name = "loramux"

    def __init__(self, model: Path, args: argparse.Namespace, adapters: dict[str, Path]) -> None:
        from loramux import Engine

        self.eng = Engine.load(model, n_ctx=args.n_ctx, n_batch=args.n_batch, n_threads=args.threads,
                               flash_attn=args.flash_attn)
        for label, path in adapters.items():
            self.eng.load_lora(path, name=label)
        self.bos = self.eng.model.handle.bos
        self.loras: dict[str, float] = {}

    def configure(self, label: str | None) -> None:
        loras = {label: 1.0} if label else {}
        if loras != self.loras:
            self.loras = loras
            self._run([self.bos], 1)  # a new set re-reserves llama.cpp's graph: keep that out of pp

    def _run(self, tokens: list[int], max_tokens: int) -> tuple[float, float, float]:
        """(queued, first token, done) engine-thread timestamps of one greedy request."""
        done: list[float] = []

        def on_event(kind: str, _value: Any) -> None:
            if kind in ("done", "error"):
                done.append(time.monotonic())

        req = self.eng.submit(tokens, loras=self.loras, max_tokens=max_tokens, temperature=0.0,
                              ignore_eos=True, on_event=on_event)
        from loramux.engine.streams import TextStream

        comp = TextStream(req).consume()  # the caller side of Engine.generate
        if comp.completion_tokens != max_tokens:
            raise RuntimeError(f"loramux produced {comp.completion_tokens} tokens, expected {max_tokens}")
        assert req.first_token_at is not None and done
        return req.arrived, req.first_token_at, done[0]

    def pp(self, tokens: list[int]) -> float:
        t_in, t_first, _ = self._run(tokens, 1)
        return len(tokens) / (t_first - t_in)

    def tg(self, n_gen: int) -> float:
        _, t_first, t_done = self._run([self.bos], n_gen + 1)
        return n_gen / (t_done - t_first)

    def close(self) -> None:
        self.eng.close()


class LlamaRunner:
    """llama-cpp-python's high-level `Llama`: one instance per adapter row (its `lora_path`), all kept."""

    name = "Llama"

    def __init__(self, model: Path, args: argparse.Namespace, adapters: dict[str, Path]) -> None:
        self.model, self.args, self.adapters = model, args, adapters
        self.llms: dict[str | None, Any] = {}
        self.llm: Any = None

    def configure(self, label: str | None) -> None:
        from llama_cpp import Llama

        if label not in self.llms:
            a = self.args
            self.llms[label] = Llama(model_path=str(self.model), n_ctx=a.n_ctx, n_batch=a.n_batch,
                                     n_ubatch=min(a.n_batch, 512), n_threads=a.threads,
                                     n_threads_batch=a.threads, flash_attn=a.flash_attn, verbose=False,
                                     lora_path=str(self.adapters[label]) if label else None)
            self.llm = self.llms[label]
            self.tg(2)  # warm-up
        self.llm = self.llms[label]

    def _gen(self, tokens: list[int]) -> Any:
        self.llm.reset()  # no prefix reuse between rounds
        return self.llm.generate(tokens, temp=0.0, repeat_penalty=1.0, reset=True)

    def pp(self, tokens: list[int]) -> float:
        t0 = time.perf_counter()
        gen = self._gen(tokens)
        next(gen)
        dt = time.perf_counter() - t0
        gen.close()
        return len(tokens) / dt

    def tg(self, n_gen: int) -> float:
        gen = self._gen([self.llm.token_bos()])
        self.llm.detokenize([next(gen)])
        t0 = time.perf_counter()
        for _ in range(n_gen):
            self.llm.detokenize([next(gen)])
        dt = time.perf_counter() - t0
        gen.close()
        return n_gen / dt

    def close(self) -> None:
        for llm in self.llms.values():
            llm.close()
        self.llms.clear()


class BenchRunner:
    """llama.cpp's llama-bench: no LoRA options in this version, so no-adapter rows only."""

    name = "llama-bench"

    def __init__(self, model: Path, args: argparse.Namespace, adapters: dict[str, Path]) -> None:
        self.exe = C.peer_binary("llama-bench")
        self.model, self.args = model, args
        self.active = True
        self._cache: dict[str, float] = {}

    def configure(self, label: str | None) -> None:
        self.active = label is None

    def _bench(self) -> dict[str, float]:
        a = self.args
        cmd = [str(self.exe), "-m", str(self.model), "-p", str(a.n_prompt), "-n", str(a.n_gen),
               "-t", str(a.threads), "-r", "1", "-b", str(a.n_batch), "-ub", str(min(a.n_batch, 512)),
               "-fa", "on" if a.flash_attn else "off", "-o", "json"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        res = {}
        for test in json.loads(out):
            res["pp" if test["n_gen"] == 0 else "tg"] = float(test["avg_ts"])
        return res

    def pp(self, tokens: list[int]) -> float:
        if not self.active:
            return float("nan")
        self._cache = self._bench()  # one llama-bench run gives both; tg() reads the same run
        return self._cache["pp"]

    def tg(self, n_gen: int) -> float:
        return self._cache.pop("tg", float("nan")) if self.active else float("nan")

    def close(self) -> None:
        pass


class ServerRunner:
    """llama.cpp's llama-server with every adapter loaded unapplied; per-request `lora` lists; its own timings."""

    name = "llama-server"

    def __init__(self, model: Path, args: argparse.Namespace, adapters: dict[str, Path]) -> None:
        exe = C.peer_binary("llama-server")
        self.ids = {label: i for i, label in enumerate(adapters)}
        self.lora: list[dict[str, Any]] | None = None
        self.bos = 2
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(args.threads), "-tb", str(args.threads), "-c", str(args.n_ctx), "-b", str(args.n_batch),
               "-ub", str(min(args.n_batch, 512)), "-np", "1", "-fa", "on" if args.flash_attn else "off",
               "--no-webui", "--lora-init-without-apply"]
        for path in adapters.values():
            cmd += ["--lora", str(path)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_healthy(cmd)

    def _wait_healthy(self, cmd: list[str]) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {' '.join(cmd)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("llama-server did not become healthy within 120 s")

    def configure(self, label: str | None) -> None:
        # Every adapter listed: an empty list would mean "the start-up set" (all at scale 1).
        lora = [{"id": i, "scale": 1.0 if name == label else 0.0} for name, i in self.ids.items()]
        if lora != self.lora:
            self.lora = lora
            self._complete([self.bos], 1)  # the changed set re-reserves the graph: keep it out of pp

    def _complete(self, tokens: list[int], n_predict: int) -> dict[str, Any]:
        body = {"prompt": tokens, "n_predict": n_predict, "temperature": 0.0, "ignore_eos": True,
                "cache_prompt": False, "stream": False, "lora": self.lora}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["timings"]

    def pp(self, tokens: list[int]) -> float:
        self.bos = tokens[0]
        return float(self._complete(tokens, 1)["prompt_per_second"])

    def tg(self, n_gen: int) -> float:
        return float(self._complete([self.bos], n_gen + 1)["predicted_per_second"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ProcRunner:
    """A LoramuxRunner or LlamaRunner in a worker process of its own, driven over a pipe."""

    def __init__(self, name: str, model: Path, args: argparse.Namespace, adapters: dict[str, Path],
                 log_dir: Path) -> None:
        self.name = name
        self.log = log_dir / f"worker-{name}.log"  # llama.cpp's chatter; shown if the worker fails
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--model", str(model),
               "--threads", str(args.threads), "--n-ctx", str(args.n_ctx), "--n-batch", str(args.n_batch),
               "--adapters", json.dumps({k: str(v) for k, v in adapters.items()})]
        cmd += ["--flash-attn"] if args.flash_attn else []
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         text=True, bufsize=1)
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{self.name} worker exited ({self.proc.wait()}):\n{tail}")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"{self.name} worker: {msg['error']}")
        return msg

    def _call(self, **msg: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read().get("value")

    def configure(self, label: str | None) -> None:
        self._call(op="configure", label=label)

    def pp(self, tokens: list[int]) -> float:
        return float(self._call(op="pp", tokens=tokens))

    def tg(self, n_gen: int) -> float:
        return float(self._call(op="tg", n=n_gen))

    def close(self) -> None:
        if self.proc.poll() is None:
            self._call(op="close")
            self.proc.wait(30)


WORKERS: dict[str, Callable[..., Any]] = {"loramux": LoramuxRunner, "Llama": LlamaRunner}


def worker_main(args: argparse.Namespace) -> int:
    """Serve one system's configure/pp/tg calls as JSON lines on stdin/stdout."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything native code prints to stdout goes to stderr, not into the protocol
    adapters = {k: Path(v) for k, v in json.loads(args.adapters).items()}
    try:
        runner = WORKERS[args.worker](C.model_path(args.model), args, adapters)
        hello = {"bos": runner.bos, "n_vocab": runner.eng.model.n_vocab} if args.worker == "loramux" else {}
    except Exception as e:  # noqa: BLE001 - reported to the driver
        out.write(json.dumps({"error": repr(e)}) + "\n")
        return 1
    out.write(json.dumps(hello) + "\n")
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "configure":
                value: Any = runner.configure(msg["label"])
            elif msg["op"] == "pp":
                value = runner.pp(msg["tokens"])
            elif msg["op"] == "tg":
                value = runner.tg(msg["n"])
            else:
                runner.close()
                out.write(json.dumps({"value": None}) + "\n")
                return 0
        except Exception as e:  # noqa: BLE001 - reported to the driver
            out.write(json.dumps({"error": repr(e)}) + "\n")
            continue
        out.write(json.dumps({"value": value}) + "\n")
    runner.close()
    return 0


# ----------------------------------------------------------------------------------------------
# Where loramux's per-token time goes
# ----------------------------------------------------------------------------------------------

PROFILED = (  # (module attribute path, label): the pieces of one engine-loop iteration
    ("loramux._native.ContextHandle.decode", "llama_decode (native compute)"),
    ("loramux._native.SamplerHandle.sample", "sampler.sample (native)"),
    ("loramux._native.SamplerHandle.accept", "sampler.accept (native)"),
    ("loramux._native.ModelHandle.token_bytes", "token_bytes"),
    ("loramux.engine.sampling.TextAssembler.feed", "TextAssembler.feed"),
    ("loramux.engine.request.Request.emit", "Request.emit (queue put + callback)"),
    ("loramux.engine.scheduler.Scheduler._fill_batch", "Scheduler._fill_batch"),
    ("loramux.engine.scheduler.Scheduler._apply", "Scheduler._apply (set_adapters check)"),
    ("loramux.engine.scheduler.Scheduler._pick_group", "Scheduler._pick_group"),
    ("loramux.engine.scheduler.Scheduler._drop_cancelled", "Scheduler._drop_cancelled"),
    ("loramux.engine.scheduler.Scheduler._admit", "Scheduler._admit"),
    ("loramux.engine.scheduler.Scheduler.step", "Scheduler.step (total)"),
    ("loramux.engine.runtime.Engine._run_commands", "Engine._run_commands (poll)"),
    ("loramux.engine.runtime.Engine._free_retired", "Engine._free_retired"),
)


def _patch_timers(acc: dict[str, list[float]]) -> list[tuple[Any, str, Any]]:
    """Wrap each PROFILED function with a perf_counter accumulator; returns what to restore."""
    import importlib

    saved = []
    for path, label in PROFILED:
        mod_name, cls_name, fn_name = path.rsplit(".", 2)
        cls = getattr(importlib.import_module(mod_name), cls_name)
        orig = cls.__dict__[fn_name]
        cell = acc.setdefault(label, [0.0, 0])

        def wrapper(*a: Any, _orig: Any = orig, _cell: list[float] = cell, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                _cell[0] += time.perf_counter() - t0
                _cell[1] += 1
        setattr(cls, fn_name, wrapper)
        saved.append((cls, fn_name, orig))
    return saved


def profile_loramux(model: Path, args: argparse.Namespace) -> None:
    """Per-token breakdown of loramux's decode loop (no adapter), then cProfile's top functions."""
    import cProfile
    import io
    import pstats

    runner = LoramuxRunner(model, args, {})
    runner.tg(8)
    n_runs = max(3, args.repeats)
    acc: dict[str, list[float]] = {}
    saved = _patch_timers(acc)
    try:
        tg = [runner.tg(args.n_gen) for _ in range(n_runs)]
    finally:
        for cls, fn_name, orig in saved:
            setattr(cls, fn_name, orig)
    n_tok = (args.n_gen + 1) * n_runs  # +1: the BOS prompt decode of each run
    step = acc["Scheduler.step (total)"][0]
    rows = [[label, str(int(n)), C.fmt(1e6 * total / n_tok, 1), C.fmt(100 * total / step, 1)]
            for label, (total, n) in acc.items()]
    rows.append(["step minus llama_decode (Python + sampler)", "",
                 C.fmt(1e6 * (step - acc["llama_decode (native compute)"][0]) / n_tok, 1),
                 C.fmt(100 * (1 - acc["llama_decode (native compute)"][0] / step), 1)])
    C.print_table(f"loramux decode, time per generated token by function (no adapter; {n_runs} runs of "
                  f"tg{args.n_gen} with timers: {C.median(tg):.1f} tok/s incl. timer overhead)",
                  ["function", "calls", "µs / token", "% of Scheduler.step"], rows)
    prof = cProfile.Profile()
    runner.eng.call(prof.enable)  # cProfile hooks the thread that enables it: the engine thread
    for _ in range(n_runs):
        runner.tg(args.n_gen)
    runner.eng.call(prof.disable)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    print("\ncProfile of the engine thread (sorted by own time):\n")
    print(buf.getvalue())
    runner.close()


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------

def make_adapters(model: Path, ranks: list[int], work: Path) -> dict[str, Path]:
    from loramux.gguf_io import read_header

    arch = read_header(model).architecture or "llama"
    shapes = C.projection_shapes(model)
    out = {}
    for rank in C.progress(ranks, "writing adapters"):
        out[f"rank {rank}"] = C.write_random_adapter(work / f"decode-r{rank}.gguf", arch, shapes, rank, seed=rank)
    return out


Results = dict[str, dict[str, dict[str, list[float]]]]  # [adapter row][system]['pp'|'tg'] -> per-round tok/s


def measure(runners: list[Any], makers: list[Callable[[], Any]], labels: list[str | None],
            args: argparse.Namespace, n_vocab: int, bos: int) -> Results:
    """Every (adapter row, system) pair once per round, rows and systems in a rotated order.

    All pairs of a round run within a minute or two, so per-round ratios compare like with like
    even when the machine's load drifts between rounds. Every `--fresh-every` rounds each runner
    is closed and replaced by a new one from `makers` (in place in `runners`, which the caller closes).
    """
    keys = [label or "none" for label in labels]
    results: Results = {k: {r.name: {"pp": [], "tg": []} for r in runners} for k in keys}
    rng = np.random.default_rng(1234)
    warm = [bos] + rng.integers(10, n_vocab - 10, args.n_prompt - 1).tolist()
    for r in C.progress(runners, "warm-up"):
        _warm_up(r, labels, warm)
    for i in C.progress(range(args.repeats), "rounds"):
        if args.fresh_every and i and i % args.fresh_every == 0:
            for idx, make in enumerate(makers):  # one process's memory placement must not bias a run
                runners[idx].close()
                runners[idx] = make()
                _warm_up(runners[idx], labels, warm)
        tokens = [bos] + rng.integers(10, n_vocab - 10, args.n_prompt - 1).tolist()
        for j in range(len(labels)):
            label = labels[(i + j) % len(labels)]
            k = i % len(runners)
            for r in runners[k:] + runners[:k]:
                r.configure(label)
                results[label or "none"][r.name]["pp"].append(r.pp(tokens))
                results[label or "none"][r.name]["tg"].append(r.tg(args.n_gen))
    return results


def _warm_up(r: Any, labels: list[str | None], warm: list[int]) -> None:
    if r.name == "llama-bench":  # it warms itself on every run
        return
    for label in labels:
        r.configure(label)
        r.pp(warm)
        r.tg(4)


def paired(num: list[float], den: list[float]) -> float:
    """Median over rounds of num[i] / den[i] (NaN where either is missing)."""
    return C.median([C.ratio(x, y) for x, y in zip(num, den)])


def target_lines(results: Results, systems: list[str], what: str) -> list[str]:
    """loramux against each peer without adapter: median per-round ratio, its 95 % bootstrap CI, win rate."""
    none, out = results["none"], []
    for peer in ("llama-bench", "Llama"):
        if peer not in systems:
            continue
        rs = [C.ratio(x, y) for x, y in zip(none["loramux"][what], none[peer][what])]
        rs = [r for r in rs if r == r]
        if rs:
            lo, hi = C.median_ci(rs)
            wins = sum(r > 1 for r in rs)
            out.append(f"{what} loramux/{peer}: {C.median(rs):.3f} (95% CI {lo:.3f}–{hi:.3f}; "
                       f"loramux faster in {wins} of {len(rs)} rounds)")
    return out


def summarize(results: Results, systems: list[str], what: str) -> tuple[list[str], list[list[str]]]:
    """Median tok/s per system, plus ratios and overheads as medians of per-round ratios."""
    none = results["none"]
    others = [s for s in systems if s != "llama-bench"]
    headers = ["adapter", *[f"{s} tok/s" for s in systems]]
    headers += ["loramux/llama-bench"] if "llama-bench" in systems else []
    headers += ["loramux/Llama"] if "Llama" in systems else []
    headers += [f"overhead {s}" for s in others]
    rows = []
    for label, per in results.items():
        row = [label, *[C.fmt(C.median(per[s][what])) for s in systems]]
        if "llama-bench" in systems:
            row.append(C.fmt(paired(per["loramux"][what], none["llama-bench"][what]), 3) if label == "none" else "–")
        if "Llama" in systems:
            row.append(C.fmt(paired(per["loramux"][what], per["Llama"][what]), 3))
        # overhead: extra time per token vs the same system without adapter, in the same round
        row += ["–" if label == "none" else C.fmt_pct(paired(none[s][what], per[s][what]) - 1) for s in others]
        rows.append(row)
    return headers, rows


def spread_rows(results: Results, systems: list[str]) -> list[list[str]]:
    rows = []
    for label, per in results.items():
        for s in systems:
            for what in ("pp", "tg"):
                vals = [v for v in per[s][what] if v == v]
                if vals:
                    q1, q3 = C.quartiles(vals)
                    rows.append([label, s, what, str(len(vals)), C.fmt(min(vals)), C.fmt(q1), C.fmt(C.median(vals)),
                                 C.fmt(q3), C.fmt(max(vals))])
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.common_args(p, repeats=7)
    p.add_argument("--ranks", default="2,16,64", help="adapter ranks (comma-separated; '' for none)")
    p.add_argument("--n-prompt", type=int, default=64)
    p.add_argument("--n-gen", type=int, default=64)
    p.add_argument("--n-ctx", type=int, default=512)
    p.add_argument("--n-batch", type=int, default=512)
    p.add_argument("--flash-attn", action="store_true", help="flash attention on in every system")
    p.add_argument("--fresh-every", type=int, default=1, metavar="N",
                   help="restart every system's process every N rounds (default 1: a fresh process per "
                        "round, so one process's memory placement cannot bias the run; 0: never)")
    p.add_argument("--gomp-spincount", type=int, default=None,
                   help="export GOMP_SPINCOUNT=N to every system (default: libgomp's own default)")
    for s in ("llama", "bench", "server"):
        p.add_argument(f"--no-{s}", action="store_true", help=f"skip the {s} peer")
    p.add_argument("--profile", action="store_true",
                   help="afterwards, break loramux's per-token decode time down by function")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--adapters", default="{}", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.gomp_spincount is not None:
        os.environ["GOMP_SPINCOUNT"] = str(args.gomp_spincount)  # inherited by every system's process
    for flag, tool in ((args.no_bench, "llama-bench"), (args.no_server, "llama-server")):
        if not flag:
            C.peer_binary(tool)  # fail before anything starts, with build advice
    model = C.model_path(args.model)
    info = C.machine_info(args.threads)
    info["GOMP_SPINCOUNT"] = os.environ.get("GOMP_SPINCOUNT", "default")
    C.print_machine(info)
    ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    with tempfile.TemporaryDirectory(prefix="loramux-bench-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        adapters = make_adapters(model, ranks, work)
        makers: list[Callable[[], Any]] = [lambda: ProcRunner("loramux", model, args, adapters, work)]
        makers += [] if args.no_llama else [lambda: ProcRunner("Llama", model, args, adapters, work)]
        makers += [] if args.no_bench else [lambda: BenchRunner(model, args, adapters)]
        makers += [] if args.no_server else [lambda: ServerRunner(model, args, adapters)]
        runners = [make() for make in makers]
        try:
            results = measure(runners, makers, [None, *adapters], args, runners[0].hello["n_vocab"],
                              runners[0].hello["bos"])
        finally:
            for r in runners:
                r.close()
    systems = [r.name for r in runners]
    print(f"\nmodel: {model.name}; threads {args.threads}; n_ctx {args.n_ctx}; n_batch {args.n_batch}; "
          f"flash attention {'on' if args.flash_attn else 'off'}; GOMP_SPINCOUNT {info['GOMP_SPINCOUNT']}; "
          f"{args.repeats} rounds; each system in its own process"
          + (f", restarted every {args.fresh_every} round(s)" if args.fresh_every else ""))
    for what, n in (("pp", args.n_prompt), ("tg", args.n_gen)):
        headers, rows = summarize(results, systems, what)
        C.print_table(f"{what}{n}: tok/s (median over rounds); ratios and overheads are medians of per-round "
                      "ratios; overhead = extra time per token vs the same system without adapter", headers, rows)
    print("\nno adapter, median of per-round ratios with a bootstrap confidence interval:")
    for what in ("pp", "tg"):
        for line in target_lines(results, systems, what):
            print("  " + line)
    C.print_table("spread (tok/s)", ["adapter", "system", "test", "n", "min", "p25", "median", "p75", "max"],
                  spread_rows(results, systems))
    C.dump_json(args.json, {"machine": info, "args": vars(args), "results": results})
    if args.profile:
        profile_loramux(model, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
