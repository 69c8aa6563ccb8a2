"""The server of tests/test_chaos.py, alone in its own process: ggml reads its kernel switches once per process
(deterministic mode sets them before the model loads), and the process's RSS is the server's alone.

Usage: python chaos_worker.py CONFIG.json
CONFIG: {"model", "adapter_dir", "stable": [names pinned at start], "admin_key", "deterministic", "n_ctx",
"parallel", "slots", "slot_rank", "write_timeout_s", "max_body_bytes", "sndbuf"}.
Prints one JSON line once it serves ({"port", "pid", "llamafile"}), then answers each line of stdin:
"stats" → one JSON line (RSS, what is still in flight, decode counters); "quit" → stops and exits.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import loramux as lm
from loramux import _native as N
from loramux.server import LoraEntry, ServerSettings, ServerThread, create_app
from loramux.server.generation import Job


def rss_bytes() -> int:
    """Resident set size of this process (psutil where installed; /proc otherwise)."""
    try:
        import psutil
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return int(psutil.Process().memory_info().rss)


def stats(eng: lm.Engine, state: Any) -> dict[str, Any]:
    """What the soak checks at idle: memory, and that nothing is left running, queued or referenced."""
    gc.collect()
    snap, counters = eng.scheduler.snapshot(), eng.stats()
    return {"rss": rss_bytes(), "running": snap.running, "waiting": snap.waiting,
            "in_flight": state.in_flight,
            "adapter_inflight": {e.name: e.inflight for e in state.pool.entries.values()},
            "jobs": sum(isinstance(o, Job) for o in gc.get_objects()),  # generation jobs still alive
            "resident": sorted(eng.adapters),
            "decode_steps": counters.decode_steps, "multi_seq_steps": counters.multi_seq_steps}


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    adir = Path(cfg["adapter_dir"])
    eng = lm.Engine.load(cfg["model"], n_ctx=cfg["n_ctx"], n_parallel=cfg["parallel"], n_threads=1,
                         deterministic=cfg["deterministic"], slots=cfg["slots"], slot_rank=cfg["slot_rank"])
    entries = tuple(LoraEntry(n, str(adir / f"{n}.gguf")) for n in cfg["stable"])
    for e in entries:
        eng.load_lora(e.source, e.name)
    settings = ServerSettings(loras=entries, adapter_dirs=(str(adir),), admin_api_key=cfg["admin_key"],
                              parallel=cfg["parallel"], n_ctx=cfg["n_ctx"], deterministic=cfg["deterministic"],
                              write_timeout_s=cfg["write_timeout_s"], max_body_bytes=cfg["max_body_bytes"])
    app = create_app(eng, settings, own_engine=True)
    srv = ServerThread(app)
    # accepted sockets inherit the listening socket's send buffer (Linux): a client that stops reading
    # fills it soon, so the server's write timeout is reached with little output
    srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg["sndbuf"])
    with srv:
        print(json.dumps({"port": srv.port, "pid": os.getpid(), "llamafile": "LLAMAFILE = 1" in N.system_info()}),
              flush=True)
        for line in sys.stdin:
            if line.strip() == "stats":
                print(json.dumps(stats(eng, app.state.lm)), flush=True)
            elif line.strip() == "quit":
                break


if __name__ == "__main__":
    main()
