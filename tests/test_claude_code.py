"""A Claude Code turn against a real loramux server: `claude -p` with ANTHROPIC_BASE_URL pointed at it, on the
tiny model's adapter `a`. Claude Code sends its whole agent request (~80 KB: system blocks with cache_control,
24 tools, a system turn inside `messages`, `thinking`, `context_management`, `output_config.effort`,
`metadata`, `max_tokens` 32000, streamed); the turn must complete.

Needs the `claude` binary (`npm i @anthropic-ai/claude-code`): on PATH, or named by $LORAMUX_CLAUDE; skipped
otherwise. Slow on the tiny model: its small vocabulary makes the request ~72k tokens to prefill.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest
from test_server import _metric, adir, serving  # noqa: F401 - adir is a fixture

CLAUDE = os.environ.get("LORAMUX_CLAUDE") or shutil.which("claude")
pytestmark = pytest.mark.skipif(not CLAUDE, reason="needs Claude Code (npm i @anthropic-ai/claude-code) on PATH "
                                                   "or $LORAMUX_CLAUDE")


@pytest.mark.timeout(900)
def test_claude_code_print_turn_completes(tiny_model, adir, tmp_path):  # noqa: F811
    home = tmp_path / "home"
    home.mkdir()
    with serving(tiny_model, adir, loras=("a",), n_ctx=131072) as (srv, _, _):
        env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": srv.url, "ANTHROPIC_API_KEY": "sk-unused",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1"}
        p = subprocess.run([CLAUDE, "-p", "say hi", "--model", "a"], cwd=tmp_path, env=env,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=800)
        metrics = httpx.get(srv.url + "/metrics").text
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    assert _metric(metrics, 'loramux_requests_total{model="a",status="200"}') >= 1
    failed = [ln for ln in metrics.splitlines() if ln.startswith("loramux_requests_total{") and 'status="200"' not in ln]
    assert failed == [], failed  # no request of the turn was refused
