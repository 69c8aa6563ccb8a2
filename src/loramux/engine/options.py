"""How an engine is built: one typed set of options instead of the same keywords in every caller.

`Engine.load(path, n_ctx=..., slots=...)` still takes them as keywords (that is the API users write);
they become one `EngineOptions`, which is what the engine, the server settings, the CLI and the
probes pass around. Importing this module does not load llama.cpp.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from .. import _native as N
from ..errors import ParameterError
from .fairness import PREFILL_STEP_TOKENS
from .scoring import SCORE_ROWS, SCORE_ROWS_SHARED

if TYPE_CHECKING:
    from .model import Model

KV_TYPES = ("f16", "f32", "bf16", "q8_0")
#: Default bound of the slot bank's warm tier (engine/residency.py): ~65 rank-8 F32 adapters of Gemma 3 270M.
DEFAULT_ADAPTER_CACHE_BYTES = 512 * 2**20
BANK_NODE_ACCESS = ("auto", "device")  # see SlotBank: in place on host memory, else row transfers
BANK_DTYPES = ("f32", "f16")  # the slot bank's factor type (F16: half the bytes per step and per slot write)
SLOT_WRITES = ("background", "inline")  # where a slot write runs while sequences decode (engine/slot_copier.py)


@dataclass(frozen=True)
class EngineOptions:
    """Everything that fixes an engine at load time (model placement, contexts, the slot bank).

    n_ctx: tokens per sequence. n_parallel: sequences decoded together. n_batch: tokens per decode.
    n_threads: CPU threads (None: all available). n_gpu_layers: layers offloaded on a GPU build.
    use_mmap / use_mlock: how the weights are mapped. flash_attn / kv_unified / kv_type: llama.cpp's
    attention and KV-cache settings. slots / slot_rank: the slot bank (0 slots: none). adapter_cache_bytes:
    the bank's warm tier, prepared slot blocks in host RAM (0: none; see engine/residency.py). bank_dtype:
    the bank's factor type, "f32" or "f16" (half the bytes a masked decode reads and a slot write copies;
    llama.cpp then multiplies with activations rounded to F16, so results move by F16 rounding). slot_writes:
    while sequences decode, "inline" writes a slot at admission on the engine thread (every running
    sequence waits for the copy), "background" on a thread of its own (the request waits a decode step,
    nobody else waits; see engine/slot_copier.py). deterministic:
    batch-invariant serving (see README, "Deterministic mode"). rpc: llama.cpp RPC workers
    ("host:port", from `loramux rpc-worker`) that hold the base model's layers (see engine/rpc.py).
    score_rows: full-vocabulary logit rows one decode may compute for prompt scoring while no other request
    runs (a request that arrives meanwhile waits for that decode; see engine/scoring.py); score_rows_shared:
    the same while another request runs. request_slots: the most sequence slots one request of several
    sequences (the same `party`) holds at once (0: all but one of n_parallel); request_step_seqs: the most
    of its sequences one decode step serves while another request runs; request_step_every: such a request
    takes part in one decode step of every request_step_every while another request runs (see
    engine/fairness.py); prefill_step_tokens: while another request decodes, a longer prompt puts at most
    this many tokens into a step, in the same turns; prefill_chunk_tokens: the most prompt tokens of one
    request in a decode otherwise (0: n_batch), which bounds how long a request arriving waits for it.
    max_loaded: adapters llama.cpp holds at once (None: no bound); past it the least recently used one
    that no request uses is evicted and loaded again when a request names it (engine/residency.py).
    """

    n_ctx: int = 4096
    n_parallel: int = 1
    n_batch: int = 512
    n_threads: int | None = None
    n_gpu_layers: int = 0
    use_mmap: bool = True
    use_mlock: bool = False
    flash_attn: bool = False
    kv_unified: bool = False
    slots: int = 0
    slot_rank: int = 16
    adapter_cache_bytes: int = DEFAULT_ADAPTER_CACHE_BYTES
    bank_node_access: str = "auto"
    bank_dtype: str = "f32"
    slot_writes: str = "inline"
    deterministic: bool = False
    kv_type: str = "f16"
    rpc: tuple[str, ...] = ()
    score_rows: int = SCORE_ROWS
    score_rows_shared: int = SCORE_ROWS_SHARED
    request_slots: int = 0
    request_step_seqs: int = 1
    request_step_every: int = 2
    prefill_step_tokens: int = PREFILL_STEP_TOKENS
    prefill_chunk_tokens: int = 0
    max_loaded: int | None = None

    def __post_init__(self) -> None:
        problems: list[tuple[str, str]] = []
        try:  # a list or "h1:p1,h2:p2" becomes a tuple of checked endpoints (the dataclass stays hashable)
            object.__setattr__(self, "rpc", parse_endpoints(self.rpc or ()))
        except ParameterError as e:
            problems.append(("rpc", e.message.split(": ", 1)[-1]))
        for name in ("n_ctx", "n_parallel", "n_batch", "slot_rank", "score_rows", "score_rows_shared",
                     "request_step_seqs", "request_step_every", "prefill_step_tokens"):
            if getattr(self, name) < 1:
                problems.append((name, f"must be ≥ 1 (got {getattr(self, name)})"))
        if self.prefill_chunk_tokens < 0:
            problems.append(("prefill_chunk_tokens", f"must be ≥ 0 (0 = n_batch; got {self.prefill_chunk_tokens})"))
        if self.request_slots < 0:
            problems.append(("request_slots", f"must be ≥ 0 (0 = all but one of n_parallel; got {self.request_slots})"))
        if self.slots < 0:
            problems.append(("slots", f"must be ≥ 0 (0 = no slot bank; got {self.slots})"))
        if self.adapter_cache_bytes < 0:
            problems.append(("adapter_cache_bytes", f"must be ≥ 0 (0 = no warm tier; got {self.adapter_cache_bytes})"))
        if self.max_loaded is not None and self.max_loaded < 1:
            problems.append(("max_loaded", f"must be ≥ 1, or None for no bound (got {self.max_loaded})"))
        if self.n_threads is not None and self.n_threads < 1:
            problems.append(("n_threads", f"must be ≥ 1, or None for all cores (got {self.n_threads})"))
        if self.bank_node_access not in BANK_NODE_ACCESS:
            problems.append(("bank_node_access", f"must be one of {', '.join(BANK_NODE_ACCESS)} "
                                                 f"(got {self.bank_node_access!r})"))
        if self.bank_dtype not in BANK_DTYPES:
            problems.append(("bank_dtype", f"must be one of {', '.join(BANK_DTYPES)} (got {self.bank_dtype!r})"))
        if self.deterministic and self.bank_dtype != "f32":
            problems.append(("bank_dtype", "must be f32 in deterministic mode (its batch invariance is "
                                           f"checked with F32 factors; got {self.bank_dtype!r})"))
        if self.slot_writes not in SLOT_WRITES:
            problems.append(("slot_writes", f"must be one of {', '.join(SLOT_WRITES)} (got {self.slot_writes!r})"))
        if self.kv_type not in KV_TYPES:
            problems.append(("kv_type", f"must be one of {', '.join(KV_TYPES)} (got {self.kv_type!r})"))
        if problems:
            # one error naming every bad option; `parameter` is the first
            raise ParameterError(problems[0][0], "; ".join(f"{n} {m}" if i else m
                                                          for i, (n, m) in enumerate(problems)))

    @classmethod
    def from_keywords(cls, base: EngineOptions | None = None, **keywords: Any) -> EngineOptions:
        """`base` (default: the defaults) with `keywords` replaced; an unknown keyword names itself."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(keywords) - known)
        if unknown:
            raise ParameterError(unknown[0], f"is not an engine option (known: {', '.join(sorted(known))})")
        return replace(base or cls(), **keywords)

    def as_dict(self) -> dict[str, Any]:
        """The options as plain values (for logs, /health and benchmark records)."""
        return asdict(self)

    def changed(self) -> Mapping[str, Any]:
        """Only the options that differ from the defaults."""
        default = EngineOptions()
        return {k: v for k, v in self.as_dict().items() if getattr(default, k) != v}


