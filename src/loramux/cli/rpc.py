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

from ..engine.rpc_cache import DEFAULT_MAX_BYTES, DEFAULT_MAX_FILES, CacheKeeper
from ..errors import ParameterError, RpcError

log = logging.getLogger("loramux.rpc")

EPILOG = """\
examples:
  loramux rpc-worker                               # 127.0.0.1:50052, all cores
  loramux rpc-worker --host 10.0.0.2 --port 50052 --threads 16 --cache
then, on the machine that serves:
  loramux serve big.gguf --rpc 10.0.0.2:50052,10.0.0.3:50052

RPC is unauthenticated and unencrypted: anyone who reaches the port can run computations on this
machine, read what it holds and (with --cache) write files into the cache. Bind a private interface
only (a VPN or cluster network), never a public one. A worker serves one client at a time.
docs/distributed.md has the whole setup, docs/security.md the cache's bounds and limits.
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
                        "client sends large weights by hash only; DIR is the cache's alone (loramux deletes "
                        "whatever else is in it). Only with peers you trust: docs/security.md")
    p.add_argument("--cache-max-bytes", type=int, default=None, metavar="N",
                   help=f"delete the oldest cache entries past N bytes (default {DEFAULT_MAX_BYTES >> 30} GiB)")
    p.add_argument("--cache-max-files", type=int, default=None, metavar="N",
                   help=f"delete the oldest cache entries past N files (default {DEFAULT_MAX_FILES})")
    p.add_argument("--cache-sealed", action="store_true",
                   help="serve only the entries already recorded (each checked by its sha256), accept no new "
                        "ones, and make DIR read-only: fill the cache once from a trusted server, then seal it")
    p.set_defaults(func=cmd_rpc_worker)


def _cache(args: argparse.Namespace) -> CacheKeeper | None:
    """The bounded cache --cache asks for (its keeper not started yet), or None."""
    if args.cache is None:
        for flag, value in (("--cache-max-bytes", args.cache_max_bytes), ("--cache-max-files", args.cache_max_files),
                            ("--cache-sealed", args.cache_sealed or None)):
            if value is not None:
                raise ParameterError(flag, "only applies with --cache [DIR]")
        return None
    from .. import config

    path = os.path.expanduser(args.cache) if args.cache else os.path.join(config.cache_dir(), "rpc")
    os.makedirs(path, exist_ok=True)
    keeper = CacheKeeper(path, max_bytes=DEFAULT_MAX_BYTES if args.cache_max_bytes is None else args.cache_max_bytes,
                         max_files=DEFAULT_MAX_FILES if args.cache_max_files is None else args.cache_max_files,
                         sealed=args.cache_sealed)
    return keeper


def cmd_rpc_worker(args: argparse.Namespace) -> int:
    from ..engine import rpc
    from ..engine.model import default_threads
    from ..engine.options import parse_endpoint

    endpoint = parse_endpoint(f"{args.host}:{args.port}", "--host/--port")
    keeper = _cache(args)
    if args.threads is not None and args.threads < 1:
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
    cache = str(keeper.start().path) if keeper is not None else None  # its first pass before any client
    server = threading.Thread(target=N.rpc_serve, args=(endpoint,), kwargs={"n_threads": threads, "cache_dir": cache},
                              name="loramux-rpc-worker", daemon=True)
    server.start()
    names = ", ".join(name for _, name in N.rpc_worker_devices())
    bounds = (f", cache {cache} (at most {keeper.max_bytes} bytes, {keeper.max_files} files"
              f"{', sealed' if keeper.sealed else ''})" if keeper is not None else "")
    print(f"loramux: RPC worker on {endpoint} serving {names} ({threads} threads{bounds}); Ctrl-C stops it",
          file=sys.stderr, flush=True)
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
