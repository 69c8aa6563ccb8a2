"""loramux as users get it: the wheel built from this checkout, installed (not editable) into a fresh venv.

Nothing of the checkout is on that venv's path, so a file the wheel leaves out (the example adapter, the
probe references, the golden prompts) fails here, not on a user's machine. pip reuses the llama-cpp-python
wheel it cached when the checkout was installed, so llama.cpp is not compiled again.

In the venv, from an empty directory, as a new user types them: `loramux run -p ...`, `loramux serve` with
no arguments (it lists `pirate` and answers a chat on it), `loramux inspect` on the shipped adapter and
`loramux probe --check shipped` against the shipped references.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.gemma]
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 900


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LORAMUX_MODEL", "LORAMUX_API_KEY", "LORAMUX_ADMIN_API_KEY")}
    env.update(LORAMUX_CACHE=str(cache), OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(ROOT)], check=True, timeout=TIMEOUT)
    (path,) = out.glob("loramux-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory, gemma_path: Path) -> tuple[Path, dict[str, str]]:
    """A fresh venv with the wheel and its dependencies; its bin directory and the environment to run in."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=TIMEOUT)
    bin_ = root / "venv" / "bin"
    env = _env(root / "cache")
    subprocess.run([str(bin_ / "python"), "-m", "pip", "install", "--quiet", str(wheel)], check=True,
                   timeout=TIMEOUT, env=env)
    target = root / "cache" / "models" / gemma_path.name  # the embedded model, assembled once already
    target.parent.mkdir(parents=True)
    os.link(gemma_path, target) if gemma_path.stat().st_dev == target.parent.stat().st_dev else \
        target.write_bytes(gemma_path.read_bytes())
    return bin_, env


def _run(venv: tuple[Path, dict[str, str]], cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    bin_, env = venv
    return subprocess.run([str(bin_ / argv[0]), *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


def test_the_wheel_holds_all_package_data(wheel: Path) -> None:
    shipped = {f"loramux/{p.relative_to(ROOT / 'src' / 'loramux')}"
               for p in (ROOT / "src" / "loramux" / "data").rglob("*") if p.is_file()}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert shipped and shipped - names == set(), f"left out of the wheel: {sorted(shipped - names)}"


def test_installed_package_is_not_the_checkout(venv, tmp_path: Path) -> None:
    p = _run(venv, tmp_path, "python", "-c", "import loramux, loramux.config as c; "
             "print(loramux.__file__); print(c.example_adapter_path())")
    assert p.returncode == 0, p.stderr
    module, adapter = p.stdout.split()
    assert str(venv[0].parent) in module and str(ROOT) not in module
    assert Path(adapter).is_file() and str(venv[0].parent) in adapter


def test_run_on_the_embedded_model(venv, tmp_path: Path) -> None:
    p = _run(venv, tmp_path, "loramux", "run", "-p", "The capital of France is", "-n", "8")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("The capital of France is") and len(p.stdout) > len("The capital of France is")


def test_serve_with_no_arguments_answers_on_pirate(venv, tmp_path: Path) -> None:
    bin_, env = venv
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(bin_ / "loramux"), "serve"], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while "listening on" not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"loramux serve exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.25)
        text = log.read_text()
        assert re.search(r"models:  gemma-3-270m-q4_k_m \(base\), pirate", text), text
        curl = re.search(r"try:     (curl .*)", text)[1]  # the printed curl line works as printed
        got = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=TIMEOUT)
        assert got.returncode == 0 and '"model":"pirate"' in got.stdout, got
        models = httpx.get("http://127.0.0.1:8080/v1/models", timeout=30).json()
        assert "pirate" in [m["id"] for m in models["data"]]
        r = httpx.post("http://127.0.0.1:8080/v1/chat/completions", timeout=TIMEOUT, json={
            "model": "pirate", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of Germany?"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].strip()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    assert proc.returncode in (0, 130), log.read_text()  # 130: stopped by Ctrl-C, as a user stops it


def test_inspect_the_shipped_adapter(venv, tmp_path: Path) -> None:
    path = _run(venv, tmp_path, "python", "-c", "import loramux.config as c; print(c.example_adapter_path())")
    p = _run(venv, tmp_path, "loramux", "inspect", path.stdout.strip())
    assert p.returncode == 0, p.stderr
    assert "kind: lora adapter" in p.stdout and "rank: 8" in p.stdout


def test_probe_checks_against_the_shipped_references(venv, tmp_path: Path) -> None:
    p = _run(venv, tmp_path, "loramux", "probe", "--threads", "2", "--check", "shipped")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "probe matches the shipped reference" in p.stderr
