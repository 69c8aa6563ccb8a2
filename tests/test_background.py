"""The server's work beside decoding runs on worker threads at background CPU priority (server/background.py):
a request's tokenizing (and everything else the server sends to `asyncio.to_thread`) runs at nice 19 by
default, at the process's priority with `background_nice` 0, while the engine thread and the event loop keep
theirs. Real server, real HTTP; priorities read from the kernel (no timings)."""

from __future__ import annotations

import os
import sys
import threading

import httpx
import pytest
from test_server import serving

from loramux.cli.serve import add_parsers, settings_from_args
from loramux.errors import ParameterError
from loramux.server import background
from loramux.server.config import ServerSettings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _nice(t: threading.Thread) -> int:
    assert t.native_id is not None
    return os.getpriority(os.PRIO_PROCESS, t.native_id)


def _tokenized_on(tiny_model, **settings: object) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """Serve one completion; return (thread name, nice) of every tokenize call the request made, and the
    nice values of the engine thread and the server's own thread."""
    seen: list[tuple[str, int]] = []
    with serving(tiny_model, **settings) as (srv, eng, _state):
        real = eng.tokenize

        def spy(*a, **kw):  # the real tokenizer, recording the thread it runs on
            seen.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
            return real(*a, **kw)
        eng.tokenize = spy
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        others = {t.name: _nice(t) for t in threading.enumerate()
                  if t.name == "loramux-engine" or t.name.startswith("loramux-server")}
    return seen, others


def test_request_work_runs_at_the_lowest_priority(tiny_model):
    seen, others = _tokenized_on(tiny_model)
    assert seen, "the completion was never tokenized"
    assert all(name.startswith(background.THREAD_PREFIX) and nice == background.NICE_MAX for name, nice in seen), seen
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert others and all(v == base for v in others.values()), others  # decoding keeps its priority


def test_background_nice_zero_keeps_the_process_priority(tiny_model):
    seen, _ = _tokenized_on(tiny_model, background_nice=0)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert seen and all(nice == base and not name.startswith(background.THREAD_PREFIX) for name, nice in seen), seen


def test_the_setting_is_checked_and_reaches_the_server():
    import argparse

    ap = argparse.ArgumentParser()
    add_parsers(ap.add_subparsers())
    assert settings_from_args(ap.parse_args(["serve", "--background-nice", "5"])).background_nice == 5
    assert settings_from_args(ap.parse_args(["serve"])).background_nice == 19
    for bad in (-1, 20, True, 2.5):
        with pytest.raises(ParameterError, match="background_nice"):
            ServerSettings(background_nice=bad).validated()  # type: ignore[arg-type]
