"""`loramux serve`: the OpenAI-compatible multi-adapter server from the command line."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from typing import Any

from ..errors import ParameterError

log = logging.getLogger("loramux.server")

EPILOG = """\
examples:
  loramux serve --lora pirate=adapters/pirate.gguf --parallel 4
  loramux serve base.gguf --lora style=hf://owner/repo/style.gguf:0.5 --adapter-dir ./adapters \\
      --max-loaded 16 --api-key-file key.txt --admin-api-key-file admin.txt \\
      --host 0.0.0.0 --allowed-hosts llm.internal
  loramux serve --config deploy.toml          # every setting in one file; options override it
  loramux serve big.gguf --rpc 10.0.0.2:50052,10.0.0.3:50052   # layers on `loramux rpc-worker`s

then, with any OpenAI client (base_url http://127.0.0.1:8080/v1):
  model="<base>"      the base model (plus the global adapter set of POST /lora-adapters)
  model="pirate"      the adapter 'pirate' at its scale
  extra_body={"lora": [{"name": "pirate", "scale": 0.5}, {"id": 1, "scale": 1.0}]}   a stack per request
admin (needs --admin-api-key; off by default): POST /v1/load_lora_adapter {"lora_name", "lora_path"}
         (a file inside --adapter-dir), POST /v1/unload_lora_adapter {"lora_name"}, POST /lora-adapters
read:    GET /v1/models, /lora-adapters, /health, /metrics
"""

LOOPBACK = ("127.0.0.1", "localhost", "::1")
WELCOME_ADAPTERS = 10  # adapter names the start banner lists (a --lora-dir may register 100,000)


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
                        "(default: --parallel, so a request on one adapter never waits for a slot, and none "
                        "at --parallel 1; 0: adapter-set groups take turns instead; see docs/scaling.md)")
    p.add_argument("--slot-rank", type=int, default=None, metavar="R",
                   help="largest adapter rank a bank slot holds (default: the widest --lora adapter's "
                        "rank, or of up to 32 --lora-dir files, rounded up to a multiple of 8, else 16; "
                        "larger ones take turns)")
    p.add_argument("--adapter-cache-bytes", type=int, default=None, metavar="N",
                   help="warm tier: bytes of prepared slot blocks kept in RAM so an adapter re-enters a "
                        "bank slot by one copy (default 536870912 = 512 MiB; 0: none; docs/scaling.md)")
    p.add_argument("--bank-dtype", choices=("f32", "f16"), default=None,
                   help="the slot bank's factor type (default f32). f16 halves the bytes every mixed-adapter "
                        "decode reads, every slot write copies and every warm-tier entry holds; results then "
                        "move by F16 rounding (docs/scaling.md)")
    p.add_argument("--slot-writes", choices=("background", "inline"), default=None,
                   help="where a bank slot is written while other requests decode (default inline: at "
                        "admission, on the engine thread; every running request waits for the copy). "
                        "background: on a thread of its own; the request waits one decode step and nobody "
                        "else waits, for steadier token times at some throughput (docs/scaling.md)")
    p.add_argument("--deterministic", action="store_true", default=None,
                   help="batch-invariant kernels: a request's output does not depend on what it is "
                        "batched with (slower)")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8080)")
    _security_options(p)
    p.add_argument("--public-metrics", action="store_true", default=None,
                   help="serve /metrics without the API key (for Prometheus / the GIE endpoint picker)")
    p.add_argument("--adapter-dir", action="append", default=[], metavar="DIR",
                   help="directory runtime loads by path may read from (repeatable); without one, "
                        "/v1/load_lora_adapter refuses paths")
    p.add_argument("--lora-dir", action="append", default=[], metavar="DIR",
                   help="register every *.gguf file of DIR under its file name without .gguf (repeatable), "
                        "cold: nothing is read at start, the first request naming one loads it; bad names, "
                        "files outside DIR and duplicates stop the start (docs/server.md, Cold adapters)")
    p.add_argument("--max-adapters", type=int, default=None, metavar="N",
                   help="adapters the server knows at most, loaded or cold (default 100000); loads past it "
                        "get 400 too_many_adapters")
    p.add_argument("--metric-adapters", type=int, default=None, metavar="N",
                   help="adapter names with their own /metrics series; requests on others count under "
                        "'_other_' (default 100)")
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
    p.add_argument("--gpu-layers", type=int, default=None,
                   help="layers to offload to a GPU build or the --rpc workers (default 0; with --rpc: all)")
    p.add_argument("--rpc", default=None, metavar="H1:P1,H2:P2",
                   help="split the base model's layers over llama.cpp RPC workers (`loramux rpc-worker` on "
                        "each; needs llama.cpp built with -DGGML_RPC=on; docs/distributed.md). If a worker "
                        "is lost, requests get 503 rpc_unavailable and the server restarts itself in place "
                        "once every worker answers again")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="name of the base model in the API (default: the model file's name)")
    p.add_argument("--control-vector", action="append", default=[], metavar="NAME=FILE",
                   help="control vector requests may choose by name with a strength (repeatable)")
    p.add_argument("--control-vector-layers", default=None, metavar="A-B",
                   help="layers the control vectors apply to (inclusive, 1-based; default all)")
    p.add_argument("--tool-format", default=None, metavar="NAME",
                   help="the tool-call format of every chat: auto (default: what the chat template writes), "
                        "generic, hermes or function_gemma (docs/server.md, Tool calling)")
    p.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (default 1 MiB)")
    p.add_argument("--max-upload-bytes", type=int, default=None,
                   help="largest factor push or training file (admin plane; default 256 MiB)")
    p.add_argument("--jobs-dir", default=None, help="where fine-tuning jobs keep files and checkpoints "
                                                    "(default: a temporary directory)")
    p.set_defaults(func=cmd_serve)


def _security_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("access and limits (docs/server.md, Security)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: --api-key-file, else $LORAMUX_API_KEY)")
    g.add_argument("--api-key-file", default=None, metavar="FILE", help="read the API key from FILE")
    g.add_argument("--admin-api-key", default=None, metavar="KEY",
                   help="enable the endpoints that change server state (load, unload, POST /lora-adapters) "
                        "for 'Authorization: Bearer KEY'; without an admin key they answer 403 "
                        "(default: --admin-api-key-file, else $LORAMUX_ADMIN_API_KEY)")
    g.add_argument("--admin-api-key-file", default=None, metavar="FILE", help="read the admin key from FILE")
    g.add_argument("--allowed-hosts", action="append", default=[], metavar="NAME[,NAME...]",
                   help="Host headers to accept (name, name:port, *.domain, or * for any); "
                        "default: 127.0.0.1, localhost, ::1 and --host")
    g.add_argument("--cors-origins", action="append", default=[], metavar="ORIGIN[,ORIGIN...]",
                   help="browser origins (scheme://host[:port], or *) allowed to call the API cross-origin; "
                        "preflights are answered before authentication (default: no CORS)")
    g.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help="requests that may wait beyond the --parallel running ones; more get 429 "
                        "(default max(64, 8 × --parallel))")
    g.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="open connections; more get 503 (default 512)")
    g.add_argument("--read-timeout", type=float, default=None, metavar="S",
                   help="seconds a client has to send a whole request, headers and body (default 15)")
    g.add_argument("--keep-alive-timeout", type=float, default=None, metavar="S",
                   help="seconds an idle keep-alive connection stays open (default 5)")
    g.add_argument("--write-timeout", type=float, default=None, metavar="S",
                   help="seconds a response may stall on a client that does not read before the "
                        "connection is dropped and its request cancelled (default 30)")
    _share_options(p)


def _share_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fair shares of the engine (docs/security.md, Per-request cost budgets)")
    g.add_argument("--request-slots", type=int, default=None, metavar="K",
                   help="the most sequences of one request (n, best_of, several prompts, fan-out) that run at "
                        "once; its others wait (default 0: all but one of --parallel, so a request arriving "
                        "finds a slot)")
    g.add_argument("--request-step-seqs", type=int, default=None, metavar="K",
                   help="the most sequences of one request a decode step serves while another request runs; "
                        "they take turns (default 1)")
    g.add_argument("--request-step-every", type=int, default=None, metavar="N",
                   help="while another request runs, a request of several sequences takes part in one decode "
                        "step of every N; the others serve the rest alone (default 2; 1: every step)")
    g.add_argument("--prefill-step-tokens", type=int, default=None, metavar="N",
                   help="while another request decodes, a longer prompt puts at most N tokens into a decode "
                        "step, in turns with the others, so a long prompt does not stall their tokens "
                        "(default 16)")
    g.add_argument("--prefill-chunk-tokens", type=int, default=None, metavar="N",
                   help="otherwise, a prompt puts at most N tokens into a decode step, so a request arriving "
                        "waits for at most N prompt tokens (default 0: --n-batch)")
    g.add_argument("--background-nice", type=int, default=None, metavar="N",
                   help="CPU priority (nice, 0-19) of the threads that prepare requests and render responses "
                        "beside decoding: tokenizing, templates, grammar compiles, cold adapter loads (default "
                        "19, the lowest: they only use CPU that decoding leaves; 0: the process's priority)")
    g.add_argument("--score-rows", type=int, default=None, metavar="N",
                   help="prompt-scoring logit rows per decode while nothing else runs (default 8)")
    g.add_argument("--score-rows-shared", type=int, default=None, metavar="N",
                   help="prompt-scoring logit rows per decode while another request runs (default 1)")


def _key(args: argparse.Namespace, name: str) -> str | None:
    """A key from --NAME, else --NAME-file, else its environment variable (None: not given)."""
    from ..server.config import KEY_SOURCES, read_key_file

    flag = "--" + name.replace("_", "-")
    value, path = getattr(args, name), getattr(args, name + "_file")
    if value is not None and path is not None:
        raise ParameterError(flag, f"give {flag} or {flag}-file, not both")
    if path is not None:
        return read_key_file(path, flag + "-file")
    if value is not None:
        return value.strip()
    return os.environ.get(KEY_SOURCES[name], "").strip() or None


def _hosts(values: list[str]) -> tuple[str, ...] | None:
    hosts = tuple(h.strip() for v in values for h in v.split(",") if h.strip())
    return hosts or None


def _pair(text: str, option: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise ParameterError(option, f"expected NAME=VALUE, got {text!r}")
    return name, value


def settings_from_args(args: argparse.Namespace) -> Any:
    """ServerSettings from --config (if any) with the command-line options on top."""
    from ..config import EXAMPLE_ADAPTER_NAME, embedded_model_in_use, example_adapter_path
    from ..engine.options import parse_endpoints
    from ..engine.specs import LoraSpec, adapter_name
    from ..server.config import ControlEntry, LoraEntry, ServerSettings

    base = ServerSettings.from_toml(args.config) if args.config else ServerSettings()
    loras = []
    if (not args.lora and not args.config and args.model is None and embedded_model_in_use()
            and not args.no_example_adapter):
        # First run on the embedded model: offer the shipped example adapter so an adapter visibly works.
        loras.append(LoraEntry(EXAMPLE_ADAPTER_NAME, str(example_adapter_path()), 1.0))
    for text in args.lora:
        spec = LoraSpec.parse(text)
        loras.append(LoraEntry(spec.name or adapter_name(spec.source), spec.source, spec.scale))
    cvs = [ControlEntry(*_pair(t, "--control-vector")) for t in args.control_vector]
    return base.override(
        model=args.model, host=args.host, port=args.port, parallel=args.parallel, n_ctx=args.n_ctx,
        slots=args.slots, slot_rank=args.slot_rank, deterministic=args.deterministic,
        adapter_cache_bytes=args.adapter_cache_bytes, bank_dtype=args.bank_dtype, slot_writes=args.slot_writes,
        n_batch=args.n_batch, threads=args.threads, gpu_layers=args.gpu_layers,
        rpc=parse_endpoints(args.rpc, "--rpc") if args.rpc else None,
        api_key=_key(args, "api_key"), admin_api_key=_key(args, "admin_api_key"),
        allowed_hosts=_hosts(args.allowed_hosts), cors_origins=_hosts(args.cors_origins),
        max_queue=args.max_queue, max_connections=args.max_connections,
        read_timeout_s=args.read_timeout, keep_alive_s=args.keep_alive_timeout, write_timeout_s=args.write_timeout,
        public_metrics=args.public_metrics,
        adapter_dirs=tuple(base.adapter_dirs) + tuple(args.adapter_dir) if args.adapter_dir else None,
        lora_dirs=tuple(base.lora_dirs) + tuple(args.lora_dir) if args.lora_dir else None,
        max_adapters=args.max_adapters, metric_adapters=args.metric_adapters,
        allow_remote_adapters=args.allow_remote_adapters, max_loaded=args.max_loaded,
        allow_private_networks=args.allow_private_networks, max_adapter_bytes=args.max_adapter_bytes,
        served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
        max_upload_bytes=args.max_upload_bytes, jobs_dir=args.jobs_dir,
        loras=tuple(base.loras) + tuple(loras) if loras else None,
        control_vectors=tuple(base.control_vectors) + tuple(cvs) if cvs else None,
        control_vector_layers=args.control_vector_layers, tool_format=args.tool_format,
        request_slots=args.request_slots, request_step_seqs=args.request_step_seqs,
        request_step_every=args.request_step_every, score_rows=args.score_rows,
        score_rows_shared=args.score_rows_shared, background_nice=args.background_nice,
        prefill_step_tokens=args.prefill_step_tokens, prefill_chunk_tokens=args.prefill_chunk_tokens)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..config import MODEL_ENV, embedded_model_in_use
    from ..server.app import create_app
    from ..server.guard import uvicorn_config

    settings = settings_from_args(args)
    if settings.host not in LOOPBACK and not settings.api_key:
        log.warning("binding %s without --api-key: anyone who can reach this port can use the server",
                    settings.host)
    if settings.allowed_hosts is None and settings.host not in LOOPBACK:
        log.warning("only requests with Host %s are served; pass --allowed-hosts with the names clients use "
                    "(or '*' behind a proxy that checks them)", ", ".join(settings.host_allowlist()))
    if settings.admin_api_key is None:
        log.info("admin endpoints (load, unload, global scales) are disabled: start with --admin-api-key")
    what = settings.model or ("the embedded Gemma 3 270M" if embedded_model_in_use()
                              else f"{os.environ[MODEL_ENV]} (${MODEL_ENV})")
    print(f"loramux: loading {what} with {len(settings.loras)} adapter(s)…", file=sys.stderr, flush=True)
    engine = settings.build_engine()
    if settings.rpc:
        _restart_when_workers_return(settings.rpc)
    try:
        app = create_app(engine, settings, own_engine=True)
    except BaseException:
        engine.close()
        raise
    state = app.state.lm
    level = logging.getLogger().getEffectiveLevel()
    server = uvicorn.Server(uvicorn_config(app, settings, host=settings.host, port=settings.port,
                                           log_level="info" if level <= logging.INFO else "warning"))
    banner = welcome(settings, state.base_name, [e.name for e in state.pool.ordered()])
    _print_when_listening(server, banner)
    log.debug("froze %d start-up objects out of the garbage collector's walks", freeze_start_up())
    server.run()
    return 0


def freeze_start_up() -> int:
    """Put every object alive at start-up out of the cyclic garbage collector's reach; returns their count.

    The model's metadata, the adapter table (a name and a header per registered adapter), routes and schemas
    are about 100,000 objects that live as long as the server. A full collection walks every tracked object,
    35-70 ms with these, on whichever thread happens to allocate, and every other thread waits for it (the
    GIL): that was the longest stall of the decode loop. Frozen, a full collection walks only what came
    later. Reference counting still frees them; only cycles among them would stay (none is made to go).
    Called by `loramux serve`, which owns its process; an app embedded with `create_app` is left alone.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def welcome(settings: Any, base: str, adapters: list[str]) -> str:
    """What `loramux serve` prints once it listens: the URL, the models, a curl line that works as
    printed (the API key read from $LORAMUX_API_KEY when one is set), and where to read on."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host  # a client's address
    url = f"http://{'[' + host + ']' if ':' in host else host}:{settings.port}"
    model = adapters[0] if adapters else base
    auth = ' -H "Authorization: Bearer $LORAMUX_API_KEY"' if settings.api_key else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    shown = adapters[:WELCOME_ADAPTERS] + ([f"… {len(adapters) - WELCOME_ADAPTERS} more (GET /v1/models)"]
                                           if len(adapters) > WELCOME_ADAPTERS else [])
    models = ", ".join([f"{base} (base)", *shown])
    admin = ("on (admin key set)" if settings.admin_api_key else
             "off: load/unload need --admin-api-key")
    return "\n".join([
        f"loramux: listening on {url}/v1 (parallel {settings.parallel}, n_ctx {settings.n_ctx})",
        f"  models:  {models}",
        f"  try:     curl {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' -d '{body}'",
        f"  clients: any OpenAI client with base_url={url}/v1 and model=<one of the models>",
        f"  page:    {url}/playground (chat with an adapter stack, compare adapters side by side, what the server "
        "holds)",
        f"  admin:   {admin}",
        "  help:    loramux serve --help (adapters per request, admin plane, limits); Ctrl-C stops"])


def _print_when_listening(server: Any, text: str) -> None:
    """Print `text` to stderr once uvicorn has bound its socket (so the curl line works when it shows)."""
    import threading
    import time

    def wait() -> None:
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.05)
        print(text, file=sys.stderr, flush=True)

    threading.Thread(target=wait, name="loramux-welcome", daemon=True).start()


def _restart_when_workers_return(endpoints: tuple[str, ...]) -> None:
    """On a lost RPC worker: answer 503 meanwhile (the engine does), then re-exec this same command once
    every worker answers again. A process whose ggml-rpc connection broke cannot reconnect (engine/rpc.py),
    so recovery is a fresh process: same PID, same command line, the start adapters loaded again."""
    import threading

    from ..engine import rpc

    started = threading.Event()

    def restart() -> None:
        log.error("an RPC worker was lost; serving 503 until all of %s answer, then restarting",
                  ", ".join(endpoints))
        rpc.release_connections(endpoints)  # the surviving workers serve one client: let ours go
        rpc.wait_for_workers(endpoints)
        print("loramux: every RPC worker answers again; restarting the server", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024)  # no inherited sockets
        os.execv(sys.executable, sys.orig_argv)

    def on_lost(_message: str) -> None:
        if not started.is_set():
            started.set()
            threading.Thread(target=restart, name="loramux-rpc-restart", daemon=True).start()

    rpc.on_lost(on_lost)


__all__ = ["add_parsers", "cmd_serve", "settings_from_args", "welcome"]