def bank_size(n_parallel: int, ranks: Iterable[int] = ()) -> tuple[int, int]:
    """The default slot bank for `n_parallel` sequences and adapters of these ranks: (slots, slot_rank).

    slots = n_parallel: a free sequence then always finds a free slot for a one-adapter request, so
    such a request never waits for the bank, and each extra slot costs every masked decode (the
    bank's width K·r is paid by every token; see docs/scaling.md for the measurement). One sequence
    (n_parallel = 1) gets no bank: its decodes never hold two adapter sets, so a bank would only cost
    memory (its decodes on one set run natively, without the eval callback). slot_rank = the
    largest rank given, rounded up to a multiple of 8 (16 when no rank is known): a narrower slot
    than the widest adapter would serve that adapter natively, a wider one costs every masked decode.
    """
    known = [int(r) for r in ranks if int(r) > 0]
    rank = -(-max(known) // 8) * 8 if known else 16
    return (n_parallel if n_parallel > 1 else 0), rank


def parse_endpoint(text: str, option: str = "rpc") -> str:
    """`text` as "host:port" (IPv6 hosts in brackets are refused: ggml-rpc splits at the first colon)."""
    host, sep, port = text.strip().rpartition(":")
    problem = None
    if not sep or not host:
        problem = f"expected HOST:PORT, got {text!r}"
    elif ":" in host:
        problem = f"{text!r}: ggml-rpc splits at the first ':', so IPv6 addresses cannot be used; give a name"
    elif not port.isdigit() or not 1 <= int(port) <= 65535:
        problem = f"{text!r}: the port must be a number in 1-65535"
    if problem:
        raise ParameterError(option, problem)
    return f"{host}:{int(port)}"


def parse_endpoints(values: str | Sequence[str], option: str = "rpc") -> tuple[str, ...]:
    """Endpoints from a list or a comma-separated string; duplicates are refused."""
    items = values.split(",") if isinstance(values, str) else list(values)
    out = tuple(parse_endpoint(v, option) for v in items if v.strip())
    dup = sorted({e for e in out if out.count(e) > 1})
    if dup:
        raise ParameterError(option, f"lists {dup[0]} twice (each worker holds its own part of the model)")
    return out


def check_deterministic(model: Model | None, flash_attn: bool, kv_unified: bool) -> None:
    """Refuse settings that make a sequence's arithmetic depend on its batch."""
    problems = []
    if flash_attn:
        problems.append("flash attention takes other code paths for long caches and large prefills")
    if kv_unified:
        problems.append("a unified KV cache puts a sequence's tokens in batch-dependent cells")
    if model is not None and model.handle.repack:
        problems.append("the model was loaded with repacked weights (load it with repack=False)")
    if model is not None and os.environ.get(N.TILED_ENV) != "0":
        problems.append(f"{N.TILED_ENV} is not 0 (ggml's tiled matmul is batch-variant)")
    if problems:
        raise ParameterError("deterministic", "these settings are not batch-invariant: " + "; ".join(problems),
                             hint="use Engine.load(..., deterministic=True), which sets all of this up")


__all__ = ["BANK_DTYPES", "BANK_NODE_ACCESS", "DEFAULT_ADAPTER_CACHE_BYTES", "EngineOptions", "KV_TYPES", "bank_size",
           "check_deterministic", "parse_endpoint", "parse_endpoints"]
