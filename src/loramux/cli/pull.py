"""`loramux pull`: resolve an adapter source into the cache and print its path."""

from __future__ import annotations

import argparse
from typing import Any

from ..sources import POLICIES, Source, resolve, tqdm_progress


def _cmd_pull(args: argparse.Namespace) -> int:
    src = Source.parse(args.source)
    bar = None if args.quiet or src.kind == "path" else tqdm_progress(f"pull {src}")
    try:
        path = resolve(src, sha256=args.sha256, policy=args.policy, retries=args.retries,
                       timeout=args.timeout, progress=bar,
                       **({"cache_dir": args.cache_dir} if args.cache_dir else {}),
                       **({"token": args.token} if args.token else {}))
    finally:
        if bar is not None:
            bar.close()
    print(path)
    return 0


def add_parsers(sub: Any) -> None:
    """Register `loramux pull`."""
    p = sub.add_parser(
        "pull", help="download an adapter (path, https:// URL or hf://) into the cache and print its path",
        description="Resolve SRC to a verified local file: downloads resume after an interruption, are "
                    "checked (size, GGUF magic, optional sha256 pin) before they get their final name, and "
                    "are reused from the cache afterwards.",
        epilog="examples:\n  loramux pull https://example.org/style.gguf#sha256=<64 hex>\n"
               "  loramux pull hf://owner/repo/adapters/style.gguf@v1.0\n  loramux pull ./local.gguf",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="path, http(s):// URL (optionally #sha256=...), or hf://owner/repo/file[@rev]")
    p.add_argument("--sha256", default=None, help="expected sha256 of the file (hex)")
    p.add_argument("--policy", choices=POLICIES, default="use",
                   help="use: reuse a cached file (default); revalidate: ask the server; refresh: download again")
    p.add_argument("--retries", type=int, default=4, help="retries on connection errors and 5xx (default 4)")
    p.add_argument("--timeout", type=float, default=30.0, help="network timeout in seconds (default 30)")
    p.add_argument("--cache-dir", default=None, help="cache root (default $LORAMUX_CACHE or ~/.cache/loramux)")
    p.add_argument("--token", default=None, help="bearer token sent to the source's host only")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_pull)


__all__ = ["add_parsers"]
