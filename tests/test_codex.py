"""A Codex CLI turn against a real loramux server: `codex exec` with a custom provider (wire_api = "responses")
on the tiny model's adapter `a`. Codex sends its whole agent request (developer instructions, function and
namespace tools, a hosted web_search tool, reasoning, include, prompt_cache_key, store false, stream true);
the turn must complete.

Needs the `codex` binary (`npm i @openai/codex`): on PATH, or named by $LORAMUX_CODEX; skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest
from test_server import _metric, adir, serving  # noqa: F401 - adir is a fixture

CODEX = os.environ.get("LORAMUX_CODEX") or shutil.which("codex")
pytestmark = pytest.mark.skipif(not CODEX, reason="needs Codex CLI (npm i @openai/codex) on PATH or $LORAMUX_CODEX")


def test_codex_exec_turn_completes(tiny_model, adir, tmp_path):  # noqa: F811
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    # a Codex turn is ~40 KB of text: tens of thousands of tokens in the tiny model's small vocabulary
    with serving(tiny_model, adir, loras=("a",), n_ctx=65536) as (srv, _, _):
        (home / "config.toml").write_text(
            'model = "a"\nmodel_provider = "loramux"\n\n[model_providers.loramux]\nname = "loramux"\n'
            f'base_url = "{srv.url}/v1"\nwire_api = "responses"\n', encoding="utf-8")
        env = {**os.environ, "CODEX_HOME": str(home)}
        p = subprocess.run([CODEX, "exec", "--skip-git-repo-check", "say hi"], cwd=work, env=env,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
        metrics = httpx.get(srv.url + "/metrics").text
    assert p.returncode == 0, p.stderr[-3000:]
    assert "tokens used" in p.stderr + p.stdout
    assert _metric(metrics, 'loramux_requests_total{model="a",status="200"}') >= 1
    assert _metric(metrics, 'loramux_adapter_requests_total{adapter="a"}') >= 1
    failed = [ln for ln in metrics.splitlines() if ln.startswith("loramux_requests_total{") and 'status="200"' not in ln]
    assert failed == [], failed  # no request of the turn was refused
