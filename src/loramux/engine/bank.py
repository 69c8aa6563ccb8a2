"""The slot bank: one resident LoRA of rank K·r that lets sequences on different adapters share a decode.

The bank is an ordinary llama.cpp adapter over every projection, created with zero factors and
always active at scale 1 (alpha 0, so llama.cpp applies no alpha/rank factor). Each user adapter
lives in a slot k: rows [k·r, k·r + r) of every A and the same columns of every B, written in place.
During a decode, `cb_eval` stops at each bank `A·x` product (ne = [K·r, n_tokens]) and multiplies
the row block of slot k for token t by the scale token t's sequence wants for that adapter (its
request scale × alpha/rank; 0 when unused). `B · (mask ⊙ A·x)` then adds each sequence's own delta
and exactly +0.0 for the others, so one decode serves every sequence whatever its adapters, with no
change of the context's adapter set and no graph re-reserve.

Facts this relies on (see the mixed-batching notes): the context must use `kv_unified=true` and
n_ubatch == n_batch so the node's token columns follow the batch order; in the last block only the
tokens that request logits remain, so those nodes get the output rows of the mask. After every decode
`check()` verifies that every bank node was masked with a planned shape; otherwise it raises instead
of silently serving unmasked output.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import _native as N
from ..errors import BackendError, LoramuxError
from ..gguf_io import write_adapter
from .adapters import LoRAAdapter
from .model import Model

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
VIEW_CACHE_MAX = 4096  # cached node views (a few per graph shape); cleared when exceeded


class SlotsBusyError(LoramuxError):
    """Every slot of the bank holds an adapter that a running request uses."""

    code = "slots_busy"


@dataclass
class _Slot:
    adapter: LoRAAdapter | None = None
    version: int = -1
    refs: int = 0
    pinned: bool = False
    last_used: float = 0.0


@dataclass
class MaskPlan:
    """Per-token masks of one decode, one (full, out) pair per ubatch in llama.cpp's processing order.

    `full` has a row per token of the ubatch (in the ubatch's token order), `out` the rows of the
    tokens that request logits (what remains in the last block).
    """

    ubatches: list[tuple[np.ndarray, np.ndarray]]
    per_ubatch: int  # bank nodes each ubatch's graph holds
    masked: int = 0
    problems: list[str] = field(default_factory=list)


def plan_ubatches(seq_ids: np.ndarray, n_ubatch: int, unified: bool) -> list[np.ndarray]:
    """The batch indices of each ubatch, as llama.cpp's batch allocator will split this batch.

    Unified KV cache: consecutive slices (`split_simple`). Otherwise `split_equal(sequential)`: each
    ubatch takes runs of consecutive sequence ids and the same number of tokens from each, grouped
    by sequence. One sequence per token (no coupled sequences), as the scheduler builds batches.
    """
    n = len(seq_ids)
    if unified:
        return [np.arange(i, min(i + n_ubatch, n)) for i in range(0, n, n_ubatch)]
    used = np.zeros(n, bool)
    out = []
    while not used.all():
        cur: list[int] = []
        for i in range(n):
            s = int(seq_ids[i])
            if used[i] or s in cur or (cur and s != cur[-1] + 1):
                continue
            cur.append(s)
            if len(cur) > n_ubatch:
                break
        queues = [[i for i in range(n) if not used[i] and seq_ids[i] == s] for s in cur]
        per: list[list[int]] = [[] for _ in cur]
        while all(len(q) > len(p) for q, p in zip(queues, per)):
            for q, p in zip(queues, per):
                p.append(q[len(p)])
                used[q[len(p) - 1]] = True
            if (len(per[0]) + 1) * len(cur) > n_ubatch:
                break
        out.append(np.array([i for p in per for i in p], dtype=np.int64))
    return out


class SlotBank:
    """K slots of rank r over every projection of the base model. Engine-thread only."""

    def __init__(self, model: Model, slots: int, rank: int, *, dtype: str = "f32") -> None:
        if slots < 1 or rank < 1:
            raise LoramuxError(f"a slot bank needs slots ≥ 1 and slot_rank ≥ 1 (got {slots}, {rank})")
        self.model, self.K, self.r = model, slots, rank
        self.width = slots * rank
        self.targets = [f"blk.{i}.{p}.weight" for i in range(model.n_layer) for p in PROJECTIONS
                        if f"blk.{i}.{p}.weight" in model.tensor_shapes]
        zeros = {t: (np.zeros((self.width, model.tensor_shapes[t][1]), np.float32),
                     np.zeros((model.tensor_shapes[t][0], self.width), np.float32)) for t in self.targets}
        self._dir = tempfile.TemporaryDirectory(prefix="loramux-bank-")
        path = write_adapter(Path(self._dir.name) / "bank.gguf", model.architecture, zeros, 0.0, dtype=dtype)
        self.adapter = LoRAAdapter(model, path, "__bank__")
        facs = self.adapter._factors or {}
        self._a_ptrs = {facs[t].a: t for t in self.targets}
        self._esize = N.GGML_TYPE_SIZE[facs[self.targets[0]].type]
        self.slots = [_Slot() for _ in range(slots)]
        self.plan: MaskPlan | None = None
        self._views: dict[tuple[int | None, int | None, int], np.ndarray | None] = {}
        self.writes = 0

    # -- slots ---------------------------------------------------------------------------------
    def eligible(self, adapter: LoRAAdapter) -> bool:
        """Can this adapter live in a slot (rank ≤ r, every target a bank projection)?"""
        return adapter.rank <= self.r and set(adapter.targets) <= set(self._a_ptrs.values())

    def slot_of(self, adapter: LoRAAdapter) -> int | None:
        for k, s in enumerate(self.slots):
            if s.adapter is adapter and s.version == adapter.version:
                return k
        return None

    def acquire(self, adapter: LoRAAdapter) -> int | None:
        """A slot holding this adapter's current factors (written now if needed); None if all are busy."""
        k = self.slot_of(adapter)
        if k is None:
            idle = [i for i, s in enumerate(self.slots) if s.refs == 0 and not s.pinned]
            if not idle:
                return None
            k = min(idle, key=lambda i: (self.slots[i].adapter is not None, self.slots[i].last_used))
            self._write(k, adapter)
        s = self.slots[k]
        s.refs += 1
        s.last_used = time.monotonic()
        return k

    def release(self, k: int) -> None:
        self.slots[k].refs = max(0, self.slots[k].refs - 1)

    def pin(self, adapter: LoRAAdapter) -> int:
        """Keep an adapter resident (never evicted); raises SlotsBusyError when no slot can take it."""
        k = self.acquire(adapter)
        if k is None:
            raise SlotsBusyError(f"every one of the {self.K} slots is in use; cannot pin {adapter.name!r}",
                                 hint="raise --max-loaded / slots, or unpin an adapter")
        self.slots[k].pinned = True
        self.release(k)
        return k

    def forget(self, adapter: LoRAAdapter) -> None:
        """Drop an unloaded adapter's slots (their contents stay until overwritten; never used again)."""
        for s in self.slots:
            if s.adapter is adapter:
                s.adapter, s.version, s.pinned = None, -1, False

    def resident(self) -> list[str]:
        return [s.adapter.name for s in self.slots if s.adapter is not None]

    def _write(self, k: int, adapter: LoRAAdapter) -> None:
        facs = adapter.all_factors()  # live factors (engine thread: inline)
        store = np.float32 if self._esize == 4 else np.float16
        r0, ru = k * self.r, adapter.rank
        for t in self.targets:
            f = self.adapter._factors[t]  # type: ignore[index]
            out_dim, in_dim = f.b_shape[0], f.a_shape[1]
            a = np.zeros((self.r, in_dim), store)
            b = np.zeros((out_dim, self.r), store)
            if t in facs:
                a[:ru] = facs[t][0]
                b[:, :ru] = facs[t][1]
            N.tensor_set(f.a, np.ascontiguousarray(a), offset=r0 * in_dim * self._esize)
            N.tensor_set_2d(f.b, np.ascontiguousarray(b), offset=r0 * self._esize, row_bytes=self.r * self._esize,
                            n_rows=out_dim, stride_tensor=self.width * self._esize)
        s = self.slots[k]
        s.adapter, s.version = adapter, adapter.version
        self.writes += 1

    # -- masks ---------------------------------------------------------------------------------
    def set_plan(self, token_scales: np.ndarray, out_flags: np.ndarray,
                 ubatches: list[np.ndarray] | None = None) -> None:
        """Masks for the next decode: token_scales (n_tokens, K) in batch order → blocks of width r.

        `out_flags[i]` says batch token i requests logits; `ubatches` (batch indices per ubatch, from
        plan_ubatches) says how llama.cpp will split the batch (default: one ubatch in batch order).
        """
        full = np.repeat(np.asarray(token_scales, np.float32), self.r, axis=1)
        flags = np.asarray(out_flags, bool)
        ubs = ubatches if ubatches is not None else [np.arange(len(full))]
        self.plan = MaskPlan([(full[u], full[u[flags[u]]]) for u in ubs], len(self.targets))

    def callback(self, t: int, ask: bool) -> bool:
        """cb_eval: stop at bank A·x nodes and scale them in place; never truncate the graph."""
        if ask:  # called for every node of the graph: the cheapest test (one read, a set lookup) first
            return N.node_src0(t) in self._a_ptrs and N.node_op(t) == N.OP_MUL_MAT
        plan = self.plan
        if plan is None:
            return True
        u = plan.masked // plan.per_ubatch
        if u >= len(plan.ubatches):
            plan.problems.append("more bank nodes than planned ubatches")
            return True
        full, out = plan.ubatches[u]
        n_tok = N.node_ne1(t)
        mask = full if n_tok == full.shape[0] else out if n_tok == out.shape[0] else None
        plan.masked += 1
        if mask is None:
            plan.problems.append(f"node with {n_tok} tokens matches neither {full.shape[0]} nor {out.shape[0]}")
            return True
        view = self._node_view(t, n_tok)
        if view is not None:
            view *= mask  # CPU: scale the node's output where it lies, no copies
        else:
            data = N.tensor_get(t, np.empty((n_tok, self.width), np.float32))
            data *= mask
            N.tensor_set(t, data)
        return True

    def _node_view(self, t: int, n_tok: int) -> np.ndarray | None:
        """The node's host memory as (n_tok, width) floats; None off the host. Cached per memory place:
        llama.cpp reuses the same compute-buffer addresses for every decode of a graph shape, and
        the key (data address, buffer, n_tok) names memory the node occupies right now."""
        key = (*N.node_place(t), n_tok)
        try:
            return self._views[key]
        except KeyError:
            if len(self._views) >= VIEW_CACHE_MAX:
                self._views.clear()
            view = self._views[key] = N.host_f32_view(t, (n_tok, self.width))
            return view

    def check(self) -> None:
        """After a decode: every bank node was masked with a planned shape, or raise."""
        plan, self.plan = self.plan, None
        if plan is None:
            return
        want = plan.per_ubatch * len(plan.ubatches)
        if plan.problems or plan.masked != want:
            raise BackendError("slot bank masks", None,
                               f"masked {plan.masked} of {want} bank nodes; "
                               + "; ".join(plan.problems[:3]),
                               hint="llama.cpp's graph no longer matches the bank plan; serve without slots")

    def close(self) -> None:
        self.adapter.close()
        self._dir.cleanup()


def token_scales(bank: SlotBank, entries: list[tuple[int, list[tuple[int, float]]]]) -> np.ndarray:
    """Rows of per-slot scales: entries = [(n_tokens, [(slot, scale), ...]), ...] in batch order."""
    rows = []
    for n, pairs in entries:
        row = np.zeros(bank.K, np.float32)
        for k, s in pairs:
            row[k] += s
        rows.append(np.broadcast_to(row, (n, bank.K)))
    return np.concatenate(rows) if rows else np.zeros((0, bank.K), np.float32)


__all__ = ["SlotBank", "SlotsBusyError", "MaskPlan", "plan_ubatches", "token_scales", "Any"]
