"""Shared helpers for the benchmark scripts: peers, test adapters, timing, tables.

Nothing here is part of the loramux package: these scripts measure it. Every table a script
prints holds ratios measured side by side in one run (the machines are noisy and shared, so
absolute numbers from different runs must not be compared; medians over repeats are reported).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
#: The seven projection weights of a transformer block that LoRA adapters usually target.
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
PEER_TOOLS = ("llama-bench", "llama-server", "llama-export-lora", "llama-cvector-generator")


class PeerMissing(SystemExit):
    """A llama.cpp peer binary is not built; the message says how to build it."""


def peers_dir() -> Path:
    """Where build_peers.sh puts the sdist and the build: $LORAMUX_PEERS, else <repo>/peers."""
    env = os.environ.get("LORAMUX_PEERS")
    return Path(env).expanduser() if env else REPO_ROOT / "peers"


def peer_binary(name: str) -> Path:
    """Path of a llama.cpp tool built by benchmarks/build_peers.sh; exits with build advice if absent."""
    path = peers_dir() / "build" / "bin" / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise PeerMissing(
            f"error: {name} not found at {path}.\n"
            "Build llama.cpp's tools from the binding's vendored source first (about 10 minutes on 2 cores):\n"
            "    benchmarks/build_peers.sh            # into ./peers (or set LORAMUX_PEERS=/some/dir)\n"
            "or skip this peer with the script's --no-... option.")
    return path


def machine_info(threads: int) -> dict[str, Any]:
    """What the numbers were measured on (the tables are only meaningful with this next to them)."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        n_cpu = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        n_cpu = os.cpu_count() or 0
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    from loramux import _native as N

    return {"cpu": cpu, "cores": n_cpu, "threads": threads, "loadavg": [round(x, 2) for x in load],
            "python": platform.python_version(), "llama_cpp_python": N.binding_version(),
            "system_info": N.system_info().strip()}


def print_machine(info: Mapping[str, Any]) -> None:
    print(f"machine: {info['cpu']}, {info['cores']} cores usable, {info['threads']} threads used, "
          f"load average {info['loadavg']} at start; llama-cpp-python {info['llama_cpp_python']}")
    print(f"ggml: {info['system_info']}")


# ----------------------------------------------------------------------------------------------
# Test adapters
# ----------------------------------------------------------------------------------------------

def projection_shapes(model_path: str | os.PathLike[str]) -> dict[str, tuple[int, int]]:
    """numpy (out, in) shapes of every block's 7 projection weights, in block order."""
    from loramux.gguf_io import read_header

    tensors = read_header(model_path).tensors
    shapes: dict[str, tuple[int, int]] = {}
    block = 0
    while f"blk.{block}.attn_q.weight" in tensors:
        for proj in PROJECTIONS:
            name = f"blk.{block}.{proj}.weight"
            if name in tensors:
                out_dim, in_dim = tensors[name].shape
                shapes[name] = (int(out_dim), int(in_dim))
        block += 1
    if not shapes:
        raise SystemExit(f"error: {model_path} has no blk.N.attn_q.weight tensors; not a transformer GGUF?")
    return shapes


