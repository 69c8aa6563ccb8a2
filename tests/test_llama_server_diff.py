"""Differential test: the same requests to llama.cpp's llama-server and to loramux on the tiny model; the
response shapes (keys and JSON types, not the text) must agree, but for the differences docs/llama-server.md
lists (OMITTED below, each with its reason).

llama-server is found at $LORAMUX_LLAMA_SERVER, else in the peers directory of benchmarks/build_peers.sh
($LORAMUX_PEERS, default <repo>/peers, then build/bin/llama-server); without it the test is skipped.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import adir, serving  # noqa: F401 - adir is a fixture

REPO = Path(__file__).resolve().parent.parent
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
PROMPT = "the cat sat"


def llama_server_binary() -> Path | None:
    env = os.environ.get("LORAMUX_LLAMA_SERVER")
    if env:
        return Path(env)
    peers = Path(os.environ.get("LORAMUX_PEERS") or REPO / "peers").expanduser()
    path = peers / "build" / "bin" / "llama-server"
    return path if path.is_file() else None


EXE = llama_server_binary()
pytestmark = pytest.mark.skipif(
    EXE is None or not os.access(EXE, os.X_OK),
    reason="llama-server is not built: run benchmarks/build_peers.sh, or set LORAMUX_LLAMA_SERVER to its path")

# What loramux leaves out of llama-server's answers, by case and dotted path ("*" = any list item); the
# reasons are docs/llama-server.md's.
SAMPLERS_NOT_OFFERED = {  # llama.cpp samplers and settings loramux does not offer: dynamic temp, top-n-sigma...
    "dynatemp_range", "dynatemp_exponent", "top_n_sigma", "repeat_last_n", "adaptive_target", "adaptive_decay",
    "n_keep", "n_discard", "logit_bias", "min_keep", "grammar_lazy", "grammar_triggers", "preserved_tokens",
    "chat_format", "reasoning_format", "reasoning_in_content", "generation_prompt",
    "speculative.types", "backend_sampling"}
PROPS_SAMPLERS = {  # /props' defaults: loramux reports the other samplers per request only (generation_settings)
    "xtc_probability", "xtc_threshold", "typical_p", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_penalty_last_n", "dry_sequence_breakers", "mirostat", "mirostat_tau", "mirostat_eta", "samplers"}
OMITTED: dict[str, set[str]] = {
    "completion": {f"generation_settings.{k}" for k in SAMPLERS_NOT_OFFERED},
    "props": {"default_generation_settings.params." + k for k in SAMPLERS_NOT_OFFERED | PROPS_SAMPLERS}
    | {"model_ftype", "media_marker", "ui_settings", "cors_proxy_enabled", "chat_template_tool_use",
       "webui", "webui_settings", "default_generation_settings.id", "default_generation_settings.id_task"},
    # the slot's task, prompt and output: other tenants' data (loramux lists the metrics-only form)
    "slots": {"*.id_task", "*.n_prompt_tokens", "*.n_prompt_tokens_processed", "*.n_prompt_tokens_cache",
              "*.params", "*.next_token", "*.prompt", "*.generated"},
    "models": {"models", "data.*.meta", "data.*.aliases", "data.*.tags", "data.*.status"},
    # on the OpenAI routes errors are OpenAI's shape: `code` is a string (context_length_exceeded), which
    # OpenAI's SDKs and LangChain read; llama-server's status number is the HTTP status
    "oai-error": {"error.code"},
    "lora": {"*.task_name", "*.prompt_prefix", "*.alora_invocation_string", "*.alora_invocation_tokens"},
}


def shape(v: Any) -> Any:
    """A JSON value's shape: objects by key, lists by their first item, numbers as one type."""
    if isinstance(v, dict):
        return {k: shape(x) for k, x in v.items()}
    if isinstance(v, list):
        return [shape(v[0])] if v else []
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    return "null" if v is None else type(v).__name__


