"""Server settings, from the command line and/or one `deploy.toml`, so a deployment is one file.

    # deploy.toml
    model = "/models/base.gguf"          # omit for the embedded Gemma 3 270M
    served_model_name = "base"
    host = "0.0.0.0"
    port = 8080
    parallel = 8
    slots = 8                            # slot bank: requests on 8 different adapters share each decode
                                         # (default: one slot per parallel sequence; docs/scaling.md)
    adapter_cache_bytes = 536870912      # warm tier: prepared slot blocks kept in RAM (default 512 MiB)
    bank_dtype = "f32"                   # the bank's factors: "f16" reads and copies half the bytes
    slot_writes = "inline"               # "background": slot writes beside the decodes, not between them
    n_ctx = 4096                         # tokens per sequence
    api_key_env = "LORAMUX_API_KEY"      # read the key from this variable (or api_key_file, api_key = "...")
    admin_api_key_file = "/run/secrets/loramux-admin"   # enables load/unload/global scales (off without it)
    allowed_hosts = ["llm.internal", "10.0.0.5"]         # Host headers accepted (default: loopback + host)
    cors_origins = ["https://app.internal"]             # browser pages allowed cross-origin (default: none)
    max_queue = 32                       # waiting beyond the `parallel` running ones (default max(64, 8 × parallel))
    adapter_dirs = ["/adapters"]         # runtime loads by path only from here
    lora_dirs = ["/adapters/cold"]       # every *.gguf here registered at start under its stem, loaded on first use
    max_adapters = 100000                # adapters the server knows (loaded or cold) at most
    allow_remote_adapters = false
    allow_private_networks = false       # remote loads may not reach loopback/link-local/private hosts
    max_adapter_bytes = 4294967296       # largest adapter a remote load downloads (4 GiB)
    max_loaded = 16

    [[lora]]
    name = "pirate"
    source = "/adapters/pirate.gguf"     # path, https:// URL or hf://owner/repo/file.gguf
    scale = 1.0                          # scale used when a request names this adapter
    apply = 0.0                          # scale in the global set that base-model requests get

    [[control_vector]]
    name = "happy"
    path = "/vectors/happy.gguf"

Command-line options override the file.
"""

from __future__ import annotations

import contextlib
import os
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..engine.fairness import PREFILL_STEP_TOKENS
from ..engine.grammar_cost import DEFAULT_LIMITS, GrammarLimits
from ..engine.options import BANK_DTYPES, DEFAULT_ADAPTER_CACHE_BYTES, SLOT_WRITES, EngineOptions, bank_size
from ..engine.runtime import Engine
from ..engine.scoring import SCORE_ROWS, SCORE_ROWS_SHARED
from ..errors import LoramuxError, ParameterError
from ..gguf_io import validate_adapter

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-:@+/]{0,127}$")
RANK_SAMPLE = 32  # --lora-dir files whose headers size the default slot rank (about 1 ms each)
NAME_RULE = "1-128 characters: letters, digits and . _ - : @ + /, starting with a letter or digit"
#: Size cap of a remote load: LoRA adapters of the largest open models at rank 64 in F16 take 1-2 GiB.
DEFAULT_MAX_ADAPTER_BYTES = 4 << 30
#: Adapters one server knows (loaded or cold, `--lora-dir` ones included): each costs ~1 kB of table.
DEFAULT_MAX_ADAPTERS = 100_000
#: Adapter names with their own series in /metrics; requests on others count under "_other_".
DEFAULT_METRIC_ADAPTERS = 100
KEY_RE = re.compile(r"^[\x21-\x7e]+$")  # what a client can send in 'Authorization: Bearer KEY'
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
CORS_ORIGIN_RE = re.compile(r"^[a-z][a-z0-9+.-]*://[^/\s?#]+$")  # an Origin header's form: no path, no query
KEY_SOURCES = {"api_key": "LORAMUX_API_KEY", "admin_api_key": "LORAMUX_ADMIN_API_KEY"}  # key -> env variable


