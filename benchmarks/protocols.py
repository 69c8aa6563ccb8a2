"""The same request through each protocol: chat completions, Responses, Anthropic Messages, Ollama's chat.

One loramux server (in this process, on 127.0.0.1) with one random adapter; each repeat sends one streamed,
greedy request per protocol, interleaved, on the adapter, and measures the time to the first text and the
generated tokens per second after it. Greedy on the same chat gives the same tokens through every protocol
(tests/test_protocols.py), so the rows differ only by what each protocol's layer costs.

    python benchmarks/protocols.py [--model M.gguf] [--repeats 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from _common import (
    common_args,
    machine_info,
    median,
    model_path,
    print_machine,
    print_table,
    projection_shapes,
    write_random_adapter,
)

PROMPT = "Write a short story about a lighthouse keeper who"


def _sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for ln in lines:
        if ln.startswith("data: ") and ln != "data: [DONE]":
            yield json.loads(ln[6:])


def _chat(ev: dict[str, Any]) -> tuple[bool, int | None]:
    text = any(c.get("delta", {}).get("content") for c in ev.get("choices", []))
    return text, (ev.get("usage") or {}).get("completion_tokens")


def _responses(ev: dict[str, Any]) -> tuple[bool, int | None]:
    done = ev["type"] in ("response.completed", "response.incomplete")
    return ev["type"] == "response.output_text.delta", ev["response"]["usage"]["output_tokens"] if done else None


def _messages(ev: dict[str, Any]) -> tuple[bool, int | None]:
    n = ev["usage"]["output_tokens"] if ev["type"] == "message_delta" else None
    return ev["type"] == "content_block_delta", n


def _ollama(ev: dict[str, Any]) -> tuple[bool, int | None]:
    return bool(ev.get("message", {}).get("content")), ev.get("eval_count") if ev.get("done") else None


def cases(model: str, n: int) -> dict[str, tuple[str, dict[str, Any], bool, Callable[..., tuple[bool, int | None]]]]:
    msgs = [{"role": "user", "content": PROMPT}]
    return {
        "chat completions": ("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": n,
                                                       "temperature": 0, "stream": True,
                                                       "stream_options": {"include_usage": True}}, True, _chat),
        "Responses": ("/v1/responses", {"model": model, "input": PROMPT, "max_output_tokens": n, "temperature": 0,
                                        "stream": True}, True, _responses),
        "Anthropic Messages": ("/v1/messages", {"model": model, "messages": msgs, "max_tokens": n, "temperature": 0,
                                                "stream": True}, True, _messages),
        "Ollama /api/chat": ("/api/chat", {"model": model, "messages": msgs, "stream": True,
                                           "options": {"num_predict": n, "temperature": 0}}, False, _ollama),
    }


def one(url: str, path: str, body: dict[str, Any], sse: bool, read: Callable[..., tuple[bool, int | None]]
        ) -> tuple[float, float, int]:
    """(time to first text, total time, generated tokens) of one streamed request."""
    t0 = time.perf_counter()
    first, tokens = float("nan"), 0
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
        r.raise_for_status()
        lines = r.iter_lines()
        for ev in (_sse(lines) if sse else (json.loads(x) for x in lines if x)):
            text, n = read(ev)
            if text and first != first:
                first = time.perf_counter() - t0
            tokens = n if n is not None else tokens
    return first, time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap, repeats=5)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request (default 64)")
    args = ap.parse_args()
    import loramux as lm
    from loramux.server import ServerSettings, create_app, serve_in_thread

    model = model_path(args.model)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="loramux-proto-"))
    eng = lm.Engine.load(model, n_ctx=2048, n_parallel=1, n_threads=args.threads)
    adapter = write_random_adapter(work / "ad.gguf", eng.model.architecture, projection_shapes(model), 8, 0)
    eng.load_lora(adapter, "ad")
    print_machine(machine_info(args.threads))
    results: dict[str, list[tuple[float, float, int]]] = {}
    with serve_in_thread(create_app(eng, ServerSettings(), own_engine=True)) as srv:
        table = cases("ad", args.tokens)
        for path, body, sse, read in table.values():  # warm-up: the prompt's KV, the first graphs
            one(srv.url, path, body, sse, read)
        for _ in range(args.repeats):
            for name, (path, body, sse, read) in table.items():
                results.setdefault(name, []).append(one(srv.url, path, body, sse, read))
    rows = []
    base = median(n / (t - f) for f, t, n in results["chat completions"])
    for name, runs in results.items():
        rate = median(n / (t - f) for f, t, n in runs)
        rows.append([name, f"{median(f for f, _, _ in runs) * 1000:.0f}", f"{rate:.1f}", f"{rate / base:.2f}",
                     str(runs[0][2])])
    print_table(f"Streamed greedy request on an adapter, {args.repeats} repeats (medians)",
                ["protocol", "time to first text (ms)", "tok/s after it", "vs chat completions", "tokens"], rows)


if __name__ == "__main__":
    main()