def differences(want: Any, got: Any, omitted: set[str], path: str = "") -> list[str]:
    """Where loramux's shape `got` lacks or changes what llama-server's `want` has (extra keys are fine)."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{path or '$'}: object in llama-server, {got!r} in loramux"]
        out = []
        for k, w in want.items():
            p = f"{path}.{k}" if path else k
            if p in omitted:
                continue
            if k not in got:
                out.append(f"{p}: missing")
            else:
                out += differences(w, got[k], omitted, p)
        return out
    if isinstance(want, list):
        if not isinstance(got, list):
            return [f"{path}: list in llama-server, {got!r} in loramux"]
        if want and got:
            return differences(want[0], got[0], omitted, f"{path}.*" if path else "*")
        return []
    if want != got and "null" not in (want, got):  # a value may be null on one side (none, or not measured)
        return [f"{path}: {want} in llama-server, {got} in loramux"]
    return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def peer(tiny_model: Path, adir: Path) -> Iterator[str]:  # noqa: F811 - the fixture imported above
    port = free_port()
    cmd = [str(EXE), "-m", str(tiny_model), "--host", "127.0.0.1", "--port", str(port), "-c", "256", "-np", "1",
           "-t", "1", "--no-webui", "--metrics", "--slots", "--lora-init-without-apply",
           "--lora", str(adir / "a.gguf")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"llama-server exited with {proc.returncode}: {' '.join(cmd)}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama-server did not become healthy"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def ours(tiny_model: Path, adir: Path) -> Iterator[str]:  # noqa: F811
    with serving(tiny_model, adir, loras=("a",)) as (srv, _, _):
        yield srv.url


def both(peer: str, ours: str, method: str, path: str, body: dict | None = None) -> tuple[httpx.Response, ...]:
    return tuple(httpx.request(method, u + path, json=body, timeout=120) for u in (peer, ours))


def chunks(r: httpx.Response) -> list[Any]:
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# llama.vim's FIM request (autoload/llama.vim, llama#fim): its sampling and limit fields, then the whole body
LLAMA_VIM_FIELDS = {"n_predict": 8, "stop": [], "n_indent": 2, "top_k": 40, "top_p": 0.90, "stream": False,
                    "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
                    "t_max_predict_ms": 250,
                    "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms",
                                        "timings/prompt_per_token_ms", "timings/prompt_per_second",
                                        "timings/predicted_n", "timings/predicted_ms",
                                        "timings/predicted_per_token_ms", "timings/predicted_per_second",
                                        "truncated", "tokens_cached"]}
LLAMA_VIM_FIM = {"input_prefix": "def f(x):\n", "input_suffix": "\n", "prompt": "    ",
                 "input_extra": [{"text": "import os\n", "time": [1733, 120000], "filename": "a.py"}],
                 **LLAMA_VIM_FIELDS}

CASES = [  # (name, method, path, body, how to read it)
    ("completion", "POST", "/completion", {"prompt": PROMPT, "n_predict": 4, "n_probs": 2, "return_tokens": True,
                                           "temperature": 0}, "json"),
    ("completion", "POST", "/completions", {"prompt": PROMPT, "n_predict": 3}, "json"),
    ("completion-stream", "POST", "/completion", {"prompt": PROMPT, "n_predict": 4, "n_probs": 1, "stream": True},
     "stream"),
    ("chat", "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 3}, "json"),
    ("chat", "POST", "/chat/completions", {**CHAT, "max_tokens": 3}, "json"),
    ("chat-stream", "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 3, "stream": True,
                                                     "stream_options": {"include_usage": True}}, "stream"),
    ("cmpl", "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 3}, "json"),
    ("tokenize", "POST", "/tokenize", {"content": PROMPT, "with_pieces": True}, "json"),
    ("detokenize", "POST", "/detokenize", {"tokens": [1, 100, 101]}, "json"),
    ("apply-template", "POST", "/apply-template", CHAT, "json"),
    ("input-tokens", "POST", "/chat/completions/input_tokens", CHAT, "json"),
    ("props", "GET", "/props", None, "json"),
    ("slots", "GET", "/slots", None, "json"),
    ("health", "GET", "/health", None, "json"),
    ("models", "GET", "/models", None, "json"),
    ("lora", "GET", "/lora-adapters", None, "json"),
    ("context-error", "POST", "/completion", {"prompt": "the cat " * 200, "n_predict": 2}, "json"),
    ("oai-error", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "the cat " * 200}]}, "json"),
    ("infill-no-fim", "POST", "/infill", {"input_prefix": "a", "input_suffix": "b"}, "json"),
    ("infill-no-fim", "POST", "/infill", LLAMA_VIM_FIM, "json"),
    ("completion", "POST", "/completion", {**LLAMA_VIM_FIELDS, "prompt": PROMPT}, "json"),
    ("completion", "POST", "/completion", {"prompt": PROMPT, "n_predict": 4, "seed": 3, "typical_p": 0.9,
                                           "xtc_probability": 0.5, "xtc_threshold": 0.1, "dry_multiplier": 0.8,
                                           "dry_sequence_breakers": ["\n"], "samplers": "edkypmxt"}, "json"),
    ("completion", "POST", "/completion", {"prompt": PROMPT, "n_predict": 4, "mirostat": 2}, "json"),
    ("oai-error", "POST", "/chat/completions",
     {"messages": [{"role": "user", "content": "t"}, {"role": "assistant", "content": "t"},
                   {"role": "assistant", "content": "t"}]}, "json"),
]


@pytest.mark.parametrize(("name", "method", "path", "body", "read"), CASES,
                         ids=[f"{c[0]}:{c[2]}" for c in CASES])
def test_same_shapes_as_llama_server(peer, ours, name, method, path, body, read):
    theirs, mine = both(peer, ours, method, path, body)
    assert mine.status_code == theirs.status_code, (theirs.text[:300], mine.text[:300])
    omitted = OMITTED.get(name.removesuffix("-stream"), set())
    if read == "json":
        problems = differences(shape(theirs.json()), shape(mine.json()), omitted)
    else:  # the first chunk, a middle one and the last, each against its counterpart
        a, b = chunks(theirs), chunks(mine)
        assert len(a) >= 3 and len(b) >= 3, (theirs.text[:300], mine.text[:300])
        problems = [f"chunk {i}: {p}" for i, (x, y) in enumerate([(a[0], b[0]), (a[1], b[1]), (a[-1], b[-1])])
                    for p in differences(shape(x), shape(y), omitted)]
        assert ("data: [DONE]" in theirs.text) == ("data: [DONE]" in mine.text)
    assert not problems, problems


def test_same_llamacpp_metric_families(peer, ours):
    """Every llamacpp:* series llama-server exports, but for what loramux cannot count (speculative decoding,
    n_tokens_max, n_busy_slots_per_decode), loramux exports too; and /metrics has Process-Start-Time-Unix."""
    not_counted = {"llamacpp:n_tokens_max", "llamacpp:n_busy_slots_per_decode"}

    def series(r: httpx.Response) -> set[str]:
        assert int(r.headers["process-start-time-unix"]) > 0
        return {line.split()[0].split("{")[0] for line in r.text.splitlines()
                if line.startswith("llamacpp:") and "spec_decode" not in line}
    theirs, mine = (series(httpx.get(u + "/metrics", timeout=60)) for u in (peer, ours))
    assert theirs and theirs - not_counted <= mine, sorted(theirs - not_counted - mine)



# n_indent on a text a grammar fixes: the same cut as llama-server's (the ids may differ: the two servers'
# logits differ on the tiny model, so each may spell the text with other tokens, and where llama-server
# checks a line depends on its tokens; these texts stop at the same place either way)
SAME_TEXT = [{"n_indent": 3}, {"n_indent": 1}, {"n_indent": 0}, {"n_indent": 5}]


@pytest.mark.parametrize("extra", SAME_TEXT, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()))
def test_same_n_indent_cut_as_llama_server(peer, ours, extra):
    body = {"prompt": PROMPT, "n_predict": 40, "grammar": 'root ::= "x\\n    y\\n  z\\nw"', "temperature": 0,
            **extra}
    theirs, mine = (r.json() for r in both(peer, ours, "POST", "/completion", body))
    assert (mine["content"], mine["stop_type"]) == (theirs["content"], theirs["stop_type"])
