"""`loramux rpc-worker`: llama.cpp's RPC server, from the llama.cpp this loramux runs on.

A worker holds part of a base model for a `loramux serve --rpc H:P,...` (or `Engine.load(rpc=[...])`)
elsewhere and computes its layers. It is llama.cpp's own RPC server (ggml_backend_rpc_start_server),
so the protocol always matches the client's build when both come from the same install.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from typing import Any

from ..errors import RpcError

log = logging.getLogger("loramux.rpc")

EPILOG = """\
examples:
  loramux rpc-worker                               # 127.0.0.1:50052, all cores
  loramux rpc-worker --host 10.0.0.2 --port 50052 --threads 16 --cache
then, on the machine that serves:
  loramux serve big.gguf --rpc 10.0.0.2:50052,10.0.0.3:50052

RPC is unauthenticated and unencrypted: anyone who reaches the port can run computations on this
machine and read what it holds. Bind a private interface only (a VPN or cluster network), never a
public one. A worker serves one client at a time. docs/distributed.md has the whole setup.
"""

LOOPBACK = ("127.0.0.1", "localhost")


def add_parsers(sub: Any) -> None:
    """Register `rpc-worker`."""
    p = sub.add_parser("rpc-worker", help="hold part of a base model for `serve --rpc` (llama.cpp RPC server)",
                       description="Run llama.cpp's RPC server: a `loramux serve --rpc HOST:PORT` elsewhere "
                                   "puts some of its model's layers here. Needs llama.cpp built with "
                                   "-DGGML_RPC=on (README, 'Beyond one machine').",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; anything else is reachable by others and "
                        "RPC has no authentication)")
    p.add_argument("--port", type=int, default=50052, help="TCP port (default 50052)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the layers held here (default: all)")
    p.add_argument("--cache", nargs="?", const="", default=None, metavar="DIR",
                   help="keep received tensors in DIR (default: loramux's cache, rpc/) so that a reconnecting "
                        "client sends large weights by hash only")
    p.set_defaults(func=cmd_rpc_worker)


def _cache_dir(value: str | None) -> str | None:
    if value is None:
        return None
    from .. import config

    path = os.path.expanduser(value) if value else os.path.join(config.cache_dir(), "rpc")
    os.makedirs(path, exist_ok=True)
    return path


def cmd_rpc_worker(args: argparse.Namespace) -> int:
    from ..engine import rpc
    from ..engine.model import default_threads

    endpoint = rpc.parse_endpoint(f"{args.host}:{args.port}", "--host/--port")
    if args.threads is not None and args.threads < 1:
        from ..errors import ParameterError

        raise ParameterError("--threads", f"must be ≥ 1 (got {args.threads})")
    from .. import _native as N

    if not N.rpc_supported():
        raise RpcError(None, "unsupported", "this llama.cpp was built without its RPC backend",
                       hint=rpc.INSTALL_HINT)
    if args.host not in LOOPBACK:
        log.warning("listening on %s: llama.cpp's RPC has no authentication or encryption; anyone who can "
                    "reach this port can use this machine. Keep it on a private network.", endpoint)
        print(f"loramux: WARNING: RPC on {endpoint} is unauthenticated; expose it on a private network only",
              file=sys.stderr)
    threads = args.threads or default_threads()
    cache = _cache_dir(args.cache)
    server = threading.Thread(target=N.rpc_serve, args=(endpoint,), kwargs={"n_threads": threads, "cache_dir": cache},
                              name="loramux-rpc-worker", daemon=True)
    server.start()
    names = ", ".join(name for _, name in N.rpc_worker_devices())
    print(f"loramux: RPC worker on {endpoint} serving {names} ({threads} threads"
          f"{', cache ' + cache if cache else ''}); Ctrl-C stops it", file=sys.stderr, flush=True)
    try:
        while server.is_alive():
            server.join(0.5)  # wake up for Ctrl-C: the server itself never returns to Python
    except KeyboardInterrupt:
        print("loramux: RPC worker stopped", file=sys.stderr, flush=True)
        os._exit(130)  # the server thread is inside llama.cpp for good; do not wait for it
    print(f"error: the RPC server could not listen on {endpoint} (port in use, or an address this machine "
          "does not have; llama.cpp's message is above)", file=sys.stderr)
    return 1


__all__ = ["add_parsers", "cmd_rpc_worker"]
