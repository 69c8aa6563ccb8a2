"""EleutherAI's lm-evaluation-harness (`local-completions`, the remote tokenizer) against `loramux serve` with an
adapter, on a small multiple-choice task this test writes (a task YAML and a JSONL: nothing from the Hub).
Every loglikelihood it computes from the server's echo + logprobs equals the engine's own score of the same
tokens, bit for bit: an engine built with the server's settings runs the same decode."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra")


@pytest.fixture()
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """lm-eval and datasets must never reach the Hub here: offline for this test only. huggingface_hub and
    datasets read the variables once, at import, so their constants are patched too (and restored after,
    so the hf:// tests that run later still reach their local test hub)."""
    import datasets.config
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)

import loramux as lm  # noqa: E402
from loramux.server import ServerSettings  # noqa: E402

ITEMS = [
    {"prompt": "the cat sat on the", "choices": ["mat", "dog", "world"], "answer": 0},
    {"prompt": "a big red", "choices": ["dog", "cat"], "answer": 0},
    {"prompt": "hello", "choices": ["world", "mat", "ran", "is"], "answer": 0},
    {"prompt": "she ran to the", "choices": ["mat", "big"], "answer": 1},
]
SERVE = dict(n_ctx=256, threads=1, parallel=2, slots=2, slot_rank=4)


def _task(tmp: Path) -> Path:
    data = tmp / "items.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in ITEMS))
    tasks = tmp / "tasks"
    tasks.mkdir()
    (tasks / "loramux_tiny_mc.yaml").write_text(
        "task: loramux_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {tmp / 'hf-cache'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{prompt}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return tasks


def _serve(model: Path, adapter: Path) -> tuple[subprocess.Popen[str], str]:
    """`loramux serve` in a subprocess, with adapter `a`; returns it and its URL once it listens."""
    args = [sys.executable, "-m", "loramux", "--log-level", "INFO", "serve", str(model), "--port", "0",
            "--no-example-adapter", "--lora", f"a={adapter}", "--served-model-name", "tiny",
            "--n-ctx", str(SERVE["n_ctx"]), "--threads", str(SERVE["threads"]), "--parallel", str(SERVE["parallel"]),
            "--slots", str(SERVE["slots"]), "--slot-rank", str(SERVE["slot_rank"])]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stderr is not None
        for ln in proc.stderr:
            lines.put(ln)
        lines.put(None)
    threading.Thread(target=pump, daemon=True).start()
    seen, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if "Uvicorn running on http://127.0.0.1:" in line:
            return proc, "http://127.0.0.1:" + line.split("127.0.0.1:")[1].split()[0]
    proc.kill()
    raise AssertionError("loramux serve did not start:\n" + "".join(seen))


def _pairs(sample: dict) -> list[tuple[str, str]]:
    args = sample["arguments"]
    if isinstance(args, dict):  # newer lm-eval: {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
        return [(v["arg_0"], v["arg_1"]) for v in args.values()]
    return [(a[0], a[1]) for a in args]


def _encode_pair(eng: lm.Engine, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's own split (TemplateAPI._encode_pair with the remote tokenizer: no special tokens)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = eng.tokenize(context + continuation, add_bos=False)
    n_ctx = len(eng.tokenize(context, add_bos=False))
    return whole, n_ctx


@pytest.mark.timeout(900)
def test_lm_eval_local_completions_equals_engine_scores(tiny_model, tiny_dir, tmp_path, offline):
    tasks = _task(tmp_path)
    proc, url = _serve(tiny_model, tiny_dir / "a.gguf")
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        out = simple_evaluate(
            model="local-completions",
            model_args={"model": "a", "base_url": url + "/v1/completions", "tokenizer_backend": "remote",
                        "num_concurrent": 1, "max_retries": 1, "max_length": SERVE["n_ctx"]},
            tasks=["loramux_tiny_mc"], task_manager=TaskManager(include_path=str(tasks)), log_samples=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    samples = out["samples"]["loramux_tiny_mc"]
    assert len(samples) == len(ITEMS)
    acc = out["results"]["loramux_tiny_mc"]["acc,none"]
    settings = ServerSettings(**SERVE)
    eng = lm.Engine.load(tiny_model, options=settings.engine_options())
    try:
        eng.load_lora(tiny_dir / "a.gguf", "a")
        right = 0
        for s in samples:
            lls = []
            for (context, continuation), resp in zip(_pairs(s), s["resps"]):
                ll, _greedy = resp[0]
                toks, n_ctx = _encode_pair(eng, context, continuation)
                c = eng.logprobs(toks, loras={"a": 1.0}, top_logprobs=1, max_tokens=1, temperature=0)
                want = sum([e.logprob for e in c.prompt_logprobs][n_ctx:])  # lm-eval's sum, in its order
                assert ll == want, (context, continuation, ll, want)
                lls.append(ll)
            right += int(max(range(len(lls)), key=lambda k: lls[k]) == s["target"])
        assert acc == right / len(samples)
        base = eng.logprobs(toks, top_logprobs=1, max_tokens=1, temperature=0)
        assert sum(e.logprob for e in base.prompt_logprobs[n_ctx:]) != want  # the adapter made a difference
    finally:
        eng.close()