@dataclass(frozen=True)
class LoraEntry:
    """An adapter to load at start: pinned (never evicted by --max-loaded)."""

    name: str
    source: str
    scale: float = 1.0
    apply: float = 0.0


@dataclass(frozen=True)
class ControlEntry:
    """A control vector loaded at start, chosen per request by name."""

    name: str
    path: str
    layers: str | None = None  # "A-B", 1-based inclusive


def _tool_format_problems(name: str) -> list[str]:
    from .tool_formats import names

    known = ["auto", *names()]
    return [] if name in known else [f"tool_format: {name!r} is not one of {', '.join(known)}"]


@dataclass(frozen=True)
class ServerSettings:
    """Everything `loramux serve` needs. Build with `from_toml` and/or keyword arguments."""

    model: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    parallel: int = 4
    n_ctx: int = 4096
    n_batch: int = 512
    threads: int | None = None
    gpu_layers: int = 0
    rpc: tuple[str, ...] = ()  # llama.cpp RPC workers ("host:port") that hold the base model's layers
    slots: int | None = None  # slot bank: K adapters share every decode (0 = rotate groups); None: = parallel
    slot_rank: int | None = None  # None: widest start adapter's or lora_dirs sample's rank, up to a multiple of 8
    adapter_cache_bytes: int = DEFAULT_ADAPTER_CACHE_BYTES  # the bank's warm tier (engine/residency.py)
    bank_dtype: str = "f32"  # the bank's factor type: "f16" halves the bytes of a masked decode and a slot write
    slot_writes: str = "inline"  # "background": slot writes beside the running decodes (slot_copier.py)
    deterministic: bool = False  # batch-invariant kernels: outputs do not depend on the batch
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)  # None: no endpoint changes server state
    allowed_hosts: tuple[str, ...] | None = None  # Host headers accepted; None: LOOPBACK_HOSTS + host
    public_metrics: bool = False  # /metrics without the API key (for scrapers such as the GIE endpoint picker)
    cors_origins: tuple[str, ...] = ()  # browser origins allowed cross-origin ("*": any); () = no CORS (access.py)
    adapter_dirs: tuple[str, ...] = ()
    lora_dirs: tuple[str, ...] = ()  # every *.gguf registered cold at start under its stem (server/lora_dirs.py)
    max_adapters: int = DEFAULT_MAX_ADAPTERS  # adapters known at once (loaded or cold); loads past it get 400
    metric_adapters: int = DEFAULT_METRIC_ADAPTERS  # adapter names with their own /metrics series
    allow_remote_adapters: bool = False
    allow_private_networks: bool = False  # remote loads may reach loopback, link-local and private addresses
    max_adapter_bytes: int | None = DEFAULT_MAX_ADAPTER_BYTES  # size cap of a remote load; None: no cap
    max_loaded: int | None = None
    max_body_bytes: int = 1 << 20
    max_upload_bytes: int = 256 << 20  # admin-plane uploads: factor pushes, training files (guard.py)
    jobs_dir: str | None = None  # training jobs' files and checkpoints (None: a temporary directory)
    max_queue: int | None = None  # requests waiting beyond the `parallel` running ones; None: max(64, 8 × parallel)
    max_connections: int = 512  # open connections (uvicorn's limit_concurrency); more get 503
    read_timeout_s: float = 15.0  # a request's headers and body must arrive within this
    keep_alive_s: float = 5.0  # idle keep-alive connections are closed after this
    write_timeout_s: float = 30.0  # a response write stalled this long (client not reading) drops the client
    loras: tuple[LoraEntry, ...] = ()
    control_vectors: tuple[ControlEntry, ...] = ()
    control_vector_layers: str | None = None
    graceful_shutdown_s: float = 30.0
    # Grammar budgets (engine/grammar_cost.py; docs/structured.md): what a request's grammar may be, and the
    # engine time its checks may take per token and per request before that request alone fails.
    grammar_max_optional_run: float = DEFAULT_LIMITS.optional_run
    grammar_max_alternatives: int = DEFAULT_LIMITS.breadth
    grammar_max_elements: int = DEFAULT_LIMITS.elements
    grammar_token_seconds: float = DEFAULT_LIMITS.token_seconds
    grammar_request_seconds: float = DEFAULT_LIMITS.request_seconds
    # Tokens one request may have scored (prompt_logprobs/echo and logprobs, over its prompts and
    # sequences; server/scoring.py): each is a pass over the vocabulary on the engine thread.
    max_scored_tokens: int = 8192
    # The tool-call format of every chat (server/tool_formats): 'auto' reads it off the chat template.
    tool_format: str = "auto"
    # Prompt-scoring logit rows per decode while nothing else runs (engine/scoring.py): a request arriving
    # meanwhile waits for that decode, about 11-20 ms a row on Gemma 3 270M (2 cores).
    score_rows: int = SCORE_ROWS
    # ... and while another request runs: each row is a pass over the vocabulary the neighbour waits for.
    score_rows_shared: int = SCORE_ROWS_SHARED
    # A request of several sequences (n, best_of, prompts, fan-out; engine/fairness.py): the most slots it
    # holds at once (0: all but one of --parallel, so a request arriving finds one free), and the most of
    # its sequences one decode step serves while another request runs (they take turns), and it takes part
    # in one decode step of every `request_step_every` while another request runs.
    request_slots: int = 0
    request_step_seqs: int = 1
    request_step_every: int = 2
    # While another request decodes, a prompt longer than this puts at most this many tokens into a decode
    # step, and takes the same turns (engine/fairness.py).
    prefill_step_tokens: int = PREFILL_STEP_TOKENS
    # ... and otherwise at most this many (0: n_batch): a request arriving waits for the decode in progress.
    prefill_chunk_tokens: int = 0
    # CPU priority (nice, 0-19) of the worker threads that prepare requests and render responses beside
    # decoding (tokenizing, templates, grammar compiles, cold loads; server/background.py): 19 leaves the
    # decode threads their cores; 0 runs them at the process's priority.
    background_nice: int = 19

    # ------------------------------------------------------------------ building
    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> ServerSettings:
        """Read a deploy.toml; every problem in it is reported at once."""
        p = Path(path).expanduser()
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ParameterError("--config", f"{p}: no such file") from None
        except tomllib.TOMLDecodeError as e:
            raise ParameterError("--config", f"{p}: not valid TOML: {e}") from None
        return cls.from_dict(data, origin=str(p))

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = "settings") -> ServerSettings:
        data = dict(data)
        problems: list[str] = []
        for key in KEY_SOURCES:
            _key_from(data, key, problems)
        loras = tuple(_entries(data.pop("lora", []), LoraEntry, "lora", problems))
        cvs = tuple(_entries(data.pop("control_vector", []), ControlEntry, "control_vector", problems))
        known = {f.name for f in fields(cls)} - {"loras", "control_vectors"}
        for k in sorted(set(data) - known):
            problems.append(f"unknown key {k!r} (known: {', '.join(sorted(known | {'lora', 'control_vector'}))})")
        kwargs = {k: v for k, v in data.items() if k in known}
        for k in ("adapter_dirs", "lora_dirs", "allowed_hosts", "rpc", "cors_origins"):
            if isinstance(kwargs.get(k), list):
                kwargs[k] = tuple(str(d) for d in kwargs[k])
        if problems:
            raise ParameterError(origin, "invalid server settings:\n  - " + "\n  - ".join(problems))
        return cls(loras=loras, control_vectors=cvs, **kwargs).validated()

    def override(self, **values: Any) -> ServerSettings:
        """A copy with the given values replaced; None values are ignored (option not given)."""
        return replace(self, **{k: v for k, v in values.items() if v is not None}).validated()

    def validated(self) -> ServerSettings:
        problems = []
        if not 0 <= self.port <= 65535:
            problems.append(f"port: {self.port} is not a TCP port")
        for name in ("parallel", "n_ctx", "n_batch", "max_body_bytes", "max_upload_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                problems.append(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if (self.slots is not None and self.slots < 0) or (self.slot_rank is not None and self.slot_rank < 1):
            problems.append(f"slots/slot_rank: need slots ≥ 0 and slot_rank ≥ 1, got {self.slots}/{self.slot_rank}")
        if not isinstance(self.adapter_cache_bytes, int) or self.adapter_cache_bytes < 0:
            problems.append(f"adapter_cache_bytes: must be a number of bytes ≥ 0 (0: no warm tier), "
                            f"got {self.adapter_cache_bytes!r}")
        if self.bank_dtype not in BANK_DTYPES:
            problems.append(f"bank_dtype: must be one of {', '.join(BANK_DTYPES)}, got {self.bank_dtype!r}")
        if self.slot_writes not in SLOT_WRITES:
            problems.append(f"slot_writes: must be one of {', '.join(SLOT_WRITES)}, got {self.slot_writes!r}")
        if self.max_loaded is not None and self.max_loaded < 1:
            problems.append(f"max_loaded: must be ≥ 1, got {self.max_loaded}")
        if self.max_adapter_bytes is not None and (type(self.max_adapter_bytes) is not int
                                                   or self.max_adapter_bytes < 1):
            problems.append(f"max_adapter_bytes: must be a positive number of bytes, got {self.max_adapter_bytes!r}")
        if self.threads is not None and self.threads < 1:
            problems.append(f"threads: must be ≥ 1, got {self.threads}")
        problems += self._security_problems()
        problems += self._budget_problems()
        problems += _tool_format_problems(self.tool_format)
        for key in ("adapter_dirs", "lora_dirs"):
            for d in getattr(self, key):
                if not Path(d).expanduser().is_dir():
                    problems.append(f"{key}: {d} is not a directory")
        for key in ("max_adapters", "metric_adapters"):
            v = getattr(self, key)
            if type(v) is not int or v < (1 if key == "max_adapters" else 0):
                problems.append(f"{key}: must be an integer ≥ {1 if key == 'max_adapters' else 0}, got {v!r}")
        if type(self.max_adapters) is int and len(self.loras) > self.max_adapters:
            problems.append(f"max_adapters={self.max_adapters} but {len(self.loras)} adapters are loaded at start")
        names = [e.name for e in self.loras] + ([self.served_model_name] if self.served_model_name else [])
        for e in self.loras:
            if not NAME_RE.match(e.name):
                problems.append(f"lora {e.name!r}: adapter names must be {NAME_RULE}")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            problems.append(f"names used twice: {', '.join(dupes)}")
        if self.max_loaded is not None and len(self.loras) > self.max_loaded:
            problems.append(f"max_loaded={self.max_loaded} but {len(self.loras)} adapters are pinned at start")
        if problems:
            raise ParameterError("settings", "invalid server settings:\n  - " + "\n  - ".join(problems))
        return self

    def _security_problems(self) -> list[str]:
        problems = []
        for name in KEY_SOURCES:
            key = getattr(self, name)
            if key is not None and not KEY_RE.match(key):
                problems.append(f"{name}: must be non-empty printable ASCII without spaces (it is sent as "
                                "'Authorization: Bearer KEY')")
        if self.api_key is not None and self.api_key == self.admin_api_key:
            problems.append("admin_api_key: must differ from api_key (the admin key may change what the server "
                            "serves; the API key only uses it)")
        for h in self.allowed_hosts or ():
            if not h or any(c.isspace() for c in h) or "/" in h:
                problems.append(f"allowed_hosts: {h!r} is not a host name, address or '*'")
        for o in self.cors_origins:
            if o != "*" and not CORS_ORIGIN_RE.match(o):
                problems.append(f"cors_origins: {o!r} is not an origin (scheme://host[:port], no path) or '*'")
        if self.max_queue is not None and (not isinstance(self.max_queue, int) or self.max_queue < 0):
            problems.append(f"max_queue: must be an integer ≥ 0, got {self.max_queue!r}")
        if not isinstance(self.max_connections, int) or self.max_connections < 1:
            problems.append(f"max_connections: must be a positive integer, got {self.max_connections!r}")
        for name in ("read_timeout_s", "keep_alive_s", "write_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 < v < 1e6:
                problems.append(f"{name}: must be a positive number of seconds, got {v!r}")
        return problems

    def grammar_limits(self) -> GrammarLimits:
        """The budgets every request's grammar is compiled and run under."""
        return replace(DEFAULT_LIMITS, optional_run=float(self.grammar_max_optional_run),
                       breadth=self.grammar_max_alternatives, elements=self.grammar_max_elements,
                       token_seconds=float(self.grammar_token_seconds),
                       request_seconds=float(self.grammar_request_seconds))

    def _budget_problems(self) -> list[str]:
        problems = []
        for name in ("grammar_max_alternatives", "grammar_max_elements", "max_scored_tokens", "score_rows",
                     "score_rows_shared", "request_step_seqs", "request_step_every", "prefill_step_tokens"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                problems.append(f"{name}: must be a positive integer, got {v!r}")
        if type(self.prefill_chunk_tokens) is not int or self.prefill_chunk_tokens < 0:
            problems.append(f"prefill_chunk_tokens: must be an integer ≥ 0 (0: n_batch), got {self.prefill_chunk_tokens!r}")
        if type(self.background_nice) is not int or not 0 <= self.background_nice <= 19:
            problems.append(f"background_nice: must be an integer from 0 to 19 (19: the lowest CPU priority), "
                            f"got {self.background_nice!r}")
        if type(self.request_slots) is not int or self.request_slots < 0:
            problems.append(f"request_slots: must be an integer ≥ 0 (0: all but one of parallel), "
                            f"got {self.request_slots!r}")
        for name in ("grammar_max_optional_run", "grammar_token_seconds", "grammar_request_seconds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e6:
                problems.append(f"{name}: must be a positive number, got {v!r}")
        return problems

    def queue_limit(self, parallel: int | None = None) -> int:
        """Requests accepted at once (running + waiting): parallel + max_queue, max_queue by default
        max(64, 8 × parallel): room for a burst of clients (an eval harness's 32 concurrent requests) while
        the server stays bounded. `parallel`: the engine's, when it was built apart from these settings."""
        p = self.parallel if parallel is None else parallel
        return p + (max(64, 8 * p) if self.max_queue is None else self.max_queue)

    def host_allowlist(self) -> tuple[str, ...]:
        """Host names (optionally name:port) a request's Host header may carry; '*' accepts any."""
        if self.allowed_hosts is not None:
            return self.allowed_hosts
        return tuple(dict.fromkeys((*LOOPBACK_HOSTS, self.host)))

    # ------------------------------------------------------------------ engine
    def engine_options(self) -> EngineOptions:
        """The engine these settings ask for (raises ParameterError naming a bad option).

        Slots and slot rank not given follow `bank_size`: one slot per parallel sequence, the rank
        of the widest start adapter that is a local file (remote ones are not fetched yet) or of a sample
        of the `lora_dirs` files (`dir_sample`)."""
        slots, rank = bank_size(self.parallel, self.start_ranks() if self.slot_rank is None else ())
        return EngineOptions(n_ctx=self.n_ctx, n_parallel=self.parallel, n_batch=self.n_batch,
                             n_threads=self.threads, n_gpu_layers=self.gpu_layers,
                             slots=slots if self.slots is None else self.slots,
                             slot_rank=rank if self.slot_rank is None else self.slot_rank,
                             adapter_cache_bytes=self.adapter_cache_bytes, bank_dtype=self.bank_dtype,
                             slot_writes=self.slot_writes,
                             deterministic=self.deterministic,
                             rpc=self.rpc, score_rows=self.score_rows, score_rows_shared=self.score_rows_shared,
                             request_slots=self.request_slots, request_step_seqs=self.request_step_seqs,
                             request_step_every=self.request_step_every, max_loaded=self.max_loaded,
                             prefill_step_tokens=self.prefill_step_tokens,
                             prefill_chunk_tokens=self.prefill_chunk_tokens)

    def start_ranks(self) -> list[int]:
        """Largest rank of each start adapter that is a readable local file, and of a sample of the `lora_dirs`
        files (at most RANK_SAMPLE, spread over their names): headers only."""
        ranks = []
        for p in [*(Path(e.source).expanduser() for e in self.loras), *dir_sample(self.lora_dirs)]:
            try:
                if p.is_file():
                    ranks.append(max(a[0] for a, _ in validate_adapter(p).shapes.values()))
            except (LoramuxError, OSError, ValueError):
                continue  # the load (or the scan) reports it properly
        return ranks

    def build_engine(self) -> Engine:
        """Load the base model and the start adapters (loaded, not in the global set unless `apply`)."""
        eng = Engine.load(self.model, options=self.engine_options())
        try:
            for e in self.loras:
                eng.load_lora(e.source, e.name)
        except BaseException:
            eng.close()
            raise
        return eng


def dir_sample(dirs: Iterable[str], n: int = RANK_SAMPLE) -> list[Path]:
    """Up to `n` of the `*.gguf` files of `dirs`, evenly spread over their sorted names (the slot rank's
    sample: reading every header would make start cost grow with the files registered)."""
    files: list[Path] = []
    for d in dirs:
        root = Path(d).expanduser()
        with contextlib.suppress(OSError):  # the scan names an unreadable directory
            files += sorted(root / e.name for e in os.scandir(root)
                            if e.name.endswith(".gguf") and not e.name.startswith("."))
    if len(files) <= n:
        return files
    return [files[i * len(files) // n] for i in range(n)]


def read_key_file(path: str | os.PathLike[str], option: str) -> str:
    """A key kept in a file (a mounted secret): its text without the trailing newline."""
    p = Path(path).expanduser()
    try:
        key = p.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ParameterError(option, f"cannot read the key file {p}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ParameterError(option, f"the key file {p} is not UTF-8 text") from None
    if not key:
        raise ParameterError(option, f"the key file {p} is empty")
    return key


def _key_from(data: dict[str, Any], key: str, problems: list[str]) -> None:
    """`KEY_env = "VAR"` or `KEY_file = "PATH"` in a config file, unless the key itself is given."""
    env, path = data.pop(f"{key}_env", None), data.pop(f"{key}_file", None)
    if key in data:
        return
    if path is not None:
        try:
            data[key] = read_key_file(str(path), f"{key}_file")
        except ParameterError as e:
            problems.append(e.message)
    elif env is not None:
        data[key] = os.environ.get(str(env), "").strip() or None
        if data[key] is None:
            problems.append(f"{key}_env: the variable {env} is not set or empty")


def _entries(raw: Any, cls: type, key: str, problems: list[str]) -> list[Any]:
    if not isinstance(raw, list):
        problems.append(f"{key}: expected an array of tables ([[{key}]])")
        return []
    out = []
    allowed = {f.name for f in fields(cls)}
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            problems.append(f"{key}[{i}]: expected a table")
            continue
        extra = set(item) - allowed
        if extra:
            problems.append(f"{key}[{i}]: unknown keys {sorted(extra)} (allowed: {sorted(allowed)})")
            continue
        try:
            out.append(cls(**item))
        except TypeError as e:
            problems.append(f"{key}[{i}]: {e}")
    return out


__all__ = ["DEFAULT_MAX_ADAPTERS", "DEFAULT_METRIC_ADAPTERS", "KEY_SOURCES", "LOOPBACK_HOSTS", "ControlEntry", "LoraEntry", "NAME_RE", "ServerSettings",
           "read_key_file"]