def random_factors(shapes: Mapping[str, tuple[int, int]], rank: int, seed: int,
                   std: float = 0.02) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Small random float32 factors A (r, in), B (out, r) for every projection."""
    rng = np.random.default_rng(seed)
    return {name: ((rng.standard_normal((rank, i)) * std).astype(np.float32),
                   (rng.standard_normal((o, rank)) * std).astype(np.float32))
            for name, (o, i) in shapes.items()}


def write_random_adapter(path: Path, architecture: str, shapes: Mapping[str, tuple[int, int]],
                         rank: int, seed: int) -> Path:
    """An F32 adapter over every projection with alpha == rank (so llama.cpp's alpha/rank is 1)."""
    from loramux.gguf_io import write_adapter

    return write_adapter(path, architecture, random_factors(shapes, rank, seed), float(rank), dtype="f32")


def concat_stages(stages: Sequence[Mapping[str, tuple[np.ndarray, np.ndarray]]]
                  ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Rank-concatenate several adapters' factors: one adapter equal to their sum (same alpha/rank)."""
    return {name: (np.concatenate([s[name][0] for s in stages], axis=0),
                   np.concatenate([s[name][1] for s in stages], axis=1))
            for name in stages[0]}


# ----------------------------------------------------------------------------------------------
# GGUF metadata
# ----------------------------------------------------------------------------------------------

def copy_gguf_fields(w: Any, ref: Any, skip: Iterable[str] = (),
                     replace: Mapping[str, Any] | None = None) -> None:
    """Copy every metadata field of `ref` (a gguf.GGUFReader) into `w` (a gguf.GGUFWriter), each with its own
    value type, but the keys in `skip` (the reader's GGUF.* entries and general.architecture are the writer's
    own); `replace` maps a key to the value written instead of the reference's (same type)."""
    import gguf

    skipped, replace = {*skip, "general.architecture"}, replace or {}
    for key, field in ref.fields.items():
        if key.startswith("GGUF.") or key in skipped:
            continue
        kind = field.types[0]
        if key == "general.alignment":  # the writer pads tensor data by it: set it there, not as a plain key
            w.add_custom_alignment(int(replace.get(key, field.parts[field.data[0]].tolist()[0])))
        elif kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[1]
            if key in replace:
                vals: Any = list(replace[key])
            elif sub == gguf.GGUFValueType.STRING:
                vals = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
            else:
                vals = [field.parts[i].tolist()[0] for i in field.data]
            w.add_key_value(key, vals, kind, sub_type=sub)
        elif key in replace:
            w.add_key_value(key, replace[key], kind)
        elif kind == gguf.GGUFValueType.STRING:
            w.add_key_value(key, bytes(field.parts[field.data[0]]).decode("utf-8"), kind)
        else:
            w.add_key_value(key, field.parts[field.data[0]].tolist()[0], kind)


# ----------------------------------------------------------------------------------------------
# Timing and statistics
# ----------------------------------------------------------------------------------------------

def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of `fn` took (perf_counter)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(xs: Iterable[float]) -> float:
    vals = [x for x in xs if x == x]  # drop NaN
    return statistics.median(vals) if vals else float("nan")


def quartiles(xs: Iterable[float]) -> tuple[float, float]:
    """(25th, 75th) percentile, to show how noisy a median is."""
    vals = [x for x in xs if x == x]
    if not vals:
        return float("nan"), float("nan")
    q = np.percentile(vals, [25, 75])
    return float(q[0]), float(q[1])


def median_ci(xs: Iterable[float], level: float = 0.95, n_boot: int = 5000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap confidence interval of the median: how far the median of noisy rounds can be trusted."""
    vals = np.array([x for x in xs if x == x])
    if len(vals) < 3:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(vals, (n_boot, len(vals))), axis=1)
    lo, hi = np.percentile(meds, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


def fmt(x: float | None, digits: int = 1, suffix: str = "") -> str:
    if x is None or x != x:
        return "–"
    return f"{x:.{digits}f}{suffix}"


def fmt_pct(x: float | None) -> str:
    if x is None or x != x:
        return "–"
    return f"{x * 100:+.1f} %"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A GitHub-markdown table (pastes straight into BENCHMARKS.md)."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    print(f"\n{title}\n")
    print("| " + " | ".join(str(h).ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
    sys.stdout.flush()


def common_args(parser: argparse.ArgumentParser, repeats: int) -> None:
    """Options every benchmark takes."""
    parser.add_argument("--model", default=None,
                        help="base GGUF (default: loramux's embedded Gemma 3 270M Q4_K_M)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for every system (default 2)")
    parser.add_argument("--repeats", type=int, default=repeats,
                        help=f"measurements per cell; medians are reported (default {repeats})")
    parser.add_argument("--work-dir", default=None,
                        help="where to write the test adapters (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write every raw measurement to this JSON file")


def model_path(arg: str | None) -> Path:
    from loramux.config import default_model_path

    return Path(arg).expanduser() if arg else default_model_path()


@functools.lru_cache(maxsize=4)
def prompt_openers(model: Path) -> tuple[str, ...]:
    """Capitalised words (4 to 10 letters) that are each one token of the model's vocabulary.

    A prompt that starts with its own opener differs from every other from its first token after BOS, so no
    server reuses a cached prefix of another request, whatever its adapters (a shared first word, such as
    "Request 12", lets a server that runs every request on one adapter reuse a few tokens of each prompt that
    servers spreading them over many adapters cannot).
    """
    # gguf is a loramux dependency; imported here because only the benchmarks that ask for unique prompts read it
    from gguf import GGUFReader

    field = GGUFReader(str(model)).fields["tokenizer.ggml.tokens"]
    words = (bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data)
    return tuple(w for w in words if re.fullmatch(r"[A-Z][a-z]{3,9}", w))


def dump_json(path: str | None, payload: Mapping[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=1, default=float))
        print(f"\nraw measurements written to {path}")


def progress(iterable: Iterable[Any], desc: str, total: int | None = None) -> Iterable[Any]:
    """tqdm on stderr (keeps stdout a clean table)."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=False, dynamic_ncols=True)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300, path: str = "/health") -> float:
    """Seconds until GET url+path answers 200 (llama-cpp-python's server has no /health: pass /v1/models)."""
    import httpx  # only the server benchmarks need it

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("server did not become ready")
