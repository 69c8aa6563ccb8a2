#!/usr/bin/env bash
# Make the Python that the deterministic-mode tests with adapters and the RPC tests run on: a venv
# (.venv-det in the checkout) whose llama-cpp-python is built without llamafile's sgemm
# (-DGGML_LLAMAFILE=OFF) and with llama.cpp's RPC backend (-DGGML_RPC=on), with this checkout installed in
# it. One variant serves both, so CI compiles llama.cpp once more, not twice. tests/test_deterministic.py,
# tests/test_chaos.py and tests/test_rpc.py find it through LORAMUX_DET_PYTHON:
#
#     export LORAMUX_DET_PYTHON="$(scripts/det-venv.sh)" && python -m pytest -q
#
# The wheel is built once (about 8-10 minutes on 2 cores) and cached in loramux's cache under
# wheels/llamafile-off-rpc ($LORAMUX_CACHE, else $XDG_CACHE_HOME/loramux, else ~/.cache/loramux); later
# runs only install it. Everything but the final path goes to stderr. .ci/run calls this script.
# Environment: PYTHON (the interpreter for the venv, default python3), LORAMUX_DET_VENV (its folder).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
VENV="${LORAMUX_DET_VENV:-.venv-det}"
VERSION="$(sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' pyproject.toml)"
[ -n "$VERSION" ] || { echo "det-venv: no llama-cpp-python==X pin in pyproject.toml" >&2; exit 1; }
FLAGS="-DGGML_LLAMAFILE=OFF -DGGML_RPC=on"
WHEELS="${LORAMUX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/loramux}/wheels/llamafile-off-rpc"

{
  "$PY" -m venv "$VENV"
  DET="$(cd "$VENV" && pwd)/bin/python"
  "$DET" -m pip install --quiet --upgrade pip
  pattern="llama_cpp_python-$VERSION-*.whl"  # py3-none-<platform>: the binding loads llama.cpp with ctypes
  if ! compgen -G "$WHEELS/$pattern" >/dev/null; then
    mkdir -p "$WHEELS"
    tmp="$(mktemp -d "$WHEELS.build.XXXXXX")"  # private: another build may be running next to this one
    trap 'rm -rf "$tmp"' EXIT
    echo "det-venv: building llama-cpp-python $VERSION with $FLAGS (once; cached in $WHEELS)"
    CMAKE_ARGS="$FLAGS" "$DET" -m pip wheel --quiet --no-deps --no-cache-dir \
      "llama-cpp-python==$VERSION" -w "$tmp"
    mv "$tmp"/$pattern "$WHEELS"/
  fi
  wheel="$(compgen -G "$WHEELS/$pattern" | head -n 1)"
  "$DET" -m pip install --quiet --force-reinstall --no-deps "$wheel"
  "$DET" -m pip install --quiet -e .
  # the build must really be the one without llamafile and with RPC (the tests assert it too, per run)
  "$DET" -c 'from loramux import _native as N; info = N.system_info(); assert "LLAMAFILE = 1" not in info, info'
  "$DET" -c 'from loramux import _native as N; assert N.rpc_supported(), "this llama.cpp lacks GGML_RPC"'
} >&2

echo "$(cd "$VENV" && pwd)/bin/python"
