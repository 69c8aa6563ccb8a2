"""`loramux serve`: the OpenAI-compatible multi-adapter server from the command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import ParameterError

log = logging.getLogger("loramux.server")

EPILOG = """\
examples:
  loramux serve --lora pirate=adapters/pirate.gguf --parallel 4
  loramux serve base.gguf --lora style=hf://owner/repo/style.gguf:0.5 --adapter-dir ./adapters \\
      --max-loaded 16 --api-key $KEY --host 0.0.0.0
  loramux serve --config deploy.toml          # every setting in one file; options override it

then, with any OpenAI client (base_url http://127.0.0.1:8080/v1):
  model="<base>"      the base model (plus the global adapter set of POST /lora-adapters)
  model="pirate"      the adapter 'pirate' at its scale
  extra_body={"lora": [{"name": "pirate", "scale": 0.5}, {"id": 1, "scale": 1.0}]}   a stack per request
runtime: POST /v1/load_lora_adapter {"lora_name", "lora_path"} (a file inside --adapter-dir),
         POST /v1/unload_lora_adapter {"lora_name"}; GET /v1/models, /lora-adapters, /health, /metrics
"""

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_parsers(sub: Any) -> None:
    """Register `serve`."""
    p = sub.add_parser("serve", help="OpenAI-compatible server with per-request adapters and hot load/unload",
                       description="Serve one base model and any number of LoRA adapters over an "
                                   "OpenAI-compatible HTTP API. Binds 127.0.0.1 unless told otherwise.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="base GGUF model (default: the embedded Gemma 3 270M Q4_K_M)")
    p.add_argument("--config", metavar="DEPLOY.toml", help="read settings from a TOML file (options override it)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=SRC[:SCALE]",
                   help="adapter to load at start, pinned (repeatable). SRC: path, https:// URL or "
                        "hf://owner/repo/file.gguf; SCALE: its scale when a request names it (default 1)")
    p.add_argument("--no-example-adapter", action="store_true",
                   help="on the embedded model without --lora, do not offer the shipped 'pirate' adapter")
    p.add_argument("--parallel", type=int, default=None, help="sequences decoded together (default 4)")
    p.add_argument("--slots", type=int, default=None, metavar="K",
                   help="slot bank: requests on up to K different adapters share every decode step "
                        "(default 4; 0: adapter-set groups take turns instead)")
    p.add_argument("--slot-rank", type=int, default=None, metavar="R",
                   help="largest adapter rank a bank slot holds (default 16; larger ones take turns)")
    p.add_argument("--deterministic", action="store_true", default=None,
                   help="batch-invariant kernels: a request's output does not depend on what it is "
                        "batched with (slower)")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8080)")
    p.add_argument("--api-key", default=os.environ.get("LORAMUX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $LORAMUX_API_KEY)")
    p.add_argument("--public-metrics", action="store_true", default=None,
                   help="serve /metrics without the API key (for Prometheus / the GIE endpoint picker)")
    p.add_argument("--adapter-dir", action="append", default=[], metavar="DIR",
                   help="directory runtime loads by path may read from (repeatable); without one, "
                        "/v1/load_lora_adapter refuses paths")
    p.add_argument("--allow-remote-adapters", action="store_true", default=None,
                   help="let /v1/load_lora_adapter fetch https:// and hf:// sources")
    p.add_argument("--allow-private-networks", action="store_true", default=None,
                   help="let remote loads reach loopback, link-local and private addresses (refused by "
                        "default: a client could reach internal services or cloud metadata)")
    p.add_argument("--max-adapter-bytes", type=int, default=None, metavar="N",
                   help="largest file a remote load downloads, in bytes (default 4294967296 = 4 GiB)")
    p.add_argument("--max-loaded", type=int, default=None, metavar="N",
                   help="keep at most N adapters in memory; least recently used unpinned ones are evicted "
                        "and reloaded on demand (default: no limit)")
    p.add_argument("--n-ctx", type=int, default=None, help="context tokens per request (default 4096)")
    p.add_argument("--n-batch", type=int, default=None, help="tokens per decode call (default 512)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all available)")
    p.add_argument("--gpu-layers", type=int, default=None, help="layers to offload to a GPU build (default 0)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="name of the base model in the API (default: the model file's name)")
    p.add_argument("--control-vector", action="append", default=[], metavar="NAME=FILE",
                   help="control vector requests may choose by name with a strength (repeatable)")
    p.add_argument("--control-vector-layers", default=None, metavar="A-B",
                   help="layers the control vectors apply to (inclusive, 1-based; default all)")
    p.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (default 1 MiB)")
    p.set_defaults(func=cmd_serve)


def _pair(text: str, option: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise ParameterError(option, f"expected NAME=VALUE, got {text!r}")
    return name, value


EXAMPLE_ADAPTER = Path(__file__).parent / "data" / "pirate.gguf"


def settings_from_args(args: argparse.Namespace) -> Any:
    """ServerSettings from --config (if any) with the command-line options on top."""
    from ..engine.runtime import LoraSpec, adapter_name
    from ..server.config import ControlEntry, LoraEntry, ServerSettings

    base = ServerSettings.from_toml(args.config) if args.config else ServerSettings()
    loras = []
    if not args.lora and not args.config and args.model is None and not args.no_example_adapter:
        # First run on the embedded model: offer the shipped example adapter so an adapter visibly works.
        loras.append(LoraEntry("pirate", str(EXAMPLE_ADAPTER), 1.0))
    for text in args.lora:
        spec = LoraSpec.parse(text)
        loras.append(LoraEntry(spec.name or adapter_name(spec.source), spec.source, spec.scale))
    cvs = [ControlEntry(*_pair(t, "--control-vector")) for t in args.control_vector]
    return base.override(
        model=args.model, host=args.host, port=args.port, parallel=args.parallel, n_ctx=args.n_ctx,
        slots=args.slots, slot_rank=args.slot_rank, deterministic=args.deterministic,
        n_batch=args.n_batch, threads=args.threads, gpu_layers=args.gpu_layers, api_key=args.api_key,
        public_metrics=args.public_metrics,
        adapter_dirs=tuple(base.adapter_dirs) + tuple(args.adapter_dir) if args.adapter_dir else None,
        allow_remote_adapters=args.allow_remote_adapters, max_loaded=args.max_loaded,
        allow_private_networks=args.allow_private_networks, max_adapter_bytes=args.max_adapter_bytes,
        served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
        loras=tuple(base.loras) + tuple(loras) if loras else None,
        control_vectors=tuple(base.control_vectors) + tuple(cvs) if cvs else None,
        control_vector_layers=args.control_vector_layers)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..server.app import create_app

    settings = settings_from_args(args)
    if settings.host not in LOOPBACK and not settings.api_key:
        log.warning("binding %s without --api-key: anyone who can reach this port can use the server",
                    settings.host)
    print(f"loramux: loading {settings.model or 'the embedded Gemma 3 270M'} "
          f"with {len(settings.loras)} adapter(s)…", file=sys.stderr)
    engine = settings.build_engine()
    try:
        app = create_app(engine, settings, own_engine=True)
    except BaseException:
        engine.close()
        raise
    state = app.state.lm
    print(f"loramux: serving {state.base_name!r} + {len(state.pool.entries)} adapter(s) at "
          f"http://{settings.host}:{settings.port}/v1 (parallel {settings.parallel}, n_ctx {settings.n_ctx})",
          file=sys.stderr)
    level = logging.getLogger().getEffectiveLevel()
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info" if level <= logging.INFO else "warning",
                timeout_graceful_shutdown=settings.graceful_shutdown_s)
    return 0


__all__ = ["add_parsers", "cmd_serve", "settings_from_args"]
